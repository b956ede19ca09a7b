// Preference losses (train/preference_loss.h): each loss's value where the policy is the reference,
// its gradient with respect to the answers' summed log-probabilities against double-precision
// finite differences, and the metrics TRL's definitions give from a step's sums.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "keel/train/preference_loss.h"

namespace keel::train {
namespace {

using recipe::PreferenceLoss;

PreferenceLossOptions options(PreferenceLoss loss, double label_smoothing = 0) {
  PreferenceLossOptions o;
  o.loss = loss;
  o.beta = 0.3;
  o.gamma = 0.4;
  o.label_smoothing = label_smoothing;
  return o;
}

TEST(PreferenceLoss, AtTheReferenceTheLossIsThatOfZeroMargin) {
  const PairScore s{-40.0, -55.0, 10, 12, -40.0, -55.0};
  EXPECT_NEAR(pair_loss(options(PreferenceLoss::Sigmoid), s).loss, std::log(2.0), 1e-15);
  EXPECT_EQ(pair_loss(options(PreferenceLoss::Hinge), s).loss, 1.0);
  EXPECT_NEAR(pair_loss(options(PreferenceLoss::Ipo), s).loss, std::pow(1 / (2 * 0.3), 2), 1e-12);
  const PairLoss l = pair_loss(options(PreferenceLoss::Sigmoid), s);
  EXPECT_EQ(l.reward_c, 0.0);
  EXPECT_EQ(l.reward_r, 0.0);
}

TEST(PreferenceLoss, GradientsMatchFiniteDifferences) {
  const struct {
    PreferenceLoss loss;
    double smoothing;
  } cases[] = {{PreferenceLoss::Sigmoid, 0.0}, {PreferenceLoss::Sigmoid, 0.2}, {PreferenceLoss::Hinge, 0.0},
               {PreferenceLoss::Ipo, 0.0},     {PreferenceLoss::Simpo, 0.0},   {PreferenceLoss::Simpo, 0.1},
               {PreferenceLoss::Orpo, 0.0}};
  for (const auto& c : cases) {
    const PreferenceLossOptions o = options(c.loss, c.smoothing);
    for (const PairScore s : {PairScore{-12.0, -15.0, 6, 9, -13.0, -14.0}, PairScore{-30.0, -8.0, 11, 4, -29.0, -9.5}}) {
      const PairLoss l = pair_loss(o, s);
      const double h = 1e-6;
      PairScore up = s, down = s;
      up.logp_c += h;
      down.logp_c -= h;
      const double fd_c = (pair_loss(o, up).loss - pair_loss(o, down).loss) / (2 * h);
      up = down = s;
      up.logp_r += h;
      down.logp_r -= h;
      const double fd_r = (pair_loss(o, up).loss - pair_loss(o, down).loss) / (2 * h);
      const std::string what = std::string(recipe::choice_name(c.loss)) + " smoothing " + std::to_string(c.smoothing);
      EXPECT_NEAR(l.dlogp_c, fd_c, 1e-7 * std::max(1.0, std::abs(fd_c))) << what;
      EXPECT_NEAR(l.dlogp_r, fd_r, 1e-7 * std::max(1.0, std::abs(fd_r))) << what;
      EXPECT_TRUE(std::abs(fd_c) > 1e-9 || c.loss == PreferenceLoss::Hinge) << what << ": a gradient to check";
    }
  }
}

TEST(PreferenceLoss, SigmoidIsConservativeDpoWithLabelSmoothing) {
  // -(1-e) log sigmoid(x) - e log sigmoid(-x), x = beta * ((logp_c - ref_c) - (logp_r - ref_r))
  const PairScore s{-10.0, -12.0, 5, 5, -11.0, -11.5};
  const double x = 0.3 * ((-10.0 + 11.0) - (-12.0 + 11.5)), e = 0.2;
  const double expected = -(1 - e) * std::log(1 / (1 + std::exp(-x))) - e * std::log(1 / (1 + std::exp(x)));
  EXPECT_NEAR(pair_loss(options(PreferenceLoss::Sigmoid, e), s).loss, expected, 1e-14);
}

TEST(PreferenceLoss, MetricsAreTrlsMeans) {
  PreferenceLossOptions o = options(PreferenceLoss::Sigmoid);
  o.pairs_per_micro_batch = 2;
  o.micro_batches = 2;
  // Sums over 4 pairs, then per micro-batch: chosen logit sum, tokens, rejected logit sum, tokens.
  std::vector<double> sums = {0.4, -0.2, 3, 0.6, -100, -120, 0, 0, 0, 1.0, 10, 2.0, 10, 3.0, 30, -1.0, 5};
  const report::PreferenceMetrics m = preference_metrics(o, sums);
  EXPECT_DOUBLE_EQ(m.rewards_chosen, 0.1);
  EXPECT_DOUBLE_EQ(m.rewards_accuracies, 0.75);
  EXPECT_DOUBLE_EQ(m.logps_rejected, -30.0);
  // Each micro-batch's token mean, then their mean (not the mean over all tokens): (0.1 + 0.1) / 2.
  EXPECT_DOUBLE_EQ(m.logits_chosen, 0.1);
  EXPECT_DOUBLE_EQ(m.logits_rejected, (0.2 - 0.2) / 2);
  EXPECT_FALSE(m.orpo);
}

}  // namespace
}  // namespace keel::train
