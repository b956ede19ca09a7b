// Memory plans of whole training runs, per rank, from the recipe alone: the architecture comes
// from [model_config] or model_name/config.json (no weights are read), and the decoder describes
// its buffers with the same function that lays out its arena. To that plan this adds what a run
// holds besides the decoder: data-parallel gradient buckets, ZeRO-1 sharding, the loader's
// micro-batches, the asynchronous checkpoint snapshot and the program itself. `keel plan` prints
// it with a verdict against the device memory and, when it does not fit, what to change.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "keel/core/memory_plan.h"
#include "keel/model/config.h"
#include "keel/recipe/recipe.h"

namespace keel::report {

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

struct PlanRequest {
  int64_t dp = 0;                  // 0: the recipe's dp_degree
  int zero_stage = -1;             // 0, 1 or 2; -1: the recipe's zero_stage
  size_t device_memory_bytes = 0;  // per rank; 0: no device check
};

// The report `keel plan` prints: the model and run, the per-rank breakdown by category and the
// total, whether it fits the device memory and memory_pool_size, and when it does not, the
// micro-batch, gradient checkpointing, ZeRO-1 and sequence-length changes that make it fit (each
// planned with the same planner).
struct MemoryReport {
  std::string text;
  // Whether the configured run fits the device memory and memory_pool_size; nullopt when neither
  // is given (nothing to check). `keel plan` exits 3 when this is false.
  std::optional<bool> fits;
};
MemoryReport memory_report(const recipe::Recipe& recipe, const PlanRequest& request);

// The plan of the configured run as one JSON object: total, arena, live peak, waste, bytes outside
// the arena, and bytes per category at the peak (for scripts and benchmarks).
// "fits" is true, false or null as MemoryReport::fits.
MemoryReport memory_report_json(const recipe::Recipe& recipe, const PlanRequest& request);

// "64GB", "64 GiB", "512MiB", "1.5TB", "64" (GiB): memory sizes in binary units, as device memory is
// quoted (a "64 GB" card holds 64 GiB). keel::Error for anything else.
size_t parse_memory_size(std::string_view text);

}  // namespace keel::report
