// keel bench ladder: the reference article's optimization table ("Baseline, + data loader,
// + communication, + memory pool" against throughput, compute utilization, memory per card and
// gradient-sync share) measured on this machine. Each row is a real training run of the same
// recipe with one more of keel's optimisations switched on than the row before:
//
//   1. baseline   records tokenized on the training thread at every step (data_pipeline =
//                 "on_the_fly"), one allreduce of all gradients after the backward pass
//                 (overlap_grad_sync = false, bucket_size_mb = 4096), a malloc per activation and
//                 scratch tensor at every forward/backward (memory_planning = "per_tensor");
//   2. + prepared data read by the prefetching loader (data_pipeline = "prepared");
//   3. + gradient buckets reduced during the backward pass (overlap_grad_sync = true, the
//        recipe's bucket_size_mb);
//   4. + the planned memory arena (memory_planning = "planned"): keel's defaults.
//
// None of the switches changes the batches or the arithmetic, only speed and memory.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "keel/recipe/recipe.h"

namespace keel::cli {

struct LadderStage {
  std::string name;                   // the table's row label
  std::vector<std::string> settings;  // recipe overrides (key=value) that make the row
};

// The four rows for this recipe (its bucket_size_mb in rows 3 and 4).
std::vector<LadderStage> ladder_stages(const recipe::Recipe& recipe);

// Overrides every row adds: `steps` steps into `output_dir`, with one document per row
// (packing = "pad", as the on-the-fly baseline needs), no checkpoints and no evaluation.
std::vector<std::string> ladder_run_settings(int64_t steps, const std::string& output_dir);

// What one row's run measured.
struct LadderResult {
  std::string stage, output_dir;
  int64_t steps = 0, measured_steps = 0;  // steps run; steps in the timings (after the warm-up)
  double seconds = 0, tokens_per_s = 0;
  double compute_share = 0, data_wait_share = 0, grad_sync_share = 0, optimizer_share = 0;
  double mfu = 0;
  double flops_per_token = 0, matmul_peak_flops = 0;  // MFU's terms (the peak as this row's run measured it)
  int64_t peak_memory_bytes = 0, planned_memory_bytes = 0;
  int ranks = 1;
  std::vector<double> runs_tokens_per_s;  // with repeats: every run's throughput (this result is the median run)
};

// The median run of one row's repeats, by throughput (the lower middle one of an even count),
// with every run's throughput in runs_tokens_per_s.
LadderResult median_run(std::vector<LadderResult> runs);

// Reads output_dir/summary.json (memory, ranks, MFU's scale) and output_dir/metrics.jsonl (the
// timings), leaving the first `warmup_steps` steps out of the timings when the run has more: the
// first step pays for one-off work (oneDNN's kernel generation, the loader's first fill).
LadderResult read_ladder_result(const std::string& output_dir, int64_t warmup_steps);

// Puts every row's MFU over the same matmul peak, the highest the rows measured: each run
// measures the peak once, and on a shared machine one measurement can be far off, which would
// make MFU disagree with throughput between rows.
void use_common_matmul_peak(std::vector<LadderResult>& rows);

// The table in the article's shape, and a line with the overall speed-up.
std::string ladder_table(const std::vector<LadderResult>& rows);
std::string ladder_json(const std::string& recipe_path, int64_t steps, int64_t warmup_steps, int64_t repeats,
                        const std::vector<LadderStage>& stages, const std::vector<LadderResult>& rows);

}  // namespace keel::cli
