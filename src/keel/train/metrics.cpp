#include "keel/train/metrics.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>

#include "keel/core/error.h"

namespace keel::train {

MetricsWriter::MetricsWriter(const std::string& path) : path_(path) {
  file_ = std::fopen(path.c_str(), "w");
  require(file_ != nullptr, "{}: cannot open for writing ({})", path, std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

void MetricsWriter::write(const StepMetrics& m) {
  // {:.9g} keeps every fp32 digit, so tests can compare losses to 1e-7 and beyond.
  auto line = fmt::format(
      "{{\"step\": {}, \"loss\": {:.9g}, \"lr\": {:.9g}, \"grad_norm\": {:.9g}, \"tokens\": {}, "
      "\"target_tokens\": {}, \"step_time_s\": {:.6f}, \"tokens_per_s\": {:.3f}, \"compute_s\": {:.6f}, "
      "\"optimizer_s\": {:.6f}, \"data_s\": {:.6f}}}\n",
      m.step, m.loss, m.lr, m.grad_norm, m.tokens, m.target_tokens, m.step_time_s, m.tokens_per_s, m.compute_s,
      m.optimizer_s, m.data_s);
  require(std::fputs(line.c_str(), file_) >= 0 && std::fflush(file_) == 0, "{}: write failed ({})", path_,
          std::strerror(errno));
}

}  // namespace keel::train
