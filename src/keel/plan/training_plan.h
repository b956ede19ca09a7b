// Memory plans of whole training runs, per rank, from the recipe alone: the architecture comes
// from [model_config] or model_name/config.json (no weights are read), and the decoder describes
// its buffers with the same function that lays out its arena. To that plan this adds what a run
// holds besides the decoder: data-parallel gradient buckets, ZeRO sharding, the loader's
// micro-batches, the checkpoint snapshot or staging and the program itself. The trainer reports
// the plan beside the peak it measures; `keel plan` (report/memory_report.h) prints it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "keel/core/memory_plan.h"
#include "keel/model/config.h"
#include "keel/model/decoder.h"
#include "keel/recipe/recipe.h"

namespace keel::plan {

// The program itself, beyond its planned buffers, measured on keel's bench runs: at start (code,
// libraries, MPI, the recipe and records of a small run) and, from step 1 on, what the libraries
// add (oneDNN's matmul scratchpad and JIT kernels, OpenMP threads, the kernels' per-thread
// scratch, the trainer's matmul-peak probe).
constexpr size_t kProcessStartBytes = size_t(10) << 20;
constexpr size_t kStepRuntimeBytes = size_t(24) << 20;
// Open MPI on the ranks of one machine, measured with 2 ranks: what MPI_Init and its shared-memory
// transport hold, and the allreduce's scratch, which grows with the bucket (about a quarter of it).
constexpr size_t kMpiBytes = size_t(10) << 20;
constexpr double kAllreduceScratchPerBucketByte = 0.25;

// The knobs a run's memory depends on and that "what to change" varies.
struct RunShape {
  int64_t batch_size = 1;  // rows (sequences) per micro-batch per rank
  bool preference_pairs = false;  // stage = "dpo": the rows are pairs' chosen and rejected answers
  int64_t max_seq_len = 2048;
  int64_t gradient_accumulation_steps = 1;
  int64_t dp = 1;      // data-parallel ranks
  int zero_stage = 0;  // 0: replicated; 1: optimizer state sharded over dp; 2: and the gradients
  bool gradient_checkpointing = false;
  int64_t checkpointing_layers = 0;  // with checkpointing: the blocks that recompute, from the first; 0 = keel's choice
  bool async_checkpoint = true;  // false: plan without the recipe's async_save snapshot
};
RunShape run_shape(const recipe::Recipe& recipe);  // as the recipe configures it

// The per-rank plan of one training process of this recipe with `shape` instead of the recipe's
// own batch, sequence, accumulation, dp, ZeRO and checkpointing settings.
MemoryPlan training_memory_plan(const recipe::Recipe& recipe, const model::ModelConfig& config, const RunShape& shape);

// The file pages a load holds at once: those of the largest tensor (CheckpointReader releases each
// tensor's pages once read), from the directory's safetensors headers, or, for a directory with
// config.json only, what that tensor would take in the config's torch_dtype.
size_t largest_weight_tensor_bytes(const std::string& dir, const model::ModelConfig& config);

// What keel train with this recipe peaks at by that plan. A model directory holding config.json
// alone is planned as if its weights loaded (the largest tensor's file pages during the setup:
// planning a download), but keel train initialises it at random and maps no file: its peak is
// then the plan's without those pages (`random_initialisation` set true).
size_t training_peak_bytes(const recipe::Recipe& recipe, const model::ModelConfig& config, const MemoryPlan& plan,
                           bool* random_initialisation = nullptr);

// The decoder settings of one rank of this recipe run with `shape`.
model::DecoderOptions planned_decoder_options(const recipe::Recipe& recipe, const model::ModelConfig& config,
                                              const RunShape& shape);

// The blocks the run recomputes, as the decoder decides them (checkpointing_layers 0 left to
// keel: model::resolve_checkpointing_layers); 0 without checkpointing.
int64_t recomputed_blocks(const recipe::Recipe& recipe, const model::ModelConfig& config, const RunShape& shape);

}  // namespace keel::plan
