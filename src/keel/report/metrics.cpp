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

namespace {

// TRL's names, prefixed "eval_" for the evaluation's (as TRL's log() prefixes them).
void add_preference_fields(const PreferenceMetrics& p, const char* prefix, std::vector<MetricField>& fields) {
  if (!p.present) return;
  using F = MetricField::Format;
  static const std::string names[2][11] = {
      {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
       "logits/chosen", "logits/rejected", "log_odds_ratio", "log_odds_chosen", "nll_loss"},
      {"eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/accuracies", "eval_rewards/margins",
       "eval_logps/chosen", "eval_logps/rejected", "eval_logits/chosen", "eval_logits/rejected", "eval_log_odds_ratio",
       "eval_log_odds_chosen", "eval_nll_loss"}};
  const auto& n = names[*prefix ? 1 : 0];
  const double values[11] = {p.rewards_chosen, p.rewards_rejected, p.rewards_accuracies, p.rewards_margins,
                             p.logps_chosen,   p.logps_rejected,   p.logits_chosen,      p.logits_rejected,
                             p.log_odds_ratio, p.log_odds_chosen,  p.nll_loss};
  for (int i = 0; i < (p.orpo ? 11 : 8); ++i) fields.push_back({n[i].c_str(), values[i], F::Significant});
}

}  // namespace

std::vector<MetricField> step_metric_fields(const StepMetrics& m) {
  using F = MetricField::Format;
  const double t = std::max(m.step_time_s, 1e-12);
  std::vector<MetricField> fields = {
      {"loss", m.loss, F::Significant},
      {"lr", m.lr, F::Significant},
      {"grad_norm", m.grad_norm, F::Significant},
      {"tokens", double(m.tokens), F::Integer},
      {"target_tokens", double(m.target_tokens), F::Integer},
      {"step_time_s", m.step_time_s, F::Fixed6},
      {"tokens_per_s", m.tokens_per_s, F::Fixed3},
      {"compute_share", m.compute_s / t, F::Fixed4},
      {"data_wait_share", m.data_s / t, F::Fixed4},
      {"optimizer_share", m.optimizer_s / t, F::Fixed4},
      {"grad_sync_share", m.grad_sync_s / t, F::Fixed4},
      {"checkpoint_s", m.checkpoint_s, F::Fixed6},
  };
  if (m.peer_wait_s > 0) fields.push_back({"peer_wait_share", m.peer_wait_s / t, F::Fixed4});
  // In GB of 1e9 bytes, as the summary table prints the run's peak.
  if (m.peak_memory_bytes > 0) fields.push_back({"peak_memory_gb", double(m.peak_memory_bytes) / 1e9, F::Fixed4});
  if (m.eval_loss >= 0) {
    fields.push_back({"eval_loss", m.eval_loss, F::Significant});
    if (m.eval_perplexity > 0) fields.push_back({"eval_perplexity", m.eval_perplexity, F::Significant});
  }
  add_preference_fields(m.preference, "", fields);
  add_preference_fields(m.eval_preference, "eval_", fields);
  if (m.aux_loss >= 0) fields.push_back({"aux_loss", m.aux_loss, F::Significant});
  return fields;
}

namespace {

std::string formatted(const MetricField& f) {
  using F = MetricField::Format;
  switch (f.format) {
    case F::Integer: return fmt::format("{}", int64_t(f.value));
    case F::Fixed3: return fmt::format("{:.3f}", f.value);
    case F::Fixed4: return fmt::format("{:.4f}", f.value);
    case F::Fixed6: return fmt::format("{:.6f}", f.value);
    case F::Significant: break;
  }
  return json_number(f.value);
}

}  // namespace

void MetricsWriter::write(const StepMetrics& m) {
  std::string line = fmt::format("{{\"step\": {}", m.step);
  for (const MetricField& f : step_metric_fields(m)) line += fmt::format(", \"{}\": {}", f.name, formatted(f));
  if (!m.expert_load.empty()) {  // a list, one per sparse layer: not a scalar field
    line += ", \"expert_load_max_over_mean\": [";
    for (size_t i = 0; i < m.expert_load.size(); ++i)
      line += fmt::format("{}{:.4f}", i ? ", " : "", m.expert_load[i]);
    line += "]";
  }
  if (m.skipped) line += ", \"skipped\": true";
  line += "}\n";
  require(std::fputs(line.c_str(), file_) >= 0 && std::fflush(file_) == 0, "{}: write failed ({})", path_,
          std::strerror(errno));
}

}  // namespace keel::report
