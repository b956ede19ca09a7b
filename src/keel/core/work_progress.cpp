#include "keel/core/work_progress.h"

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace keel {

bool stdout_is_terminal() {
  if (const char* mode = std::getenv("KEEL_PROGRESS")) {
    if (std::strcmp(mode, "live") == 0) return true;
    if (std::strcmp(mode, "plain") == 0) return false;
  }
  return isatty(STDOUT_FILENO) == 1;
}

WorkProgress::WorkProgress(std::ostream* out, bool live) : out_(out), live_(live) {
  const char* interval = std::getenv("KEEL_PROGRESS_INTERVAL_S");
  // A live line can be refreshed often; a log gets a line every few seconds.
  interval_s_ = interval ? std::max(0.0, std::atof(interval)) : live ? 0.5 : 5.0;
}

double WorkProgress::elapsed_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

bool WorkProgress::due() {
  if (!out_) return false;
  const double now = elapsed_s();
  if (now - last_s_ < interval_s_ || (interval_s_ > 0 && now < interval_s_)) return false;
  last_s_ = now;
  return true;
}

void WorkProgress::print(const std::string& line) {
  if (!out_) return;
  if (live_) {
    *out_ << "\r\033[K" << line;
    showing_ = true;
  } else {
    *out_ << line << '\n';
  }
  out_->flush();
}

void WorkProgress::finish() {
  if (out_ && showing_) *out_ << '\n';
  showing_ = false;
}

void WorkProgress::update(const std::string& label, double done, double total, const std::string& unit) {
  if (!due()) return;
  const double rate = done / std::max(elapsed_s(), 1e-9);
  const double left = rate > 0 ? std::max(0.0, total - done) / rate : 0.0;
  print(fmt::format("{}: {:.1f} of {:.1f} {} ({:.0f}%), {:.1f} {}/s, about {:.0f} s left", label, done, total, unit,
                    total > 0 ? 100.0 * done / total : 100.0, rate, unit, left));
}

}  // namespace keel
