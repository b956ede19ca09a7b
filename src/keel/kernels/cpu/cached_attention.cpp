#include "keel/kernels/cached_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace keel::kernels {

void cached_attention(const AttentionShape& s, const float* q, int64_t tokens, int64_t first_position,
                      const float* k_cache, const float* v_cache, float* out) {
  const int64_t D = s.head_dim, KV = s.kv_heads * D, group = s.q_heads / s.kv_heads;
  // One row of scores per thread: backends are shared by the process.
  static thread_local std::vector<float> scores;
  scores.resize(size_t(first_position + tokens));
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t keys = first_position + t + 1;
    const int64_t first = s.window > 0 ? std::max<int64_t>(0, keys - s.window) : 0;  // the sliding window's first key
    for (int64_t h = 0; h < s.q_heads; ++h) {
      const float* qh = q + t * s.ldq + h * D;
      const int64_t kvh = h / group;
      double max_score = -1e300;
      for (int64_t j = first; j < keys; ++j) {
        const float* kj = k_cache + j * KV + kvh * D;
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += double(qh[d]) * double(kj[d]);
        float score = float(dot * s.scale);
        if (s.softcap > 0) score = float(s.softcap) * std::tanh(score / float(s.softcap));
        scores[size_t(j)] = score;
        max_score = std::max(max_score, double(score));
      }
      double sum = 0;
      for (int64_t j = first; j < keys; ++j) sum += std::exp(double(scores[size_t(j)]) - max_score);
      float* o = out + t * s.q_heads * D + h * D;
      std::fill(o, o + D, 0.0f);
      for (int64_t j = first; j < keys; ++j) {
        const float w = float(std::exp(double(scores[size_t(j)]) - max_score) / sum);
        const float* vj = v_cache + j * KV + kvh * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * vj[d];
      }
    }
  }
}

}  // namespace keel::kernels
