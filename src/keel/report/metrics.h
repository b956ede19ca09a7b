// metrics.jsonl: one JSON object per optimizer step, appended and flushed as the run goes, so a
// crashed or running job can be inspected (and plotted) at any time.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace keel::report {

// Preference tuning's metrics (train/preference_loss.h says how each is computed), as TRL names them.
struct PreferenceMetrics {
  bool present = false;
  double rewards_chosen = 0, rewards_rejected = 0, rewards_accuracies = 0, rewards_margins = 0;
  double logps_chosen = 0, logps_rejected = 0, logits_chosen = 0, logits_rejected = 0;
  bool orpo = false;  // and ORPO's own three
  double log_odds_ratio = 0, log_odds_chosen = 0, nll_loss = 0;
};

struct StepMetrics {
  int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0;
  int64_t tokens = 0;         // non-padding input tokens of the step (all micro-batches)
  int64_t target_tokens = 0;  // tokens that carried loss
  double step_time_s = 0, tokens_per_s = 0;
  double compute_s = 0, optimizer_s = 0, data_s = 0, grad_sync_s = 0, checkpoint_s = 0;
  // Part of grad_sync_s spent at the step's first collective (the global token count): time this
  // rank waited for the slowest one to arrive, not transfer time (data parallel only).
  double peer_wait_s = 0;
  double eval_loss = -1, eval_perplexity = -1;  // negative: not evaluated at this step
  int64_t peak_memory_bytes = 0;                // the process's resident high-water mark after the step (VmHWM)
  bool skipped = false;                         // non-finite loss or gradient, step not applied
  PreferenceMetrics preference;                 // stage = "dpo": the step's
  PreferenceMetrics eval_preference;            // and the evaluation's, where it ran
  // Mixture of experts: the load-balancing loss (the mean over the step's micro-batches; negative:
  // no experts) and, per sparse layer, the most tokens any expert got over the mean per expert
  // (1: perfectly balanced; experts / top_k: a router sending every token to the same experts).
  double aux_loss = -1;
  std::vector<double> expert_load;
};

// A number as JSON: 9 significant digits, null for NaN and infinity.
std::string json_number(double v);

// One value of a step's record, as metrics.jsonl names and prints it. The list below is the one
// place the record's fields are spelled: metrics.jsonl and TensorBoard's scalars both come from it.
struct MetricField {
  enum class Format { Significant, Integer, Fixed3, Fixed4, Fixed6 };
  const char* name;
  double value;
  Format format;
};
// The fields of one step, in metrics.jsonl's order: the optional ones (peer_wait_share,
// peak_memory_gb, eval_loss, eval_perplexity) only when the step has them. `skipped` is not a number and is not
// listed (metrics.jsonl adds it).
std::vector<MetricField> step_metric_fields(const StepMetrics& m);

// A metrics.jsonl line is a few hundred bytes; a longer one is not keel's and is skipped by the
// readers (resume, loss.svg), which stream the file.
inline constexpr size_t kMaxMetricsLineBytes = size_t(1) << 20;

class MetricsWriter {
 public:
  // Starts metrics.jsonl afresh, or, when resuming after step `keep_through_step` > 0, keeps the
  // lines of steps up to it (written by the run being resumed) and appends after them.
  explicit MetricsWriter(const std::string& path, int64_t keep_through_step = 0);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  void write(const StepMetrics& m);

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace keel::report
