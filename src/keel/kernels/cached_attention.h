// Attention of new tokens over a KV cache (generation), one query row at a time: latency-bound on
// one sequence, so no blocking and no threads. Both backends run this body: the CPU one in float
// (scores rounded to float, the softmax's sums in double), the reference one in double.
#pragma once
#include <cstdint>

#include "keel/kernels/shapes.h"

namespace keel::kernels {

// q [tokens, q_heads*head_dim] (row stride s.ldq) at positions first_position.. over caches of
// [positions, kv_heads*head_dim]; causal, with s's scale, sliding window and soft cap;
// out [tokens, q_heads*head_dim].
template <typename T>
void cached_attention(const AttentionShape& s, const T* q, int64_t tokens, int64_t first_position, const T* k_cache,
                      const T* v_cache, T* out);

}  // namespace keel::kernels
