#include "keel/recipe/recipe.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <filesystem>
#include <map>
#include <set>
#include <toml++/toml.h>
#include <variant>

#include "keel/core/error.h"
#include "keel/core/four_bit.h"
#include "keel/core/file_io.h"
#include "keel/core/suggest.h"
#include "keel/model/gguf_config.h"

namespace keel::recipe {

namespace fs = std::filesystem;

std::string toml_quote(const std::string& s);

namespace {

// One key of a TOML table and the member of S it fills: the tables below are the only place each
// key is spelled, for parsing, printing (recipe_to_toml) and the list of valid keys alike.
// What a string key accepts besides a TOML string.
enum class Also {
  Nothing,
  NameList,  // a list of strings, kept as the names between commas (["q_proj", "v_proj"])
  Boolean,   // true/false, read as the names "true"/"false" (a switch that also has a word: "auto")
};

template <class S>
struct FieldOf {
  const char* key;
  // A string, a number, a switch, or one of a closed set of names (an enum of recipe.h's choices).
  std::variant<std::string S::*, int64_t S::*, double S::*, bool S::*, Precision S::*, Packing S::*,
               DataPipeline S::*, Finetuning S::*, FourBitType S::*, LrScheduler S::*, OverlapGradSync S::*,
               MemoryPlanning S::*, Stage S::*, PreferenceLoss S::*, CheckpointLayout S::*>
      member;
  const char* alias = nullptr;  // second accepted name (cann-recipes-train spelling)
  Also also = Also::Nothing;
};
using Field = FieldOf<Recipe>;

// [model_config]: a new model's architecture.
const std::vector<FieldOf<ScratchModel>>& model_config_fields() {
  static const std::vector<FieldOf<ScratchModel>> table = {
      {"family", &ScratchModel::family},
      {"vocab_size", &ScratchModel::vocab_size},
      {"hidden_size", &ScratchModel::hidden_size},
      {"intermediate_size", &ScratchModel::intermediate_size},
      {"num_layers", &ScratchModel::num_layers},
      {"num_heads", &ScratchModel::num_heads},
      {"num_kv_heads", &ScratchModel::num_kv_heads},
      {"head_dim", &ScratchModel::head_dim},
      {"max_position_embeddings", &ScratchModel::max_position_embeddings},
      {"rope_theta", &ScratchModel::rope_theta},
      {"rms_norm_eps", &ScratchModel::rms_norm_eps},
      {"tie_word_embeddings", &ScratchModel::tie_word_embeddings},
      {"sliding_window", &ScratchModel::sliding_window},
  };
  return table;
}

const std::vector<Field>& fields() {
  static const std::vector<Field> table = {
      {"model_name", &Recipe::model_name},
      {"dtype", &Recipe::dtype},
      {"data_path", &Recipe::data_path},
      {"eval_data_path", &Recipe::eval_data_path},
      {"max_seq_len", &Recipe::max_seq_len},
      {"tokenizer", &Recipe::tokenizer},
      {"packing", &Recipe::packing},
      {"chat_template", &Recipe::chat_template},
      {"train_on_prompt", &Recipe::train_on_prompt},
      {"special_tokens_in_messages", &Recipe::special_tokens_in_messages},
      {"num_workers", &Recipe::num_workers},
      {"prefetch_factor", &Recipe::prefetch_factor},
      {"preprocess_on_npu", &Recipe::preprocess_on_npu},
      {"data_pipeline", &Recipe::data_pipeline},
      {"shuffle", &Recipe::shuffle},
      {"finetuning_type", &Recipe::finetuning_type},
      {"lora_rank", &Recipe::lora_rank},
      {"lora_alpha", &Recipe::lora_alpha},
      {"lora_dropout", &Recipe::lora_dropout},
      {"lora_target", &Recipe::lora_target, nullptr, Also::NameList},
      {"use_rslora", &Recipe::use_rslora},
      {"adapter_name_or_path", &Recipe::adapter_name_or_path},
      {"additional_target", &Recipe::additional_target, nullptr, Also::NameList},
      {"quantization_bit", &Recipe::quantization_bit},
      {"quantization_type", &Recipe::quantization_type},
      {"double_quantization", &Recipe::double_quantization},
      {"stage", &Recipe::stage},
      {"pref_loss", &Recipe::pref_loss},
      {"pref_beta", &Recipe::pref_beta},
      {"pref_ftx", &Recipe::pref_ftx},
      {"simpo_gamma", &Recipe::simpo_gamma},
      {"dpo_label_smoothing", &Recipe::dpo_label_smoothing},
      {"batch_size", &Recipe::batch_size},
      {"gradient_accumulation_steps", &Recipe::gradient_accumulation_steps},
      {"learning_rate", &Recipe::learning_rate},
      {"weight_decay", &Recipe::weight_decay},
      {"max_steps", &Recipe::max_steps},
      {"num_epochs", &Recipe::num_epochs},
      {"warmup_steps", &Recipe::warmup_steps},
      {"lr_scheduler", &Recipe::lr_scheduler},
      {"adam_beta1", &Recipe::adam_beta1},
      {"adam_beta2", &Recipe::adam_beta2},
      {"adam_epsilon", &Recipe::adam_epsilon},
      {"max_grad_norm", &Recipe::max_grad_norm},
      {"seed", &Recipe::seed},
      {"dp_degree", &Recipe::dp_degree},
      {"bucket_size_mb", &Recipe::bucket_size_mb},
      {"deterministic_reduce", &Recipe::deterministic_reduce},
      {"overlap_grad_sync", &Recipe::overlap_grad_sync, nullptr, Also::Boolean},
      {"comm_timeout_s", &Recipe::comm_timeout_s},
      {"zero_stage", &Recipe::zero_stage},
      {"use_flash_attention", &Recipe::use_flash_attention},
      {"use_gradient_checkpointing", &Recipe::use_gradient_checkpointing},
      {"gradient_checkpointing_layers", &Recipe::gradient_checkpointing_layers},
      {"lm_head_chunk_tokens", &Recipe::lm_head_chunk_tokens},
      {"topology", &Recipe::topology, "hccl_topology"},
      {"memory_pool_size", &Recipe::memory_pool_size},
      {"memory_planning", &Recipe::memory_planning},
      {"backend", &Recipe::backend},
      {"checkpoint_dir", &Recipe::checkpoint_dir},
      {"save_interval", &Recipe::save_interval},
      {"async_save", &Recipe::async_save},
      {"checkpoint_layout", &Recipe::checkpoint_layout},
      {"checkpoint_staging_mb", &Recipe::checkpoint_staging_mb},
      {"keep_last_n", &Recipe::keep_last_n},
      {"fail_on_save_error", &Recipe::fail_on_save_error},
      {"skip_nonfinite_steps", &Recipe::skip_nonfinite_steps},
      {"output_dir", &Recipe::output_dir},
      {"cache_dir", &Recipe::cache_dir},
      {"max_bad_fraction", &Recipe::max_bad_fraction},
      {"log_interval", &Recipe::log_interval},
      {"report_to", &Recipe::report_to, nullptr, Also::NameList},
      {"eval_interval", &Recipe::eval_interval},
  };
  return table;
}

const std::vector<std::string>& model_config_keys() {
  static const std::vector<std::string> keys = [] {
    std::vector<std::string> k;
    for (const auto& f : model_config_fields()) k.push_back(f.key);
    return k;
  }();
  return keys;
}

std::vector<std::string> all_keys() {
  std::vector<std::string> keys;
  for (const auto& f : fields()) {
    keys.push_back(f.key);
    if (f.alias) keys.push_back(f.alias);
  }
  keys.push_back("model_config");
  return keys;
}

struct Where {
  std::string source;
  std::map<std::string, std::string> place;  // key -> "recipe.toml:12" or "--set"
  // Keys of a closed set whose value named none of its choices -> that value: validate reports it
  // (in its turn among the checks), unless a later override chose a valid one.
  std::map<std::string, std::string> unchosen;
  std::string of(const std::string& key) const {
    auto it = place.find(key);
    return it == place.end() ? source : it->second;
  }
};

std::string type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a number";
    case toml::node_type::boolean: return "a boolean";
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    default: return "a date/time";
  }
}

// `one_line`: the source is an override (--set, a TrainingConfig keyword), named whole.
std::string place_of(const toml::node& n, const std::string& source, bool one_line) {
  const auto& s = n.source();
  if (s.begin.line == 0 || one_line) return source;
  return fmt::format("{}:{}", source, s.begin.line);
}

// The text of a string key (or of a choice's name), with what `f.also` accepts besides a string.
template <class S>
std::string text_of(const FieldOf<S>& f, const toml::node& n, const std::string& where, const std::string& key) {
  if (f.also == Also::Boolean && n.is_boolean()) return *n.value<bool>() ? "true" : "false";
  if (f.also == Also::NameList && n.is_array()) {
    std::string joined;
    for (const auto& item : *n.as_array()) {
      require(item.is_string(), "{}: key '{}' expects a string or a list of strings, found {} in the list", where,
              key, type_name(item));
      joined += (joined.empty() ? "" : ",") + *item.value<std::string>();
    }
    return joined;
  }
  auto v = n.value<std::string>();
  require(n.is_string() && v.has_value(), "{}: key '{}' expects a string, found {}", where, key, type_name(n));
  return *v;
}

// Sets the member from the node. Returns the text given to a key of a closed set that names none
// of its choices (the member keeps its value; validate reports it), else nothing.
template <class S>
std::optional<std::string> assign(S& r, const FieldOf<S>& f, const toml::node& n, const std::string& where,
                                  const std::string& key) {
  std::optional<std::string> unchosen;
  std::visit(
      [&](auto member) {
        using T = std::remove_cvref_t<decltype(r.*member)>;
        if constexpr (std::is_same_v<T, std::string>) {
          r.*member = text_of(f, n, where, key);
        } else if constexpr (RecipeChoice<T>) {
          std::string text = text_of(f, n, where, key);
          if (auto choice = parse_choice<T>(text))
            r.*member = *choice;
          else
            unchosen = std::move(text);
        } else if constexpr (std::is_same_v<T, int64_t>) {
          require(n.is_integer(), "{}: key '{}' expects an integer, found {}", where, key, type_name(n));
          r.*member = *n.value<int64_t>();
        } else if constexpr (std::is_same_v<T, double>) {
          require(n.is_number(), "{}: key '{}' expects a number, found {}", where, key, type_name(n));
          r.*member = *n.value<double>();
        } else {
          require(n.is_boolean(), "{}: key '{}' expects true or false, found {}", where, key, type_name(n));
          r.*member = *n.value<bool>();
        }
      },
      f.member);
  return unchosen;
}

// A table's entries in the order they appear in the file (toml++ iterates in key order): errors
// name the first mistake in the file, and a list of them reads top to bottom. Entries without a
// place (an override's) keep key order.
std::vector<std::pair<std::string, const toml::node*>> in_file_order(const toml::table& t) {
  std::vector<std::pair<std::string, const toml::node*>> entries;
  for (const auto& [k, node] : t) entries.emplace_back(std::string(k.str()), &node);
  std::stable_sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) {
    const auto &x = a.second->source().begin, &y = b.second->source().begin;
    return std::pair{x.line, x.column} < std::pair{y.line, y.column};
  });
  return entries;
}

// A key no table declares, where it was found.
struct UnknownKey {
  std::string at;  // "recipe.toml:12", "--set k=v"
  std::string key;
  bool in_model_config = false;
  toml::source_position position{};  // in the file; {0, 0} for an override
};

const Field* find_field(const std::string& key) {
  auto it = std::find_if(fields().begin(), fields().end(),
                         [&](const Field& f) { return key == f.key || (f.alias && key == f.alias); });
  return it == fields().end() ? nullptr : &*it;
}

const FieldOf<ScratchModel>* find_model_config_field(const std::string& key) {
  const auto& table = model_config_fields();
  auto it = std::find_if(table.begin(), table.end(), [&](const auto& f) { return key == f.key; });
  return it == table.end() ? nullptr : &*it;
}

// Every unknown key of a recipe table (and of its [model_config]), in file order.
std::vector<UnknownKey> unknown_keys(const toml::table& t, const std::string& source, bool one_line) {
  std::vector<UnknownKey> unknown;
  for (const auto& [key, node] : in_file_order(t)) {
    if (key == "model_config") {
      if (!node->is_table()) continue;  // apply_table names the wrong type
      for (const auto& [inner, value] : in_file_order(*node->as_table()))
        if (!find_model_config_field(inner))
          unknown.push_back({place_of(*value, source, one_line), inner, true, value->source().begin});
    } else if (!find_field(key)) {
      unknown.push_back({place_of(*node, source, one_line), key, false, node->source().begin});
    }
  }
  // [model_config]'s keys, and dotted model_config.* keys among the others, in their places.
  std::stable_sort(unknown.begin(), unknown.end(), [](const UnknownKey& a, const UnknownKey& b) {
    return std::pair{a.position.line, a.position.column} < std::pair{b.position.line, b.position.column};
  });
  return unknown;
}

// One message naming every unknown key, each with its place and the nearest valid key. One key
// alone keeps the one-line form ("recipe.toml:4: unknown key 'x' (did you mean 'y'?). ...").
[[noreturn]] void fail_unknown_keys(const std::vector<UnknownKey>& unknown) {
  auto describe = [](const UnknownKey& u) {
    return u.in_model_config
               ? fmt::format("unknown key '{}' in [model_config]{}", u.key, did_you_mean(u.key, model_config_keys()))
               : fmt::format("unknown key '{}'{}", u.key, did_you_mean(u.key, all_keys()));
  };
  const std::string every_key = "`keel train --print-recipe` lists every key.";
  const std::string model_config_valid = fmt::format("valid keys: {}", fmt::join(model_config_keys(), ", "));
  if (unknown.size() == 1) {
    const UnknownKey& u = unknown.front();
    if (u.in_model_config) fail("{}: {}; {}", u.at, describe(u), model_config_valid);
    fail("{}: {}. {}", u.at, describe(u), every_key);
  }
  std::string lines;
  bool top_level = false, model_config = false;
  for (const auto& u : unknown) {
    lines += fmt::format("\n  {}: {}", u.at, describe(u));
    (u.in_model_config ? model_config : top_level) = true;
  }
  std::string after;
  if (top_level) after += "\n" + every_key;
  if (model_config) after += "\n[model_config]: " + model_config_valid;
  fail("{} unknown keys:{}{}", unknown.size(), lines, after);
}

void parse_model_config_table(Recipe& r, const toml::table& t, const std::string& source, Where& where,
                              bool one_line) {
  ScratchModel m;
  for (const auto& [key, node] : in_file_order(t)) {
    const std::string at = place_of(*node, source, one_line);
    const std::string full = "model_config." + key;
    where.place[full] = at;
    const auto* field = find_model_config_field(key);
    if (!field) fail_unknown_keys({{at, key, true}});
    assign(m, *field, *node, at, full);
  }
  r.model_config = m;
}

void apply_table(Recipe& r, const toml::table& t, const std::string& source, Where& where, bool one_line = false) {
  for (const auto& [key, node] : in_file_order(t)) {
    const std::string at = place_of(*node, source, one_line);
    if (key == "model_config") {
      require(node->is_table(), "{}: key 'model_config' expects a table, found {}", at, type_name(*node));
      parse_model_config_table(r, *node->as_table(), source, where, one_line);
      where.place["model_config"] = at;
      continue;
    }
    const Field* field = find_field(key);
    if (!field) fail_unknown_keys({{at, key}});
    if (auto unchosen = assign(r, *field, *node, at, key))
      where.unchosen[field->key] = *unchosen;
    else
      where.unchosen.erase(field->key);
    where.place[field->key] = at;
  }
}

// `label` names where overrides come from: "--set" (the command line: "--set kv", quoted when the
// text is not a key=value) or a caller's name such as "TrainingConfig" (the Python package:
// "TrainingConfig(kv)").
std::string override_place(const std::string& label, const std::string& kv, bool quoted = false) {
  if (label != "--set") return fmt::format("{}({})", label, kv);
  return quoted ? fmt::format("--set '{}'", kv) : "--set " + kv;
}

// One override ("key=value") read as a one-line TOML table, and the place messages give it.
struct Override {
  std::string place;
  toml::table table;
};

Override parse_override(const std::string& kv, const std::string& label) {
  auto eq = kv.find('=');
  require(eq != std::string::npos && eq > 0, "{}: expected key=value", override_place(label, kv, /*quoted=*/true));
  std::string key = kv.substr(0, eq), value = kv.substr(eq + 1);
  Override o{override_place(label, kv), {}};
  try {
    o.table = toml::parse(std::string_view(key + " = " + value), std::string_view("--set"));
  } catch (const toml::parse_error&) {
    // Bare words are strings: --set output_dir=runs/a
    try {
      o.table = toml::parse(std::string_view(key + " = " + toml_quote(value)), std::string_view("--set"));
    } catch (const toml::parse_error& e) {  // not a key (`--set 'a b=1'`), or not a value even quoted
      fail("{}: expected key=value with a recipe key and a TOML value: {}", override_place(label, kv, /*quoted=*/true),
           e.description());
    }
  }
  return o;
}

// Every key the override sets is placed at the override (place_of names a one-line source whole).
void apply_override(Recipe& r, const Override& o, Where& where) {
  apply_table(r, o.table, o.place, where, /*one_line=*/true);
}

// A key of a closed set given a name outside it: "{place}: key 'dtype' must be "fp32" or "bf16",
// got "fp16"", the valid names listed from the choices (true and false bare where TOML's booleans
// are accepted).
void require_chosen(const Where& w, const std::string& key) {
  auto it = w.unchosen.find(key);
  if (it == w.unchosen.end()) return;
  const Field& f = *find_field(key);
  std::vector<std::string> names;
  std::visit(
      [&](auto member) {
        using T = std::remove_cvref_t<decltype(Recipe{}.*member)>;
        if constexpr (RecipeChoice<T>)
          for (const auto& [e, name] : choices(T{}))
            names.push_back(f.also == Also::Boolean && (name == "true" || name == "false")
                                ? std::string(name)
                                : fmt::format("\"{}\"", name));
      },
      f.member);
  std::string valid;
  for (size_t i = 0; i < names.size(); ++i) valid += (i == 0 ? "" : i + 1 < names.size() ? ", " : " or ") + names[i];
  fail("{}: key '{}' must be {}, got \"{}\"", w.of(key), key, valid, it->second);
}

void validate_finetuning(const Recipe& r, const Where& w) {
  require_chosen(w, "finetuning_type");
  require(r.quantization_bit == 0 || r.quantization_bit == 4,
          "{}: key 'quantization_bit' must be 0 (no quantization) or 4 (QLoRA: NF4 or FP4), got {}",
          w.of("quantization_bit"), r.quantization_bit);
  require_chosen(w, "quantization_type");
  require(r.quantization_bit == 0 || r.finetuning_type == Finetuning::Lora,
          "{}: key 'quantization_bit' = 4 quantizes frozen weights: it needs finetuning_type = \"lora\" (QLoRA)",
          w.of("quantization_bit"));
  require(r.additional_target.empty() || r.finetuning_type == Finetuning::Lora,
          "{}: key 'additional_target' names modules trained beside LoRA's adapters: it needs finetuning_type = "
          "\"lora\"",
          w.of("additional_target"));
  for (const auto& t : additional_targets(r))
    require(!t.empty(), "{}: key 'additional_target' = \"{}\" has an empty name between commas",
            w.of("additional_target"), r.additional_target);
  if (r.finetuning_type != Finetuning::Lora) {
    // A LoRA setting given a value of its own would be ignored: say so. (The resolved recipe a
    // checkpoint keeps lists every key with its default, which is fine.)
    const Recipe defaults;
    for (auto [key, changed] : {std::pair{"lora_rank", r.lora_rank != defaults.lora_rank},
                                {"lora_alpha", r.lora_alpha != defaults.lora_alpha},
                                {"lora_dropout", r.lora_dropout != defaults.lora_dropout},
                                {"lora_target", r.lora_target != defaults.lora_target},
                                {"use_rslora", r.use_rslora != defaults.use_rslora},
                                {"adapter_name_or_path", !r.adapter_name_or_path.empty()}})
      require(!changed,
              "{}: key '{}' applies to LoRA, but finetuning_type is \"{}\" (set finetuning_type = \"lora\")",
              w.of(key), key, choice_name(r.finetuning_type));
    return;
  }
  require(r.lora_rank >= 1 && r.lora_rank <= 4096, "{}: key 'lora_rank' must be in [1, 4096], got {}",
          w.of("lora_rank"), r.lora_rank);
  require(r.lora_alpha >= 0, "{}: key 'lora_alpha' must not be negative (0: 2 x lora_rank), got {}",
          w.of("lora_alpha"), r.lora_alpha);
  require(r.lora_dropout >= 0 && r.lora_dropout < 1, "{}: key 'lora_dropout' must be in [0, 1), got {}",
          w.of("lora_dropout"), r.lora_dropout);
  const auto targets = lora_targets(r);
  require(!targets.empty(), "{}: key 'lora_target' names no module; use \"all\" or names such as \"q_proj,v_proj\"",
          w.of("lora_target"));
  for (const auto& t : targets)
    require(!t.empty(), "{}: key 'lora_target' = \"{}\" has an empty name between commas", w.of("lora_target"),
            r.lora_target);
}

// stage = "dpo" and its keys (train/preference_loss.h says what each loss computes).
void validate_preference(const Recipe& r, const Where& w) {
  require_chosen(w, "stage");
  require_chosen(w, "pref_loss");
  const Recipe defaults;
  if (r.stage == Stage::Sft) {
    // A preference setting given a value of its own would be ignored by supervised fine-tuning.
    for (auto [key, changed] : {std::pair{"pref_loss", r.pref_loss != defaults.pref_loss},
                                {"pref_beta", r.pref_beta != defaults.pref_beta},
                                {"pref_ftx", r.pref_ftx != defaults.pref_ftx},
                                {"simpo_gamma", r.simpo_gamma != defaults.simpo_gamma},
                                {"dpo_label_smoothing", r.dpo_label_smoothing != defaults.dpo_label_smoothing}})
      require(!changed, "{}: key '{}' applies to preference tuning, but stage is \"sft\" (set stage = \"dpo\")",
              w.of(key), key);
    return;
  }
  require(r.pref_beta > 0 && std::isfinite(r.pref_beta), "{}: key 'pref_beta' must be positive, got {}",
          w.of("pref_beta"), r.pref_beta);
  require(r.pref_ftx >= 0 && std::isfinite(r.pref_ftx), "{}: key 'pref_ftx' must not be negative, got {}",
          w.of("pref_ftx"), r.pref_ftx);
  require(r.dpo_label_smoothing >= 0 && r.dpo_label_smoothing < 0.5,
          "{}: key 'dpo_label_smoothing' must be in [0, 0.5), got {}", w.of("dpo_label_smoothing"),
          r.dpo_label_smoothing);
  require(r.dpo_label_smoothing == 0 || r.pref_loss == PreferenceLoss::Sigmoid || r.pref_loss == PreferenceLoss::Simpo,
          "{}: key 'dpo_label_smoothing' smooths the sigmoid loss; pref_loss = \"{}\" has none (at {})",
          w.of("dpo_label_smoothing"), choice_name(r.pref_loss), w.of("pref_loss"));
  require(r.simpo_gamma == defaults.simpo_gamma || r.pref_loss == PreferenceLoss::Simpo,
          "{}: key 'simpo_gamma' is SimPO's margin; pref_loss is \"{}\" (at {})", w.of("simpo_gamma"),
          choice_name(r.pref_loss), w.of("pref_loss"));
  require(std::isfinite(r.simpo_gamma), "{}: key 'simpo_gamma' must be a finite number", w.of("simpo_gamma"));
  require(r.pref_loss != PreferenceLoss::Orpo || r.pref_ftx == 0,
          "{}: ORPO's loss already holds the chosen answers' NLL; key 'pref_ftx' would add it twice (at {})",
          w.of("pref_loss"), w.of("pref_ftx"));
  // Pairs are kept whole in a row each: packing several into one row is not built yet.
  require(r.packing == Packing::Pad,
          "{}: stage = \"dpo\" puts each answer of a pair in a row of its own and needs packing = \"pad\" (got "
          "\"{}\" at {})",
          w.of("stage"), choice_name(r.packing), w.of("packing"));
  require(r.data_pipeline == DataPipeline::Prepared,
          "{}: stage = \"dpo\" reads its pairs once, before step 1; data_pipeline = \"on_the_fly\" is for "
          "supervised fine-tuning (at {})",
          w.of("stage"), w.of("data_pipeline"));
}

void validate_recipe(const Recipe& r, const Where& w) {
  auto positive = [&](int64_t v, const char* key) {
    require(v > 0, "{}: key '{}' must be positive, got {}", w.of(key), key, v);
  };
  auto non_negative = [&](double v, const char* key) {
    require(v >= 0, "{}: key '{}' must not be negative, got {}", w.of(key), key, v);
  };
  require(r.model_name.empty() != !r.model_config.has_value(),
          "{}: give exactly one of 'model_name' (an HF model directory) or a [model_config] table", r.source);
  require_chosen(w, "dtype");
  require(!r.data_path.empty(), "{}: key 'data_path' is required (a JSONL file of training records)", r.source);
  positive(r.max_seq_len, "max_seq_len");
  require(r.max_seq_len >= 2 && r.max_seq_len <= (1 << 20), "{}: key 'max_seq_len' must be in [2, 1048576], got {}",
          w.of("max_seq_len"), r.max_seq_len);
  positive(r.batch_size, "batch_size");
  require_chosen(w, "packing");
  require(r.chat_template == "auto" || r.chat_template == "model" || r.chat_template == "glm4" ||
              r.chat_template == "llama3" || r.chat_template == "chatml" || r.chat_template == "none" ||
              r.chat_template.ends_with(".jinja"),
          "{}: key 'chat_template' must be auto, model, a .jinja file, glm4, llama3, chatml or none, got \"{}\"",
          w.of("chat_template"), r.chat_template);
  require_chosen(w, "data_pipeline");
  require(r.data_pipeline != DataPipeline::OnTheFly || r.packing == Packing::Pad,
          "{}: data_pipeline = \"on_the_fly\" puts one record in each row and needs packing = \"pad\" (got \"{}\" "
          "at {})",
          w.of("data_pipeline"), choice_name(r.packing), w.of("packing"));
  require_chosen(w, "memory_planning");
  require(r.backend == "cpu" || r.backend == "reference",
          "{}: key 'backend' must be \"cpu\" or \"reference\", got \"{}\"", w.of("backend"), r.backend);
  require(r.num_workers >= 0 && r.num_workers <= 64, "{}: key 'num_workers' must be in [0, 64]", w.of("num_workers"));
  require(r.prefetch_factor >= 1 && r.prefetch_factor <= 64, "{}: key 'prefetch_factor' must be in [1, 64]",
          w.of("prefetch_factor"));
  positive(r.gradient_accumulation_steps, "gradient_accumulation_steps");
  validate_finetuning(r, w);
  validate_preference(r, w);
  require(r.max_steps >= 0 && r.max_steps <= 1'000'000'000, "{}: key 'max_steps' must be in [0, 1e9], got {}",
          w.of("max_steps"), r.max_steps);
  require(r.num_epochs >= 0 && r.num_epochs <= 1'000'000, "{}: key 'num_epochs' must be in [0, 1e6], got {}",
          w.of("num_epochs"), r.num_epochs);
  require(r.warmup_steps >= 0, "{}: key 'warmup_steps' must not be negative", w.of("warmup_steps"));
  non_negative(r.learning_rate, "learning_rate");
  non_negative(r.weight_decay, "weight_decay");
  non_negative(r.max_grad_norm, "max_grad_norm");
  require_chosen(w, "lr_scheduler");
  require(r.adam_beta1 >= 0 && r.adam_beta1 < 1, "{}: key 'adam_beta1' must be in [0, 1)", w.of("adam_beta1"));
  require(r.adam_beta2 >= 0 && r.adam_beta2 < 1, "{}: key 'adam_beta2' must be in [0, 1)", w.of("adam_beta2"));
  require(r.adam_epsilon > 0, "{}: key 'adam_epsilon' must be positive", w.of("adam_epsilon"));
  positive(r.dp_degree, "dp_degree");
  positive(r.log_interval, "log_interval");
  require(r.bucket_size_mb > 0 && r.bucket_size_mb <= 4096, "{}: key 'bucket_size_mb' must be in (0, 4096]",
          w.of("bucket_size_mb"));
  require_chosen(w, "overlap_grad_sync");
  require(r.comm_timeout_s > 0, "{}: key 'comm_timeout_s' must be positive", w.of("comm_timeout_s"));
  require(r.zero_stage >= 0 && r.zero_stage <= 3, "{}: key 'zero_stage' must be 0, 1, 2 or 3", w.of("zero_stage"));
  require(r.gradient_checkpointing_layers >= 0, "{}: key 'gradient_checkpointing_layers' must not be negative, got {}",
          w.of("gradient_checkpointing_layers"), r.gradient_checkpointing_layers);
  require(r.gradient_checkpointing_layers == 0 || r.use_gradient_checkpointing,
          "{}: key 'gradient_checkpointing_layers' = {} chooses how many blocks recompute: it needs "
          "use_gradient_checkpointing = true",
          w.of("gradient_checkpointing_layers"), r.gradient_checkpointing_layers);
  require(r.eval_interval >= 0, "{}: key 'eval_interval' must not be negative", w.of("eval_interval"));
  require(r.keep_last_n >= 1, "{}: key 'keep_last_n' must be at least 1", w.of("keep_last_n"));
  require_chosen(w, "checkpoint_layout");
  require(r.checkpoint_staging_mb > 0 && r.checkpoint_staging_mb <= 1 << 20,
          "{}: key 'checkpoint_staging_mb' must be in (0, 1048576] (MiB per rank), got {}",
          w.of("checkpoint_staging_mb"), r.checkpoint_staging_mb);
  require(r.log_interval <= 1'000'000'000 && r.eval_interval <= 1'000'000'000 && r.save_interval <= 1'000'000'000,
          "{}: intervals must be at most 1e9 steps", r.source);
  require(!r.eval_data_path.empty() || r.eval_interval == 0,
          "{}: key 'eval_interval' is set but 'eval_data_path' is not", w.of("eval_interval"));
  require(r.save_interval == 0 || !r.checkpoint_dir.empty(),
          "{}: key 'save_interval' is set but 'checkpoint_dir' is not", w.of("save_interval"));
  require(r.save_interval >= 0, "{}: key 'save_interval' must not be negative", w.of("save_interval"));
  non_negative(r.memory_pool_size, "memory_pool_size");
  require(r.lm_head_chunk_tokens >= 0 && r.lm_head_chunk_tokens <= 1'000'000'000,
          "{}: key 'lm_head_chunk_tokens' must be 0 (keel's choice) or a number of tokens, got {}",
          w.of("lm_head_chunk_tokens"), r.lm_head_chunk_tokens);
  require(r.max_bad_fraction >= 0 && r.max_bad_fraction <= 1, "{}: key 'max_bad_fraction' must be in [0, 1], got {}",
          w.of("max_bad_fraction"), r.max_bad_fraction);
  require(!r.output_dir.empty(), "{}: key 'output_dir' must not be empty", w.of("output_dir"));
  const auto reports = report_destinations(r);
  for (const auto& name : reports) {
    require(name == "none" || name == "tensorboard" || name == "all",
            "{}: key 'report_to' = \"{}\": keel reports to \"tensorboard\" (event files under output_dir/runs/), "
            "\"all\" (the same) or \"none\"; \"{}\" is not one of them",
            w.of("report_to"), r.report_to, name);
    require(name != "none" || reports.size() == 1, "{}: key 'report_to' = \"{}\" lists \"none\" beside other names",
            w.of("report_to"), r.report_to);
  }
  require(!reports.empty(), "{}: key 'report_to' is empty; use \"none\" for no reporting", w.of("report_to"));
  if (r.model_config) {
    const auto& m = *r.model_config;
    for (auto [v, k] : {std::pair{m.vocab_size, "vocab_size"},
                        {m.hidden_size, "hidden_size"},
                        {m.intermediate_size, "intermediate_size"},
                        {m.num_layers, "num_layers"},
                        {m.num_heads, "num_heads"}})
      require(v > 0, "{}: key 'model_config.{}' is required and must be positive", w.of("model_config"), k);
    require(m.sliding_window >= 0, "{}: key 'model_config.sliding_window' must be 0 (none) or positive, got {}",
            w.of("model_config"), m.sliding_window);
  }
}

}  // namespace

Recipe parse_recipe(const std::string& text, const std::string& source, const std::vector<std::string>& overrides,
                    const std::string& override_label) {
  Recipe r;
  r.source = source;
  Where where{source, {}};
  toml::table t;
  try {
    t = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    fail("{}:{}:{}: invalid TOML: {}", source, e.source().begin.line, e.source().begin.column, e.description());
  }
  std::vector<Override> parsed;
  for (const auto& kv : overrides) parsed.push_back(parse_override(kv, override_label));
  // Every unknown key of the file and the overrides in one message, before any other mistake.
  auto unknown = unknown_keys(t, source, /*one_line=*/false);
  for (const auto& o : parsed) {
    auto more = unknown_keys(o.table, o.place, /*one_line=*/true);
    unknown.insert(unknown.end(), more.begin(), more.end());
  }
  if (!unknown.empty()) fail_unknown_keys(unknown);
  apply_table(r, t, source, where);
  for (const auto& o : parsed) apply_override(r, o, where);
  validate_recipe(r, where);
  return r;
}

namespace {

// The path keys made absolute: relative to `base_dir`, or to the current directory for the keys
// in `keys_from_cwd`.
void make_paths_absolute(Recipe& r, const std::string& base_dir, const std::set<std::string>& keys_from_cwd) {
  const fs::path recipe_dir = base_dir;
  for (auto [key, value] : {std::pair{"model_name", &r.model_name},
                            {"data_path", &r.data_path},
                            {"eval_data_path", &r.eval_data_path},
                            {"tokenizer", &r.tokenizer},
                            {"output_dir", &r.output_dir},
                            {"checkpoint_dir", &r.checkpoint_dir},
                            {"cache_dir", &r.cache_dir},
                            {"adapter_name_or_path", &r.adapter_name_or_path}}) {
    if (value->empty() || fs::path(*value).is_absolute()) continue;
    const fs::path base = keys_from_cwd.count(key) ? fs::current_path() : recipe_dir;
    *value = (base / *value).lexically_normal().string();
  }
}

}  // namespace

Recipe load_recipe(const std::string& path, const std::vector<std::string>& overrides) {
  return resolve_recipe(read_file(path), path, fs::absolute(path).parent_path().string(), overrides);
}

Recipe resolve_recipe(const std::string& text, const std::string& source, const std::string& base_dir,
                      const std::vector<std::string>& overrides, const std::string& override_label) {
  Recipe r = parse_recipe(text, source, overrides, override_label);
  // Which keys the overrides set: those are relative to the current directory.
  std::set<std::string> from_overrides;
  for (const auto& kv : overrides) from_overrides.insert(kv.substr(0, kv.find('=')));
  make_paths_absolute(r, base_dir, from_overrides);
  return r;
}


void require_training_length(const Recipe& r) {
  require(r.max_steps > 0 || r.num_epochs > 0, "{}: set 'max_steps' or 'num_epochs'", r.source);
}

std::vector<std::pair<std::string, std::string>> recipe_key_aliases() {
  std::vector<std::pair<std::string, std::string>> aliases;
  for (const auto& f : fields())
    if (f.alias) aliases.emplace_back(f.alias, f.key);
  return aliases;
}

std::string toml_quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    // TOML forbids raw control characters in strings: escaped, the resolved recipe reads back.
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      out += fmt::format("\\u{:04X}", static_cast<unsigned char>(c));
      continue;
    }
    out += c;
  }
  return out + "\"";
}

namespace {

// A TOML float that reads back as the same double (TOML needs a '.' or an exponent).
std::string toml_number(double v) {
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

}  // namespace

namespace {

template <class S>
void write_fields(const S& s, const std::vector<FieldOf<S>>& table, std::string& out) {
  for (const auto& f : table) {
    std::visit(
        [&](auto member) {
          using T = std::remove_cvref_t<decltype(s.*member)>;
          if constexpr (std::is_same_v<T, std::string>)
            out += fmt::format("{} = {}\n", f.key, toml_quote(s.*member));
          else if constexpr (RecipeChoice<T>)
            out += fmt::format("{} = {}\n", f.key, toml_quote(std::string(choice_name(s.*member))));
          else if constexpr (std::is_same_v<T, bool>)
            out += fmt::format("{} = {}\n", f.key, (s.*member) ? "true" : "false");
          else if constexpr (std::is_same_v<T, double>)
            out += fmt::format("{} = {}\n", f.key, toml_number(s.*member));
          else
            out += fmt::format("{} = {}\n", f.key, s.*member);
        },
        f.member);
  }
}

}  // namespace

std::string recipe_to_toml(const Recipe& r) {
  std::string out;
  write_fields(r, fields(), out);
  if (r.model_config) {
    out += "\n[model_config]\n";
    write_fields(*r.model_config, model_config_fields(), out);
  }
  return out;
}

std::string recipe_tokenizer_path(const Recipe& r) {
  if (!r.tokenizer.empty()) return r.tokenizer;
  if (r.model_config) return "";
  return model::is_gguf_path(r.model_name) ? r.output_dir + "/gguf_tokenizer" : r.model_name;
}

namespace {

// "a, b,c" -> {"a", "b", "c"}; "" -> {}.
std::vector<std::string> comma_list(const std::string& text) {
  std::vector<std::string> out;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find(',', begin);
    if (end == std::string::npos) end = text.size();
    std::string item = text.substr(begin, end - begin);
    const auto first = item.find_first_not_of(" \t"), last = item.find_last_not_of(" \t");
    out.push_back(first == std::string::npos ? "" : item.substr(first, last - first + 1));
    begin = end + 1;
  }
  if (out.size() == 1 && out[0].empty()) out.clear();
  return out;
}

}  // namespace

std::vector<std::string> lora_targets(const Recipe& r) { return comma_list(r.lora_target); }
std::vector<std::string> additional_targets(const Recipe& r) { return comma_list(r.additional_target); }
std::vector<std::string> report_destinations(const Recipe& r) { return comma_list(r.report_to); }
bool reports_to_tensorboard(const Recipe& r) {
  for (const auto& name : report_destinations(r))
    if (name == "tensorboard" || name == "all") return true;
  return false;
}

bool bf16_full_fine_tuning(const Recipe& r) {
  return r.dtype == Precision::Bf16 && r.finetuning_type != Finetuning::Lora;
}

double lora_alpha(const Recipe& r) { return r.lora_alpha > 0 ? r.lora_alpha : 2.0 * double(r.lora_rank); }

std::vector<std::string> inactive_key_warnings(const Recipe& r) {
  std::vector<std::string> w;
  auto note = [&](bool set, const char* key, const char* what) {
    if (set) w.push_back(fmt::format("recipe key '{}' is accepted but has no effect here: {}", key, what));
  };
  // Stage 3 with one rank still drops the whole bf16 copy of the weights.
  const bool casts = r.zero_stage >= 3 && bf16_full_fine_tuning(r);
  note(r.zero_stage >= 1 && r.dp_degree == 1 && !casts, "zero_stage",
       "ZeRO shards the optimizer state (stage 2: and the gradients; stage 3: and the weights) over dp_degree ranks; "
       "with dp_degree = 1 there is nothing to shard (stage 3 in bf16 full fine-tuning still casts the bf16 weights "
       "per position instead of keeping a whole copy)");
  note(r.topology != "auto", "topology", "topology-aware placement is not active yet");
  note(!r.use_flash_attention, "use_flash_attention",
       "keel's attention is always the tiled flash-style kernel; false changes nothing");
  note(r.preprocess_on_npu, "preprocess_on_npu",
       "keel tokenizes once, before training, into prepared shards (keel prepare, or automatically for a JSONL "
       "data_path); this key changes nothing");
  return w;
}

}  // namespace keel::recipe
