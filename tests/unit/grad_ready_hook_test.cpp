// The decoder's grad-ready hook (data parallel starts a bucket's allreduce from it during the
// backward pass) must report every parameter exactly once, and only once its gradient is final:
// the gradient seen at the hook equals the gradient after forward_backward returns, bit for bit.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "keel/model/decoder.h"
#include "keel/recipe/model_setup.h"
#include "decoder_test_support.h"

namespace keel::model {
namespace {

void expect_hook_sees_final_gradients(const std::string& family, bool tied, bool checkpointing,
                                      const std::string& backend) {
  recipe::ScratchModel m;
  m.family = family;
  m.vocab_size = 61;
  m.hidden_size = 32;
  m.intermediate_size = 48;
  m.num_layers = 3;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.tie_word_embeddings = tied;
  const auto config = recipe::scratch_model_config(m);
  const int64_t batch = 2, seq = 16;
  Decoder decoder(config, Precision::F32, batch, seq, test::on_backend(backend, {checkpointing, true, 0}));
  decoder.init_random(3, 0.2);
  ParamStore& params = decoder.params();
  const int n = int(params.params().size());

  std::vector<int> calls(size_t(n), 0), order;
  std::vector<std::vector<float>> at_hook(static_cast<size_t>(n));
  uint64_t last_event = 0;
  decoder.set_grad_ready_hook([&](int p, ComputeEvent written) {
    EXPECT_GT(written.sequence, last_event) << "events are recorded in the order the gradients finish";
    last_event = written.sequence;
    ASSERT_GE(p, 0);
    ASSERT_LT(p, n);
    ++calls[size_t(p)];
    order.push_back(p);
    const float* g = params.grad(p);
    at_hook[size_t(p)].assign(g, g + params.param(p).numel);
  });

  std::mt19937 rng(5);
  std::vector<int32_t> ids, targets, positions;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < seq; ++t) {
      ids.push_back(int32_t(rng() % config.vocab_size));
      targets.push_back(t + 1 < seq ? int32_t(rng() % config.vocab_size) : -100);
      positions.push_back(int32_t(t));
    }
  params.zero_grads();
  decoder.forward_backward(MicroBatch{batch, seq, ids.data(), targets.data(), positions.data(), nullptr}, 0.01);

  for (int p = 0; p < n; ++p) {
    SCOPED_TRACE(params.param(p).name);
    ASSERT_EQ(calls[size_t(p)], 1);
    const float* g = params.grad(p);
    ASSERT_EQ(std::memcmp(at_hook[size_t(p)].data(), g, sizeof(float) * size_t(params.param(p).numel)), 0)
        << "the gradient changed after the hook reported it final";
  }
  // Buckets are cut in reverse parameter order; the embedding (first parameter) comes last.
  EXPECT_EQ(order.back(), decoder.ids().embed);
}

class GradReadyHook : public ::testing::TestWithParam<std::string> {};

TEST_P(GradReadyHook, ReportsEachParameterOnceWhenFinal) {
  for (const char* family : {"llama", "qwen2", "glm", "glm_original", "qwen3", "mistral", "gemma2", "gemma3"})
    for (bool checkpointing : {false, true}) {
      SCOPED_TRACE(std::string(family) + (checkpointing ? " checkpointing" : ""));
      expect_hook_sees_final_gradients(family, false, checkpointing, GetParam());
    }
}

TEST_P(GradReadyHook, TiedEmbeddingIsReportedAfterTheEmbeddingBackward) {
  expect_hook_sees_final_gradients("qwen2", true, false, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Backends, GradReadyHook, test::each_backend(), [](const auto& info) { return info.param; });

}  // namespace
}  // namespace keel::model
