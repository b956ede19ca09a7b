// Autoregressive generation with a KV cache: the prompt is run once (prefill), then each new
// token costs one position's worth of work, attending to the cached keys and values.
// Works on ids; tokenization and chat templates belong to the caller (the CLI).
#pragma once
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "keel/model/decoder.h"

namespace keel::model {

struct SamplingOptions {
  int64_t max_new_tokens = 128;
  double temperature = 0.0;  // 0: greedy (argmax)
  int64_t top_k = 0;         // 0: no top-k cut
  double top_p = 1.0;        // 1: no nucleus cut
  uint64_t seed = 0;
  std::vector<int64_t> stop_ids;  // generation ends after emitting one of these (EOS)
};

class Generator {
 public:
  // Reads the decoder's fp32 weights (no copy); the cache holds up to max_length positions.
  Generator(const Decoder& decoder, int64_t max_length);

  // Generates after `prompt`; on_token (if set) sees each new id as it is produced.
  std::vector<int32_t> generate(const std::vector<int32_t>& prompt, const SamplingOptions& options,
                                const std::function<void(int32_t)>& on_token = {});

  // Logits for the next token after feeding `ids` at positions [position, position + n) on top of
  // the cache (which must hold exactly `position` tokens). Exposed for tests.
  const std::vector<float>& feed(const int32_t* ids, int64_t n, int64_t position);

 private:
  int32_t sample(const SamplingOptions& options);
  void linear(const float* x, const float* w, int64_t rows, int64_t in, int64_t out, float* y, float beta);

  const Decoder& decoder_;
  kernels::Backend& backend_;
  const ModelConfig& c_;
  int64_t max_length_;
  kernels::RopeTable rope_, rope_local_;  // rope_local_: Gemma 3's sliding layers
  std::vector<std::vector<float>> k_cache_, v_cache_;  // per layer [max_length, kv_heads * head_dim]
  std::vector<float> x_, xn_, qkv_, attn_, h_, gate_up_, act_, logits_;
  std::vector<float> branch_;  // sandwich norms: a branch's output before its norm
  std::vector<float> qk_rstd_;  // q/k norms: each head's rstd (not needed after, but the kernel writes it)
  std::mt19937_64 rng_;
};

}  // namespace keel::model
