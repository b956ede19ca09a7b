// The CPU backend's attention of new tokens over a KV cache (generation), one query row at a time:
// latency-bound on one sequence, so no blocking and no threads; scores rounded to float, the
// softmax's sums in double. (The reference backend has its own, in double:
// reference/cached_attention.h.)
#pragma once
#include <cstdint>

#include "keel/kernels/shapes.h"

namespace keel::kernels {

// q [tokens, q_heads*head_dim] (row stride s.ldq) at positions first_position.. over caches of
// [positions, kv_heads*head_dim]; causal, with s's scale, sliding window and soft cap;
// out [tokens, q_heads*head_dim].
void cached_attention(const AttentionShape& s, const float* q, int64_t tokens, int64_t first_position,
                      const float* k_cache, const float* v_cache, float* out);

}  // namespace keel::kernels
