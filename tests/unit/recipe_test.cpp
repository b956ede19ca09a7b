#include <fmt/format.h>
#include <gtest/gtest.h>

#include <tuple>

#include "keel/core/error.h"
#include "keel/recipe/recipe.h"

using keel::recipe::DataPipeline;
using keel::recipe::MemoryPlanning;
using keel::recipe::OverlapGradSync;
using keel::recipe::parse_recipe;

namespace {

const char* kMinimal = R"(
model_name = "/models/glm-4-9b"
data_path = "train.jsonl"
max_steps = 10
)";

std::string error_of(const std::string& text, std::vector<std::string> overrides = {}) {
  try {
    parse_recipe(text, "r.toml", overrides);
  } catch (const keel::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Recipe, DefaultsAndArticleKeys) {
  auto r = parse_recipe(std::string(kMinimal) + R"(
dtype = "bf16"
batch_size = 4
gradient_accumulation_steps = 4
learning_rate = 2e-5
weight_decay = 0.01
warmup_steps = 200
dp_degree = 1
use_flash_attention = true
use_gradient_checkpointing = false
hccl_topology = "hccs_full_mesh"
memory_pool_size = 56
checkpoint_dir = "/shared/checkpoints"
save_interval = 2000
async_save = true
preprocess_on_npu = true
)",
                        "r.toml");
  EXPECT_EQ(r.batch_size, 4);
  EXPECT_EQ(r.topology, "hccs_full_mesh");  // hccl_topology is accepted as an alias
  EXPECT_DOUBLE_EQ(r.memory_pool_size, 56);
  EXPECT_EQ(r.lr_scheduler, keel::recipe::LrScheduler::Cosine);
  EXPECT_DOUBLE_EQ(r.adam_beta2, 0.999);
  EXPECT_FALSE(keel::recipe::inactive_key_warnings(r).empty());
}

TEST(Recipe, UnknownKeyNamesLineAndSuggests) {
  auto e = error_of(std::string(kMinimal) + "learning_rte = 1e-4\n");
  EXPECT_NE(e.find("r.toml:5"), std::string::npos) << e;
  EXPECT_NE(e.find("learning_rte"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean 'learning_rate'"), std::string::npos) << e;
}

// Every unknown key in one message, in the file's order (toml++ iterates a table in key order:
// 'stage' on line 2 was reported after 'pref_beta' on line 4, and only one of them at a time),
// each with its line and suggestion; [model_config]'s and the overrides' in the same message.
TEST(Recipe, UnknownKeysAreNamedTogetherInFileOrder) {
  const std::string text = "data_path = \"d\"\n"     // 1
                           "neftune_noise_alpha = 5\n"  // 2
                           "max_steps = 1\n"         // 3
                           "galore_rank = 16\n"      // 4
                           "learning_rte = 1e-4\n"   // 5
                           "[model_config]\n"        // 6
                           "vocab_size = 8\n"        // 7
                           "hiden_size = 8\n";       // 8
  const std::string e = error_of(text, {"max_stepz=3", "lerning_rate=1e-3"});
  const std::vector<std::string> in_order = {
      "r.toml:2: unknown key 'neftune_noise_alpha'",
      "r.toml:4: unknown key 'galore_rank'",
      "r.toml:5: unknown key 'learning_rte' (did you mean 'learning_rate'?)",
      "r.toml:8: unknown key 'hiden_size' in [model_config] (did you mean 'hidden_size'?)",
      "--set max_stepz=3: unknown key 'max_stepz' (did you mean 'max_steps'?)",
      "--set lerning_rate=1e-3: unknown key 'lerning_rate' (did you mean 'learning_rate'?)",
  };
  size_t at = 0;
  for (const auto& line : in_order) {
    const size_t found = e.find(line, at);
    ASSERT_NE(found, std::string::npos) << "'" << line << "' missing or out of order in:\n" << e;
    at = found + line.size();
  }
  EXPECT_EQ(e.rfind("6 unknown keys:", 0), 0u) << e;
  EXPECT_NE(e.find("`keel train --print-recipe` lists every key."), std::string::npos) << e;
  EXPECT_NE(e.find("[model_config]: valid keys: family, vocab_size"), std::string::npos) << e;
  // Before any other mistake, such as a wrong type earlier in the file.
  EXPECT_EQ(error_of("batch_size = \"two\"\n" + text).rfind("4 unknown keys:", 0), 0u);
  // The overrides' alone, together (the Python package's keywords use this path too).
  const std::string set = error_of(kMinimal, {"max_stepz=3", "seeed=1"});
  EXPECT_EQ(set.rfind("2 unknown keys:\n  --set max_stepz=3: unknown key 'max_stepz' (did you mean 'max_steps'?)\n"
                      "  --set seeed=1: unknown key 'seeed' (did you mean 'seed'?)\n",
                      0),
            0u)
      << set;
  // One key keeps its one-line message.
  EXPECT_EQ(error_of(std::string(kMinimal) + "learning_rte = 1e-4\n"),
            "r.toml:5: unknown key 'learning_rte' (did you mean 'learning_rate'?). `keel train --print-recipe` lists "
            "every key.");
}

// Mistakes other than unknown keys are also found in file order: the first in the file is named
// (in key order 'adam_beta1' came first).
TEST(Recipe, FirstMistakeInTheFileIsNamed) {
  const std::string types = error_of(std::string(kMinimal) + "warmup_steps = \"two\"\nadam_beta1 = \"x\"\n");
  EXPECT_NE(types.find("r.toml:5: key 'warmup_steps'"), std::string::npos) << types;
}

// max_steps / num_epochs is training's question: parsing (and so `keel plan`) does without it.
TEST(Recipe, TrainingLengthIsRequiredOnlyForTraining) {
  const auto r = parse_recipe("model_name = \"m\"\ndata_path = \"d\"\n", "r.toml");
  EXPECT_EQ(r.max_steps, 0);
  try {
    keel::recipe::require_training_length(r);
    ADD_FAILURE() << "expected keel::Error";
  } catch (const keel::Error& e) {
    EXPECT_STREQ(e.what(), "r.toml: set 'max_steps' or 'num_epochs'");
  }
  EXPECT_NO_THROW(keel::recipe::require_training_length(parse_recipe(kMinimal, "r.toml")));
  EXPECT_NO_THROW(keel::recipe::require_training_length(parse_recipe("model_name = \"m\"\ndata_path = \"d\"\n"
                                                                   "num_epochs = 2\n", "r.toml")));
}

TEST(Recipe, WrongTypeNamesKeyAndLine) {
  auto e = error_of(std::string(kMinimal) + "batch_size = \"four\"\n");
  EXPECT_NE(e.find("r.toml:5"), std::string::npos) << e;
  EXPECT_NE(e.find("'batch_size' expects an integer, found a string"), std::string::npos) << e;
}

TEST(Recipe, InvalidValuesAreErrors) {
  EXPECT_NE(error_of(std::string(kMinimal) + "dtype = \"fp8\"\n").find("'dtype'"), std::string::npos);
  EXPECT_NE(error_of(std::string(kMinimal) + "lr_scheduler = \"step\"\n").find("'lr_scheduler'"), std::string::npos);
  EXPECT_NE(error_of(std::string(kMinimal) + "batch_size = 0\n").find("'batch_size' must be positive"),
            std::string::npos);
  EXPECT_NE(error_of("data_path = \"x\"\nmax_steps = 1\n").find("model_name"), std::string::npos);
  EXPECT_NE(error_of("model_name = \"m\"\nmax_steps = 1\n").find("data_path"), std::string::npos);
  EXPECT_NE(error_of("model_name = [1\n").find("invalid TOML"), std::string::npos);
}

TEST(Recipe, OverridesApplyAfterTheFile) {
  auto r = parse_recipe(kMinimal, "r.toml", {"max_steps=3", "output_dir=runs/a", "shuffle=false"});
  EXPECT_EQ(r.max_steps, 3);
  EXPECT_EQ(r.output_dir, "runs/a");
  EXPECT_FALSE(r.shuffle);
  auto e = error_of(kMinimal, {"max_stepz=3"});
  EXPECT_NE(e.find("did you mean 'max_steps'"), std::string::npos) << e;
}

TEST(Recipe, ResolvedRecipeParsesBackToTheSameValues) {
  auto r = parse_recipe(std::string(kMinimal) + "learning_rate = 3e-4\nweight_decay = 0.1\n", "r.toml");
  auto again = parse_recipe(keel::recipe::recipe_to_toml(r), "resolved.toml");
  EXPECT_EQ(again.model_name, r.model_name);
  EXPECT_DOUBLE_EQ(again.learning_rate, r.learning_rate);
  EXPECT_DOUBLE_EQ(again.weight_decay, r.weight_decay);
  EXPECT_EQ(again.max_steps, r.max_steps);
}

TEST(Recipe, ModelConfigTable) {
  auto r = parse_recipe(R"(
data_path = "d.jsonl"
max_steps = 1
[model_config]
family = "glm"
vocab_size = 300
hidden_size = 64
intermediate_size = 128
num_layers = 2
num_heads = 4
num_kv_heads = 2
)",
                        "r.toml");
  ASSERT_TRUE(r.model_config.has_value());
  EXPECT_EQ(r.model_config->family, "glm");
  EXPECT_EQ(r.model_config->num_kv_heads, 2);
  auto e = error_of("data_path = \"d\"\nmax_steps = 1\n[model_config]\nhiden_size = 3\n");
  EXPECT_NE(e.find("did you mean 'hidden_size'"), std::string::npos) << e;
}

TEST(Recipe, BaselineModeKeys) {
  auto r = parse_recipe(kMinimal, "r.toml");
  EXPECT_EQ(r.data_pipeline, DataPipeline::Prepared);
  EXPECT_EQ(r.memory_planning, MemoryPlanning::Planned);
  r = parse_recipe(kMinimal, "r.toml", {"data_pipeline=on_the_fly", "memory_planning=per_tensor"});
  EXPECT_EQ(r.data_pipeline, DataPipeline::OnTheFly);
  EXPECT_EQ(r.memory_planning, MemoryPlanning::PerTensor);
  const std::string toml = keel::recipe::recipe_to_toml(r);
  EXPECT_NE(toml.find("data_pipeline = \"on_the_fly\""), std::string::npos) << toml;
  EXPECT_NE(toml.find("memory_planning = \"per_tensor\""), std::string::npos) << toml;

  auto e = error_of(std::string(kMinimal) + "data_pipeline = \"lazy\"\n");
  EXPECT_NE(e.find("r.toml:5"), std::string::npos) << e;
  EXPECT_NE(e.find("'data_pipeline' must be \"prepared\" or \"on_the_fly\""), std::string::npos) << e;
  e = error_of(std::string(kMinimal) + "memory_planning = \"pooled\"\n");
  EXPECT_NE(e.find("'memory_planning' must be \"planned\" or \"per_tensor\""), std::string::npos) << e;
  e = error_of(std::string(kMinimal) + "packing = \"pack\"\n", {"data_pipeline=on_the_fly"});
  EXPECT_NE(e.find("needs packing = \"pad\""), std::string::npos) << e;
  EXPECT_NE(e.find("r.toml:5"), std::string::npos) << e;  // where packing was set
}

TEST(Recipe, LoraKeysAsLlamaFactoryNamesThem) {
  auto r = parse_recipe(std::string(kMinimal) + R"(
finetuning_type = "lora"
lora_rank = 16
lora_target = ["q_proj", "v_proj"]
use_rslora = true
)",
                        "r.toml");
  EXPECT_EQ(r.lora_rank, 16);
  EXPECT_EQ(keel::recipe::lora_targets(r), (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_EQ(keel::recipe::lora_alpha(r), 32.0);  // 2 x rank when unset, as LLaMA-Factory
  // The comma-separated form, trimmed, and the list form read back from the resolved recipe.
  r = parse_recipe(std::string(kMinimal) + "finetuning_type = \"lora\"\nlora_target = \"q_proj , dense\"\n", "r.toml");
  EXPECT_EQ(keel::recipe::lora_targets(r), (std::vector<std::string>{"q_proj", "dense"}));
  const auto back = parse_recipe(keel::recipe::recipe_to_toml(r), "resolved.toml");
  EXPECT_EQ(keel::recipe::lora_targets(back), keel::recipe::lora_targets(r));
  EXPECT_EQ(keel::recipe::lora_targets(parse_recipe(kMinimal, "r.toml")), (std::vector<std::string>{"all"}));
}

TEST(Recipe, LoraNonsenseCombinationsAreErrors) {
  const std::string lora = std::string(kMinimal) + "finetuning_type = \"lora\"\n";
  auto e = error_of(std::string(kMinimal) + "lora_rank = 16\n");
  EXPECT_NE(e.find("r.toml:5: key 'lora_rank' applies to LoRA, but finetuning_type is \"full\""), std::string::npos)
      << e;
  e = error_of(std::string(kMinimal) + "quantization_bit = 4\n");
  EXPECT_NE(e.find("'quantization_bit' = 4 quantizes frozen weights: it needs finetuning_type = \"lora\""),
            std::string::npos)
      << e;
  e = error_of(lora + "quantization_bit = 8\n");
  EXPECT_NE(e.find("'quantization_bit' must be 0 (no quantization) or 4"), std::string::npos) << e;
  EXPECT_EQ(error_of(lora + "quantization_bit = 4\nquantization_type = \"fp4\"\n"), "");
  e = error_of(lora + "quantization_bit = 4\nquantization_type = \"int4\"\n");
  EXPECT_NE(e.find("'quantization_type' must be \"nf4\" or \"fp4\", got \"int4\""), std::string::npos) << e;
  EXPECT_EQ(error_of(lora + "quantization_bit = 4\ndouble_quantization = false\n"), "");
  e = error_of(lora + "lora_rank = 0\n");
  EXPECT_NE(e.find("'lora_rank' must be in [1, 4096]"), std::string::npos) << e;
  e = error_of(lora + "lora_target = \"q_proj,,v_proj\"\n");
  EXPECT_NE(e.find("empty name between commas"), std::string::npos) << e;
  e = error_of(lora + "lora_target = [\"q_proj\", 3]\n");
  EXPECT_NE(e.find("'lora_target' expects a string or a list of strings"), std::string::npos) << e;
  e = error_of(std::string(kMinimal) + "finetuning_type = \"freeze\"\n");
  EXPECT_NE(e.find("'finetuning_type' must be \"full\" or \"lora\""), std::string::npos) << e;
  e = error_of(std::string(kMinimal) + "additional_target = \"lm_head\"\n");
  EXPECT_NE(e.find("'additional_target' names modules trained beside LoRA's adapters"), std::string::npos) << e;
  EXPECT_EQ(error_of(lora + "additional_target = [\"lm_head\", \"embed_tokens\"]\n"), "");
}

TEST(Recipe, ReportToAsTransformersSpellsIt) {
  EXPECT_FALSE(keel::recipe::reports_to_tensorboard(parse_recipe(kMinimal, "r.toml")));  // default "none"
  EXPECT_TRUE(keel::recipe::reports_to_tensorboard(parse_recipe(std::string(kMinimal) + "report_to = \"all\"\n", "r")));
  EXPECT_TRUE(
      keel::recipe::reports_to_tensorboard(parse_recipe(std::string(kMinimal) + "report_to = [\"tensorboard\"]\n", "r")));
  auto e = error_of(std::string(kMinimal) + "report_to = [\"tensorboard\", \"wandb\"]\n");
  EXPECT_NE(e.find("r.toml:5: key 'report_to'"), std::string::npos) << e;
  EXPECT_NE(e.find("\"wandb\" is not one of them"), std::string::npos) << e;
  e = error_of(std::string(kMinimal) + "report_to = \"none,tensorboard\"\n");
  EXPECT_NE(e.find("lists \"none\" beside other names"), std::string::npos) << e;
  EXPECT_NE(error_of(std::string(kMinimal) + "report_to = []\n").find("'report_to' is empty"), std::string::npos);
}

TEST(Recipe, OverlapGradSyncIsAutoTrueOrFalse) {
  EXPECT_EQ(parse_recipe(kMinimal, "r.toml").overlap_grad_sync, OverlapGradSync::Auto);
  EXPECT_EQ(parse_recipe(std::string(kMinimal) + "overlap_grad_sync = true\n", "r").overlap_grad_sync,
            OverlapGradSync::True);
  EXPECT_EQ(parse_recipe(kMinimal, "r", {"overlap_grad_sync=false"}).overlap_grad_sync, OverlapGradSync::False);
  EXPECT_EQ(parse_recipe(kMinimal, "r", {"overlap_grad_sync=auto"}).overlap_grad_sync, OverlapGradSync::Auto);
  EXPECT_EQ(parse_recipe(kMinimal, "r", {"overlap_grad_sync=\"true\""}).overlap_grad_sync, OverlapGradSync::True);
  const auto e = error_of(std::string(kMinimal) + "overlap_grad_sync = \"sometimes\"\n");
  EXPECT_NE(e.find("r.toml:5: key 'overlap_grad_sync' must be true, false or \"auto\""), std::string::npos) << e;
  // The resolved recipe (what checkpoints keep) reads back.
  const auto r = parse_recipe(keel::recipe::recipe_to_toml(parse_recipe(kMinimal, "r", {"overlap_grad_sync=true"})), "r");
  EXPECT_EQ(r.overlap_grad_sync, OverlapGradSync::True);
}

// Each key of a closed set of names is parsed into its enum as the recipe is read; a name outside
// the set is reported with its place and the valid names, in its turn among the checks, and an
// override may still replace it.
TEST(Recipe, ClosedSetsOfNamesAreCheckedWithTheirValidNames) {
  for (auto [key, bad, good, message] : {
           std::tuple{"dtype", "fp16", "fp32", R"(key 'dtype' must be "fp32" or "bf16", got "fp16")"},
           {"packing", "both", "pack", R"(key 'packing' must be "pad" or "pack", got "both")"},
           {"data_pipeline", "x", "on_the_fly", R"(key 'data_pipeline' must be "prepared" or "on_the_fly", got "x")"},
           {"finetuning_type", "qlora", "lora", R"(key 'finetuning_type' must be "full" or "lora", got "qlora")"},
           {"quantization_type", "int4", "fp4", R"(key 'quantization_type' must be "nf4" or "fp4", got "int4")"},
           {"lr_scheduler", "step", "linear",
            R"(key 'lr_scheduler' must be "cosine", "linear" or "constant", got "step")"},
           {"overlap_grad_sync", "yes", "false", R"(key 'overlap_grad_sync' must be true, false or "auto", got "yes")"},
           {"memory_planning", "x", "per_tensor",
            R"(key 'memory_planning' must be "planned" or "per_tensor", got "x")"},
       }) {
    const std::string file = fmt::format("{}{} = \"{}\"\n", kMinimal, key, bad);
    EXPECT_EQ(error_of(file), fmt::format("r.toml:5: {}", message));
    EXPECT_EQ(error_of(kMinimal, {fmt::format("{}={}", key, bad)}), fmt::format("--set {}={}: {}", key, bad, message));
    // An override naming a choice replaces the file's mistake, and the resolved recipe names it.
    const auto r = parse_recipe(file, "r.toml", {fmt::format("{}={}", key, good)});
    const std::string toml = keel::recipe::recipe_to_toml(r);
    EXPECT_NE(toml.find(fmt::format("\n{} = \"{}\"\n", key, good)), std::string::npos) << toml;
  }
  // Reported in the order of the checks, as when the values were kept as strings: dtype's mistake
  // before the missing data_path.
  EXPECT_EQ(error_of("model_name = \"m\"\ndtype = \"fp16\"\n"),
            R"(r.toml:2: key 'dtype' must be "fp32" or "bf16", got "fp16")");
  const auto r = parse_recipe(kMinimal, "r.toml", {"finetuning_type=lora", "dtype=fp32"});
  EXPECT_EQ(r.finetuning_type, keel::recipe::Finetuning::Lora);
  EXPECT_EQ(r.dtype, keel::recipe::Precision::Fp32);
  EXPECT_EQ(keel::recipe::choice_name(r.finetuning_type), "lora");
}

// stage = "dpo" and its keys: LLaMA-Factory's names, and the nonsense combinations refused by key.
TEST(Recipe, PreferenceStageKeys) {
  const auto r = parse_recipe(std::string(kMinimal) + "stage = \"dpo\"\npref_loss = \"ipo\"\npref_beta = 0.5\n",
                              "r.toml");
  EXPECT_EQ(r.stage, keel::recipe::Stage::Dpo);
  EXPECT_EQ(r.pref_loss, keel::recipe::PreferenceLoss::Ipo);
  EXPECT_EQ(r.pref_beta, 0.5);
  EXPECT_EQ(keel::recipe::rows_per_micro_batch(r), 2 * r.batch_size);
  const struct {
    std::string text;
    std::vector<std::string> parts;
  } refused[] = {
      {"pref_beta = 0.2\n", {"r.toml:", "'pref_beta' applies to preference tuning", "stage = \"dpo\""}},
      {"stage = \"dpo\"\npref_beta = 0\n", {"'pref_beta' must be positive"}},
      {"stage = \"dpo\"\npref_loss = \"orpo\"\npref_ftx = 1\n", {"ORPO", "'pref_ftx'"}},
      {"stage = \"dpo\"\npref_loss = \"hinge\"\ndpo_label_smoothing = 0.1\n", {"'dpo_label_smoothing'", "hinge"}},
      {"stage = \"dpo\"\nsimpo_gamma = 1\n", {"'simpo_gamma'", "SimPO"}},
      {"stage = \"dpo\"\npacking = \"pack\"\n", {"packing = \"pad\""}},
      {"stage = \"ppo\"\n", {"'stage' must be", "\"sft\" or \"dpo\""}},
  };
  for (const auto& c : refused) {
    const std::string e = error_of(std::string(kMinimal) + c.text);
    for (const auto& part : c.parts) EXPECT_NE(e.find(part), std::string::npos) << c.text << " -> " << e;
  }
}
