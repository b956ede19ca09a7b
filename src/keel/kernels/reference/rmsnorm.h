// The reference backend's RMSNorm, in double from the float inputs, each output rounded once.
// Written from the formula, not from the CPU kernel (kernels/cpu/rmsnorm.cpp), so that a change
// there cannot move the yardstick it is measured against.
#pragma once
#include "keel/kernels/shapes.h"

namespace keel::kernels::reference {

// For each vector v of s.dim (s.heads per row of s.rows):
//   rstd = 1 / sqrt(mean(v^2) + eps),  y = (offset + w) * v * rstd;
// rstd [rows * heads] rounded to float; y written only at its vectors (padding left as it was).
void rmsnorm_forward(const RmsNormShape& s, const float* x, const float* w, float* y, float* rstd);

// With g = (offset + w) * dy:  dx = rstd * (g - v * rstd^2 * mean(g * v)) (+ residual), and
// dw[c] += sum over vectors of dy[c] * v[c] * rstd (dw null: frozen). rstd is the forward's, as
// saved (float).
void rmsnorm_backward(const RmsNormShape& s, const float* x, const float* w, const float* rstd, const float* dy,
                      float* dx, float* dw, const float* residual);

}  // namespace keel::kernels::reference
