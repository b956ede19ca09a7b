// The reference backend's attention of new tokens over a KV cache (generation), in double from the
// float inputs, each output rounded once. Written from the formula, not from the CPU's loop
// (kernels/cpu/cached_attention.cpp), so that a change there cannot move the yardstick.
#pragma once
#include <cstdint>

#include "keel/kernels/shapes.h"

namespace keel::kernels::reference {

// Query t (position p = first_position + t), head h, reading kv head h / (q_heads / kv_heads):
//   score_j = scale * q . k_j for the keys j <= p inside the window (p - window < j),
//             then softcap * tanh(score_j / softcap) where softcap > 0;
//   out = sum_j softmax(score)_j v_j.
// q [tokens, q_heads*head_dim] with row stride s.ldq; caches [positions, kv_heads*head_dim];
// out [tokens, q_heads*head_dim].
void cached_attention(const AttentionShape& s, const float* q, int64_t tokens, int64_t first_position,
                      const float* k_cache, const float* v_cache, float* out);

}  // namespace keel::kernels::reference
