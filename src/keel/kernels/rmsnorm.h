// RMSNorm (Zhang & Sennrich 2019) as in HF LlamaRMSNorm: y = x / sqrt(mean(x^2) + eps) * w.
#pragma once
#include <cstdint>

namespace keel::kernels {

// x, y: [rows, dim]; w: [dim]; rstd: [rows] saved for the backward pass.
template <typename T>
void rmsnorm_forward(const T* x, const T* w, int64_t rows, int64_t dim, double eps, T* y, T* rstd);

// dx = (overwritten) gradient w.r.t. x; dw is ACCUMULATED into (+=) so micro-batches add up.
template <typename T>
void rmsnorm_backward(const T* x, const T* w, const T* rstd, const T* dy, int64_t rows, int64_t dim, T* dx, T* dw);

}  // namespace keel::kernels
