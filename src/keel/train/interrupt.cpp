#include "keel/train/interrupt.h"

#include <atomic>
#include <csignal>
#include <unistd.h>

namespace keel::train {
namespace {

std::atomic<int> g_signal{0};
struct sigaction g_previous_int, g_previous_term;

void on_signal(int sig) {
  if (g_signal.exchange(sig) != 0) _exit(128 + sig);  // second signal: the user means it
  static const char kMessage[] = "\nkeel: stopping at the end of this step (signal again to exit now)\n";
  ssize_t ignored = write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
  (void)ignored;
}

}  // namespace

InterruptGuard::InterruptGuard() {
  g_signal = 0;
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, &g_previous_int);
  sigaction(SIGTERM, &action, &g_previous_term);
}

InterruptGuard::~InterruptGuard() {
  sigaction(SIGINT, &g_previous_int, nullptr);
  sigaction(SIGTERM, &g_previous_term, nullptr);
}

bool InterruptGuard::requested() { return g_signal.load() != 0; }
int InterruptGuard::signal_number() { return g_signal.load(); }

}  // namespace keel::train
