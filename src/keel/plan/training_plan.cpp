#include "keel/plan/training_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>

#include "keel/core/error.h"
#include "keel/distributed/communicator.h"
#include "keel/formats/safetensors.h"
#include "keel/model/decoder.h"
#include "keel/model/hf_weights.h"
#include "keel/recipe/model_setup.h"

namespace keel::plan {

RunShape run_shape(const recipe::Recipe& r) {
  RunShape s;
  s.batch_size = recipe::rows_per_micro_batch(r);
  s.preference_pairs = r.stage == recipe::Stage::Dpo;
  s.max_seq_len = r.max_seq_len;
  s.gradient_accumulation_steps = r.gradient_accumulation_steps;
  s.dp = r.dp_degree;
  s.zero_stage = int(r.zero_stage);
  s.gradient_checkpointing = r.use_gradient_checkpointing;
  s.checkpointing_layers = r.gradient_checkpointing_layers;
  return s;
}

namespace {

// Whether a mixture of experts' checkpoint holds each layer's experts in one tensor (transformers
// 5's layout), which the load reads whole.
bool fused_expert_checkpoint(const std::string& dir, const model::ModelConfig& config) {
  if (!config.has_experts()) return false;
  try {
    return model::checkpoint_expert_layout(formats::CheckpointReader::open_dir(dir), config) ==
           model::ExpertLayout::Fused;
  } catch (const Error&) {
    return false;  // no weights (config.json only), or unreadable: the load reports that itself
  }
}

}  // namespace

size_t largest_weight_tensor_bytes(const std::string& dir, const model::ModelConfig& config) {
  model::ParamStore params;
  model::DecoderParamIds ids;
  model::declare_model_params(config, params, ids);
  size_t largest = 0;
  try {
    const auto reader = formats::CheckpointReader::open_dir(dir);
    for (const auto& t : model::hf_tensors(config, ids, model::checkpoint_expert_layout(reader, config)))
      if (reader.has(t.name)) largest = std::max(largest, reader.get(t.name).nbytes);
  } catch (const Error&) {
    largest = 0;  // no weights (config.json only), or unreadable: the load reports that itself
  }
  if (largest > 0) return largest;
  for (const auto& t : model::hf_tensors(config, ids))
    largest = std::max(largest, size_t(t.rows * (t.cols ? t.cols : 1)) * dtype_size(config.torch_dtype));
  return largest;
}

namespace {


// The batch buffers of the trainer's data source (data/batch_source.cpp decides which): a
// pre-tokenized JSONL file with padding is read into memory and filled into one step's micro-batches
// (input ids, targets, positions); anything else goes through prepared shards, whose loader keeps
// prefetch_factor + 1 steps of micro-batches (with document ids too) when it has worker threads.
// Preference pairs (data/pair_source.h) fill one step's micro-batches on the training thread, and the
// preference objective scores each micro-batch's tokens (an NLL and a mean logit in double, a weight
// in float: train/preference_loss.h). The pairs' own ids are not counted: 4 bytes a token of the data.
size_t loader_buffer_bytes(const recipe::Recipe& r, const RunShape& shape) {
  const size_t micro_batch = size_t(shape.batch_size) * size_t(shape.max_seq_len) * sizeof(int32_t);
  const size_t per_step = size_t(shape.gradient_accumulation_steps);
  if (r.stage == recipe::Stage::Dpo) return per_step * 4 * micro_batch + micro_batch / sizeof(int32_t) * (8 + 8 + 4);
  const std::string& path = r.data_path;
  bool records = false;
  if (r.packing == recipe::Packing::Pad && path.size() >= 6 && path.compare(path.size() - 6, 6, ".jsonl") == 0) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line))
      if (line.find_first_not_of(" \t\r") != std::string::npos) {
        records = line.find("\"input_ids\"") != std::string::npos;
        break;
      }
  }
  if (records) return per_step * 3 * micro_batch;
  const size_t slots = r.num_workers > 0 ? size_t(std::max<int64_t>(1, r.prefetch_factor)) + 1 : 1;
  return slots * per_step * 4 * micro_batch;
}

// What rank 0 holds of the other ranks' shards while it writes them (distributed::ShardReader):
// one message piece, or a whole shard when shards are smaller.
size_t received_piece_bytes(size_t param_elements, size_t shards) {
  return size_t(std::min<int64_t>(distributed::kMessagePiece, int64_t((param_elements + shards - 1) / shards))) *
         sizeof(float);
}

}  // namespace

// The decoder settings of one rank of this recipe run with `shape`.
model::DecoderOptions planned_decoder_options(const recipe::Recipe& r, const model::ModelConfig& config,
                                              const RunShape& shape) {
  require(shape.dp >= 1, "memory plan: dp must be at least 1, got {}", shape.dp);
  require(shape.zero_stage >= 0 && shape.zero_stage <= 3, "memory plan: ZeRO stage {} is not supported (0 to 3)",
          shape.zero_stage);
  auto options = recipe::training_decoder_options(r, config);
  options.gradient_checkpointing = shape.gradient_checkpointing;
  options.checkpointing_layers = shape.gradient_checkpointing ? shape.checkpointing_layers : 0;
  options.memory_cap_bytes = 0;  // the caller compares against the cap; here we only plan
  // ZeRO-1 (Rajbhandari et al. 2020, stage 1): each rank keeps and updates 1/dp of the Adam moments
  // and, in bf16 full fine-tuning, of the fp32 masters (the decoder plans the shards; the weights
  // the step reads stay whole: the bf16 copies, and the norms and the embedding in fp32). In fp32
  // the masters are the compute weights and stay whole.
  // ZeRO-2 shards the gradients too: the decoder plans this rank's shard of them and the staging of
  // the groups the backward pass writes and reduces.
  recipe::set_zero_stage(options, shape.zero_stage, shape.dp, recipe::recipe_precision(r));
  return options;
}

// The blocks the run recomputes, as the decoder decides them (checkpointing_layers 0 left to
// keel: model::resolve_checkpointing_layers); 0 without checkpointing.
int64_t recomputed_blocks(const recipe::Recipe& r, const model::ModelConfig& config, const RunShape& shape) {
  if (!shape.gradient_checkpointing) return 0;
  return model::resolve_checkpointing_layers(config, recipe::recipe_precision(r), shape.batch_size, shape.max_seq_len,
                                             planned_decoder_options(r, config, shape))
      .checkpointing_layers;
}

MemoryPlan training_memory_plan(const recipe::Recipe& r, const model::ModelConfig& config, const RunShape& shape) {
  const auto options = planned_decoder_options(r, config, shape);
  const size_t shards = shape.zero_stage >= 1 ? size_t(shape.dp) : 1;
  const auto precision = recipe::recipe_precision(r);
  const MemoryPlan decoder =
      model::decoder_memory_plan(config, precision, shape.batch_size, shape.max_seq_len, options);

  MemoryPlan plan(decoder.alignment());
  size_t param_elements = 0;
  for (const auto& b : decoder.buffers()) {
    // What trains (the gradients buckets reduce, the checkpoint holds): the weights, or LoRA's adapter.
    if (b.name == "lora.weights" || (b.name == "weights" && param_elements == 0)) param_elements = b.bytes / sizeof(float);
    if (b.in_arena)
      plan.add(b.name, b.category, b.bytes, b.first_use, b.last_use);
    else
      plan.add_external(b.name, b.category, b.bytes, b.first_use, b.last_use);
  }

  const model::StepTimeline t{int32_t(config.num_layers)};
  const int32_t end = t.last();
  const bool masters_sharded = options.shard_weights || options.shard_masters;
  if (masters_sharded) {
    // ZeRO-3 (and ZeRO-1/2 in bf16) holds a shard of the masters: what trains is the whole model all
    // the same (under LoRA the adapter, whole on every rank).
    model::ParamStore whole;
    model::DecoderParamIds ids;
    model::declare_model_params(config, whole, ids);
    const bool lora = options.lora.enabled();
    if (!lora) param_elements = size_t(whole.total());
    // Each tensor passes through memory whole while it is loaded or initialised, this rank keeping
    // its part (the largest: the embedding or the LM head in every family; LoRA in bf16 holds it
    // in bf16).
    int64_t largest = 0;
    for (const auto& p : whole.params()) largest = std::max(largest, p.numel);
    const size_t element = lora && precision == model::Precision::BF16 ? sizeof(bf16) : sizeof(float);
    plan.add_external(
        fmt::format("ZeRO-{}: one tensor whole while loading (this rank keeps its part)", shape.zero_stage),
        MemoryCategory::Data, size_t(largest) * element, 0, 0);
  }
  if (masters_sharded && !options.lora.enabled()) {
    // The final save: rank 0 writes each tensor as the other ranks' pieces of it arrive
    // (distributed::ShardReader), holding one piece at a time (rank 0's figure).
    plan.add_external(fmt::format("ZeRO-{} final save: one piece of another rank's weights", shape.zero_stage),
                      MemoryCategory::CheckpointStaging, received_piece_bytes(param_elements, shards), end, end);
  }
  if (shape.dp > 1) {
    // Gradient buckets (distributed::GradBuckets) are contiguous ranges of the gradient buffer, reduced in
    // place by one communication thread, one bucket at a time, handed to MPI in pieces of at most
    // distributed::kMessagePiece floats. What they cost is MPI itself and the reduction's scratch for one
    // piece: MPI_Allreduce's temporaries, or, for deterministic_reduce, the buffer every rank's piece
    // is gathered into (kept from the first step on).
    const size_t bucket = std::min({size_t(r.bucket_size_mb * double(1 << 20)), param_elements * sizeof(float),
                                    size_t(distributed::kMessagePiece) * sizeof(float)});
    plan.add_external("MPI (library, shared-memory transport)", MemoryCategory::Communication, kMpiBytes, 0, end);
    if (r.deterministic_reduce)
      plan.add_external("rank-ordered reduction buffer (bucket x dp)", MemoryCategory::Communication,
                        bucket * size_t(shape.dp), 1, end);
    else
      plan.add_external("allreduce scratch", MemoryCategory::Communication,
                        size_t(double(bucket) * kAllreduceScratchPerBucketByte), t.backward(config.num_layers - 1),
                        t.optimizer());
  }
  // Position 0 is also the model's setup: the arena is touched, then the weights load, tensor by
  // tensor from the mapped files, each tensor's pages released once it is read.
  if (!r.model_config)
    plan.add_external("weight file pages while loading (the largest tensor)", MemoryCategory::Data,
                      largest_weight_tensor_bytes(r.model_name, config), 0, 0);
  // QLoRA fills its 4-bit projections one tensor at a time from fp32: that tensor, during the setup.
  if (const int64_t scratch = model::four_bit_setup_scratch_elements(
          config, options, !r.model_config, !r.model_config && fused_expert_checkpoint(r.model_name, config)))
    plan.add_external("4-bit quantization (one projection in fp32)", MemoryCategory::Data,
                      size_t(scratch) * sizeof(float), 0, 0);
  plan.add_external("keel process at start", MemoryCategory::Runtime, kProcessStartBytes, 0, end);
  // What the trainer allocates after the setup, kept for the whole run.
  plan.add_external("micro-batches", MemoryCategory::Data, loader_buffer_bytes(r, shape), 1, end);
  // The snapshot an asynchronous save writes from (with ZeRO-1, rank 0 gathers every rank's moments
  // into it). A synchronous ZeRO-1 save writes the other ranks' moments as they arrive, one piece
  // at a time (distributed::ShardReader). Both are rank 0's figures; the other ranks hold neither.
  if (!r.checkpoint_dir.empty() && recipe::sharded_checkpoints(r, shape.dp)) {
    // Sharded (checkpoint/sharded_writer.h): every rank writes its own part of the state, rank 0's
    // the largest (keel::shard_ranges); an asynchronous save copies at most checkpoint_staging_mb
    // of it aside and writes the rest from the live state. A synchronous one needs no buffer.
    if (shape.async_checkpoint && r.async_save) {
      const int64_t window = shard_ranges(int64_t(param_elements), int(shape.dp))[0].size();
      const int64_t limit = int64_t(r.checkpoint_staging_mb * double(1 << 20)) / 4 * 4;
      plan.add_external("checkpoint staging (async sharded save: this rank's weights, m and v, at most "
                        "checkpoint_staging_mb)",
                        MemoryCategory::CheckpointStaging, size_t(std::min(limit, 12 * window)), 1, end);
    }
  } else if (!r.checkpoint_dir.empty() && shape.async_checkpoint && r.async_save)
    plan.add_external(shards > 1 ? "checkpoint snapshot (weights, m, v; rank 0 gathers the moments)"
                                 : "checkpoint snapshot (weights, m, v)",
                      MemoryCategory::CheckpointStaging, 3 * param_elements * sizeof(float), 1, end);
  else if (!r.checkpoint_dir.empty() && shards > 1)
    plan.add_external("checkpoint receive buffer (one piece of another rank's moments)",
                      MemoryCategory::CheckpointStaging, received_piece_bytes(param_elements, shards), 1, end);
  plan.add_external("libraries while training", MemoryCategory::Runtime, kStepRuntimeBytes, 1, end);
  plan.pack();
  return plan;
}

size_t training_peak_bytes(const recipe::Recipe& r, const model::ModelConfig& config, const MemoryPlan& plan,
                           bool* random_initialisation) {
  const bool random = !r.model_config && formats::holds_config_only(r.model_name);
  if (random_initialisation) *random_initialisation = random;
  if (!random) return plan.total_bytes();
  size_t external = plan.external_bytes_at(0) - largest_weight_tensor_bytes(r.model_name, config);
  for (int32_t p = 1; p <= model::StepTimeline{int32_t(config.num_layers)}.last(); ++p)
    external = std::max(external, plan.external_bytes_at(p));
  return plan.arena_bytes() + external;
}

}  // namespace keel::plan
