#include "keel/train/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace keel::train {

double LrSchedule::multiplier(int64_t c) const {
  if (c < warmup_steps) return double(c) / double(std::max<int64_t>(1, warmup_steps));
  if (kind == recipe::LrScheduler::Constant) return 1.0;
  const double remaining = double(std::max<int64_t>(1, total_steps - warmup_steps));
  if (kind == recipe::LrScheduler::Linear) return std::max(0.0, double(total_steps - c) / remaining);
  // Cosine with num_cycles = 0.5: from 1 down to 0 over the steps after warmup.
  const double progress = double(c - warmup_steps) / remaining;
  return std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * 0.5 * 2.0 * progress)));
}

}  // namespace keel::train
