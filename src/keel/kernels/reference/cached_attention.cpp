#include "keel/kernels/reference/cached_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace keel::kernels::reference {

void cached_attention(const AttentionShape& s, const float* q, int64_t tokens, int64_t first_position,
                      const float* k_cache, const float* v_cache, float* out) {
  const int64_t D = s.head_dim, KV = s.kv_heads * D, group = s.q_heads / s.kv_heads;
  std::vector<double> score(static_cast<size_t>(first_position + tokens)), o(static_cast<size_t>(D));
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t p = first_position + t;
    for (int64_t h = 0; h < s.q_heads; ++h) {
      const float* qh = q + t * s.ldq + h * D;
      const int64_t kv = h / group;
      double top = -INFINITY;
      for (int64_t j = 0; j <= p; ++j) {
        if (!in_window(s.window, p, j)) continue;
        const float* k = k_cache + j * KV + kv * D;
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += double(qh[d]) * double(k[d]);
        double sj = s.scale * dot;
        if (s.softcap > 0) sj = s.softcap * std::tanh(sj / s.softcap);
        score[size_t(j)] = sj;
        top = std::max(top, sj);
      }
      double sum = 0;
      for (int64_t j = 0; j <= p; ++j)
        if (in_window(s.window, p, j)) sum += std::exp(score[size_t(j)] - top);
      std::fill(o.begin(), o.end(), 0.0);
      for (int64_t j = 0; j <= p; ++j) {
        if (!in_window(s.window, p, j)) continue;
        const double pj = std::exp(score[size_t(j)] - top) / sum;
        const float* v = v_cache + j * KV + kv * D;
        for (int64_t d = 0; d < D; ++d) o[size_t(d)] += pj * double(v[d]);
      }
      float* oh = out + t * s.q_heads * D + h * D;
      for (int64_t d = 0; d < D; ++d) oh[d] = float(o[size_t(d)]);
    }
  }
}

}  // namespace keel::kernels::reference
