#include "keel/recipe/model_setup.h"

#include <fmt/ostream.h>
#include <fmt/ranges.h>

#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/model/gguf_config.h"
#include "keel/model/gguf_weights.h"
#include "keel/model/hf_weights.h"
#include "keel/model/peft_adapter.h"
#include "keel/formats/safetensors.h"

namespace keel::recipe {

model::ModelConfig scratch_model_config(const ScratchModel& m) {
  model::ModelConfig c;
  c.family = model::family_from_name(m.family);
  c.vocab_size = m.vocab_size;
  c.hidden_size = m.hidden_size;
  c.intermediate_size = m.intermediate_size;
  c.num_layers = m.num_layers;
  c.num_heads = m.num_heads;
  c.num_kv_heads = m.num_kv_heads > 0 ? m.num_kv_heads : m.num_heads;
  c.head_dim = m.head_dim > 0 ? m.head_dim : m.hidden_size / std::max<int64_t>(m.num_heads, 1);
  c.rope_theta = m.rope_theta;
  c.rms_norm_eps = m.rms_norm_eps;
  c.tie_word_embeddings = m.tie_word_embeddings;
  c.max_position_embeddings = m.max_position_embeddings;
  model::apply_family_traits(c);
  model::validate(c, "[model_config]");  // the sizes first: the window's list has one entry per layer
  if (m.sliding_window > 0) {  // every layer (mistral, qwen3), or the family's pattern (gemma2, gemma3)
    c.sliding_window = m.sliding_window;
    for (int64_t l = 0; l < c.num_layers; ++l)
      c.sliding_layers.push_back(c.family == model::Family::Gemma2   ? l % 2 == 0
                                 : c.family == model::Family::Gemma3 ? (l + 1) % 6 != 0
                                                                     : true);
  }
  model::validate(c, "[model_config]");
  return c;
}

void require_sequence_fits_model(const Recipe& r, const model::ModelConfig& c) {
  require(r.max_seq_len <= c.max_position_embeddings,
          "{}: max_seq_len = {} is longer than the model's {} positions (max_position_embeddings in {}): it would "
          "train on positions the model never had. Set max_seq_len <= {}",
          r.source, r.max_seq_len, c.max_position_embeddings,
          r.model_config                   ? "[model_config]"
          : model::is_gguf_path(r.model_name) ? r.model_name + "'s context_length"
                                              : r.model_name + "/config.json",
          c.max_position_embeddings);
}

model::ModelConfig recipe_model_config(const Recipe& r) {
  if (r.model_config) return scratch_model_config(*r.model_config);
  require(path_exists(r.model_name),
          "{}: model_name '{}' does not exist (keel reads local HF model directories and GGUF files only)", r.source,
          r.model_name);
  if (model::is_gguf_path(r.model_name)) return model::gguf_model_config(formats::GgufFile(r.model_name));
  return model::load_model_config(r.model_name + "/config.json");
}

model::Precision recipe_precision(const Recipe& r) {
  return r.dtype == Precision::Bf16 ? model::Precision::BF16 : model::Precision::F32;
}

namespace {

// QLoRA's 4-bit base: quantized by keel at load (quantization_bit = 4), or as a checkpoint
// transformers + bitsandbytes saved in 4 bits holds it (read as it is; nothing is requantized).
void set_four_bit_base(const Recipe& r, const model::ModelConfig& config, model::DecoderOptions& o) {
  o.double_quantization = r.double_quantization;
  o.four_bit_type = r.quantization_type;
  o.four_bit_base = r.quantization_bit == 4;
  if (!config.saved_four_bit) return;
  const auto& saved = *config.saved_four_bit;
  const std::string_view type = four_bit_type_name(saved.type);
  require(r.finetuning_type == Finetuning::Lora,
          "{}: model_name '{}' is saved in 4 bits by bitsandbytes ({}, config.json's quantization_config): its weights "
          "can only stay frozen. Train LoRA adapters on it (finetuning_type = \"lora\": QLoRA), or start from the "
          "full-precision model to fine-tune every weight",
          r.source, r.model_name, type);
  require(
      r.quantization_bit == 0 || r.quantization_type == saved.type,
      "{}: quantization_type = \"{}\", but model_name '{}' is saved in 4 bits as {} by bitsandbytes: keel reads its "
      "codes as they are and does not requantize. Remove quantization_bit (the checkpoint decides) or set "
      "quantization_type = \"{}\"",
      r.source, four_bit_type_name(r.quantization_type), r.model_name, type, type);
  o.four_bit_base = true;
  o.four_bit_type = saved.type;
  o.double_quantization = saved.double_quantization;
}

// model_name is a GGUF file: its weights dequantized, and what keel decided said.
void load_gguf_model(model::Decoder& decoder, const std::string& path, ModelSetup& s, std::ostream* log, bool live) {
  const formats::GgufFile file(path);
  model::GgufLoadSummary loaded;
  {
    WorkProgress progress(log, live);
    loaded = model::load_gguf_weights(decoder, file, &progress);
  }
  s.unused_tensors = loaded.unused;
  const auto& c = decoder.config();
  if (log)
    fmt::print(*log,
               "keel: model from GGUF file {}: arch {} ({}), {} layers, hidden {}, {} heads ({} kv), vocab {}{}; "
               "{} dequantized to fp32{}{}\n",
               path, *file.string_value("general.architecture"), c.architecture, c.num_layers, c.hidden_size,
               c.num_heads, c.num_kv_heads, c.vocab_size,
               c.tie_word_embeddings ? ", tied embeddings (no output.weight)" : "",
               fmt::join(loaded.types, ", "),
               loaded.permuted ? fmt::format("; the converter's Q/K permutation undone on {} tensors", loaded.permuted)
                               : std::string(),
               loaded.shifted ? fmt::format("; {} norms stored as 1 + w read back as w", loaded.shifted)
                              : std::string());
  if (log)
    for (const auto& note : model::gguf_config_notes(c)) fmt::print(*log, "keel: note: {}\n", note);
}

}  // namespace

model::DecoderOptions training_decoder_options(const Recipe& r, const model::ModelConfig& config) {
  model::DecoderOptions o;
  o.gradient_checkpointing = r.use_gradient_checkpointing;
  require(r.gradient_checkpointing_layers <= config.num_layers,
          "{}: gradient_checkpointing_layers = {}, but the model has {} blocks (0 = keel's choice)", r.source,
          r.gradient_checkpointing_layers, config.num_layers);
  o.checkpointing_layers = r.gradient_checkpointing_layers;
  o.lm_head_chunk_tokens = r.lm_head_chunk_tokens;
  o.optimizer_state = true;
  o.memory_cap_bytes = size_t(r.memory_pool_size * double(size_t(1) << 30));
  o.memory_planning = r.memory_planning == MemoryPlanning::PerTensor ? model::MemoryPlanning::PerTensor
                                                                      : model::MemoryPlanning::Planned;
  o.backend = &kernels::backend_named(r.backend);
  o.lora = recipe_lora_spec(r);
  set_four_bit_base(r, config, o);
  set_zero_stage(o, r.zero_stage, r.dp_degree, recipe_precision(r));
  return o;
}

void set_zero_stage(model::DecoderOptions& o, int64_t stage, int64_t dp, model::Precision precision) {
  const bool sharded = stage >= 1 && dp > 1;
  o.optimizer_shards = stage >= 1 ? int(dp) : 1;
  o.shard_gradients = sharded && stage >= 2;
  o.shard_weights = sharded && stage >= 3;
  // DeepSpeed's ZeRO-1/2 (and the paper's accounting): the fp32 master is optimizer state. In fp32
  // it is also what the step reads, and LoRA's frozen base has none: whole there.
  o.shard_masters = sharded && stage <= 2 && precision == model::Precision::BF16 && !o.lora.enabled();
  // ZeRO-3 with one rank has nothing to shard, but it can still drop the whole bf16 copy of the
  // weights that stage 3 never keeps: each position casts its own (LoRA's frozen base is that copy).
  o.cast_per_position = stage >= 3 && dp == 1 && precision == model::Precision::BF16 && !o.lora.enabled();
}

model::LoraSpec recipe_lora_spec(const Recipe& r) {
  model::LoraSpec spec;
  if (r.finetuning_type != Finetuning::Lora) return spec;  // rank 0: full fine-tuning
  spec.rank = r.lora_rank;
  spec.alpha = lora_alpha(r);
  spec.rslora = r.use_rslora;
  spec.targets = lora_targets(r);
  spec.dropout = r.lora_dropout;
  spec.modules_to_save = additional_targets(r);
  return spec;
}

DType recipe_export_dtype(const Recipe& r, const model::ModelConfig& config, const model::DecoderParamIds& ids) {
  if (!r.model_config && model::is_gguf_path(r.model_name)) return DType::F32;  // dequantized to fp32, as transformers loads it
  if (r.model_config || formats::holds_config_only(r.model_name)) return r.dtype == Precision::Bf16 ? DType::BF16 : DType::F32;
  return formats::CheckpointReader::open_dir(r.model_name).dtype_of(model::hf_tensors(config, ids)[0].name);
}

ModelSetup setup_model(const Recipe& r, int rank, std::ostream* progress_log, bool live_progress) {
  ModelSetup s;
  const auto precision = recipe_precision(r);
  const auto config = recipe_model_config(r);
  auto options = training_decoder_options(r, config);
  options.optimizer_shard = options.optimizer_shards > 1 ? rank : 0;
  s.decoder = std::make_unique<model::Decoder>(config, precision, recipe::rows_per_micro_batch(r), r.max_seq_len, options);
  if (r.model_config) {
    s.decoder->init_random(uint64_t(r.seed));
  } else if (model::is_gguf_path(r.model_name)) {
    load_gguf_model(*s.decoder, r.model_name, s, progress_log, live_progress);
  } else if (formats::holds_config_only(r.model_name)) {
    // A directory holding config.json and no weights: a new model of that architecture, initialised
    // as transformers' _init_weights does (Decoder::init_random: normal(0, initializer_range)).
    if (progress_log)
      fmt::print(*progress_log,
                 "keel: {} holds config.json and no weights: the model is initialised at random (seed {}, matrices "
                 "normal(0, {}) as its initializer_range, norms scaling by 1, biases 0){}\n",
                 r.model_name, r.seed, config.initializer_range,
                 options.four_bit_base ? ", each 4-bit matrix quantized a piece of 1M draws at a time" : "");
    s.decoder->init_random(uint64_t(r.seed));
  } else {
    WorkProgress progress(progress_log, live_progress);
    s.unused_tensors = model::load_hf_weights(*s.decoder, r.model_name, &progress);
  }
  if (!r.adapter_name_or_path.empty())
    model::load_peft_adapter(*s.decoder, r.adapter_name_or_path);
  else
    s.decoder->init_adapter(uint64_t(r.seed));
  s.export_dtype = recipe_export_dtype(r, config, s.decoder->ids());
  return s;
}

}  // namespace keel::recipe
