// RMSNorm (Zhang & Sennrich 2019) as in HF LlamaRMSNorm: y = x / sqrt(mean(x^2) + eps) * w, or
// Gemma's * (1 + w): weight_offset 1 (added to w in T first, as Gemma's 1.0 + weight.float()).
// The CPU backend's kernels; the shape (shapes.h: RmsNormShape) and the arguments' order are the
// seam's (Backend::rmsnorm_forward/backward).
#pragma once
#include "keel/core/dtype.h"
#include "keel/kernels/shapes.h"

namespace keel::kernels {

// Each vector of s normalised with w [dim] into y (y may be x); rstd [rows * heads] saved for
// the backward pass. y_bf16 (float only; may be null; laid out as y): bf16(y) as well, each row
// converted while it is still in cache — the next GEMM's input copy without a pass of its own.
template <typename T>
void rmsnorm_forward(const RmsNormShape& s, const T* x, const T* w, T* y, T* rstd, bf16* y_bf16 = nullptr);

// dx (overwritten) is the gradient w.r.t. x; dw is ACCUMULATED into (+=) so micro-batches add up
// (null: a frozen weight). residual (may be null; laid out as dx): the gradient reaching x past
// the norm (the residual stream's), added to dx in T as a separate add of the two would: one pass
// instead of two. dx_bf16 (float only; may be null; laid out as dx): bf16(dx) as well, for the
// GEMMs that read dx next.
template <typename T>
void rmsnorm_backward(const RmsNormShape& s, const T* x, const T* w, const T* rstd, const T* dy, T* dx, T* dw,
                      const T* residual = nullptr, bf16* dx_bf16 = nullptr);

}  // namespace keel::kernels
