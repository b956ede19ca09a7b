// Progress of long work other than training steps (preparing data, loading or quantizing a
// model's weights, exporting one): on a terminal one live line rewritten in place; otherwise a
// plain line every KEEL_PROGRESS_INTERVAL_S seconds (default 5; 0: at every update, for tests).
// Work shorter than the interval prints nothing. Training's own line is report/progress.h.
#pragma once
#include <chrono>
#include <ostream>
#include <string>

namespace keel {

// Whether standard output is an interactive terminal (KEEL_PROGRESS=plain|live overrides).
bool stdout_is_terminal();

class WorkProgress {
 public:
  // out null: silent (ranks other than 0, library callers that did not ask).
  WorkProgress(std::ostream* out, bool live);
  ~WorkProgress() { finish(); }
  // Whether a line is due now (the interval passed since the start and since the last line).
  bool due();
  double elapsed_s() const;
  // Prints one line: rewritten in place when live, else on its own line.
  void print(const std::string& line);
  // Ends a live line (a newline), so that what follows starts on its own line.
  void finish();
  // "{label}: {done} of {total} {unit} ({share}%), {rate} {unit}/s, about {eta} left", when due.
  void update(const std::string& label, double done, double total, const std::string& unit);

  WorkProgress(const WorkProgress&) = delete;
  WorkProgress& operator=(const WorkProgress&) = delete;

 private:
  std::ostream* out_;
  bool live_, showing_ = false;
  double interval_s_ = 5.0, last_s_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace keel
