// A training step without a zeroing pass over the gradients (ParamStore::begin_gradient_step):
// each tensor's first gradient write of the step overwrites. Against the zeroing path
// (zero_grads, then every write accumulates) the gradients must be equal bit for bit, in every
// family and precision, across accumulated micro-batches and several steps — with the gradient
// buffer filled with NaN before each step, so a tensor the backward pass forgot to overwrite
// shows; with tied embeddings (the LM head's GEMM writes first, the embedding's scatter adds) and
// with gradient checkpointing. The store's own rules are checked on an owned store. (ZeRO-2's
// staging and LoRA's adapter never enable overwriting: ParamStore::overwrite_first_gradient_writes
// refuses a staged store, and the decoder enables it only without LoRA.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "decoder_test_support.h"
#include "keel/model/decoder.h"

namespace keel::model {
namespace {

using test::random_batch;

struct Case {
  const char* family;
  bool qkv_bias, tied, checkpointing;
};

void expect_same_gradients(const Case& k, Precision precision) {
  const std::string family = k.family;
  auto config = test::tiny_config(family, k.qkv_bias);
  config.tie_word_embeddings = k.tied;
  const int64_t batch = 2, seq = 24;
  Decoder zeroing(config, precision, batch, seq, test::on_backend("cpu", {k.checkpointing, true, 0}));
  Decoder overwriting(config, precision, batch, seq, test::on_backend("cpu", {k.checkpointing, true, 0}));
  zeroing.init_random(11, 0.2);
  overwriting.init_random(11, 0.2);
  ParamStore &z = zeroing.params(), &o = overwriting.params();
  const int64_t total = z.total();
  for (int step = 1; step <= 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    // What a previous step (or anything else) left behind must not matter.
    std::fill_n(o.grads(), total, std::numeric_limits<float>::quiet_NaN());
    z.zero_grads();
    o.begin_gradient_step();
    const auto first = random_batch(batch, seq, config.vocab_size, 10 * step + 1);
    const auto second = random_batch(1, seq - 5, config.vocab_size, 10 * step + 2);
    for (Decoder* d : {&zeroing, &overwriting}) {
      d->forward_backward(first.view(batch, seq), 1.0 / 40);
      d->forward_backward(second.view(1, seq - 5), 1.0 / 40);
    }
    for (const auto& p : z.params()) {
      const int i = int(&p - z.params().data());
      ASSERT_EQ(std::memcmp(z.grad(i), o.grad(i), sizeof(float) * size_t(p.numel)), 0)
          << family << ": the gradient of " << p.name << " differs (NaN: never overwritten)";
    }
    double sum = 0;
    for (int64_t i = 0; i < total; ++i) sum += std::abs(z.grads()[i]);
    ASSERT_GT(sum, 0.0) << "the comparison is not vacuous";
  }
}

class GradientOverwrite : public ::testing::TestWithParam<Case> {};

TEST_P(GradientOverwrite, EqualsZeroingInFp32) { expect_same_gradients(GetParam(), Precision::F32); }
TEST_P(GradientOverwrite, EqualsZeroingInBf16) { expect_same_gradients(GetParam(), Precision::BF16); }

INSTANTIATE_TEST_SUITE_P(Families, GradientOverwrite,
                         ::testing::Values(Case{"llama", false, false, false}, Case{"qwen2", true, false, false},
                                           Case{"qwen3", false, false, false}, Case{"mistral", false, false, false},
                                           Case{"gemma2", false, false, false}, Case{"gemma3", false, false, false},
                                           Case{"glm", true, false, false}, Case{"glm_original", false, false, false},
                                           Case{"llama", false, true, false}, Case{"gemma2", false, true, true},
                                           Case{"qwen3", false, false, true}),
                         [](const auto& info) {
                           const Case& k = info.param;
                           return std::string(k.family) + (k.tied ? "_tied" : "") +
                                  (k.checkpointing ? "_checkpointing" : "");
                         });

// A store that has not enabled overwriting (an owned one here) zeroes in begin_gradient_step, and
// zero_grads makes every later write accumulate.
TEST(GradientOverwriteStore, WithoutOverwritingBeginZeroes) {
  ParamStore store;
  store.add("w", {4, 8}, true);
  store.add("b", {8}, false);
  store.allocate(false);
  std::fill_n(store.grads(), store.total(), 3.0f);
  store.begin_gradient_step();
  for (int64_t i = 0; i < store.total(); ++i) ASSERT_EQ(store.grads()[i], 0.0f);
  EXPECT_FALSE(store.first_gradient_write(0));
  std::fill_n(store.grads(), store.total(), 3.0f);
  store.overwrite_first_gradient_writes(true);  // zeroes the whole buffer once, padding included
  for (int64_t i = 0; i < store.total(); ++i) ASSERT_EQ(store.grads()[i], 0.0f);
  store.begin_gradient_step();
  EXPECT_TRUE(store.first_gradient_write(0));
  EXPECT_FALSE(store.first_gradient_write(0));
  store.grads()[0] = 5.0f;  // tensor 0 written this step, tensor 1 not
  store.grads()[store.param(1).offset] = 7.0f;
  store.begin_gradient_step();
  EXPECT_EQ(store.grads()[0], 5.0f) << "a tensor written last step is overwritten by its next write, not zeroed";
  EXPECT_EQ(store.grads()[store.param(1).offset], 0.0f) << "a tensor no pass wrote is zeroed";
  store.zero_grads();
  EXPECT_FALSE(store.first_gradient_write(1)) << "after zero_grads every write accumulates";
}

}  // namespace
}  // namespace keel::model
