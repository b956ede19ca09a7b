// RMSNorm (Zhang & Sennrich 2019) as in HF LlamaRMSNorm: y = x / sqrt(mean(x^2) + eps) * w, or
// Gemma's * (1 + w): weight_offset 1 (added to w in T first, as Gemma's 1.0 + weight.float()).
#pragma once
#include <cstdint>

#include "keel/core/dtype.h"

namespace keel::kernels {

// x, y: [rows, dim]; w: [dim]; rstd: [rows] saved for the backward pass. y_bf16 (float only;
// may be null): bf16(y) as well, each row converted while it is still in cache — the next GEMM's
// input copy without a pass of its own.
template <typename T>
void rmsnorm_forward(const T* x, const T* w, int64_t rows, int64_t dim, double eps, T* y, T* rstd,
                     double weight_offset = 0.0, bf16* y_bf16 = nullptr);

// dx = (overwritten) gradient w.r.t. x; dw is ACCUMULATED into (+=) so micro-batches add up.
// residual (may be null; laid out as dx): the gradient reaching x past the norm (the residual
// stream's), added to dx in T as a separate add of the two would: one pass instead of two.
// dx_bf16 (float only; may be null): bf16(dx) as well, for the GEMMs that read dx next.
template <typename T>
void rmsnorm_backward(const T* x, const T* w, const T* rstd, const T* dy, int64_t rows, int64_t dim, T* dx, T* dw,
                      double weight_offset = 0.0, const T* residual = nullptr, bf16* dx_bf16 = nullptr);

// The same norm applied to each of `heads` vectors of `dim` in a token's row (Qwen3's q_norm and
// k_norm: one weight shared by the heads): token t's head h is at x + t * ldx + h * dim, and at
// the same place in y (row stride ldy; y may be x), dy and dx with their strides; rstd
// [tokens * heads]. rmsnorm_forward/backward are the case heads = 1, ld = dim.
template <typename T>
void head_rmsnorm_forward(const T* x, int64_t ldx, const T* w, int64_t tokens, int64_t heads, int64_t dim, double eps,
                          T* y, int64_t ldy, T* rstd, double weight_offset = 0.0, bf16* y_bf16 = nullptr);
template <typename T>
void head_rmsnorm_backward(const T* x, int64_t ldx, const T* w, const T* rstd, const T* dy, int64_t ldy, int64_t tokens,
                           int64_t heads, int64_t dim, T* dx, int64_t lddx, T* dw, double weight_offset = 0.0,
                           const T* residual = nullptr, bf16* dx_bf16 = nullptr);

}  // namespace keel::kernels
