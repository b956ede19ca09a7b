// ZeRO-3 with one rank (DecoderOptions::cast_per_position): no whole bf16 copy of the weights;
// each position casts its GEMM matrices from the masters into a buffer planned for it. The casts
// are the same bits the whole copy holds, so training (accumulated micro-batches, AdamW with
// clipping, evaluation, logits) must equal the decoder with the whole copy bit for bit, in every
// family, tied or not, with and without checkpointing; a cast made for the wrong position, a
// tensor pointed into the wrong buffer or a buffer reused too early would show here. The plan
// holds two positions' casts instead of the model's copy.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "decoder_test_support.h"
#include "keel/core/error.h"
#include "keel/model/decoder.h"
#include "keel/train/optimizer.h"

namespace keel::model {
namespace {

struct TrainedRun {
  std::vector<double> losses;
  std::vector<float> grads, weights;
  double eval_loss = 0;
  std::vector<float> logits;
};

TrainedRun train(const ModelConfig& config, const DecoderOptions& options, int steps) {
  const int64_t batch = 2, seq = 16;
  Decoder d(config, Precision::BF16, batch, seq, options);
  d.init_random(7, 0.2);
  train::AdamW adamw(d.backend(), d.params(), {0.9, 0.95, 1e-6, 0.1});
  const auto first = test::random_batch(batch, seq, config.vocab_size, 31);
  const auto second = test::random_batch(1, seq - 5, config.vocab_size, 32);
  TrainedRun r;
  for (int step = 1; step <= steps; ++step) {
    d.params().zero_grads();
    r.losses.push_back(d.forward_backward(first.view(batch, seq), 1.0 / 40));
    r.losses.push_back(d.forward_backward(second.view(1, seq - 5), 1.0 / 40));
    if (step == 1) r.grads.assign(d.params().grads(), d.params().grads() + d.params().total());
    // The step reads the masters whole; outside a call no tensor points at a cast.
    if (options.cast_per_position)
      for (const Param& p : d.params().params())
        EXPECT_EQ(d.params().weight_bf16(int(&p - d.params().params().data())), nullptr) << p.name;
    adamw.step(1e-2, step, train::clip_coefficient(train::gradient_norm(d.backend(), d.params()), 1.0));
  }
  r.weights.assign(d.params().weights(), d.params().weights() + d.params().total());
  r.eval_loss = d.forward_loss(first.view(batch, seq));
  const std::vector<int64_t> rows{0, seq + 3};
  r.logits.resize(rows.size() * size_t(config.vocab_size));
  d.logits_at(first.view(batch, seq), rows.data(), int64_t(rows.size()), r.logits.data());
  return r;
}

bool same_bits(const void* a, const void* b, size_t bytes) { return std::memcmp(a, b, bytes) == 0; }

// family, tied embeddings, checkpointing, backend
using Case = std::tuple<const char*, bool, bool, std::string>;
class CastPerPosition : public ::testing::TestWithParam<Case> {};

TEST_P(CastPerPosition, TrainsBitIdenticalToTheWholeBf16Copy) {
  const auto& [family, tied, checkpointing, backend] = GetParam();
  ModelConfig config = test::tiny_config_with_experts(family);
  config.tie_word_embeddings = tied;
  const DecoderOptions whole = test::on_backend(backend, {checkpointing, true, 0});
  DecoderOptions cast = whole;
  cast.cast_per_position = true;
  const TrainedRun a = train(config, whole, 3), b = train(config, cast, 3);
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i)
    EXPECT_TRUE(same_bits(&a.losses[i], &b.losses[i], sizeof(double)))
        << "loss " << i << ": " << a.losses[i] << " vs " << b.losses[i];
  EXPECT_TRUE(same_bits(a.grads.data(), b.grads.data(), a.grads.size() * sizeof(float))) << "first step's gradients";
  EXPECT_TRUE(same_bits(a.weights.data(), b.weights.data(), a.weights.size() * sizeof(float)))
      << "weights after 3 AdamW steps";
  EXPECT_TRUE(same_bits(&a.eval_loss, &b.eval_loss, sizeof(double))) << a.eval_loss << " vs " << b.eval_loss;
  EXPECT_TRUE(same_bits(a.logits.data(), b.logits.data(), a.logits.size() * sizeof(float))) << "logits";
  // Not vacuous: training moved the weights.
  double moved = 0;
  std::vector<float> initial;
  {
    Decoder d(config, Precision::BF16, 2, 16, whole);
    d.init_random(7, 0.2);
    initial.assign(d.params().weights(), d.params().weights() + d.params().total());
  }
  for (size_t i = 0; i < initial.size(); ++i) moved += std::abs(double(a.weights[i]) - initial[i]);
  EXPECT_GT(moved, 0.0);
}

INSTANTIATE_TEST_SUITE_P(Families, CastPerPosition,
                         ::testing::Combine(::testing::Values("llama", "qwen2", "gemma3", "glm", "glm_original", "qwen3_moe", "mixtral", "glm4_moe"),
                                            ::testing::Bool(), ::testing::Bool(), test::each_backend()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param)) + (std::get<1>(info.param) ? "_tied" : "") +
                                  (std::get<2>(info.param) ? "_checkpointing_" : "_") + std::get<3>(info.param);
                         });

// MemoryPlanning::PerTensor (the allocator baseline) keeps the cast buffers across calls like the
// other persistent ones: the same training.
TEST(CastPerPosition, PerTensorPlanningTrainsTheSame) {
  const ModelConfig config = test::tiny_config("qwen3");
  DecoderOptions whole{true, true, 0};
  DecoderOptions cast = whole;
  cast.cast_per_position = true;
  cast.memory_planning = MemoryPlanning::PerTensor;
  const TrainedRun a = train(config, whole, 2), b = train(config, cast, 2);
  EXPECT_TRUE(same_bits(a.weights.data(), b.weights.data(), a.weights.size() * sizeof(float)));
  EXPECT_TRUE(same_bits(&a.eval_loss, &b.eval_loss, sizeof(double)));
}

// The plan: no whole bf16 copy, one cast buffer per position that reads bf16 matrices, at most
// two positions' alive at once; everything else as with the whole copy.
TEST(CastPerPositionPlan, HoldsTwoPositionsCastsInsteadOfTheWholeCopy) {
  ModelConfig config = test::tiny_config("llama");
  config.num_layers = 6;
  DecoderOptions whole{false, true, 0};
  DecoderOptions cast = whole;
  cast.cast_per_position = true;
  const MemoryPlan a = decoder_memory_plan(config, Precision::BF16, 2, 16, whole);
  const MemoryPlan b = decoder_memory_plan(config, Precision::BF16, 2, 16, cast);
  size_t casts = 0, largest = 0, whole_copy = 0;
  for (const auto& buffer : a.buffers())
    if (buffer.name == "weights.bf16") whole_copy = buffer.bytes;
  for (const auto& buffer : b.buffers()) {
    EXPECT_NE(buffer.name, "weights.bf16");
    if (buffer.name.rfind("weights.bf16.cast", 0) == 0) {
      ++casts;
      largest = std::max(largest, buffer.bytes);
    }
  }
  ASSERT_GT(whole_copy, 0u);
  EXPECT_EQ(casts, size_t(2 * config.num_layers + 1)) << "each block forward and backward, and the head";
  const size_t at_peak = b.category_bytes_at_peak(MemoryCategory::ComputeWeights);
  EXPECT_GT(at_peak, 0u);
  EXPECT_LE(at_peak, 2 * largest);
  EXPECT_LT(at_peak, whole_copy);
  EXPECT_EQ(a.category_bytes_at_peak(MemoryCategory::MasterWeights),
            b.category_bytes_at_peak(MemoryCategory::MasterWeights));
  EXPECT_LT(b.total_bytes(), a.total_bytes());

  // fp32 has no bf16 copy to drop: the option changes nothing there.
  EXPECT_EQ(decoder_memory_plan(config, Precision::F32, 2, 16, whole).total_bytes(),
            decoder_memory_plan(config, Precision::F32, 2, 16, cast).total_bytes());
  // Not with sharding or LoRA (their own gathers, or a frozen base that is the bf16 copy).
  DecoderOptions lora = cast;
  lora.lora.rank = 4;
  EXPECT_THROW(decoder_memory_plan(config, Precision::BF16, 2, 16, lora), Error);
  DecoderOptions sharded = cast;
  sharded.optimizer_shards = 2;
  EXPECT_THROW(decoder_memory_plan(config, Precision::BF16, 2, 16, sharded), Error);
}

}  // namespace
}  // namespace keel::model
