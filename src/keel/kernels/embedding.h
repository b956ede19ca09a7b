// Token embedding lookup and its gradient (a scatter-add into the used rows).
#pragma once
#include <cstdint>

#include "keel/core/dtype.h"

namespace keel::kernels {

// out[i] = table[ids[i]]; ids are validated by the caller to be < vocab.
template <typename T>
void embedding_forward(const int32_t* ids, int64_t n, const T* table, int64_t hidden, T* out);
// The same from a bf16 table, widened to fp32 (exact).
void embedding_forward_bf16(const int32_t* ids, int64_t n, const bf16* table, int64_t hidden, float* out);
// dtable[ids[i]] += dout[i] (ACCUMULATES) for every i with ids[i] != padding_idx; deterministic
// whatever the thread count. padding_idx is torch's nn.Embedding(padding_idx=...): that row's
// lookups give it no gradient (-1: no such row). The row is still read in the forward pass, and
// a tied LM head still writes its gradient there: only the lookups' share is left out.
template <typename T>
void embedding_backward(const int32_t* ids, int64_t n, const T* dout, int64_t hidden, int64_t vocab,
                        int64_t padding_idx, T* dtable);

}  // namespace keel::kernels
