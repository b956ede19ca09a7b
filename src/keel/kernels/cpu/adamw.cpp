// AdamW (Loshchilov & Hutter 2019) reproducing torch.optim.AdamW's single-tensor path
// (torch 1.13 `_single_tensor_adamw`) operation by operation in fp32:
//   param.mul_(1 - lr*wd)
//   exp_avg.mul_(b1).add_(grad, alpha=1-b1)            -> m = fma(g, 1-b1, m*b1)
//   exp_avg_sq.mul_(b2).addcmul_(grad, grad, 1-b2)     -> v = v*b2 + ((1-b2)*g)*g
//   denom = (exp_avg_sq.sqrt() / sqrt(1-b2^t)).add_(eps)
//   param.addcdiv_(exp_avg, denom, value=-lr/(1-b1^t)) -> w = w + (-step_size*m) / denom
// Scalars are formed in double (Python floats) and rounded to fp32 where torch rounds them.
#include "keel/kernels/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "keel/core/threads.h"
#include "keel/kernels/cpu/vector_ops.h"

namespace keel::kernels {
namespace {

// fp32 a*b + c with a single rounding, as torch's vectorised add_ (vec::fmadd) computes it.
// a*b is exact in double, so the double sum is one rounding away from the exact result; rounding
// that to float is then correct unless the double landed exactly on a float rounding boundary
// (its 29 bits below float precision read 1000...0) or in float's subnormal range, where the
// library fmaf decides. This keeps the common case free of a function call on CPUs where the
// baseline build has no FMA instruction.
inline float fused_multiply_add(float a, float b, float c) {
  const double r = double(a) * double(b) + double(c);
  uint64_t bits;
  std::memcpy(&bits, &r, sizeof bits);
  const bool on_boundary = (bits & 0x1fffffffu) == 0x10000000u;
  const bool tiny = r != 0.0 && std::fabs(r) < 0x1p-125;
  if (on_boundary || tiny) return std::fma(a, b, c);
  return float(r);
}

// Elements per block of sum_of_squares: block sums are always formed the same way and added in
// block order, so the result is independent of the number of threads.
constexpr int64_t kSquaresBlock = int64_t(1) << 14;
constexpr int64_t kBlocksPerRound = 256;

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMinElements = int64_t(1) << 15;

}  // namespace

// The AdamW row of each instruction-set level (VectorOps::adamw). This file is compiled with
// -ffp-contract=off (CMakeLists.txt): the compiler may not fuse `v * beta2 + ...` or
// `w * decay + ...` into one rounding, which torch does not do, and with -fno-math-errno, so that
// sqrt is the instruction (v is never negative). Where the level has FMA, m's update is the
// instruction (torch's vectorised add_ is an fmadd); the portable level rounds it in double.
#define KEEL_ADAMW_FMA fused_multiply_add
namespace isa_portable {
#include "keel/kernels/cpu/adamw_row.inc"
}  // namespace isa_portable
#undef KEEL_ADAMW_FMA

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define KEEL_ADAMW_FMA std::fma
namespace isa_avx2 {
#include "keel/kernels/cpu/adamw_row.inc"
}  // namespace isa_avx2
#undef KEEL_ADAMW_FMA
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define KEEL_ADAMW_FMA std::fma
namespace isa_avx512 {
#include "keel/kernels/cpu/adamw_row.inc"
}  // namespace isa_avx512
#undef KEEL_ADAMW_FMA
#pragma GCC pop_options

void adamw_update(float* w, const float* g, float* m, float* v, int64_t n, const AdamWStep& s, double weight_decay,
                  bf16* w_bf16) {
  const double bias_correction1 = 1.0 - std::pow(s.beta1, double(s.step));
  const double bias_correction2 = 1.0 - std::pow(s.beta2, double(s.step));
  const AdamWConstants k{.decay = float(1.0 - s.lr * weight_decay),
                         .beta1 = float(s.beta1),
                         .one_minus_beta1 = float(1.0 - s.beta1),
                         .beta2 = float(s.beta2),
                         .one_minus_beta2 = float(1.0 - s.beta2),
                         .neg_step_size = float(-(s.lr / bias_correction1)),
                         .bias_correction2_sqrt = float(std::sqrt(bias_correction2)),
                         .eps = float(s.eps),
                         .grad_scale = float(s.grad_scale)};
  const VectorOps& ops = vector_ops();
  parallel_for(n, n >= kParallelMinElements, [&](int64_t begin, int64_t end) {
    ops.adamw(w + begin, g + begin, m + begin, v + begin, end - begin, k, w_bf16 ? w_bf16 + begin : nullptr);
  });
}

double sum_of_squares(const float* x, int64_t n) {
  const int64_t blocks = (n + kSquaresBlock - 1) / kSquaresBlock;
  double partial[kBlocksPerRound];
  double total = 0;
  const VectorOps& ops = vector_ops();  // the block sums on this CPU's level: the same bits on every level
  for (int64_t first = 0; first < blocks; first += kBlocksPerRound) {
    const int64_t count = std::min(kBlocksPerRound, blocks - first);
    parallel_for(count, count > 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t begin = (first + b) * kSquaresBlock;
        partial[b] = ops.sum_of_squares_f64(x + begin, std::min(kSquaresBlock, n - begin));
      }
    });
    for (int64_t b = 0; b < count; ++b) total += partial[b];
  }
  return total;
}

void scale_in_place(float* x, int64_t n, float factor) {
  parallel_for(n, n >= kParallelMinElements, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) x[i] *= factor;
  });
}

}  // namespace keel::kernels
