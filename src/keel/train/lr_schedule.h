// Learning-rate schedules with exactly transformers' semantics (get_cosine_schedule_with_warmup,
// get_linear_schedule_with_warmup, get_constant_schedule_with_warmup): the multiplier at index c
// is used by optimizer step c + 1, so with warmup the first step runs at lr 0.
#pragma once
#include <cstdint>

#include "keel/recipe/recipe.h"

namespace keel::train {

struct LrSchedule {
  recipe::LrScheduler kind = recipe::LrScheduler::Cosine;
  double base_lr = 0;
  int64_t warmup_steps = 0, total_steps = 1;

  double multiplier(int64_t index) const;
  // Learning rate of optimizer step `step` (counting from 1).
  double lr_for_step(int64_t step) const { return base_lr * multiplier(step - 1); }
};

}  // namespace keel::train
