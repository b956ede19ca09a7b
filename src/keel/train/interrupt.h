// Ctrl-C and SIGTERM (a scheduler preempting the job) ask the trainer to stop at the next step
// boundary, save and exit cleanly, instead of killing it mid-step. A second signal exits at once.
#pragma once

namespace keel::train {

class InterruptGuard {
 public:
  InterruptGuard();   // installs the handlers
  ~InterruptGuard();  // restores the previous ones
  InterruptGuard(const InterruptGuard&) = delete;
  InterruptGuard& operator=(const InterruptGuard&) = delete;

  static bool requested();
  static int signal_number();  // which signal asked (SIGINT or SIGTERM), 0 if none
};

}  // namespace keel::train
