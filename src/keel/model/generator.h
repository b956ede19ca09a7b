// Autoregressive generation with a KV cache: the prompt is run once (prefill), then each new
// token costs one position's worth of work, attending to the cached keys and values.
// Works on ids; tokenization and chat templates belong to the caller (the CLI).
#pragma once
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "keel/core/memory_plan.h"
#include "keel/model/decoder.h"

namespace keel::model {

struct SamplingOptions {
  int64_t max_new_tokens = 128;
  double temperature = 0.0;  // 0: greedy (argmax)
  int64_t top_k = 0;         // 0: no top-k cut
  double top_p = 1.0;        // 1: no nucleus cut
  uint64_t seed = 0;
  std::vector<int64_t> stop_ids;  // generation ends after emitting one of these (EOS)
  // Until this many tokens are out, the stop ids cannot be chosen (their logits are -inf), as
  // transformers' min_new_tokens does: benchmarks need every run to produce the same count.
  int64_t min_new_tokens = 0;
};

// What the projections multiply by: the decoder's fp32 weights as they are, or their bf16 roundings
// (the dtype most checkpoints are saved in). Decoding is bound by reading the weights, one token at
// a time, so bf16 reads half the bytes; activations, the KV cache and the sums stay fp32, so bf16
// generates exactly what fp32 generates for the model whose weights were rounded to bf16.
enum class GenerationWeights { F32, Bf16 };

class Generator {
 public:
  // Reads the decoder's fp32 weights (no copy; bf16: a bf16 copy of each projection's weight, the
  // LM head's included); the cache holds up to max_length positions.
  Generator(const Decoder& decoder, int64_t max_length, GenerationWeights weights = GenerationWeights::F32);

  // Generates after `prompt`; on_token (if set) sees each new id as it is produced.
  std::vector<int32_t> generate(const std::vector<int32_t>& prompt, const SamplingOptions& options,
                                const std::function<void(int32_t)>& on_token = {});

  // Logits for the next token after feeding `ids` at positions [position, position + n) on top of
  // the cache (which must hold exactly `position` tokens). Exposed for tests.
  const std::vector<float>& feed(const int32_t* ids, int64_t n, int64_t position);

 private:
  int32_t sample(const SamplingOptions& options);
  // y[rows, out] (+)= x[rows, in] W[out, in]^T for the weight with parameter id `weight`.
  void linear(const float* x, int weight, int64_t rows, int64_t in, int64_t out, float* y, float beta);

  const Decoder& decoder_;
  kernels::Backend& backend_;
  const ModelConfig& c_;
  int64_t max_length_;
  kernels::RopeTable rope_, rope_local_;  // rope_local_: Gemma 3's sliding layers
  std::vector<std::vector<float>> k_cache_, v_cache_;  // per layer [max_length, kv_heads * head_dim]
  std::vector<float> x_, xn_, qkv_, attn_, h_, gate_up_, act_, logits_;
  // A sparse layer's MLP: x_ = h_ + the experts' outputs for xn_ (experts.h), its routed rows here.
  void routed_experts(int64_t layer, int64_t n);
  std::vector<float> routed_f_;
  std::vector<int32_t> routed_i_;
  std::vector<float> branch_;  // sandwich norms: a branch's output before its norm
  std::vector<float> qk_rstd_;  // q/k norms: each head's rstd (not needed after, but the kernel writes it)
  std::mt19937_64 rng_;
  GenerationWeights weights_;
  // bf16: the projections' roundings, by parameter id, in one arena of huge pages (decoding streams
  // through all of them per token; on 4 KiB pages the hardware prefetchers stop at every page).
  Arena bf16_arena_;
  std::vector<const bf16*> bf16_weights_;
  std::vector<float> widened_;  // bf16, the prompt: one weight widened for a GEMM over its rows
};

}  // namespace keel::model
