// memory_planning = "per_tensor" (MemoryPlanning::PerTensor) moves every activation and scratch
// buffer out of the arena into allocations of its own made at each call; the kernels see the
// same data in other places, so losses, gradients, evaluation losses and logits must equal the
// planned arena's bit for bit (memcmp), in fp32 and bf16, with and without checkpointing.
#include <gtest/gtest.h>

#include <cmath>
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

ModelConfig tiny(const std::string& family) { return test::tiny_config(family); }

template <typename T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

void expect_identical(const std::string& family, Precision precision, bool checkpointing, const std::string& backend) {
  const auto config = tiny(family);
  const int64_t batch = 2, seq = 24;
  DecoderOptions planned_options = test::on_backend(backend, {checkpointing, true, 0, MemoryPlanning::Planned});
  DecoderOptions per_tensor_options = planned_options;
  per_tensor_options.memory_planning = MemoryPlanning::PerTensor;
  Decoder planned(config, precision, batch, seq, planned_options);
  Decoder per_tensor(config, precision, batch, seq, per_tensor_options);
  planned.init_random(11, 0.2);
  per_tensor.init_random(11, 0.2);
  // Only what lives across steps is in the per-tensor arena.
  EXPECT_LT(per_tensor.arena_bytes(), planned.arena_bytes());
  size_t persistent = 0;
  for (const auto& b : planned.memory_plan().buffers())
    if (b.category == MemoryCategory::MasterWeights || b.category == MemoryCategory::ComputeWeights ||
        b.category == MemoryCategory::Gradients || b.category == MemoryCategory::OptimizerState)
      persistent += b.aligned_bytes;
  EXPECT_EQ(per_tensor.arena_bytes(), persistent);

  const size_t bytes = sizeof(float) * size_t(planned.params().total());
  const auto first = random_batch(batch, seq, config.vocab_size, 1);
  const auto second = random_batch(1, seq - 5, config.vocab_size, 2);
  // Two optimizer-free steps of two accumulated micro-batches each: the second step's transient
  // buffers in the planned arena hold the first step's leftovers, the per-tensor ones fresh memory.
  for (int step = 0; step < 2; ++step) {
    for (auto* d : {&planned, &per_tensor}) d->params().zero_grads();
    for (const auto* b : {&first, &second}) {
      const int64_t rows = b == &first ? batch : 1, len = b == &first ? seq : seq - 5;
      const double a = planned.forward_backward(b->view(rows, len), 1.0 / 40);
      const double c = per_tensor.forward_backward(b->view(rows, len), 1.0 / 40);
      EXPECT_TRUE(same_bits(a, c)) << family << " step " << step << ": loss " << a << " vs " << c;
    }
    EXPECT_EQ(std::memcmp(planned.params().grads(), per_tensor.params().grads(), bytes), 0) << family;
    for (const auto& p : planned.params().params()) {
      const int i = int(&p - planned.params().params().data());
      if (std::memcmp(planned.params().grad(i), per_tensor.params().grad(i), sizeof(float) * p.numel) != 0) {
        ADD_FAILURE() << family << ": gradient of " << p.name << " differs";
        break;
      }
    }
  }
  double sum = 0;
  for (int64_t i = 0; i < planned.params().total(); ++i) sum += std::abs(planned.params().grads()[i]);
  EXPECT_GT(sum, 0.0);  // the comparison is not vacuous

  const double la = planned.forward_loss(first.view(batch, seq));
  const double lb = per_tensor.forward_loss(first.view(batch, seq));
  EXPECT_TRUE(same_bits(la, lb)) << la << " vs " << lb;
  const int64_t rows[] = {0, 7, 23, 30};
  std::vector<float> xa(4 * config.vocab_size), xb(4 * config.vocab_size);
  planned.logits_at(first.view(batch, seq), rows, 4, xa.data());
  per_tensor.logits_at(first.view(batch, seq), rows, 4, xb.data());
  EXPECT_EQ(std::memcmp(xa.data(), xb.data(), sizeof(float) * xa.size()), 0);
}

// family, backend
class PerTensorMemory : public ::testing::TestWithParam<std::tuple<const char*, std::string>> {
 protected:
  void expect(Precision precision, bool checkpointing) {
    expect_identical(std::get<0>(GetParam()), precision, checkpointing, std::get<1>(GetParam()));
  }
};

TEST_P(PerTensorMemory, BitIdenticalToPlannedInFp32) { expect(Precision::F32, false); }
TEST_P(PerTensorMemory, BitIdenticalToPlannedInBf16) { expect(Precision::BF16, false); }
TEST_P(PerTensorMemory, BitIdenticalToPlannedWithCheckpointing) { expect(Precision::BF16, true); }

INSTANTIATE_TEST_SUITE_P(Families, PerTensorMemory,
                         ::testing::Combine(::testing::Values("llama", "qwen2", "glm", "qwen3", "mistral", "gemma2", "gemma3"), test::each_backend()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param)) + "_" + std::get<1>(info.param);
                         });

TEST(PerTensorMemoryErrors, BadBatchLeavesTheDecoderUsable) {
  const auto config = tiny("llama");
  DecoderOptions options;
  options.memory_planning = MemoryPlanning::PerTensor;
  Decoder d(config, Precision::F32, 1, 8, options);
  d.init_random(3);
  auto b = random_batch(1, 8, config.vocab_size, 4);
  b.ids[3] = int32_t(config.vocab_size);  // out of range: rejected before any allocation is used
  EXPECT_THROW(d.forward_loss(b.view(1, 8)), Error);
  b.ids[3] = 1;
  EXPECT_TRUE(std::isfinite(d.forward_loss(b.view(1, 8))));
}

}  // namespace
}  // namespace keel::model
