// AdamW (Loshchilov & Hutter 2019) with exactly torch.optim.AdamW's fp32 arithmetic:
//   w *= 1 - lr*wd;  m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g;
//   denom = sqrt(v) / sqrt(1 - b2^t) + eps;  w -= lr / (1 - b1^t) * m / denom.
#pragma once
#include <cstdint>

#include "keel/core/dtype.h"
#include "keel/kernels/shapes.h"

namespace keel::kernels {

// Updates n parameters in place. weight_decay is per call (0 for biases and norm weights).
// If w_bf16 is not null it receives the bf16 copy of the updated weights (compute copy).
void adamw_update(float* w, const float* g, float* m, float* v, int64_t n, const AdamWStep& s, double weight_decay,
                  bf16* w_bf16);

// Sum of squares in double (for the global gradient norm of clip_grad_norm_).
double sum_of_squares(const float* x, int64_t n);
void scale_in_place(float* x, int64_t n, float factor);

}  // namespace keel::kernels
