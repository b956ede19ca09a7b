// Seconds since a steady-clock time point: what the step's phases and the loaders report as their
// time (metrics.jsonl's *_s fields).
#pragma once
#include <chrono>

namespace keel {

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace keel
