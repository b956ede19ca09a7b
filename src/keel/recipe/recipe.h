// The recipe is the run's configuration (what cann-recipes-train calls TrainingConfig and HF calls
// TrainingArguments): one TOML file of flat keys named as in cann-recipes-train's TrainingConfig
// (so users of that system find the same names) plus the Hugging Face Trainer knobs keel adds. Every key is
// declared once in recipe.cpp with its type, default, check and help; unknown keys, wrong types
// and out-of-range values are errors naming the key and line, with the nearest valid key for typos.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "keel/core/four_bit.h"

namespace keel::recipe {

// The keys whose value is one of a closed set of names hold it as an enum: the name is parsed once,
// as the recipe is read (a name outside the set is an error naming the key, its place and the
// valid names), and written back by recipe_to_toml; the code that uses the recipe compares enums.
// choices() is the one place each name is spelled. (quantization_type is core's FourBitType.)
enum class Precision : uint8_t { Fp32, Bf16 };              // dtype
enum class Packing : uint8_t { Pad, Pack };                 // packing
enum class DataPipeline : uint8_t { Prepared, OnTheFly };   // data_pipeline
enum class Finetuning : uint8_t { Full, Lora };             // finetuning_type
enum class LrScheduler : uint8_t { Cosine, Linear, Constant };
enum class OverlapGradSync : uint8_t { True, False, Auto };
enum class MemoryPlanning : uint8_t { Planned, PerTensor };
enum class Stage : uint8_t { Sft, Dpo };                   // stage
enum class PreferenceLoss : uint8_t { Sigmoid, Ipo, Hinge, Simpo, Orpo };  // pref_loss
enum class CheckpointLayout : uint8_t { Auto, Sharded, SingleFile };        // checkpoint_layout

template <class E>
using Choice = std::pair<E, std::string_view>;
// Each set's names, in the order messages list them.
inline const auto& choices(Precision) {
  static constexpr Choice<Precision> c[] = {{Precision::Fp32, "fp32"}, {Precision::Bf16, "bf16"}};
  return c;
}
inline const auto& choices(Packing) {
  static constexpr Choice<Packing> c[] = {{Packing::Pad, "pad"}, {Packing::Pack, "pack"}};
  return c;
}
inline const auto& choices(DataPipeline) {
  static constexpr Choice<DataPipeline> c[] = {{DataPipeline::Prepared, "prepared"},
                                               {DataPipeline::OnTheFly, "on_the_fly"}};
  return c;
}
inline const auto& choices(Finetuning) {
  static constexpr Choice<Finetuning> c[] = {{Finetuning::Full, "full"}, {Finetuning::Lora, "lora"}};
  return c;
}
inline const auto& choices(LrScheduler) {
  static constexpr Choice<LrScheduler> c[] = {
      {LrScheduler::Cosine, "cosine"}, {LrScheduler::Linear, "linear"}, {LrScheduler::Constant, "constant"}};
  return c;
}
inline const auto& choices(OverlapGradSync) {  // TOML's true/false are accepted too
  static constexpr Choice<OverlapGradSync> c[] = {
      {OverlapGradSync::True, "true"}, {OverlapGradSync::False, "false"}, {OverlapGradSync::Auto, "auto"}};
  return c;
}
inline const auto& choices(MemoryPlanning) {
  static constexpr Choice<MemoryPlanning> c[] = {{MemoryPlanning::Planned, "planned"},
                                                 {MemoryPlanning::PerTensor, "per_tensor"}};
  return c;
}
inline const auto& choices(Stage) {
  static constexpr Choice<Stage> c[] = {{Stage::Sft, "sft"}, {Stage::Dpo, "dpo"}};
  return c;
}
inline const auto& choices(PreferenceLoss) {  // LLaMA-Factory's names (TRL's loss_type)
  static constexpr Choice<PreferenceLoss> c[] = {{PreferenceLoss::Sigmoid, "sigmoid"},
                                                 {PreferenceLoss::Ipo, "ipo"},
                                                 {PreferenceLoss::Hinge, "hinge"},
                                                 {PreferenceLoss::Simpo, "simpo"},
                                                 {PreferenceLoss::Orpo, "orpo"}};
  return c;
}
inline const auto& choices(CheckpointLayout) {  // PyTorch DCP's and DeepSpeed's per-rank files: "sharded"
  static constexpr Choice<CheckpointLayout> c[] = {{CheckpointLayout::Auto, "auto"},
                                                   {CheckpointLayout::Sharded, "sharded"},
                                                   {CheckpointLayout::SingleFile, "single_file"}};
  return c;
}
inline const auto& choices(FourBitType) {  // bitsandbytes' names, as core spells them
  static const Choice<FourBitType> c[] = {{FourBitType::Nf4, four_bit_type_name(FourBitType::Nf4)},
                                          {FourBitType::Fp4, four_bit_type_name(FourBitType::Fp4)}};
  return c;
}

template <class E>
concept RecipeChoice = requires(E e) { choices(e); };

// The name of a choice as recipes spell it ("bf16", "lora", "per_tensor").
template <RecipeChoice E>
std::string_view choice_name(E value) {
  for (const auto& [e, name] : choices(value))
    if (e == value) return name;
  return "?";
}
// The choice a name spells, if any.
template <RecipeChoice E>
std::optional<E> parse_choice(std::string_view name) {
  for (const auto& [e, n] : choices(E{}))
    if (n == name) return e;
  return std::nullopt;
}

// Sizes of a model created from scratch (the [model_config] table) instead of loaded.
struct ScratchModel {
  std::string family = "llama";
  int64_t vocab_size = 0, hidden_size = 0, intermediate_size = 0, num_layers = 0, num_heads = 0;
  int64_t num_kv_heads = 0, head_dim = 0, max_position_embeddings = 2048;
  int64_t sliding_window = 0;  // mistral, qwen3: every layer attends through this window (0: none)
  double rope_theta = 10000.0, rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
};

struct Recipe {
  // Model
  std::string model_name;                    // local HF model directory
  std::optional<ScratchModel> model_config;  // or a new model
  Precision dtype = Precision::Bf16;         // fp32 | bf16
  // Data
  std::string data_path;
  std::string eval_data_path;
  int64_t max_seq_len = 2048;
  std::string tokenizer;               // tokenizer.json / tiktoken file or dir; "" = model_name's
  Packing packing = Packing::Pad;      // "pad" one document per row, or "pack" several (no cross-attention)
  // auto (the model's own Jinja template, else a built-in) | model | a .jinja file | glm4 | llama3 | chatml
  std::string chat_template = "auto";
  bool train_on_prompt = false;             // loss on every token of a conversation, not only the answers
  bool special_tokens_in_messages = false;  // special-token strings in messages are the tokens (not text)
  int64_t num_workers = 1;             // loader threads preparing batches ahead of the step
  int64_t prefetch_factor = 2;         // steps kept ready
  bool preprocess_on_npu = false;      // accepted for compatibility; keel always prepares shards up front
  // "prepared": raw JSONL tokenized once into shards, fed by the prefetching loader (the default);
  // "on_the_fly": each step's records read and tokenized on the training thread, one per row (the
  // naive baseline `keel bench ladder` measures against). Same batches either way.
  DataPipeline data_pipeline = DataPipeline::Prepared;
  bool shuffle = true;
  // Fine-tuning method, named as LLaMA-Factory names it: "full" trains every weight; "lora" freezes
  // them and trains low-rank adapters (model/lora.h) on the lora_target modules.
  Finetuning finetuning_type = Finetuning::Full;
  int64_t lora_rank = 8;
  double lora_alpha = 0;    // 0: 2 x lora_rank (LLaMA-Factory's default)
  double lora_dropout = 0;  // dropout on the adapters' input (PEFT's lora_dropout)
  // "all" (every linear layer of the blocks) or the model's module names separated by commas
  // ("q_proj,v_proj"; a TOML list of strings is accepted too).
  std::string lora_target = "all";
  bool use_rslora = false;               // scaling alpha / sqrt(rank) instead of alpha / rank
  std::string adapter_name_or_path;      // a PEFT adapter directory to continue training from
  // Modules trained fully beside the adapters (PEFT's modules_to_save), separated by commas: the
  // embedding and/or the LM head ("embed_tokens,lm_head").
  std::string additional_target;
  // QLoRA: 4 stores the frozen projections in 4 bits (bitsandbytes' NF4 or FP4), dequantized inside the
  // GEMMs; 0 keeps them in the run's dtype.
  int64_t quantization_bit = 0;
  FourBitType quantization_type = FourBitType::Nf4;  // nf4 or fp4 (bitsandbytes' bnb_4bit_quant_type)
  bool double_quantization = true;        // the absmax values in 8 bits too, as bitsandbytes' compress_statistics
  // What a step optimises, named as LLaMA-Factory names it: "sft" (next-token loss on the answers)
  // or "dpo" (a preference loss on chosen/rejected pairs, train/preference_loss.h).
  Stage stage = Stage::Sft;
  PreferenceLoss pref_loss = PreferenceLoss::Sigmoid;  // sigmoid (DPO) | ipo | hinge | simpo | orpo
  double pref_beta = 0.1;            // DPO's beta (IPO's tau; SimPO's beta; ORPO's lambda)
  double pref_ftx = 0.0;             // weight of an added SFT loss on the chosen answers (TRL's "sft" loss_type)
  double simpo_gamma = 0.5;          // SimPO's target reward margin
  double dpo_label_smoothing = 0.0;  // conservative DPO (sigmoid only): the chance a pair's labels are flipped
  // Training
  int64_t batch_size = 1;  // sequences per micro-batch per rank
  int64_t gradient_accumulation_steps = 1;
  double learning_rate = 2e-5;
  double weight_decay = 0.0;
  int64_t max_steps = 0;  // 0: derived from num_epochs
  int64_t num_epochs = 0;
  int64_t warmup_steps = 0;
  LrScheduler lr_scheduler = LrScheduler::Cosine;  // cosine | linear | constant
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_epsilon = 1e-8;
  double max_grad_norm = 1.0;  // 0 disables clipping
  int64_t seed = 42;
  // Parallelism and optimisations
  int64_t dp_degree = 1;
  double bucket_size_mb = 25;         // gradient bucket size (HCCL_BUFFSIZE / DDP bucket_cap_mb analogue)
  bool deterministic_reduce = false;  // sum gradients in rank order: bit-identical runs whatever the timing
  // "true": start each bucket's allreduce during the backward pass; "false": after it; "auto" (the
  // default): during it when the host has a core to spare per rank for the communication
  // thread's progress, else after it (train/sync_overlap.h). TOML true/false are accepted.
  OverlapGradSync overlap_grad_sync = OverlapGradSync::Auto;
  double comm_timeout_s = 600;        // a collective waiting longer ends the job (HCCL_CONNECT_TIMEOUT analogue)
  int64_t zero_stage =
      0;  // 1: shard the AdamW moments (bf16: and fp32 masters) across the dp ranks; 2: and the gradients; 3: and the weights
  bool use_flash_attention = true;
  bool use_gradient_checkpointing = false;
  // With checkpointing: the blocks that recompute, from the first (Megatron-LM's
  // --recompute-num-layers); the rest keep their activations. 0 = keel's choice: every block, or
  // all but the last where the memory plan says keeping the last costs no more
  // (model::resolve_checkpointing_layers). `keel plan` with a memory limit names the fewest that fit.
  int64_t gradient_checkpointing_layers = 0;
  // Tokens per chunk of the fused LM head and loss ([chunk, vocab] logits in fp32 and bf16, the
  // step's largest scratch buffer); 0 = keel's choice (at least 512).
  int64_t lm_head_chunk_tokens = 0;
  std::string topology = "auto";
  double memory_pool_size = 0;  // GB, 0 = no cap
  // "planned": every buffer of a step placed in one arena before step 1 (the default);
  // "per_tensor": only weights, gradients and optimizer state there, every activation and scratch
  // buffer malloc'ed and freed around each forward/backward (the baseline). Same results.
  MemoryPlanning memory_planning = MemoryPlanning::Planned;
  // Where the step computes (kernels/backend.h): "cpu" (oneDNN GEMMs, AVX-512 row kernels; the
  // default) or "reference" (every operation in double on scalar loops: slow, for checking).
  std::string backend = "cpu";
  // Checkpoints and output
  std::string checkpoint_dir;
  int64_t save_interval = 0;
  bool async_save = false;
  // How a checkpoint is laid out (docs/checkpoints.md): "sharded" (every rank writes the pieces it
  // owns to its own file, in parallel; a manifest names them), "single_file" (rank 0 gathers and
  // writes weights.safetensors and optimizer.safetensors), or "auto": sharded when dp_degree > 1.
  CheckpointLayout checkpoint_layout = CheckpointLayout::Auto;
  // An asynchronous sharded save copies at most this much of a rank's state aside (MiB per rank);
  // the rest is written from the live state before the next optimizer step may change it.
  double checkpoint_staging_mb = 512;
  std::string output_dir = "output";
  // Where raw JSONL is prepared into shards: "" = <directory of data_path>/.keel-cache.
  std::string cache_dir;
  // Bad records (invalid JSON, missing fields, ids out of range) tolerated in the training data,
  // as a fraction of its records; above it, preparation stops and lists them.
  double max_bad_fraction = 0.01;
  int64_t keep_last_n = 3;          // training-state checkpoints kept (older ones deleted)
  bool fail_on_save_error = false;  // false: a failed save is reported and retried at the next interval
  int64_t log_interval = 1;
  // Where metrics go besides metrics.jsonl, as transformers' report_to: "none", "tensorboard"
  // (event files under output_dir/runs/) or "all" (every integration keel has: TensorBoard); a
  // TOML list of those names is accepted too.
  std::string report_to = "none";
  int64_t eval_interval = 0;
  bool skip_nonfinite_steps = false;  // false: a NaN/Inf loss or gradient stops training

  std::string source;  // path of the recipe file (for messages)
};

// Paths in a recipe file (model_name, data_path, eval_data_path, tokenizer, output_dir,
// checkpoint_dir, cache_dir) are relative to the file's directory, so a recipe works from
// wherever keel runs; paths given with --set are relative to the current directory, as the shell
// the user typed them in. load_recipe makes both absolute: the resolved recipe a checkpoint stores
// means the same from anywhere.
// Parses a recipe file; `overrides` are "key=value" strings applied after the file (--set),
// with values in TOML syntax (strings may be bare). Validates every field and their combinations.
Recipe load_recipe(const std::string& path, const std::vector<std::string>& overrides = {});
// `override_label` names the overrides in messages: "--set" (the CLI: "--set key=value: ...") or
// a caller's name ("TrainingConfig": "TrainingConfig(key=value): ..."). Paths stay as written.
Recipe parse_recipe(const std::string& toml_text, const std::string& source,
                    const std::vector<std::string>& overrides = {}, const std::string& override_label = "--set");
// parse_recipe, then the paths made absolute: relative to `base_dir`, the override keys' to the
// current directory. load_recipe is this with the file's text and directory; the Python package
// calls it with the current directory.
Recipe resolve_recipe(const std::string& text, const std::string& source, const std::string& base_dir,
                      const std::vector<std::string>& overrides = {}, const std::string& override_label = "--set");
// How long to train: max_steps or num_epochs must be set. Not part of the recipe's validation,
// which `keel plan` (a memory plan, the same for any number of steps) and evaluation share: only
// training asks for it (train::run_training).
void require_training_length(const Recipe& r);
// Second names accepted for keys (cann-recipes-train's spelling -> keel's key).
std::vector<std::pair<std::string, std::string>> recipe_key_aliases();

// The fully resolved recipe (every key with its value, defaults included) as TOML.
std::string recipe_to_toml(const Recipe& r);

// The tokenizer a run of this recipe uses: `tokenizer`, else model_name's directory ("" for a new
// model without one); for a model_name that is a GGUF file, output_dir/gguf_tokenizer, where the
// run writes the file's tokenizer as Hugging Face files (checkpoint/gguf_tokenizer.h).
std::string recipe_tokenizer_path(const Recipe& r);

// The lora_target list: "all" or the names between commas, trimmed.
std::vector<std::string> lora_targets(const Recipe& r);
// additional_target as a list (the names between commas, trimmed).
std::vector<std::string> additional_targets(const Recipe& r);
// report_to as a list, and whether it asks for TensorBoard event files.
std::vector<std::string> report_destinations(const Recipe& r);
bool reports_to_tensorboard(const Recipe& r);
// lora_alpha as used: the recipe's, or 2 x lora_rank when 0.
double lora_alpha(const Recipe& r);
// bf16 full fine-tuning: the GEMMs read a bf16 copy of the trained masters, which ZeRO-3 never
// keeps whole, even with one rank (recipe::set_zero_stage: each position casts its own).
bool bf16_full_fine_tuning(const Recipe& r);
// Whether checkpoints use the sharded layout: checkpoint_layout, or with "auto" whenever the run has
// more than one rank (as PyTorch DCP and DeepSpeed write one file per rank).
inline bool sharded_checkpoints(const Recipe& r, int64_t ranks) {
  return r.checkpoint_layout == CheckpointLayout::Sharded ||
         (r.checkpoint_layout == CheckpointLayout::Auto && ranks > 1);
}

// The rows of one micro-batch: batch_size sequences, or under stage = "dpo" batch_size pairs of two
// rows each (chosen answers, then rejected ones, TRL's layout): what the decoder and the memory plan
// are sized for.
inline int64_t rows_per_micro_batch(const Recipe& r) { return r.stage == Stage::Dpo ? 2 * r.batch_size : r.batch_size; }

// Keys that are parsed and validated but whose feature is not active yet; warnings for those set.
std::vector<std::string> inactive_key_warnings(const Recipe& r);

}  // namespace keel::recipe
