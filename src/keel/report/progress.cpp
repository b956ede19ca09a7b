#include "keel/report/progress.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <cmath>

namespace keel::report {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = int64_t(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}h{:02}m", s / 3600, (s % 3600) / 60);
  if (s >= 60) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

Progress::Progress(std::ostream& out, int64_t max_steps, int64_t log_interval, bool terminal)
    : out_(out), max_steps_(max_steps), log_interval_(log_interval), terminal_(terminal) {}

void Progress::step(const StepMetrics& m, double elapsed_s) {
  if (first_step_ < 0) first_step_ = m.step;
  const double done = double(m.step - first_step_ + 1);
  const double eta = elapsed_s / done * double(max_steps_ - m.step);
  std::string line = fmt::format("step {}/{}  loss {:.4f}  lr {:.3e}  grad_norm {:.3f}  {:.0f} tokens/s  ETA {}",
                                 m.step, max_steps_, m.loss, m.lr, m.grad_norm, m.tokens_per_s, format_duration(eta));
  if (m.eval_loss >= 0) line += fmt::format("  eval_loss {:.4f}", m.eval_loss);
  if (terminal_) {
    fmt::print(out_, "\r\033[K{}", line);  // carriage return + clear line: rewrite in place
    out_.flush();
    live_line_ = true;
    if (m.eval_loss >= 0) finish();  // keep eval results on screen
    return;
  }
  if (m.step % log_interval_ == 0 || m.step == max_steps_ || m.eval_loss >= 0) {
    fmt::print(out_, "{}\n", line);
    out_.flush();
  }
}

void Progress::message(const std::string& text) {
  finish();
  fmt::print(out_, "{}\n", text);
  out_.flush();
}

void Progress::finish() {
  if (live_line_) fmt::print(out_, "\n");
  live_line_ = false;
}

}  // namespace keel::report
