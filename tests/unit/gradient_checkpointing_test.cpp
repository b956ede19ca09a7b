// Gradient checkpointing recomputes each block inside the backward pass from its saved input;
// the recomputation runs the same kernels on the same input, so every gradient must equal the
// stored-activation run bit for bit (memcmp), in every family, with and without q/k/v biases,
// across accumulated micro-batches and optimizer-free repeated steps.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "keel/model/decoder.h"
#include "keel/run/model_setup.h"
#include "decoder_test_support.h"

namespace keel::model {
namespace {

using test::Batch;
using test::random_batch;

ModelConfig tiny(const std::string& family, bool qkv_bias) { return test::tiny_config(family, qkv_bias); }

void expect_identical_gradients(const std::string& family, bool qkv_bias, Precision precision,
                                const std::string& backend) {
  const auto config = tiny(family, qkv_bias);
  const int64_t batch = 2, seq = 24;
  Decoder stored(config, precision, batch, seq, test::on_backend(backend, {false, true, 0}));
  Decoder recomputed(config, precision, batch, seq, test::on_backend(backend, {true, true, 0}));
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
