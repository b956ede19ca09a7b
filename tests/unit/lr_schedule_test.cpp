#include <gtest/gtest.h>

#include <cmath>

#include "keel/train/lr_schedule.h"

using keel::recipe::LrScheduler;
using keel::train::LrSchedule;

// Values of transformers' get_*_schedule_with_warmup lambdas, written out by hand.
TEST(LrSchedule, CosineWithWarmupMatchesTransformers) {
  LrSchedule s{LrScheduler::Cosine, 1.0, 2, 10};
  EXPECT_DOUBLE_EQ(s.lr_for_step(1), 0.0);  // step 1 uses index 0
  EXPECT_DOUBLE_EQ(s.lr_for_step(2), 0.5);
  EXPECT_DOUBLE_EQ(s.lr_for_step(3), 1.0);
  EXPECT_NEAR(s.lr_for_step(7), 0.5 * (1 + std::cos(M_PI * 4.0 / 8.0)), 1e-15);
  EXPECT_NEAR(s.multiplier(10), 0.0, 1e-15);
}

TEST(LrSchedule, LinearAndConstant) {
  LrSchedule lin{LrScheduler::Linear, 2.0, 0, 4};
  EXPECT_DOUBLE_EQ(lin.lr_for_step(1), 2.0);
  EXPECT_DOUBLE_EQ(lin.lr_for_step(2), 1.5);
  EXPECT_DOUBLE_EQ(lin.lr_for_step(4), 0.5);
  LrSchedule constant{LrScheduler::Constant, 3.0, 2, 100};
  EXPECT_DOUBLE_EQ(constant.lr_for_step(2), 1.5);
  EXPECT_DOUBLE_EQ(constant.lr_for_step(50), 3.0);
}
