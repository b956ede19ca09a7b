// The training step (train/training_step.h) driven alone, without run_training: a tiny Llama built
// here, next-token loss, AdamW and a cosine schedule, as the trainer sets them up, in one process
// (no GradSync; data parallel's path is the integration and MPI tests'). The step's logic is above
// the device seam, so these run on the CPU backend only (backend agreement is decoder_test's).
//
// What a user relies on: training on a fixed batch lowers the loss and the step reports what its
// pieces compute; gradient accumulation is the same step as one micro-batch holding every sequence;
// a non-finite loss or gradient stops the run before the weights are touched, or with
// skip_nonfinite_steps skips the update and leaves weights and optimizer state as they were;
// clipping is clip_grad_norm_'s, the gradients scaled by max_norm / norm before AdamW reads them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "decoder_test_support.h"
#include "fake_communicator.h"
#include "keel/train/next_token_loss.h"
#include "keel/train/training_step.h"
#include "test_support.h"

namespace keel::train {
namespace {

constexpr int64_t kMaxBatch = 2, kSeq = 16;

model::ModelConfig tiny_llama() { return model::test::tiny_config("llama"); }

// `batch` rows of random tokens (about one target in seven ignored), one document a row, no padding.
data::PackedMicroBatch rows(int64_t batch, uint64_t seed) {
  const model::test::Batch b = model::test::random_batch(batch, kSeq, tiny_llama().vocab_size, seed);
  data::PackedMicroBatch mb = data::make_packed_micro_batch_buffers(batch, kSeq);
  mb.input_ids = b.ids;
  mb.targets = b.targets;
  mb.positions = b.positions;
  std::fill(mb.segments.begin(), mb.segments.end(), 0);
  mb.input_tokens = batch * kSeq;
  mb.target_tokens = std::count_if(b.targets.begin(), b.targets.end(), [](int32_t t) { return t != -100; });
  return mb;
}

// One micro-batch holding the rows of `a` and then those of `b`.
data::PackedMicroBatch concatenated(const data::PackedMicroBatch& a, const data::PackedMicroBatch& b) {
  data::PackedMicroBatch mb = data::make_packed_micro_batch_buffers(a.batch + b.batch, kSeq);
  auto join = [](const auto& x, const auto& y, auto& out) {
    std::copy(y.begin(), y.end(), std::copy(x.begin(), x.end(), out.begin()));
  };
  join(a.input_ids, b.input_ids, mb.input_ids);
  join(a.targets, b.targets, mb.targets);
  join(a.positions, b.positions, mb.positions);
  join(a.segments, b.segments, mb.segments);
  mb.input_tokens = a.input_tokens + b.input_tokens;
  mb.target_tokens = a.target_tokens + b.target_tokens;
  return mb;
}

// Step `step` over `micro`, with the totals every rank would agree on (here: this one's).
StepBatch step_batch(int64_t step, std::span<const data::PackedMicroBatch> micro) {
  StepBatch in{step, micro, false, {}};
  for (const auto& mb : micro) {
    in.totals.target_tokens += double(mb.target_tokens);
    in.totals.tokens += double(mb.input_tokens);
  }
  return in;
}

model::MicroBatch view(const data::PackedMicroBatch& mb) {
  return {mb.batch, mb.seq, mb.input_ids.data(), mb.targets.data(), mb.positions.data(), nullptr};
}

// HF's AdamW defaults but ε = 1e-3 (see TwoMicroBatchesEqualOneHoldingBothSequences), weight decay on.
constexpr AdamWConfig kAdam{0.9, 0.999, 1e-3, 0.01};
const LrSchedule kSchedule{recipe::LrScheduler::Cosine, 1e-2, 0, 5};

// A tiny decoder (the same weights in every instance) and what its step needs, as trainer.cpp sets
// them up; `objective` null: next-token loss.
struct Pieces {
  explicit Pieces(TrainingStepOptions options = {}, std::unique_ptr<Objective> custom = nullptr)
      : decoder(tiny_llama(), model::Precision::F32, kMaxBatch, kSeq,
                model::test::on_backend("cpu", {false, true, 0})),
        optimizer(decoder.backend(), decoder.trainable(), kAdam),
        objective(custom ? std::move(custom) : std::unique_ptr<Objective>(std::make_unique<NextTokenLoss>())),
        step(decoder, *objective, optimizer, schedule, comm, nullptr, options) {
    decoder.init_random(7);
  }
  model::ParamStore& trained() { return decoder.trainable(); }
  std::vector<float> weights() { return {trained().masters(), trained().masters() + trained().total()}; }
  std::vector<float> first_moments() { return {trained().adam_m(), trained().adam_m() + trained().total()}; }
  std::vector<float> second_moments() { return {trained().adam_v(), trained().adam_v() + trained().total()}; }
  // The L2 norm of the gradients, summed here in double.
  double gradient_norm_by_hand() {
    double sum = 0;
    for (int64_t i = 0; i < trained().total(); ++i) sum += double(trained().grads()[i]) * trained().grads()[i];
    return std::sqrt(sum);
  }

  model::Decoder decoder;
  AdamW optimizer;
  std::unique_ptr<Objective> objective;
  LrSchedule schedule = kSchedule;
  distributed::FakeCommunicator comm{/*size=*/1, /*rank=*/0};
  TrainingStep step;
};

double largest_magnitude(const std::vector<float>& v) {
  double most = 0;
  for (float x : v) most = std::max(most, double(std::abs(x)));
  return most;
}

double largest_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double most = 0;
  for (size_t i = 0; i < a.size(); ++i) most = std::max(most, double(std::abs(a[i] - b[i])));
  return most;
}

TEST(TrainingStep, StepsOnAFixedBatchLowerTheLossAndReportWhatThePiecesCompute) {
  Pieces p;
  p.schedule.base_lr = 2e-3;  // read at each update: small enough that every step lowers the loss
  const std::vector<data::PackedMicroBatch> micro = {rows(2, 1), rows(2, 2)};  // accumulation 2
  std::vector<double> losses;
  for (int64_t s = 1; s <= 5; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    const StepBatch in = step_batch(s, micro);
    // The loss the step must report: the mean over the step's targets of the decoder's forward pass
    // over the same rows, before the update.
    double loss_sum = 0;
    for (const auto& mb : micro) loss_sum += p.decoder.forward_loss(view(mb));
    const std::vector<float> before = p.weights();
    const report::StepMetrics m = p.step.run(in);
    EXPECT_EQ(m.step, s);
    EXPECT_EQ(m.tokens, 2 * 2 * kSeq);
    EXPECT_EQ(m.target_tokens, micro[0].target_tokens + micro[1].target_tokens);
    EXPECT_NEAR(m.loss, loss_sum / in.totals.target_tokens, 1e-5 * m.loss);
    // AdamW leaves the gradients it read in place.
    const double norm = p.gradient_norm_by_hand();
    EXPECT_GT(norm, 0.0);
    EXPECT_NEAR(m.grad_norm, norm, 1e-5 * norm);
    EXPECT_EQ(m.lr, p.schedule.lr_for_step(s));  // step s's rate, not step s - 1's (they differ: cosine)
    EXPECT_FALSE(m.skipped);
    EXPECT_GE(m.compute_s, 0.0);
    EXPECT_TRUE(m.expert_load.empty());  // a dense model
    EXPECT_GT(largest_difference(before, p.weights()), 0.0) << "the weights did not move";
    losses.push_back(m.loss);
  }
  for (size_t s = 1; s < losses.size(); ++s) EXPECT_LT(losses[s], losses[s - 1]) << "step " << s + 1;
  EXPECT_LT(losses.back(), 0.9 * losses.front());
}

// Gradient accumulation: the step's gradient is the mean over the step's targets whichever
// micro-batch a sequence is in, so one step over two micro-batches equals one step over one
// micro-batch holding both sequences — gradients (AdamW's first moments), loss, norm and weights.
// The weights' tolerance: AdamW divides by √v + ε, so a gradient near 0 whose rounding differs
// between the two moves its update by up to lr·δ/ε, and step 2's gradients then differ by what
// step 1's weights did. Hence ε = 1e-3 in these tests: with ε = 1e-6 the weights differed by
// 5.9e-6 at step 2 (AVX-512) and by 1.18e-5 on the portable kernels under ASan, past the bound,
// and the first moments by 8.1e-6 of their largest, against 1e-5; with 1e-3, 1.2e-7 and 2.6e-7
// at most. A micro-batch's gradient scaled by its own targets instead of the step's (the
// accumulation bug) moves the weights by 1.4e-2 and the first moments by 1.1 of their largest.
TEST(TrainingStep, TwoMicroBatchesEqualOneHoldingBothSequences) {
  Pieces split, whole;
  const data::PackedMicroBatch a = rows(1, 11), b = rows(1, 12);
  const std::vector<data::PackedMicroBatch> two = {a, b}, one = {concatenated(a, b)};
  ASSERT_EQ(split.weights(), whole.weights());
  for (int64_t s = 1; s <= 2; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    const report::StepMetrics ms = split.step.run(step_batch(s, two));
    const report::StepMetrics mw = whole.step.run(step_batch(s, one));
    EXPECT_EQ(ms.tokens, mw.tokens);
    EXPECT_EQ(ms.target_tokens, mw.target_tokens);
    EXPECT_NEAR(ms.loss, mw.loss, 1e-6 * mw.loss);
    EXPECT_NEAR(ms.grad_norm, mw.grad_norm, 1e-5 * mw.grad_norm);
    const std::vector<float> m_split = split.first_moments(), m_whole = whole.first_moments();
    EXPECT_LE(largest_difference(m_split, m_whole), 1e-5 * largest_magnitude(m_whole)) << "the gradients differ";
    EXPECT_LE(largest_difference(split.weights(), whole.weights()), 1e-5);
  }
}

// Data parallel's path through the step (GradSync, ZeRO stage 0) with a communicator whose
// collectives leave each value as this rank holds it (what the sums would be if the other rank
// contributed zeros): the same steps as without a GradSync, bit for bit — its begin_step starts
// each step's gradients afresh, its finish gives the loss and the norm, and its hooks change
// nothing in the gradients.
TEST(TrainingStep, WithGradSyncOnOneRanksViewEqualsTheSingleProcessStep) {
  Pieces single, synced;
  distributed::FakeCommunicator two(/*size=*/2, /*rank=*/0);
  GradSync sync(synced.decoder, two, {.zero_stage = 0, .bucket_bytes = 4096, .overlap = true});
  TrainingStep step(synced.decoder, *synced.objective, synced.optimizer, synced.schedule, two, &sync,
                    TrainingStepOptions{});
  const std::vector<data::PackedMicroBatch> micro = {rows(2, 21), rows(2, 22)};
  for (int64_t s = 1; s <= 2; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    const report::StepMetrics a = single.step.run(step_batch(s, micro)), b = step.run(step_batch(s, micro));
    EXPECT_EQ(a.loss, b.loss);
    EXPECT_EQ(a.grad_norm, b.grad_norm);
    EXPECT_EQ(single.weights(), synced.weights());
  }
}

// An objective whose loss, or one gradient, turns non-finite when `poison` is set: what a
// diverging run or a bad batch produces.
class PoisonedLoss final : public Objective {
 public:
  enum class What { Loss, Gradient };
  explicit PoisonedLoss(What what) : what_(what) {}
  bool poison = false;

  void begin_step(const StepTotals& totals) override { loss_.begin_step(totals); }
  void micro_batch(model::Decoder& decoder, const model::MicroBatch& batch,
                   const data::PackedMicroBatch& data_rows) override {
    loss_.micro_batch(decoder, batch, data_rows);
    if (poison && what_ == What::Gradient)
      decoder.trainable().grads()[decoder.trainable().total() / 2] = std::numeric_limits<float>::quiet_NaN();
  }
  double partial_loss() const override {
    return poison && what_ == What::Loss ? std::numeric_limits<double>::infinity() : loss_.partial_loss();
  }
  double step_loss(double summed) const override { return loss_.step_loss(summed); }

 private:
  What what_;
  NextTokenLoss loss_;
};

// How the parameter reads in test names and ctest's list.
void PrintTo(PoisonedLoss::What what, std::ostream* os) { *os << (what == PoisonedLoss::What::Loss ? "loss" : "gradient"); }

class NonFiniteStep : public ::testing::TestWithParam<PoisonedLoss::What> {
 protected:
  // The pieces after one ordinary step (so that the optimizer state is not zero), the poison set.
  std::unique_ptr<Pieces> after_one_step(bool skip_nonfinite_steps) {
    auto objective = std::make_unique<PoisonedLoss>(GetParam());
    poisoned_ = objective.get();
    auto p = std::make_unique<Pieces>(TrainingStepOptions{.seed = 1, .max_grad_norm = 1.0,
                                                          .skip_nonfinite_steps = skip_nonfinite_steps},
                                      std::move(objective));
    EXPECT_FALSE(p->step.run(step_batch(1, micro_)).skipped);
    poisoned_->poison = true;
    return p;
  }
  const std::vector<data::PackedMicroBatch> micro_ = {rows(2, 3)};
  PoisonedLoss* poisoned_ = nullptr;
};

TEST_P(NonFiniteStep, StopsTheRunNamingSkipNonfiniteStepsWithTheWeightsUntouched) {
  auto p = after_one_step(false);
  const auto weights = p->weights(), m = p->first_moments(), v = p->second_moments();
  keel::testing::expect_keel_error([&] { p->step.run(step_batch(2, micro_)); },
                             {"step 2", "not finite", "skip_nonfinite_steps = true"});
  EXPECT_EQ(p->weights(), weights);
  EXPECT_EQ(p->first_moments(), m);
  EXPECT_EQ(p->second_moments(), v);
}

TEST_P(NonFiniteStep, WithSkipNonfiniteStepsSkipsTheUpdateAndTheNextStepTrains) {
  auto p = after_one_step(true);
  const auto weights = p->weights(), m = p->first_moments(), v = p->second_moments();
  const report::StepMetrics skipped = p->step.run(step_batch(2, micro_));
  EXPECT_TRUE(skipped.skipped);
  EXPECT_FALSE(std::isfinite(skipped.loss) && std::isfinite(skipped.grad_norm));
  EXPECT_EQ(skipped.lr, kSchedule.lr_for_step(2));
  // Bit for bit: nothing of the step reached the weights or the optimizer state.
  EXPECT_EQ(p->weights(), weights);
  EXPECT_EQ(p->first_moments(), m);
  EXPECT_EQ(p->second_moments(), v);
  // The next step starts its gradients afresh: nothing of the skipped one's poison is left.
  poisoned_->poison = false;
  const report::StepMetrics next = p->step.run(step_batch(3, micro_));
  EXPECT_FALSE(next.skipped);
  EXPECT_TRUE(std::isfinite(next.loss));
  EXPECT_TRUE(std::isfinite(next.grad_norm));
  const auto after = p->weights();
  EXPECT_TRUE(std::all_of(after.begin(), after.end(), [](float w) { return std::isfinite(w); }));
  EXPECT_GT(largest_difference(after, weights), 0.0) << "the step after a skipped one did not train";
}

INSTANTIATE_TEST_SUITE_P(Poison, NonFiniteStep,
                         ::testing::Values(PoisonedLoss::What::Loss, PoisonedLoss::What::Gradient),
                         [](const auto& info) {
                           return std::string(info.param == PoisonedLoss::What::Loss ? "Loss" : "Gradient");
                         });

// clip_grad_norm_: with max_grad_norm below the gradients' norm, the update is AdamW's on the
// gradients scaled by max_norm / (norm + 1e-6). AdamW's first update hardly depends on the
// gradients' scale (m / √v), so the moments show it: m = (1 - β1)·g, v = (1 - β2)·g².
TEST(TrainingStep, ClippingScalesTheGradientsByMaxNormOverNorm) {
  const std::vector<data::PackedMicroBatch> micro = {rows(2, 5)};
  const StepBatch in = step_batch(1, micro);
  double norm = 0;
  {
    Pieces probe;
    report::StepMetrics m;
    probe.step.compute_gradients(in, m);
    norm = m.grad_norm;
  }
  ASSERT_GT(norm, 0.0);
  const double max_norm = norm / 4;
  Pieces clipped({.seed = 1, .max_grad_norm = max_norm}), by_hand, unclipped({.seed = 1, .max_grad_norm = 0});
  const report::StepMetrics m = clipped.step.run(in);
  EXPECT_NEAR(m.grad_norm, norm, 1e-6 * norm);  // the norm reported is the one before clipping, as HF logs it
  // By hand: the same gradients, scaled, then AdamW unclipped.
  report::StepMetrics unused;
  by_hand.step.compute_gradients(in, unused);
  const float scale = float(max_norm / (norm + 1e-6));
  for (int64_t i = 0; i < by_hand.trained().total(); ++i) by_hand.trained().grads()[i] *= scale;
  by_hand.optimizer.step(kSchedule.lr_for_step(1), 1);
  unclipped.step.run(in);

  const auto m_clipped = clipped.first_moments(), m_by_hand = by_hand.first_moments();
  const auto v_clipped = clipped.second_moments(), v_by_hand = by_hand.second_moments();
  EXPECT_LE(largest_difference(m_clipped, m_by_hand), 1e-5 * largest_magnitude(m_by_hand));
  EXPECT_LE(largest_difference(v_clipped, v_by_hand), 1e-5 * largest_magnitude(v_by_hand));
  EXPECT_LE(largest_difference(clipped.weights(), by_hand.weights()), 1e-5);
  // Not vacuous: unclipped, the first moments are four times larger.
  EXPECT_NEAR(largest_magnitude(unclipped.first_moments()), 4 * largest_magnitude(m_by_hand),
              1e-3 * largest_magnitude(unclipped.first_moments()));
}

}  // namespace
}  // namespace keel::train
