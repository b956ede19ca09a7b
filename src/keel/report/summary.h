// The end-of-run summary, in the shape of the reference article's optimization table:
// throughput, compute utilization, memory per rank, gradient-sync share, plus the data-wait and
// optimizer shares and MFU. Printed as a table and written to output_dir/summary.json.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "keel/report/metrics.h"

namespace keel::report {

struct RunSummary {
  int64_t steps = 0, skipped_steps = 0, tokens = 0;
  double seconds = 0;  // wall time of the steps (excluding setup and export)
  double final_loss = 0;
  double tokens_per_s = 0;
  double compute_share = 0, data_wait_share = 0, grad_sync_share = 0, optimizer_share = 0, checkpoint_share = 0;
  int64_t peak_memory_bytes = 0;     // RSS high-water mark of the process
  int64_t planned_memory_bytes = 0;  // what the memory plan predicted (0 if not planned)
  // The job's useful FLOPs per second over the job's matmul peak: the peaks every rank measured at
  // once (each with its own threads, as it trains), summed. Rank 0's alone made a dp = N job's MFU
  // N times too high.
  double mfu = 0;
  double matmul_peak_flops = 0;                    // the job's: sum of the ranks'
  std::vector<double> matmul_peak_flops_per_rank;  // what each rank measured
  double flops_per_token = 0;                      // the model FLOPs MFU counts per token
  double eval_loss = -1, eval_perplexity = -1;  // perplexity: next-token loss only
  PreferenceMetrics final_preference, eval_preference;  // stage = "dpo": the last step's, the last evaluation's
  int ranks = 1;

  // Accumulates one step's timings and tokens.
  void add_step(const StepMetrics& m);
  // Turns the accumulated times into shares and throughput.
  void finalize(double flops_per_token);
};

std::string summary_table(const RunSummary& s);
std::string summary_json(const RunSummary& s);

}  // namespace keel::report
