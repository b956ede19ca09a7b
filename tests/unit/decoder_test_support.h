// A tiny decoder configuration, random micro-batches and the backends, shared by the decoder-level
// unit tests (gradient checkpointing, per-tensor memory, grad-ready hook, backend agreement).
//
// Every decoder test runs once per backend (kernels/backend.h), CTranslate2's one-suite-per-device
// pattern: the suite takes the backend's name as a parameter (each_backend()) and builds its
// decoders with on_backend(name, options).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "keel/kernels/backend.h"
#include "keel/model/decoder.h"
#include "keel/recipe/model_setup.h"

namespace keel::model::test {

// qkv_bias: forced on or off, or the family's default.
inline ModelConfig tiny_config(const std::string& family, std::optional<bool> qkv_bias = std::nullopt,
                               int64_t hidden = 48, int64_t intermediate = 80) {
  recipe::ScratchModel m;
  m.family = family;
  m.vocab_size = 97;
  m.hidden_size = hidden;
  m.intermediate_size = intermediate;
  m.num_layers = 3;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  // Windows shorter than the tests' sequences, so that they matter.
  if (family == "mistral" || family == "gemma2" || family == "gemma3") m.sliding_window = 5;
  auto c = recipe::scratch_model_config(m);
  if (qkv_bias) c.qkv_bias = *qkv_bias;
  return c;
}

// "qwen3_moe" / "mixtral" / "glm4_moe": tiny_config's shape with a mixture of experts (top 2 of 5
// experts of width 16, Mixtral's as wide as intermediate); Qwen3-MoE's last layer dense, as its
// mlp_only_layers allow; GLM-4.5's first layer dense (first_k_dense_replace), its sparse layers with
// a shared expert and its sigmoid router keeping 2 of 3 groups of its 6 experts. Any
// other family: tiny_config.
inline ModelConfig tiny_config_with_experts(const std::string& family, int64_t hidden = 48, int64_t intermediate = 80) {
  if (family != "qwen3_moe" && family != "mixtral" && family != "glm4_moe")
    return tiny_config(family, std::nullopt, hidden, intermediate);
  ModelConfig c = tiny_config(family == "mixtral" ? "mistral" : "qwen3", false, hidden, intermediate);
  c.family = family == "mixtral" ? Family::Mixtral : family == "glm4_moe" ? Family::Glm4Moe : Family::Qwen3Moe;
  c.sliding_window = 0;
  c.sliding_layers.clear();
  apply_family_traits(c);
  c.moe.experts = 5;
  c.moe.experts_per_token = 2;
  c.moe.intermediate_size = family == "mixtral" ? intermediate : 16;
  c.moe.norm_topk_prob = family == "mixtral";
  c.moe.sparse_layers.assign(size_t(c.num_layers), true);
  if (family == "qwen3_moe") c.moe.sparse_layers.back() = false;
  if (family == "glm4_moe") {
    c.qk_norm = false;
    c.qkv_bias = true;
    c.moe.experts = 6;
    c.moe.norm_topk_prob = true;
    c.moe.sigmoid_router = true;
    c.moe.groups = 3;
    c.moe.topk_groups = 2;
    c.moe.routed_scaling_factor = 1.5;
    c.moe.shared_intermediate_size = 16;
    c.moe.sparse_layers.front() = false;
  }
  validate(c, "tiny_config_with_experts");
  return c;
}

inline auto each_backend() { return ::testing::ValuesIn(kernels::backend_names()); }

inline DecoderOptions on_backend(const std::string& backend, DecoderOptions options = {}) {
  options.backend = &kernels::backend_named(backend);
  return options;
}

struct Batch {
  std::vector<int32_t> ids, targets, positions;
  MicroBatch view(int64_t batch, int64_t seq) const {
    return {batch, seq, ids.data(), targets.data(), positions.data(), nullptr};
  }
};

// About one target in seven is -100 (ignored), the last position always.
inline Batch random_batch(int64_t batch, int64_t seq, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Batch b;
  for (int64_t s = 0; s < batch; ++s)
    for (int64_t t = 0; t < seq; ++t) {
      b.ids.push_back(int32_t(rng() % vocab));
      b.targets.push_back(t + 1 < seq && rng() % 7 ? int32_t(rng() % vocab) : -100);
      b.positions.push_back(int32_t(t));
    }
  return b;
}

// Rank `rank` of two under ZeRO `stage` (2: gradients sharded; 3: the weights too).
inline DecoderOptions zero_rank_options(DecoderOptions options, int rank, int stage) {
  options.optimizer_shards = 2;
  options.optimizer_shard = rank;
  options.shard_gradients = stage >= 2;
  options.shard_weights = stage >= 3;
  return options;
}

// Two identical ranks: this rank's shard of the summed gradients (`sharded`) is twice the
// replicated gradients (`whole`), per tensor within 1e-6 of the tensor's largest gradient. The
// same products, accumulated once per micro-batch instead of inside the GEMM, differ by rounding
// only; a staging buffer overwritten or summed twice is off by the gradients' own size.
inline void expect_shard_is_twice_replicated(ParamStore& sharded, ParamStore& whole) {
  const FlatRange mine = sharded.optimizer_range();
  for (const Param& p : sharded.params()) {
    const FlatRange part = FlatRange{p.offset, p.offset + p.numel}.intersect(mine);
    double diff = 0, scale = 0;
    for (int64_t e = part.begin; e < part.end; ++e) {
      const double want = 2.0 * double(whole.grads()[e]), got = sharded.shard_grads()[e - mine.begin];
      diff = std::max(diff, std::abs(got - want));
      scale = std::max(scale, std::abs(want));
    }
    if (part.size() > 0) EXPECT_LE(diff, 1e-6 * scale) << p.name << " differs from replicated training";
  }
}

}  // namespace keel::model::test
