#include "keel/report/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "keel/core/error.h"
#include "keel/core/file_io.h"

namespace keel::report {

std::string json_number(double v) {
  // {:.9g} keeps every fp32 digit, so tests can compare losses to 1e-7 and beyond; JSON has no
  // NaN or infinity, so those become null (a skipped step's loss).
  return std::isfinite(v) ? fmt::format("{:.9g}", v) : "null";
}

namespace {

// Rewrites an existing metrics.jsonl with only its lines whose "step" is at most `last_step`
// (a resumed run continues after them), streaming: the file grows with the run, so it is never
// read whole. A torn last line from a killed run is dropped.
void keep_lines_through_step(const std::string& path, int64_t last_step) {
  AtomicFileWriter out(path);
  if (last_step > 0 && path_exists(path))
    for_each_line(path, kMaxMetricsLineBytes, [&](std::string_view line, bool complete) {
      const size_t key = line.find("\"step\": ");
      if (!complete || key == std::string_view::npos) return;
      const std::string number(line.substr(key + 8, 24));
      if (std::strtoll(number.c_str(), nullptr, 10) <= last_step) {
        out.write(line);
        out.write("\n");
      }
    });
  out.commit();
}

}  // namespace

MetricsWriter::MetricsWriter(const std::string& path, int64_t keep_through_step) : path_(path) {
  keep_lines_through_step(path, keep_through_step);
  file_ = std::fopen(path.c_str(), "a");
  require(file_ != nullptr, "{}: cannot open for writing ({})", path, std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

void MetricsWriter::write(const StepMetrics& m) {
  const double t = std::max(m.step_time_s, 1e-12);
  auto line = fmt::format(
      "{{\"step\": {}, \"loss\": {}, \"lr\": {:.9g}, \"grad_norm\": {}, \"tokens\": {}, "
      "\"target_tokens\": {}, \"step_time_s\": {:.6f}, \"tokens_per_s\": {:.3f}, \"compute_share\": {:.4f}, "
      "\"data_wait_share\": {:.4f}, \"optimizer_share\": {:.4f}, \"grad_sync_share\": {:.4f}, "
      "\"checkpoint_s\": {:.6f}",
      m.step, json_number(m.loss), m.lr, json_number(m.grad_norm), m.tokens, m.target_tokens, m.step_time_s,
      m.tokens_per_s, m.compute_s / t, m.data_s / t, m.optimizer_s / t, m.grad_sync_s / t, m.checkpoint_s);
  if (m.peer_wait_s > 0) line += fmt::format(", \"peer_wait_share\": {:.4f}", m.peer_wait_s / t);
  if (m.eval_loss >= 0)
    line += fmt::format(", \"eval_loss\": {:.9g}, \"eval_perplexity\": {:.9g}", m.eval_loss, m.eval_perplexity);
  if (m.skipped) line += ", \"skipped\": true";
  line += "}\n";
  require(std::fputs(line.c_str(), file_) >= 0 && std::fflush(file_) == 0, "{}: write failed ({})", path_,
          std::strerror(errno));
}

}  // namespace keel::report
