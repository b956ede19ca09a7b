// Causal self-attention with grouped-query heads, flash-style (Dao et al. 2022): tiles of
// keys/values visited with an online softmax, scalar loops, the probabilities recomputed in the
// backward pass from the saved log-sum-exp. Templated so that the tests run it in double against
// finite differences and the reference backend runs the decoder on it; the CPU backend's blocked
// kernel (kernels/attention.h) is checked against it.
#pragma once
#include <cstdint>

#include "keel/kernels/shapes.h"

namespace keel::kernels {

// q: token t of sequence b at q + (b*seq + t)*ldq + h*head_dim; same layout for k, v, out.
// segments: optional [batch*seq] document ids; a query attends only to keys at earlier or equal
//   positions with the same id (block-diagonal causal mask for packed sequences). nullptr = one
//   document per sequence.
// lse: [batch, q_heads, seq] log-sum-exp of the scaled scores, saved for the backward pass.
template <typename T>
void attention_forward(const AttentionShape& s, const T* q, const T* k, const T* v, const int32_t* segments, T* out,
                       T* lse);

// dout has out's layout (row stride ldo). dq, dk, dv are overwritten (same layouts as q, k, v,
// with the same strides).
template <typename T>
void attention_backward(const AttentionShape& s, const T* q, const T* k, const T* v, const int32_t* segments,
                        const T* out, const T* lse, const T* dout, T* dq, T* dk, T* dv);

}  // namespace keel::kernels
