// keel generate's bf16 weights (model/generator.h): a Generator reading bf16 roundings of the
// projections gives the logits a fp32 Generator gives for the model whose projections were rounded
// beforehand — the same products, summed in another order — for the prompt (widened weights, one
// GEMM) and for each generated token (gemv_bf16); and not the unrounded model's logits, so a
// generator that ignored the option would fail. tests/reference/generate_reference.py checks the
// tokens against PyTorch on the rounded model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "decoder_test_support.h"
#include "keel/model/generator.h"

namespace keel::model {
namespace {

class GeneratorOnBackend : public ::testing::TestWithParam<std::string> {};

// The largest |a - b| over the largest |b|.
double relative_distance(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - double(b[i])));
    scale = std::max(scale, std::abs(double(b[i])));
  }
  return diff / scale;
}

TEST_P(GeneratorOnBackend, Bf16WeightsAreTheRoundedModel) {
  for (const std::string family : {"llama", "qwen3", "gemma2"}) {
    const ModelConfig config = test::tiny_config(family);
    Decoder plain(config, Precision::F32, 1, 2, test::on_backend(GetParam()));
    plain.init_random(7, 0.2);
    Decoder rounded(config, Precision::F32, 1, 2, test::on_backend(GetParam()));
    rounded.init_random(7, 0.2);
    auto& P = rounded.params();
    std::vector<int> projections{rounded.ids().lm_head};
    for (const auto& l : rounded.ids().layers)
      projections.insert(projections.end(), {l.qkv_weight, l.o_weight, l.gate_up_weight, l.down_weight});
    for (int id : projections)
      for (int64_t i = 0; i < P.param(id).numel; ++i) P.weight(id)[i] = bf16_to_float(float_to_bf16(P.weight(id)[i]));

    Generator bf16(plain, 16, GenerationWeights::Bf16), exact(rounded, 16), unrounded(plain, 16);
    const std::vector<int32_t> prompt{5, 17, 42, 8, 60};
    const int32_t next = 33;
    for (int phase = 0; phase < 2; ++phase) {  // the prompt, then one generated token
      const int32_t* ids = phase == 0 ? prompt.data() : &next;
      const int64_t n = phase == 0 ? int64_t(prompt.size()) : 1, at = phase == 0 ? 0 : int64_t(prompt.size());
      const std::vector<float> got = bf16.feed(ids, n, at);
      const std::vector<float> want = exact.feed(ids, n, at);
      const std::vector<float> other = unrounded.feed(ids, n, at);
      const double to_rounded = relative_distance(got, want), to_unrounded = relative_distance(got, other);
      // Summation order only (2.4e-6 measured with oneDNN's AVX-512 BF16 kernels, less elsewhere).
      EXPECT_LT(to_rounded, 5e-6) << family << " phase " << phase;
      EXPECT_GT(to_unrounded, 50 * to_rounded) << family << " phase " << phase << ": the weights were not rounded";
      EXPECT_GT(to_unrounded, 1e-4) << family << " phase " << phase;
    }
  }
}

// min_new_tokens (transformers' meaning): the stop ids cannot be chosen before that many tokens.
TEST_P(GeneratorOnBackend, MinNewTokensHoldsBackTheStopIds) {
  const ModelConfig config = test::tiny_config("llama");
  Decoder d(config, Precision::F32, 1, 2, test::on_backend(GetParam()));
  d.init_random(7, 0.2);
  const std::vector<int32_t> prompt{5, 17, 42};
  SamplingOptions o;
  o.max_new_tokens = 4;
  const std::vector<int32_t> free_run = Generator(d, 16).generate(prompt, o);
  ASSERT_EQ(free_run.size(), 4u);
  o.stop_ids = {free_run[0]};  // the greedy first token, made a stop id
  EXPECT_EQ(Generator(d, 16).generate(prompt, o), std::vector<int32_t>{free_run[0]});
  o.min_new_tokens = 2;
  const std::vector<int32_t> held = Generator(d, 16).generate(prompt, o);
  ASSERT_GE(held.size(), 2u);
  EXPECT_NE(held[0], free_run[0]);
  EXPECT_NE(held[1], free_run[0]);
}

INSTANTIATE_TEST_SUITE_P(Backends, GeneratorOnBackend, test::each_backend());

}  // namespace
}  // namespace keel::model
