// Backend agreement: every family trains a few steps on the CPU backend and on the reference
// backend (double precision on scalar loops, kernels/backend.h) from the same weights and
// batches, and they must agree: per-step losses and gradient norms, and the final weights. In
// fp32 the only difference is rounding (fp32 sums in oneDNN's order against double sums rounded
// once); in bf16 both round the GEMM inputs to bf16, and the CPU backend also rounds attention's
// probabilities, so the bound is bf16's.
//
// Each tolerance is checked against the distance the run itself covers (weights moved from their
// initial values, losses from step to step), so that a backend ignoring an operation cannot pass.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "decoder_test_support.h"
#include "keel/kernels/backend.h"
#include "keel/model/decoder.h"
#include "keel/train/optimizer.h"

namespace keel::model {
namespace {

struct Trace {
  std::vector<double> losses, grad_norms;
  std::vector<float> initial, first_grads, final_weights;
  std::vector<std::pair<std::string, FlatRange>> params;  // name, place in the flat buffers
};

// Two documents packed into each row (segments), a shorter second micro-batch, AdamW with weight
// decay and clipping: every operation of a training step.
Trace train(const ModelConfig& config, Precision precision, const std::string& backend, int steps) {
  const int64_t batch = 2, seq = 20;
  Decoder d(config, precision, batch, seq, test::on_backend(backend, {false, true, 0}));
  d.init_random(7, 0.2);
  // eps 1e-6, not 1e-8: some gradients are zero analytically but not in floating point (the key
  // bias: softmax ignores a shift shared by all keys), and Adam turns noise of 1e-12 into a full
  // step of either sign. Every real gradient here is far above 1e-6.
  train::AdamW adamw(d.backend(), d.params(), {0.9, 0.95, 1e-6, 0.1});
  Trace t;
  t.initial.assign(d.params().weights(), d.params().weights() + d.params().total());
  auto first = test::random_batch(batch, seq, config.vocab_size, 21);
  std::vector<int32_t> segments(size_t(batch * seq));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < seq; ++i) {
      segments[size_t(b * seq + i)] = i < 8 ? 0 : 1;
      first.positions[size_t(b * seq + i)] = int32_t(i < 8 ? i : i - 8);
    }
  const auto second = test::random_batch(1, seq - 6, config.vocab_size, 22);
  for (int step = 1; step <= steps; ++step) {
    d.params().zero_grads();
    MicroBatch packed = first.view(batch, seq);
    packed.segments = segments.data();
    double loss = d.forward_backward(packed, 1.0 / 50);
    loss += d.forward_backward(second.view(1, seq - 6), 1.0 / 50);
    if (step == 1) t.first_grads.assign(d.params().grads(), d.params().grads() + d.params().total());
    const double norm = train::gradient_norm(d.backend(), d.params());
    adamw.step(1e-2, step, train::clip_coefficient(norm, 1.0));
    t.losses.push_back(loss);
    t.grad_norms.push_back(norm);
  }
  t.final_weights.assign(d.params().weights(), d.params().weights() + d.params().total());
  for (const auto& p : d.params().params()) t.params.push_back({p.name, {p.offset, p.offset + p.numel}});
  return t;
}

double relative_l2(const std::vector<float>& a, const std::vector<float>& b, const std::vector<float>& scale,
                   FlatRange range = {0, -1}) {
  if (range.end < 0) range = {0, int64_t(a.size())};
  double diff = 0, norm = 0;
  for (int64_t i = range.begin; i < range.end; ++i) {
    diff += (double(a[i]) - double(b[i])) * (double(a[i]) - double(b[i]));
    norm += double(scale[i]) * double(scale[i]);
  }
  return std::sqrt(diff / norm);
}

class BackendAgreement : public ::testing::TestWithParam<std::tuple<const char*, Precision>> {};

TEST_P(BackendAgreement, CpuTrainsAsTheReferenceBackendDoes) {
  const auto [family, precision] = GetParam();
  const auto config = test::tiny_config(family);
  const int steps = 3;
  const Trace cpu = train(config, precision, "cpu", steps);
  const Trace ref = train(config, precision, "reference", steps);
  const bool bf = precision == Precision::BF16;
  // fp32: rounding only, at step 1 (same weights); later steps start from weights that already
  // differ, and Adam's first updates are near sign(gradient), which amplifies small differences.
  // bf16: bf16's 8-bit mantissa, and sign flips for the small gradients its rounding moves.
  const double loss_tol = bf ? 2e-2 : 2e-6, grad_tol = bf ? 5e-2 : 2e-5, weight_tol = bf ? 0.15 : 3e-4;
  // How much the step-1 bounds widen for steps 2..: in bf16, 2 since CPUs with native bf16 dot
  // products (AVX-512 BF16, oneDNN) sum in another order (mistral's step-3 norm measured 6.4% apart).
  const double later = bf ? 2.0 : 25.0;
  for (int s = 0; s < steps; ++s) {
    SCOPED_TRACE("step " + std::to_string(s + 1));
    const double widen = s == 0 ? 1.0 : later;
    EXPECT_NEAR(cpu.losses[s], ref.losses[s], widen * loss_tol * std::abs(ref.losses[s]));
    EXPECT_NEAR(cpu.grad_norms[s], ref.grad_norms[s], widen * grad_tol * ref.grad_norms[s]);
  }
  // Every parameter's gradient of the first step (before clipping and the optimizer).
  for (const auto& [name, range] : ref.params)
    EXPECT_LT(relative_l2(cpu.first_grads, ref.first_grads, ref.first_grads, range), grad_tol) << name;
  // The weights' change over the run, not the weights, is what a wrong backend gets wrong.
  std::vector<float> moved_cpu(cpu.initial.size()), moved_ref(cpu.initial.size());
  for (size_t i = 0; i < cpu.initial.size(); ++i) {
    moved_cpu[i] = cpu.final_weights[i] - cpu.initial[i];
    moved_ref[i] = ref.final_weights[i] - ref.initial[i];
  }
  EXPECT_EQ(cpu.initial, ref.initial);
  const double weight_gap = relative_l2(moved_cpu, moved_ref, moved_ref);
  EXPECT_LT(weight_gap, weight_tol) << "relative L2 of the weight updates";
  // Not vacuous: the run moves the loss by far more than the tolerance.
  EXPECT_GT(std::abs(ref.losses.front() - ref.losses.back()), 10 * later * loss_tol * std::abs(ref.losses.back()));
  std::printf(
      "%s %s: worst loss gap %.3g, weight-update gap %.3g (relative)\n", family, bf ? "bf16" : "fp32",
      [&] {
        double worst = 0;
        for (int s = 0; s < steps; ++s)
          worst = std::max(worst, std::abs(cpu.losses[s] - ref.losses[s]) / std::abs(ref.losses[s]));
        return worst;
      }(),
      weight_gap);
}

INSTANTIATE_TEST_SUITE_P(Families, BackendAgreement,
                         ::testing::Combine(::testing::Values("llama", "qwen2", "glm", "glm_original", "qwen3", "mistral", "gemma2",
                                                              "gemma3"),
                                            ::testing::Values(Precision::F32, Precision::BF16)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) == Precision::BF16 ? "_bf16" : "_fp32");
                         });

// transformers' nn.Embedding(padding_idx=pad_token_id): on every backend and precision the pad
// row gets no gradient from its lookups (untied: zero), while a tied LM head's share still
// reaches it (tied: non-zero, and not what the lookups would add).
class PaddingRow : public ::testing::TestWithParam<std::tuple<std::string, Precision>> {};

TEST_P(PaddingRow, LookupsGiveThePadRowNoGradient) {
  const auto [backend, precision] = GetParam();
  const int64_t batch = 2, seq = 12, pad = 5;
  auto batch_ids = test::random_batch(batch, seq, 97, 31);
  for (size_t i = 0; i < batch_ids.ids.size(); i += 3) batch_ids.ids[i] = int32_t(pad);  // pad in the input
  batch_ids.targets[1] = int32_t(pad);                                                     // and as a target
  auto grads_of = [&](bool tied, int64_t pad_token_id) {
    auto config = test::tiny_config("llama");
    config.tie_word_embeddings = tied;
    config.pad_token_id = pad_token_id;
    Decoder d(config, precision, batch, seq, test::on_backend(backend));
    d.init_random(3, 0.2);
    // The same weights with and without a padding index (random init zeroes the padding row).
    {
      auto same = config;
      same.pad_token_id = -1;
      Decoder w(same, precision, batch, seq, test::on_backend(backend));
      w.init_random(3, 0.2);
      std::copy_n(w.params().weights(), w.params().total(), d.params().weights());
      d.params().refresh_bf16_copy();
    }
    d.params().zero_grads();
    d.forward_backward(batch_ids.view(batch, seq), 1.0 / 20);
    const auto& p = d.params().params().front();
    EXPECT_EQ(p.name, "embed");
    const float* g = d.params().grads() + p.offset;
    std::vector<float> row(g + pad * config.hidden_size, g + (pad + 1) * config.hidden_size);
    std::vector<float> other(g + (pad + 1) * config.hidden_size, g + (pad + 2) * config.hidden_size);
    return std::pair{row, other};
  };
  const auto [untied_row, untied_other] = grads_of(false, pad);
  for (float v : untied_row) ASSERT_EQ(v, 0.0f);
  const auto [no_padding_row, no_padding_other] = grads_of(false, -1);
  EXPECT_NE(no_padding_row, untied_row);       // without padding_idx the lookups do reach the row
  EXPECT_EQ(no_padding_other, untied_other);  // and nothing else changes
  // Tied: the head's gradient still reaches the row (pad is a target, and every logit's softmax
  // gradient touches every row), the lookups' does not.
  const auto [tied_row, tied_other] = grads_of(true, pad);
  EXPECT_NE(tied_row, std::vector<float>(tied_row.size(), 0.0f));
  const auto [tied_no_padding_row, tied_no_padding_other] = grads_of(true, -1);
  EXPECT_NE(tied_row, tied_no_padding_row);
  EXPECT_EQ(tied_other, tied_no_padding_other);
}

INSTANTIATE_TEST_SUITE_P(BackendsAndPrecisions, PaddingRow,
                         ::testing::Combine(test::each_backend(), ::testing::Values(Precision::F32, Precision::BF16)),
                         [](const auto& info) {
                           return std::get<0>(info.param) +
                                  (std::get<1>(info.param) == Precision::BF16 ? "_bf16" : "_fp32");
                         });

TEST(Backends, UnknownNameIsRefusedNamingTheKnownOnes) {
  try {
    kernels::backend_named("cuda");
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("known: cpu, reference"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace keel::model
