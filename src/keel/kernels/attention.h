// Causal self-attention with grouped-query heads, computed flash-style (Dao et al. 2022):
// tiles of keys/values are visited with an online softmax, so no [T, T] matrix is ever held;
// the backward pass recomputes probabilities from the saved log-sum-exp.
#pragma once
#include <cstdint>

namespace keel::kernels {

struct AttentionShape {
  int64_t batch, seq;            // sequences in the micro-batch and their (padded) length
  int64_t q_heads, kv_heads;     // q_heads % kv_heads == 0; q head h reads kv head h / (q_heads/kv_heads)
  int64_t head_dim;
  int64_t ldq, ldk, ldv, ldo;    // row strides (elements between consecutive tokens)
  double scale;                  // usually 1/sqrt(head_dim)
};

// q: token t of sequence b at q + (b*seq + t)*ldq + h*head_dim; same layout for k, v, out.
// segments: optional [batch*seq] document ids; a query attends only to keys at earlier or equal
//   positions with the same id (block-diagonal causal mask for packed sequences). nullptr = one
//   document per sequence.
// lse: [batch, q_heads, seq] log-sum-exp of the scaled scores, saved for the backward pass.
template <typename T>
void attention_forward(const AttentionShape& s, const T* q, const T* k, const T* v,
                       const int32_t* segments, T* out, T* lse);

// dout has out's layout (row stride ldo). dq, dk, dv are overwritten (same layouts as q, k, v,
// with the same strides).
template <typename T>
void attention_backward(const AttentionShape& s, const T* q, const T* k, const T* v,
                        const int32_t* segments, const T* out, const T* lse, const T* dout, T* dq,
                        T* dk, T* dv);

}  // namespace keel::kernels
