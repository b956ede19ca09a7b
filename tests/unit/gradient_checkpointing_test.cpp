// Gradient checkpointing recomputes each block inside the backward pass from its saved input;
// the recomputation runs the same kernels on the same input, so every gradient must equal the
// stored-activation run bit for bit (memcmp), in every family, with and without q/k/v biases,
// across accumulated micro-batches and optimizer-free repeated steps; and so must a run where
// only the first blocks recompute (checkpointing_layers), whose stored and recomputed blocks
// share the step.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "keel/core/error.h"
#include "keel/model/decoder.h"
#include "keel/recipe/model_setup.h"
#include "decoder_test_support.h"

namespace keel::model {
namespace {

using test::Batch;
using test::random_batch;

ModelConfig tiny(const std::string& family, bool qkv_bias) { return test::tiny_config(family, qkv_bias); }

void expect_identical_gradients(const std::string& family, bool qkv_bias, Precision precision,
                                const std::string& backend, int64_t checkpointing_layers = 0) {
  const auto config = tiny(family, qkv_bias);
  const int64_t batch = 2, seq = 24;
  Decoder stored(config, precision, batch, seq, test::on_backend(backend, {false, true, 0}));
  DecoderOptions checkpointed;
  checkpointed.gradient_checkpointing = true;
  checkpointed.optimizer_state = true;
  checkpointed.checkpointing_layers = checkpointing_layers;
  Decoder recomputed(config, precision, batch, seq, test::on_backend(backend, checkpointed));
  stored.init_random(11, 0.2);
  recomputed.init_random(11, 0.2);
  ASSERT_EQ(stored.params().total(), recomputed.params().total());
  const size_t bytes = sizeof(float) * size_t(stored.params().total());

  // Two accumulated micro-batches, the second one shorter than the planned sequence.
  const auto first = random_batch(batch, seq, config.vocab_size, 1);
  const auto second = random_batch(1, seq - 5, config.vocab_size, 2);
  for (auto* d : {&stored, &recomputed}) d->params().zero_grads();
  const double loss_a = stored.forward_backward(first.view(batch, seq), 1.0 / 40);
  const double loss_b = recomputed.forward_backward(first.view(batch, seq), 1.0 / 40);
  EXPECT_EQ(std::memcmp(&loss_a, &loss_b, sizeof loss_a), 0) << loss_a << " vs " << loss_b;
  stored.forward_backward(second.view(1, seq - 5), 1.0 / 40);
  recomputed.forward_backward(second.view(1, seq - 5), 1.0 / 40);

  EXPECT_EQ(std::memcmp(stored.params().grads(), recomputed.params().grads(), bytes), 0);
  // Name the first parameter that differs, if any.
  for (const auto& p : stored.params().params()) {
    const int i = int(&p - stored.params().params().data());
    if (std::memcmp(stored.params().grad(i), recomputed.params().grad(i), sizeof(float) * p.numel) != 0) {
      ADD_FAILURE() << family << ": gradient of " << p.name << " differs";
      break;
    }
  }
  // Some gradient is non-zero: the comparison is not vacuous.
  double sum = 0;
  for (int64_t i = 0; i < stored.params().total(); ++i) sum += std::abs(stored.params().grads()[i]);
  EXPECT_GT(sum, 0.0);
}

// (family, q/k/v bias), backend
using Case = std::tuple<std::tuple<const char*, bool>, std::string>;
class GradientCheckpointing : public ::testing::TestWithParam<Case> {
 protected:
  void expect_identical(Precision precision) {
    const auto& [model, backend] = GetParam();
    expect_identical_gradients(std::get<0>(model), std::get<1>(model), precision, backend);
  }
};

TEST_P(GradientCheckpointing, GradientsAreBitIdenticalInFp32) { expect_identical(Precision::F32); }
TEST_P(GradientCheckpointing, GradientsAreBitIdenticalInBf16) { expect_identical(Precision::BF16); }
TEST_P(GradientCheckpointing, EveryBlockRecomputedGradientsAreBitIdenticalInBf16) {
  const auto& [model, backend] = GetParam();
  expect_identical_gradients(std::get<0>(model), std::get<1>(model), Precision::BF16, backend, 3);
}
TEST_P(GradientCheckpointing, FirstBlocksOnlyGradientsAreBitIdenticalInBf16) {
  const auto& [model, backend] = GetParam();
  // tiny_config has 3 blocks: block 0 recomputes, blocks 1 and 2 keep their intermediates.
  expect_identical_gradients(std::get<0>(model), std::get<1>(model), Precision::BF16, backend, 1);
}

INSTANTIATE_TEST_SUITE_P(Families, GradientCheckpointing,
                         ::testing::Combine(
                             // Llama never has q/k/v biases, Qwen2 always; the GLM formats either way.
                             ::testing::Values(std::tuple{"llama", false}, std::tuple{"qwen2", true}, std::tuple{"qwen3", false},
                                               std::tuple{"mistral", false}, std::tuple{"gemma2", false},
                                               std::tuple{"gemma3", false},
                                               std::tuple{"glm", false}, std::tuple{"glm", true},
                                               std::tuple{"glm_original", false}, std::tuple{"glm_original", true}),
                             test::each_backend()),
                         [](const auto& info) {
                           const auto& model = std::get<0>(info.param);
                           return std::string(std::get<0>(model)) + (std::get<1>(model) ? "_qkv_bias_" : "_no_bias_") +
                                  std::get<1>(info.param);
                         });

// Each block that keeps its intermediates adds them to the peak at the LM head: the plan grows as
// fewer blocks recompute, from all of them (below none) to none. The last block is the exception
// (blocks 0 and 1 recompute, 2 keeps its own): its backward runs first, where a recomputed block
// also holds its fp32 GEMM inputs beside the gradient scratch, so keeping it can cost no more;
// keel's own choice (checkpointing_layers 0) keeps it then.
TEST(GradientCheckpointingPlan, PeakGrowsWithEveryBlockThatDoesNotRecompute) {
  const auto config = tiny("llama", false);
  ASSERT_EQ(config.num_layers, 3);
  auto options = [](bool checkpointing, int64_t layers) {
    DecoderOptions o;
    o.gradient_checkpointing = checkpointing;
    o.optimizer_state = true;
    o.checkpointing_layers = layers;
    return o;
  };
  auto peak = [&](bool checkpointing, int64_t layers) {
    return decoder_memory_plan(config, Precision::BF16, 2, 128, options(checkpointing, layers)).peak_live_bytes();
  };
  const size_t all = peak(true, 3), none = peak(false, 0);
  EXPECT_LE(peak(true, 2), all);
  EXPECT_LT(peak(true, 2), peak(true, 1));
  EXPECT_LT(peak(true, 1), none);
  EXPECT_LT(all, none);
  // Left to keel (0), the last block keeps its intermediates when the plan says that costs no
  // more than recomputing it, as here; a count given is kept.
  ASSERT_LE(peak(true, 2), peak(true, 3));
  EXPECT_EQ(Decoder(config, Precision::BF16, 2, 128, options(true, 0)).recomputed_blocks(), 2);
  EXPECT_EQ(Decoder(config, Precision::BF16, 2, 128, options(true, 3)).recomputed_blocks(), 3);
  EXPECT_EQ(Decoder(config, Precision::BF16, 2, 128, options(false, 0)).recomputed_blocks(), 0);
  EXPECT_EQ(decoder_memory_plan(config, Precision::BF16, 2, 128, options(true, 0)).peak_live_bytes(), peak(true, 2));
  // A count the model does not have, or one without checkpointing, is refused.
  EXPECT_THROW({ Decoder d(config, Precision::BF16, 1, 8, options(true, 4)); }, keel::Error);
  EXPECT_THROW({ Decoder d(config, Precision::BF16, 1, 8, options(false, 1)); }, keel::Error);
}

class GradientCheckpointingLoss : public ::testing::TestWithParam<std::string> {};

TEST_P(GradientCheckpointingLoss, EvaluationAndLogitsAgree) {
  const auto config = tiny("glm", true);
  Decoder stored(config, Precision::F32, 1, 16, test::on_backend(GetParam(), {false, false, 0}));
  Decoder recomputed(config, Precision::F32, 1, 16, test::on_backend(GetParam(), {true, false, 0}));
  stored.init_random(5);
  recomputed.init_random(5);
  const auto b = random_batch(1, 16, config.vocab_size, 3);
  EXPECT_EQ(stored.forward_loss(b.view(1, 16)), recomputed.forward_loss(b.view(1, 16)));
  const int64_t rows[] = {0, 7, 15};
  std::vector<float> la(3 * config.vocab_size), lb(3 * config.vocab_size);
  stored.logits_at(b.view(1, 16), rows, 3, la.data());
  recomputed.logits_at(b.view(1, 16), rows, 3, lb.data());
  EXPECT_EQ(std::memcmp(la.data(), lb.data(), sizeof(float) * la.size()), 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, GradientCheckpointingLoss, test::each_backend(),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace keel::model
