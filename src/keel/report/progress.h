// What the user sees while training runs: on a terminal, one live line rewritten in place
// (step/max, loss, lr, tokens/s, ETA); otherwise (CI logs, files) one plain line every
// log_interval steps, so logs stay readable and small.
#pragma once
#include <cstdint>
#include <ostream>
#include <string>

#include "keel/core/work_progress.h"
#include "keel/report/metrics.h"

namespace keel::report {

class Progress {
 public:
  Progress(std::ostream& out, int64_t max_steps, int64_t log_interval, bool terminal);
  // Reports a finished step; elapsed_s is the wall time since training started.
  void step(const StepMetrics& m, double elapsed_s);
  // Prints a message on its own line (clearing the live line first on a terminal).
  void message(const std::string& text);
  // Ends the live line.
  void finish();

 private:
  std::ostream& out_;
  int64_t max_steps_, log_interval_, first_step_ = -1;
  bool terminal_, live_line_ = false;
};

using keel::stdout_is_terminal;  // core/work_progress.h

// "1h02m", "3m05s", "42s".
std::string format_duration(double seconds);

}  // namespace keel::report
