// LoRA in the decoder (model/lora.h), checked against the full model it stands for: with
// W_eff = W + s B A merged into a plain decoder's weights, the LoRA decoder's loss must equal the
// merged one's, and its adapter gradients must be the chain rule through W_eff,
//   dL/dB = s dL/dW_eff A^T,   dL/dA = s B^T dL/dW_eff,
// for every family's module layout (fused qkv and gate_up rows, GLM's fused names), on each
// backend. Also: the frozen base has no gradients, the plan holds none for it, the adapter's
// initialisation is PEFT's, gradient checkpointing changes nothing, the grad-ready hook reports
// every adapter matrix once, and a target that matches nothing names the model's modules.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "keel/core/error.h"
#include "keel/core/four_bit.h"
#include "keel/model/decoder.h"
#include "keel/model/peft_adapter.h"
#include "decoder_test_support.h"
#include "test_support.h"

namespace keel::model {
namespace {

using test::random_batch;

LoraSpec spec_of(std::vector<std::string> targets, bool rslora = false) {
  LoraSpec s;
  s.rank = 3;
  s.alpha = 5;
  s.rslora = rslora;
  s.targets = std::move(targets);
  return s;
}

// Random A and B (B is zero after init_lora, which would make dA vanish).
void randomise_adapter(Decoder& d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  ParamStore& a = d.adapter();
  for (int64_t i = 0; i < a.total(); ++i) a.weights()[i] = normal(rng);
  a.refresh_bf16_copy();
}

struct Case {
  const char* family;
  std::vector<std::string> targets;
  bool rslora;
};

class LoraAgainstMerged : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

const std::vector<Case>& cases() {
  static const std::vector<Case> c = {
      {"llama", {"all"}, false},
      {"qwen2", {"q_proj", "v_proj", "down_proj"}, true},
      {"glm", {"k_proj", "gate_up_proj"}, false},
      {"glm_original", {"query_key_value", "dense", "dense_4h_to_h"}, false},
  };
  return c;
}

TEST_P(LoraAgainstMerged, LossAndAdapterGradientsAreTheChainRuleThroughTheMergedWeights) {
  const auto& [index, backend] = GetParam();
  const Case& c = cases()[size_t(index)];
  const auto config = test::tiny_config(c.family);
  const int64_t batch = 2, seq = 12;
  DecoderOptions with_lora = test::on_backend(backend, {false, true, 0});
  with_lora.lora = spec_of(c.targets, c.rslora);
  Decoder lora(config, Precision::F32, batch, seq, with_lora);
  Decoder merged(config, Precision::F32, batch, seq, test::on_backend(backend, {false, true, 0}));
  lora.init_random(7, 0.2);
  merged.init_random(7, 0.2);
  randomise_adapter(lora, 8);
  ASSERT_FALSE(lora.lora_modules().empty());
  const double s = with_lora.lora.scaling();
  const int64_t r = with_lora.lora.rank;

  // W_eff = W + s B A, in double, into the plain decoder.
  for (const auto& m : lora.lora_modules()) {
    const float* A = lora.adapter().weight(m.a);
    const float* B = lora.adapter().weight(m.b);
    float* W = merged.params().weight(module_weight(merged.ids(), m)) + m.row_begin * m.cols;
    for (int64_t i = 0; i < m.rows; ++i)
      for (int64_t j = 0; j < m.cols; ++j) {
        double sum = 0;
        for (int64_t k = 0; k < r; ++k) sum += double(B[i * r + k]) * A[k * m.cols + j];
        W[i * m.cols + j] = float(W[i * m.cols + j] + s * sum);
      }
  }
  merged.params().refresh_bf16_copy();

  const auto data = random_batch(batch, seq, config.vocab_size, 3);
  lora.trainable().zero_grads();
  merged.params().zero_grads();
  const double loss_lora = lora.forward_backward(data.view(batch, seq), 1.0 / 20);
  const double loss_merged = merged.forward_backward(data.view(batch, seq), 1.0 / 20);
  EXPECT_NEAR(loss_lora, loss_merged, 1e-5 * std::abs(loss_merged));
  EXPECT_TRUE(lora.params().frozen());
  EXPECT_EQ(lora.params().grads(), nullptr);

  for (const auto& m : lora.lora_modules()) {
    const float* A = lora.adapter().weight(m.a);
    const float* B = lora.adapter().weight(m.b);
    const float* dW = merged.params().grad(module_weight(merged.ids(), m)) + m.row_begin * m.cols;
    const float* dA = lora.adapter().grad(m.a);
    const float* dB = lora.adapter().grad(m.b);
    double err_a = 0, norm_a = 0, err_b = 0, norm_b = 0;
    for (int64_t k = 0; k < r; ++k)
      for (int64_t j = 0; j < m.cols; ++j) {  // dA[k, j] = s sum_i B[i, k] dW[i, j]
        double want = 0;
        for (int64_t i = 0; i < m.rows; ++i) want += double(B[i * r + k]) * dW[i * m.cols + j];
        want *= s;
        err_a += (dA[k * m.cols + j] - want) * (dA[k * m.cols + j] - want);
        norm_a += want * want;
      }
    for (int64_t i = 0; i < m.rows; ++i)
      for (int64_t k = 0; k < r; ++k) {  // dB[i, k] = s sum_j dW[i, j] A[k, j]
        double want = 0;
        for (int64_t j = 0; j < m.cols; ++j) want += double(dW[i * m.cols + j]) * A[k * m.cols + j];
        want *= s;
        err_b += (dB[i * r + k] - want) * (dB[i * r + k] - want);
        norm_b += want * want;
      }
    EXPECT_GT(norm_a, 0) << m.path;
    EXPECT_GT(norm_b, 0) << m.path;
    EXPECT_LT(std::sqrt(err_a / norm_a), 1e-4) << m.path << ".lora_A";
    EXPECT_LT(std::sqrt(err_b / norm_b), 1e-4) << m.path << ".lora_B";
  }
}

INSTANTIATE_TEST_SUITE_P(Families, LoraAgainstMerged, ::testing::Combine(::testing::Range(0, 4), test::each_backend()),
                         [](const auto& info) {
                           return std::string(cases()[size_t(std::get<0>(info.param))].family) + "_" +
                                  std::get<1>(info.param);
                         });

TEST(Lora, PlanHasNoGradientsOrMomentsForTheFrozenWeights) {
  const auto config = test::tiny_config("llama");
  DecoderOptions full{false, true, 0};
  DecoderOptions lora = full;
  lora.lora = spec_of({"all"});
  const MemoryPlan full_plan = decoder_memory_plan(config, Precision::BF16, 2, 16, full);
  const MemoryPlan lora_plan = decoder_memory_plan(config, Precision::BF16, 2, 16, lora);
  Decoder d(config, Precision::BF16, 2, 16, lora);
  auto bytes_of = [](const MemoryPlan& p, const std::string& name) -> size_t {
    for (const auto& b : p.buffers())
      if (b.name == name) return b.bytes;
    return 0;
  };
  EXPECT_GT(bytes_of(full_plan, "grads"), 0u);
  EXPECT_EQ(bytes_of(lora_plan, "grads"), 0u);
  EXPECT_EQ(bytes_of(lora_plan, "lora.grads"), sizeof(float) * size_t(d.adapter().total()));
  EXPECT_EQ(bytes_of(lora_plan, "adam.m"), sizeof(float) * size_t(d.adapter().total()));
  // In bf16 the frozen matrices have no fp32 masters: only the norms' are left.
  EXPECT_LT(bytes_of(lora_plan, "weights"), bytes_of(full_plan, "weights") / 20);
  EXPECT_EQ(bytes_of(lora_plan, "weights.bf16 (frozen matrices in bf16 only)"), bytes_of(full_plan, "weights.bf16"));
  EXPECT_LT(lora_plan.arena_bytes(), full_plan.arena_bytes());
  // In fp32 the matrices are the GEMMs' inputs themselves: all kept.
  EXPECT_EQ(bytes_of(decoder_memory_plan(config, Precision::F32, 2, 16, lora), "weights"),
            bytes_of(decoder_memory_plan(config, Precision::F32, 2, 16, full), "weights"));
  // The decoder allocates exactly the plan `keel plan` shows.
  EXPECT_EQ(d.memory_plan().arena_bytes(), lora_plan.arena_bytes());
}

// In bf16 the frozen matrices live in bf16 alone; with B = 0 (PEFT's start) the model must be
// the plain bf16 model bit for bit, given fp32 weights that are already bf16 values.
TEST(Lora, Bf16BaseHeldInBf16AloneIsThePlainBf16Model) {
  for (const char* family : {"llama", "qwen2"}) {  // qwen2: tied embedding (embedding and LM head in bf16)
    const auto config = test::tiny_config(family);
    DecoderOptions plain_options{false, true, 0};
    DecoderOptions lora_options = plain_options;
    lora_options.lora = spec_of({"all"});
    Decoder plain(config, Precision::BF16, 2, 16, plain_options), lora(config, Precision::BF16, 2, 16, lora_options);
    plain.init_random(3, 0.2);
    lora.init_random(3, 0.2);
    lora.init_adapter(4);
    ParamStore& P = plain.params();
    for (int64_t i = 0; i < P.total(); ++i) P.weights()[i] = bf16_to_float(float_to_bf16(P.weights()[i]));
    P.refresh_bf16_copy();
    EXPECT_GT(lora.params().compute_only_total(), 0);
    EXPECT_EQ(lora.params().weight(lora.ids().embed), nullptr);
    const auto data = random_batch(2, 16, config.vocab_size, 5);
    const double a = plain.forward_loss(data.view(2, 16)), b = lora.forward_loss(data.view(2, 16));
    EXPECT_EQ(std::memcmp(&a, &b, sizeof a), 0) << family << ": " << a << " vs " << b;
  }
}

// QLoRA: the 4-bit decoder (NF4 and FP4) computes with exactly the dequantized weights. A LoRA
// decoder given those weights (and the same adapter) has the same loss and adapter gradients, up to
// the GEMMs' tiling (the 4-bit products run a tile of rows at a time), in fp32 and bf16 and on each
// backend.
TEST(Lora, FourBitBaseComputesWithItsDequantizedWeights) {
  for (const std::string& backend : kernels::backend_names())
    for (Precision precision : {Precision::F32, Precision::BF16})
      for (auto [type, double_quantization] :
           {std::pair{FourBitType::Nf4, false}, std::pair{FourBitType::Nf4, true}, std::pair{FourBitType::Fp4, true}}) {
        auto config = test::tiny_config("qwen2");
        config.hidden_size = 64, config.intermediate_size = 128, config.head_dim = 16, config.rotary_dim = 16;
        DecoderOptions q = test::on_backend(backend, {false, true, 0}), plain = q;
        q.lora = plain.lora = spec_of({"all"});
        q.four_bit_base = true;
        q.four_bit_type = type;
        q.double_quantization = double_quantization;
        q.four_bit_tile_elements = 24 * 64;  // tiles of 24 rows: every projection in several, the last one short
        Decoder quantized(config, precision, 2, 12, q), reference(config, precision, 2, 12, plain);
        quantized.init_random(5, 0.2);
        reference.init_random(5, 0.2);
        ASSERT_GT(quantized.params().four_bit_total(), 0);
        // The reference's projections := the NF4 decoder's dequantized ones.
        ParamStore& Q = quantized.params();
        ParamStore& R = reference.params();
        for (size_t i = 0; i < Q.params().size(); ++i) {
          const Param& p = Q.param(int(i));
          if (p.storage != ParamStorage::FourBit) continue;
          std::vector<float> w(size_t(p.numel));
          const FourBitWeight stored = Q.four_bit(int(i));
          four_bit_dequantize(stored.type, stored.packed, stored.absmax, p.numel, w.data());
          if (R.param(int(i)).master())
            std::copy(w.begin(), w.end(), R.weight(int(i)));
          else
            for (int64_t k = 0; k < p.numel; ++k) R.weight_bf16(int(i))[k] = float_to_bf16(w[size_t(k)]);
        }
        R.refresh_bf16_copy();
        randomise_adapter(quantized, 6);
        randomise_adapter(reference, 6);
        const auto data = random_batch(2, 12, config.vocab_size, 7);
        quantized.trainable().zero_grads();
        reference.trainable().zero_grads();
        const double a = quantized.forward_backward(data.view(2, 12), 0.05);
        const double b = reference.forward_backward(data.view(2, 12), 0.05);
        const std::string what = backend + (precision == Precision::BF16 ? " bf16 " : " fp32 ") +
                                 std::string(four_bit_type_name(type)) +
                                 (double_quantization ? " double quantization" : "");
        EXPECT_NEAR(a, b, (precision == Precision::BF16 ? 1e-4 : 1e-6) * std::abs(b)) << what;
        double err = 0, norm = 0;
        for (int64_t i = 0; i < quantized.adapter().total(); ++i) {
          const double d = double(quantized.adapter().grads()[i]) - reference.adapter().grads()[i];
          err += d * d, norm += double(reference.adapter().grads()[i]) * reference.adapter().grads()[i];
        }
        EXPECT_LT(std::sqrt(err / norm), precision == Precision::BF16 ? 1e-2 : 1e-5) << what;
      }
}

// LoRA dropout: the adapter gradients of a training pass are the derivative of that same pass's loss
// (the mask drawn from the micro-batch's key, regenerated in the backward pass), checked against
// central differences on the double-precision backend; the same key gives the same gradients, and a
// pass without a key (evaluation) has no dropout.
TEST(Lora, DropoutGradientsAreTheDerivativeOfTheDroppedOutLoss) {
  for (Precision precision : {Precision::F32, Precision::BF16}) {
    const auto config = test::tiny_config("llama");
    DecoderOptions o = test::on_backend("reference", {false, true, 0});
    o.lora = spec_of({"q_proj", "o_proj", "down_proj"});
    o.lora.dropout = 0.3;
    DecoderOptions no_dropout = o;
    no_dropout.lora.dropout = 0.0;
    Decoder d(config, precision, 2, 10, o), plain(config, precision, 2, 10, no_dropout);
    for (Decoder* x : {&d, &plain}) {
      x->init_random(1, 0.2);
      randomise_adapter(*x, 2);
    }
    const auto data = random_batch(2, 10, config.vocab_size, 3);
    MicroBatch mb = data.view(2, 10);
    mb.dropout_key = 12345;
    d.trainable().zero_grads();
    d.forward_backward(mb, 1.0);
    const std::vector<float> grads(d.adapter().grads(), d.adapter().grads() + d.adapter().total());
    d.trainable().zero_grads();
    d.forward_backward(mb, 1.0);
    EXPECT_EQ(std::memcmp(grads.data(), d.adapter().grads(), sizeof(float) * grads.size()), 0) << "same key, same masks";
    // Without a key (evaluation) the loss is the model's without dropout; with one it differs.
    MicroBatch eval = data.view(2, 10);
    EXPECT_EQ(d.forward_loss(eval), plain.forward_loss(eval));
    EXPECT_NE(d.forward_loss(mb), plain.forward_loss(mb));
    if (precision == Precision::BF16) continue;  // central differences need fp32's resolution
    // Central differences of the dropped-out loss, on the entries with the largest gradients.
    std::vector<int64_t> order(grads.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = int64_t(i);
    std::partial_sort(order.begin(), order.begin() + 24, order.end(),
                      [&](int64_t a, int64_t b) { return std::abs(grads[size_t(a)]) > std::abs(grads[size_t(b)]); });
    float* w = d.adapter().weights();
    for (int k = 0; k < 24; ++k) {
      const int64_t i = order[size_t(k)];
      const float saved = w[i], eps = 2e-3f;
      w[i] = saved + eps;
      const double up = d.forward_loss(mb);
      w[i] = saved - eps;
      const double down = d.forward_loss(mb);
      w[i] = saved;
      const double numeric = (up - down) / (2.0 * double(eps));
      EXPECT_NEAR(grads[size_t(i)], numeric, 2e-2 * std::abs(numeric) + 1e-4) << "adapter element " << i;
    }
  }
}

// additional_target: the embedding and LM head of untied models by their HF names; anything else,
// or a tied embedding, is an error naming what is possible.
TEST(Lora, ModulesToSaveAreTheEmbeddingAndTheLmHead) {
  auto spec = spec_of({"q_proj"});
  spec.modules_to_save = {"lm_head", "embed_tokens"};
  DecoderOptions o;
  o.lora = spec;
  auto llama = test::tiny_config("llama");
  llama.tie_word_embeddings = false;
  Decoder d(llama, Precision::F32, 1, 4, o);
  ASSERT_EQ(d.trained_embedding(), 0);  // first, so that it becomes final last
  ASSERT_EQ(d.trained_lm_head(), int(d.adapter().params().size()) - 1);
  EXPECT_EQ(d.adapter().param(d.trained_embedding()).name, "model.embed_tokens.weight");
  EXPECT_EQ(d.adapter().param(d.trained_lm_head()).name, "lm_head.weight");
  d.init_random(1, 0.2);
  d.init_adapter(2);  // the trained copies start as the originals
  EXPECT_EQ(std::memcmp(d.adapter().weight(d.trained_lm_head()), d.params().weight(d.ids().lm_head),
                        sizeof(float) * size_t(d.params().param(d.ids().lm_head).numel)),
            0);
  spec.modules_to_save = {"q_proj"};
  o.lora = spec;
  keel::testing::expect_keel_error([&] { Decoder x(llama, Precision::F32, 1, 4, o); },
                                   {"additional_target 'q_proj' is neither the embedding nor the LM head",
                                    "embed_tokens, lm_head"});
  auto tied = test::tiny_config("qwen2");
  tied.tie_word_embeddings = true;
  spec.modules_to_save = {"embed_tokens"};
  o.lora = spec;
  keel::testing::expect_keel_error([&] { Decoder x(tied, Precision::F32, 1, 4, o); },
                                   {"ties its embedding to its LM head"});
}

TEST(Lora, InitialisationIsPeftsAndDeterministicInTheSeed) {
  const auto config = test::tiny_config("llama");
  DecoderOptions o{false, true, 0};
  o.lora = spec_of({"q_proj", "down_proj"});
  Decoder a(config, Precision::F32, 1, 8, o), b(config, Precision::F32, 1, 8, o), c(config, Precision::F32, 1, 8, o);
  a.init_adapter(1);
  b.init_adapter(1);
  c.init_adapter(2);
  const size_t bytes = sizeof(float) * size_t(a.adapter().total());
  EXPECT_EQ(std::memcmp(a.adapter().weights(), b.adapter().weights(), bytes), 0);
  EXPECT_NE(std::memcmp(a.adapter().weights(), c.adapter().weights(), bytes), 0);
  for (const auto& m : a.lora_modules()) {
    const double bound = 1.0 / std::sqrt(double(m.cols));  // kaiming_uniform_(a = sqrt(5))
    const float* A = a.adapter().weight(m.a);
    double sum_sq = 0, max_abs = 0;
    const int64_t n = a.adapter().param(m.a).numel;
    for (int64_t i = 0; i < n; ++i) sum_sq += double(A[i]) * A[i], max_abs = std::max(max_abs, double(std::abs(A[i])));
    EXPECT_LE(max_abs, bound) << m.path;
    EXPECT_GT(max_abs, 0.8 * bound) << m.path;
    EXPECT_NEAR(std::sqrt(sum_sq / double(n)), bound / std::sqrt(3.0), 0.25 * bound) << m.path;  // uniform's std
    const float* B = a.adapter().weight(m.b);
    for (int64_t i = 0; i < a.adapter().param(m.b).numel; ++i) ASSERT_EQ(B[i], 0.0f) << m.path;
  }
  EXPECT_EQ(a.lora_modules().size(), 2u * size_t(config.num_layers));
}

TEST(Lora, GradientCheckpointingGivesTheSameAdapterGradients) {
  for (Precision precision : {Precision::F32, Precision::BF16}) {
    const auto config = test::tiny_config("qwen2");
    DecoderOptions stored_options{false, true, 0}, recomputed_options{true, true, 0};
    stored_options.lora = recomputed_options.lora = spec_of({"all"});
    Decoder stored(config, precision, 2, 16, stored_options), recomputed(config, precision, 2, 16, recomputed_options);
    for (Decoder* d : {&stored, &recomputed}) {
      d->init_random(4, 0.2);
      randomise_adapter(*d, 5);
      d->trainable().zero_grads();
      d->forward_backward(random_batch(2, 16, config.vocab_size, 6).view(2, 16), 0.05);
    }
    EXPECT_EQ(std::memcmp(stored.adapter().grads(), recomputed.adapter().grads(),
                          sizeof(float) * size_t(stored.adapter().total())),
              0);
  }
}

TEST(Lora, GradReadyHookReportsEveryAdapterMatrixOnceInReverseOrder) {
  const auto config = test::tiny_config("llama");
  DecoderOptions o{false, true, 0};
  o.lora = spec_of({"all"});
  Decoder d(config, Precision::F32, 2, 8, o);
  d.init_random(1, 0.2);
  randomise_adapter(d, 2);
  std::vector<int> order;
  std::vector<std::vector<float>> seen(d.adapter().params().size());
  d.set_grad_ready_hook([&](int p, ComputeEvent) {
    order.push_back(p);
    const float* g = d.adapter().grad(p);
    seen[size_t(p)].assign(g, g + d.adapter().param(p).numel);
  });
  d.trainable().zero_grads();
  d.forward_backward(random_batch(2, 8, config.vocab_size, 3).view(2, 8), 0.1);
  ASSERT_EQ(order.size(), d.adapter().params().size());
  for (size_t i = 0; i < order.size(); ++i)
    EXPECT_EQ(order[i], int(order.size() - 1 - i)) << "adapter parameters become final last-declared first";
  for (size_t p = 0; p < seen.size(); ++p)  // final when reported
    EXPECT_EQ(std::memcmp(seen[p].data(), d.adapter().grad(int(p)), sizeof(float) * seen[p].size()), 0)
        << d.adapter().param(int(p)).name;
}

TEST(Lora, ATargetThatMatchesNothingNamesTheModelsModules) {
  const auto config = test::tiny_config("glm_original");
  DecoderOptions o;
  o.lora = spec_of({"q_proj"});
  try {
    Decoder d(config, Precision::F32, 1, 4, o);
    FAIL() << "a ChatGLM model has no q_proj";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'q_proj' matches no linear layer"), std::string::npos) << what;
    EXPECT_NE(what.find("query_key_value, dense, dense_h_to_4h, dense_4h_to_h"), std::string::npos) << what;
  }
  o.lora = spec_of({"self_attention.query_key_value"});  // a path suffix matches, as in PEFT
  Decoder d(config, Precision::F32, 1, 4, o);
  EXPECT_EQ(d.lora_modules().size(), size_t(config.num_layers));
  EXPECT_EQ(d.lora_modules()[0].path, "transformer.encoder.layers.0.self_attention.query_key_value");
  EXPECT_EQ(d.lora_modules()[0].rows, config.q_size() + 2 * config.kv_size());
}

// A random model and adapter in `source`, its adapter saved in PEFT's format to `dir`.
void save_random_adapter(Decoder& source, uint64_t seed, const std::string& dir, const std::string& base_model) {
  source.init_random(1, 0.2);
  randomise_adapter(source, seed);
  save_peft_adapter(source, dir, base_model, 0.0, DType::F32);
}

void expect_same_adapter(Decoder& a, Decoder& b) {
  ASSERT_EQ(a.adapter().total(), b.adapter().total());
  EXPECT_EQ(std::memcmp(a.adapter().weights(), b.adapter().weights(), sizeof(float) * size_t(a.adapter().total())), 0);
}

TEST(Lora, AdapterRoundTripsThroughPeftsFormatAndMismatchesAreNamed) {
  const auto config = test::tiny_config("glm");
  DecoderOptions o{false, true, 0};
  o.lora = spec_of({"q_proj", "gate_up_proj"});
  Decoder source(config, Precision::F32, 1, 8, o), target(config, Precision::F32, 1, 8, o);
  keel::testing::TempDir dir;
  save_random_adapter(source, 9, dir.path(), "/models/glm");
  const PeftAdapterConfig read = read_peft_adapter_config(dir.path());
  EXPECT_EQ(read.spec.rank, 3);
  EXPECT_EQ(read.spec.alpha, 5.0);
  EXPECT_EQ(read.base_model, "/models/glm");
  EXPECT_EQ(read.spec.targets, (std::vector<std::string>{"q_proj", "gate_up_proj"}));
  load_peft_adapter(target, dir.path());
  expect_same_adapter(source, target);

  auto error_loading_into = [&](const LoraSpec& spec) -> std::string {
    DecoderOptions other{false, true, 0};
    other.lora = spec;
    Decoder d(config, Precision::F32, 1, 8, other);
    try {
      load_peft_adapter(d, dir.path());
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  LoraSpec rank4 = o.lora;
  rank4.rank = 4;
  EXPECT_NE(error_loading_into(rank4).find("r = 3 but the recipe's lora_rank is 4"), std::string::npos);
  EXPECT_NE(error_loading_into(spec_of({"all"})).find("set lora_target to the adapter's modules"), std::string::npos);
  // Another model's adapter: a module this model does not have.
  const auto llama = test::tiny_config("llama");
  DecoderOptions on_llama{false, true, 0};
  on_llama.lora = spec_of({"q_proj", "gate_up_proj"});
  try {
    Decoder d(llama, Precision::F32, 1, 8, on_llama);
    FAIL() << "llama has no gate_up_proj";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'gate_up_proj' matches no linear layer"), std::string::npos);
  }
}

// A target naming some of the modules of one name by path: the adapter lists those paths, since the
// bare name would make PEFT adapt every layer's module.
TEST(Lora, AdapterNamesModulesByPathWhenTheirNamesWouldSelectMore) {
  const auto config = test::tiny_config("qwen3");
  DecoderOptions o{false, true, 0};
  o.lora = spec_of({"layers.1.self_attn.q_proj", "down_proj"});
  Decoder source(config, Precision::F32, 1, 8, o), target(config, Precision::F32, 1, 8, o);
  keel::testing::TempDir dir;
  save_random_adapter(source, 10, dir.path(), "/models/qwen3");
  std::vector<std::string> expected;
  for (const auto& m : source.lora_modules()) expected.push_back(m.path);
  ASSERT_EQ(expected.size(), size_t(1 + config.num_layers));
  EXPECT_EQ(expected[0], "model.layers.0.mlp.down_proj");
  EXPECT_EQ(read_peft_adapter_config(dir.path()).spec.targets, expected);
  load_peft_adapter(target, dir.path());  // and it loads back: the same modules
  expect_same_adapter(source, target);
}

}  // namespace
}  // namespace keel::model
