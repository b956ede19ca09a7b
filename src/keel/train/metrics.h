// metrics.jsonl: one JSON object per optimizer step, appended and flushed as the run goes, so a
// crashed or running job can be inspected (and plotted) at any time.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>

namespace keel::train {

struct StepMetrics {
  int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0;
  int64_t tokens = 0;         // non-padding input tokens of the step (all micro-batches)
  int64_t target_tokens = 0;  // tokens that carried loss
  double step_time_s = 0, tokens_per_s = 0;
  double compute_s = 0, optimizer_s = 0, data_s = 0;
};

class MetricsWriter {
 public:
  explicit MetricsWriter(const std::string& path);  // truncates
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  void write(const StepMetrics& m);

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace keel::train
