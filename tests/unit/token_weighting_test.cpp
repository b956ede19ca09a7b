// Decoder::forward_score and forward_backward_weighted, the decoder's side of objectives over whole
// sequences (preference losses): the scores are the per-token losses forward_loss sums and the
// mean logits logits_at gives, and the weighted gradient is the gradient of sum_i w_i * nll_i —
// checked where it must equal next-token loss's own (every weight the same scale; a zero weight
// where the target is ignored) and, with weights that differ per sequence, by finite differences of
// the weighted loss on the double-precision backend.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <vector>

#include "decoder_test_support.h"
#include "keel/model/decoder.h"

namespace keel::model {
namespace {

constexpr int64_t kBatch = 2, kSeq = 10;

struct Scored {
  std::vector<double> nll = std::vector<double>(kBatch * kSeq, -1.0);
  std::vector<double> mean_logit = std::vector<double>(kBatch * kSeq, -1.0);
  std::vector<float> weights = std::vector<float>(kBatch * kSeq, -1.0f);
  Decoder::TokenScores scores() { return {nll.data(), mean_logit.data()}; }
};

// Weights from a fixed table, independent of the scores (the scores are checked separately).
class FixedWeights final : public Decoder::TokenWeighting {
 public:
  explicit FixedWeights(std::vector<float> w) : w_(std::move(w)) {}
  void weigh(const double*, const double*, float* weight) override { std::copy(w_.begin(), w_.end(), weight); }

 private:
  std::vector<float> w_;
};

std::vector<float> grads_of(Decoder& d) { return {d.params().grads(), d.params().grads() + d.params().total()}; }

class TokenWeighting : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenWeighting, ScoresAreForwardLossesTokensAndMeanLogits) {
  Decoder d(test::tiny_config("gemma2"), Precision::F32, kBatch, kSeq, test::on_backend(GetParam()));  // soft caps
  d.init_random(5, 0.2);
  const auto b = test::random_batch(kBatch, kSeq, d.config().vocab_size, 41);
  Scored s;
  const double total = d.forward_score(b.view(kBatch, kSeq), s.scores());
  EXPECT_DOUBLE_EQ(total, d.forward_loss(b.view(kBatch, kSeq)));
  EXPECT_DOUBLE_EQ(total, std::accumulate(s.nll.begin(), s.nll.end(), 0.0));
  const int64_t V = d.config().vocab_size;
  std::vector<int64_t> rows(kBatch * kSeq);
  std::iota(rows.begin(), rows.end(), 0);
  std::vector<float> logits(rows.size() * size_t(V));
  d.logits_at(b.view(kBatch, kSeq), rows.data(), int64_t(rows.size()), logits.data());
  for (size_t i = 0; i < rows.size(); ++i) {
    if (b.targets[i] == -100) EXPECT_EQ(s.nll[i], 0.0) << i;
    double sum = 0;
    for (int64_t j = 0; j < V; ++j) sum += logits[i * size_t(V) + size_t(j)];
    EXPECT_NEAR(s.mean_logit[i], sum / double(V), 1e-5) << i;  // logits_at gives the capped logits
  }
}

TEST_P(TokenWeighting, EqualWeightsAreNextTokenLossScaled) {
  for (Precision precision : {Precision::F32, Precision::BF16}) {
    auto config = test::tiny_config("llama");
    Decoder d(config, precision, kBatch, kSeq, test::on_backend(GetParam()));
    d.init_random(5, 0.2);
    const auto b = test::random_batch(kBatch, kSeq, config.vocab_size, 42);
    d.params().zero_grads();
    d.forward_backward(b.view(kBatch, kSeq), 0.125);
    const std::vector<float> expected = grads_of(d);
    d.params().zero_grads();
    Scored s;
    FixedWeights same(std::vector<float>(kBatch * kSeq, 0.125f));
    d.forward_backward_weighted(b.view(kBatch, kSeq), s.scores(), s.weights.data(), same);
    EXPECT_EQ(grads_of(d), expected) << (precision == Precision::BF16 ? "bf16" : "fp32");
  }
}

TEST_P(TokenWeighting, AZeroWeightIsAnIgnoredTarget) {
  auto config = test::tiny_config("qwen3");
  Decoder d(config, Precision::F32, kBatch, kSeq, test::on_backend(GetParam()));
  d.init_random(5, 0.2);
  auto b = test::random_batch(kBatch, kSeq, config.vocab_size, 43);
  std::vector<float> w(kBatch * kSeq, 1.0f);
  auto ignored = b;
  for (size_t i = 0; i < w.size(); i += 3) w[i] = 0.0f, ignored.targets[i] = -100;
  d.params().zero_grads();
  d.forward_backward(ignored.view(kBatch, kSeq), 1.0);
  const std::vector<float> expected = grads_of(d);
  d.params().zero_grads();
  Scored s;
  FixedWeights weights(w);
  d.forward_backward_weighted(b.view(kBatch, kSeq), s.scores(), s.weights.data(), weights);
  const std::vector<float> got = grads_of(d);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], expected[i], 1e-6 + 1e-5 * std::abs(expected[i])) << i;
}

INSTANTIATE_TEST_SUITE_P(Backends, TokenWeighting, test::each_backend());

// Weights that differ per sequence (what DPO gives: one coefficient for each of a pair's two
// sequences), against central differences of sum_i w_i * nll_i in the weights' direction.
TEST(TokenWeightingGradient, MatchesFiniteDifferencesOfTheWeightedLoss) {
  auto config = test::tiny_config("llama");
  Decoder d(config, Precision::F32, kBatch, kSeq, test::on_backend("reference"));
  d.init_random(6, 0.2);
  const auto b = test::random_batch(kBatch, kSeq, config.vocab_size, 44);
  std::vector<float> w(kBatch * kSeq);
  for (int64_t i = 0; i < kBatch * kSeq; ++i) w[size_t(i)] = i < kSeq ? 0.7f : -1.3f;  // chosen, rejected
  Scored s;
  FixedWeights weights(w);
  d.params().zero_grads();
  d.forward_backward_weighted(b.view(kBatch, kSeq), s.scores(), s.weights.data(), weights);
  const std::vector<float> g = grads_of(d);
  auto weighted_loss = [&] {
    Scored t;
    d.forward_score(b.view(kBatch, kSeq), t.scores());
    double sum = 0;
    for (size_t i = 0; i < w.size(); ++i) sum += double(w[i]) * t.nll[i];
    return sum;
  };
  // The directional derivative along the gradient itself: large, so float rounding stays small.
  float* x = d.params().weights();
  const int64_t n = d.params().total();
  double g2 = 0;
  for (int64_t i = 0; i < n; ++i) g2 += double(g[size_t(i)]) * double(g[size_t(i)]);
  const double eps = 1e-3 / std::sqrt(g2);
  const std::vector<float> x0(x, x + n);
  for (int64_t i = 0; i < n; ++i) x[i] = float(double(x0[size_t(i)]) + eps * double(g[size_t(i)]));
  d.params().refresh_bf16_copy();
  const double up = weighted_loss();
  for (int64_t i = 0; i < n; ++i) x[i] = float(double(x0[size_t(i)]) - eps * double(g[size_t(i)]));
  d.params().refresh_bf16_copy();
  const double down = weighted_loss();
  std::copy(x0.begin(), x0.end(), x);
  EXPECT_NEAR((up - down) / (2 * eps), g2, 2e-3 * g2);
}

}  // namespace
}  // namespace keel::model
