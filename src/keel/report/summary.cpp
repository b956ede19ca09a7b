#include "keel/report/summary.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

namespace keel::report {

void RunSummary::add_step(const StepMetrics& m) {
  ++steps;
  skipped_steps += m.skipped;
  tokens += m.tokens;
  seconds += m.step_time_s;
  compute_share += m.compute_s;
  data_wait_share += m.data_s;
  grad_sync_share += m.grad_sync_s;
  optimizer_share += m.optimizer_s;
  checkpoint_share += m.checkpoint_s;
  if (std::isfinite(m.loss)) final_loss = m.loss;
  if (m.preference.present) final_preference = m.preference;
  if (m.eval_preference.present) eval_preference = m.eval_preference;
}

void RunSummary::finalize(double flops_per_token) {
  const double t = std::max(seconds, 1e-12);
  for (double* share : {&compute_share, &data_wait_share, &grad_sync_share, &optimizer_share, &checkpoint_share})
    *share /= t;
  tokens_per_s = double(tokens) / t;
  this->flops_per_token = flops_per_token;
  mfu = matmul_peak_flops > 0 ? tokens_per_s * flops_per_token / matmul_peak_flops : 0.0;
}

std::string summary_table(const RunSummary& s) {
  const double gb = 1e9;
  std::string memory = fmt::format("{:.2f} GB", double(s.peak_memory_bytes) / gb);
  if (s.planned_memory_bytes > 0) memory += fmt::format(" (plan {:.2f} GB)", double(s.planned_memory_bytes) / gb);
  std::string out;
  out += fmt::format("{:<34}{}\n", "throughput", fmt::format("{:.1f} tokens/s", s.tokens_per_s));
  out += fmt::format("{:<34}{:.1f}%\n", "compute utilization (step share)", 100 * s.compute_share);
  out += fmt::format("{:<34}{:.1f}%\n", "MFU (vs measured matmul peak)", 100 * s.mfu);
  out += fmt::format("{:<34}{}\n", "memory per rank (peak RSS)", memory);
  out += fmt::format("{:<34}{:.1f}%\n", "gradient sync share", 100 * s.grad_sync_share);
  out += fmt::format("{:<34}{:.1f}%\n", "data wait share", 100 * s.data_wait_share);
  out += fmt::format("{:<34}{:.1f}%\n", "optimizer share", 100 * s.optimizer_share);
  if (s.checkpoint_share > 0)
    out += fmt::format("{:<34}{:.1f}%\n", "checkpoint (blocking) share", 100 * s.checkpoint_share);
  out += fmt::format("{:<34}{} ({} skipped)\n", "steps", s.steps, s.skipped_steps);
  out += fmt::format("{:<34}{:.4f}\n", "final training loss", s.final_loss);
  if (s.eval_loss >= 0)
    out += fmt::format("{:<34}{:.4f}{}\n", "eval loss", s.eval_loss,
                       s.eval_perplexity > 0 ? fmt::format(" (perplexity {:.2f})", s.eval_perplexity) : "");
  for (const auto& [p, name] : {std::pair{&s.final_preference, "final"}, {&s.eval_preference, "eval"}})
    if (p->present)
      out += fmt::format("{:<34}{:.1f}% (margin {:.4f})\n", fmt::format("{} reward accuracy", name),
                         100 * p->rewards_accuracies, p->rewards_margins);
  return out;
}

std::string summary_json(const RunSummary& s) {
  std::string out = "{\n";
  auto field = [&](const char* key, const std::string& value, bool last = false) {
    out += fmt::format("  \"{}\": {}{}\n", key, value, last ? "" : ",");
  };
  auto num = [](double v) { return json_number(v); };
  field("tokens_per_s", num(s.tokens_per_s));
  field("compute_share", num(s.compute_share));
  field("data_wait_share", num(s.data_wait_share));
  field("grad_sync_share", num(s.grad_sync_share));
  field("optimizer_share", num(s.optimizer_share));
  field("checkpoint_share", num(s.checkpoint_share));
  field("peak_memory_bytes", std::to_string(s.peak_memory_bytes));
  field("planned_memory_bytes", std::to_string(s.planned_memory_bytes));
  field("mfu", num(s.mfu));
  field("matmul_peak_flops", num(s.matmul_peak_flops));
  std::string per_rank = "[";
  for (size_t i = 0; i < s.matmul_peak_flops_per_rank.size(); ++i)
    per_rank += (i ? ", " : "") + num(s.matmul_peak_flops_per_rank[i]);
  field("matmul_peak_flops_per_rank", per_rank + "]");
  field("flops_per_token", num(s.flops_per_token));
  field("steps", std::to_string(s.steps));
  field("skipped_steps", std::to_string(s.skipped_steps));
  field("tokens", std::to_string(s.tokens));
  field("seconds", num(s.seconds));
  field("ranks", std::to_string(s.ranks));
  if (s.eval_loss >= 0) {
    field("eval_loss", num(s.eval_loss));
    if (s.eval_perplexity > 0) field("eval_perplexity", num(s.eval_perplexity));
  }
  for (const auto& [p, prefix] : {std::pair{&s.final_preference, ""}, {&s.eval_preference, "eval_"}})
    if (p->present) {
      field(fmt::format("{}reward_accuracy", prefix).c_str(), num(p->rewards_accuracies));
      field(fmt::format("{}reward_margin", prefix).c_str(), num(p->rewards_margins));
    }
  field("final_loss", num(s.final_loss), true);
  return out + "}\n";
}

}  // namespace keel::report
