// The fused LM head and loss run over chunks of tokens (Decoder::lm_head_loss): each chunk's
// logits are made, turned into their gradient in place and pushed back through the head before
// the next chunk. How many tokens a chunk holds is a memory/speed choice (the recipe's
// lm_head_chunk_tokens), never a numerical one: the loss and every gradient must come out the same
// whether the tokens go through in one chunk or in many uneven ones, and the plan must hold
// exactly the chunk the step uses.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "decoder_test_support.h"
#include "keel/model/decoder.h"

namespace keel::model {
namespace {

using test::random_batch;

// The largest difference between two gradients, relative to the larger's largest magnitude.
double relative_difference(const float* a, const float* b, int64_t n) {
  double diff = 0, scale = 0;
  for (int64_t i = 0; i < n; ++i) {
    diff = std::max(diff, double(std::abs(a[i] - b[i])));
    scale = std::max({scale, double(std::abs(a[i])), double(std::abs(b[i]))});
  }
  return scale > 0 ? diff / scale : diff;
}

// Gemma 2 soft-caps its logits inside the chunked loss; Llama does not.
class LmHeadChunks : public ::testing::TestWithParam<std::tuple<const char*, std::string>> {};

void expect_same_as_one_chunk(const std::string& family, const std::string& backend, Precision precision) {
  const auto config = test::tiny_config(family);
  const int64_t batch = 2, seq = 24;  // 48 tokens: one chunk by keel's choice
  DecoderOptions one_chunk = test::on_backend(backend), chunks_of_7 = test::on_backend(backend);
  chunks_of_7.lm_head_chunk_tokens = 7;  // 48 tokens in 7 chunks of 7 and 6, the second micro-batch in 3
  Decoder whole(config, precision, batch, seq, one_chunk);
  Decoder chunked(config, precision, batch, seq, chunks_of_7);
  whole.init_random(5, 0.2);
  chunked.init_random(5, 0.2);

  const auto first = random_batch(batch, seq, config.vocab_size, 1);
  const auto second = random_batch(1, seq - 5, config.vocab_size, 2);  // shorter than planned
  double loss_whole = 0, loss_chunked = 0;
  for (auto* d : {&whole, &chunked}) d->params().zero_grads();
  loss_whole += whole.forward_backward(first.view(batch, seq), 1.0 / 67);
  loss_chunked += chunked.forward_backward(first.view(batch, seq), 1.0 / 67);
  loss_whole += whole.forward_backward(second.view(1, seq - 5), 1.0 / 67);
  loss_chunked += chunked.forward_backward(second.view(1, seq - 5), 1.0 / 67);

  // The same to fp32's rounding: a GEMM library picks its kernel and blocking by the product's
  // shape, so a token's logits may round differently in a chunk of 7 rows than in one of 48 (oneDNN
  // on AVX2 does: 6e-7 of a loss of 308), and the head's weight gradient is summed over chunks in
  // fp32. A chunk that lost, repeated or misplaced tokens would be off by far more.
  EXPECT_NEAR(loss_whole, loss_chunked, 1e-6 * std::abs(loss_whole)) << family;
  const double tolerance = precision == Precision::F32 ? 1e-5 : 1e-3;
  double checked = 0;
  for (const auto& p : whole.params().params()) {
    const int i = int(&p - whole.params().params().data());
    EXPECT_LE(relative_difference(whole.params().grad(i), chunked.params().grad(i), p.numel), tolerance)
        << family << ": gradient of " << p.name;
    for (int64_t k = 0; k < p.numel; ++k) checked += std::abs(whole.params().grad(i)[k]);
  }
  EXPECT_GT(checked, 0.0);  // the comparison is not vacuous

  // The plan holds the chunk the step runs: 7 rows of logits, in fp32 and in bf16.
  auto bytes_of = [](const MemoryPlan& plan, const std::string& name) {
    for (const auto& b : plan.buffers())
      if (b.name == name) return b.bytes;
    ADD_FAILURE() << "no buffer " << name;
    return size_t(0);
  };
  const MemoryPlan plan = decoder_memory_plan(config, precision, batch, seq, chunks_of_7);
  EXPECT_EQ(bytes_of(plan, "lm_head.logits"), sizeof(float) * 7 * size_t(config.vocab_size));
  EXPECT_EQ(chunked.memory_plan().buffers().size(), plan.buffers().size());
}

TEST_P(LmHeadChunks, LossAndGradientsDoNotDependOnTheChunkInFp32) {
  const auto& [family, backend] = GetParam();
  expect_same_as_one_chunk(family, backend, Precision::F32);
}

TEST_P(LmHeadChunks, LossAndGradientsDoNotDependOnTheChunkInBf16) {
  const auto& [family, backend] = GetParam();
  expect_same_as_one_chunk(family, backend, Precision::BF16);
}

INSTANTIATE_TEST_SUITE_P(Families, LmHeadChunks,
                         ::testing::Combine(::testing::Values("llama", "gemma2"), test::each_backend()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param)) + "_" + std::get<1>(info.param);
                         });

// keel's choice: at least 512 tokens whatever the vocabulary (a 152K vocabulary got 55 before,
// where the head's products run far below the GEMM's speed), all of a smaller micro-batch, more
// for a small vocabulary, and chunks of equal size.
TEST(LmHeadChunkChoice, AtLeast512TokensEqualChunksAllOfASmallBatch) {
  auto config = test::tiny_config("llama");
  auto rows = [&](int64_t vocab, int64_t batch, int64_t seq, int64_t requested = 0) {
    config.vocab_size = vocab;
    DecoderOptions options;
    options.lm_head_chunk_tokens = requested;
    const MemoryPlan plan = decoder_memory_plan(config, Precision::BF16, batch, seq, options);
    for (const auto& b : plan.buffers())
      if (b.name == "lm_head.logits") return int64_t(b.bytes / sizeof(float)) / vocab;
    ADD_FAILURE() << "no logits buffer";
    return int64_t(0);
  };
  EXPECT_EQ(rows(151552, 2, 1024), 512);     // GLM-4's vocabulary, the bench micro-batch
  EXPECT_EQ(rows(32000, 2, 1024), 512);      // Llama 2's
  EXPECT_EQ(rows(32000, 1, 300), 300);       // a micro-batch under 512 tokens: one chunk
  EXPECT_EQ(rows(32000, 3, 500), 500);       // 1,500 tokens: three equal chunks, not 512 + 512 + 476
  EXPECT_EQ(rows(1024, 4, 4096), 8192);      // a small vocabulary: up to 32 MiB of fp32 logits
  EXPECT_EQ(rows(32000, 2, 1024, 100), 98);  // asked for 100: 21 chunks of 98 (the last 88)
}

}  // namespace
}  // namespace keel::model
