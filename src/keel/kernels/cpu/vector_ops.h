// Elementwise row kernels compiled for several x86 levels and chosen once at run time.
//
// The library is built for the portable x86-64 baseline (SSE2), so code that should use AVX2 or
// AVX-512 where the CPU has it is compiled three times (vector_ops.cpp includes
// vector_ops_body.inc under different `#pragma GCC target`s) and called through this table.
// KEEL_ISA=portable|avx2|avx512 lowers the choice (never above what the CPU supports): CI runs
// the kernel tests on the portable path with it, so that path stays tested on AVX-512 machines.
// Every level computes the same formulas in the same order — its vectors are its register width,
// and its sums add the same 16 (or 8) logical lanes — so results may differ only in the last bit
// where a level fuses a multiply-add.
#pragma once
#include <cstdint>
#include <string_view>

#include "keel/core/dtype.h"

namespace keel::kernels {

enum class Isa : uint8_t { Portable, Avx2, Avx512 };
std::string_view isa_name(Isa isa);  // "portable", "avx2", "avx512"

// A key mask for a row of scores: lane c is visible when first <= c < visible and, with packed
// documents, seg[c] == own (seg null: no documents).
struct RowVisibility {
  int64_t visible;
  const int32_t* seg;
  int32_t own;
  int64_t first = 0;  // keys before it are outside a sliding window
};

// AdamW's fp32 constants of one step, formed as torch forms them (adamw.cpp).
struct AdamWConstants {
  float decay, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_step_size, bias_correction2_sqrt, eps;
  float grad_scale = 1.0f;  // the clipping coefficient, g * grad_scale first (AdamWStep::grad_scale)
};

struct VectorOps {
  Isa isa;
  // max over visible c of s[c]; -inf when none is visible.
  float (*masked_max)(const float* s, RowVisibility mask);
  // s[c] = visible ? exp(s[c]*scale - shift) : 0 for c < n; returns the sum.
  float (*exp_and_sum)(float* s, int64_t n, float scale, float shift, RowVisibility mask);
  // Softmax backward from scores: p = visible ? exp(s*scale - lse) : 0, D = sum over c of
  // p * dp[c], then s[c] = p and dp[c] = scale * p * (dp[c] - D), for c < n. D is this row's own,
  // not dO . O (attention_blocked.cpp says why). Results below 1.2e-38 are flushed to zero
  // (denormals cost a microcode assist per lane; vector_ops.cpp).
  void (*softmax_grad)(float* s, float* dp, int64_t n, float scale, float lse, RowVisibility mask);
  // The same p and dp written as bf16, to p_out and ds_out (s is left holding p in fp32, dp as it
  // was): bf16 attention's backward needs nothing else of the row, and skips a pass over it.
  void (*softmax_grad_to_bf16)(float* s, const float* dp, int64_t n, float scale, float lse, RowVisibility mask,
                               bf16* p_out, bf16* ds_out);
  // dst[c] = bf16(src[c] * factor), round to nearest even.
  void (*scale_to_bf16)(const float* src, float factor, bf16* dst, int64_t n);
  // x[c] *= factor.
  void (*scale)(float* x, float factor, int64_t n);
  // x[c] = exp(x[c] - shift) for c < n; returns the sum, accumulated in double (a vocabulary-long
  // sum of floats would lose the small terms).
  double (*exp_sum_f64)(float* x, int64_t n, float shift);
  // SwiGLU: out = g / (1 + exp(-g)) * u, and its backward: du = dy * silu(g),
  // dg = dy * u * sig * (1 + g * (1 - sig)) with sig = 1 / (1 + exp(-g)).
  void (*silu_mul)(const float* g, const float* u, float* out, int64_t n);
  void (*silu_mul_backward)(const float* g, const float* u, const float* dy, float* dg, float* du, int64_t n);
  // GeGLU: out = gelu_tanh(g) * u with torch's tanh approximation, and its backward (glu.cpp has
  // the formulas); tanh through exp: 1 - 2 / (exp(2x) + 1), within 1e-7 of tanh absolutely.
  void (*gelu_tanh_mul)(const float* g, const float* u, float* out, int64_t n);
  void (*gelu_tanh_mul_backward)(const float* g, const float* u, const float* dy, float* dg, float* du, int64_t n);
  // Soft-capping: x[c] = cap * tanh(x[c] * scale / cap) (scale, divide, tanh, multiply, as
  // transformers), and when slope is not null slope[c] = scale * (1 - tanh^2), for c < n.
  void (*soft_cap)(float* x, int64_t n, float scale, float cap, float* slope);
  // sum over c < n of x[c] * float(w[c]): fp32 products in four 8-lane accumulators, then across
  // lanes, then the last n % 8 terms.
  float (*dot_bf16)(const float* x, const bf16* w, int64_t n);
  // out[r] = the same sum for the rows w + r * ld, r < 4, in one pass (one 8-lane accumulator per
  // row, x loaded once for the four).
  void (*dot4_bf16)(const float* x, const bf16* w, int64_t ld, int64_t n, float* out);
  // RMSNorm's backward for one row of dim (kernels/rmsnorm.h): dx = rstd * (g - x * rstd^2 *
  // mean(g * x)) with g = (w + offset) * dy, in double (the mean's sum in 8 lanes), rounded to
  // float, plus residual (may be null: the gradient flowing past the norm) in float. Levels with
  // FMA fuse the double multiply-adds, so they may differ from the portable level in dx's last bit.
  void (*rmsnorm_row_backward)(const float* x, const float* w, float offset, float rstd, const float* dy, int64_t dim,
                               float* dx, const float* residual);
  // acc[c] += double(a[c]) * (double(b[c]) * s): the norm weight gradient's rows, in double.
  void (*accumulate_scaled_products_f64)(double* acc, const float* a, const float* b, double s, int64_t n);
  // AdamW over n parameters, torch's fp32 operations one rounding each (kernels/adamw.h has the
  // formula), and w_bf16 (when not null) the updated weights in bf16. Defined in adamw.cpp, which
  // is compiled without multiply-add contraction: every level gives the same bits.
  void (*adamw)(float* w, const float* g, float* m, float* v, int64_t n, const AdamWConstants& k, bf16* w_bf16);
  // sum over i < n of double(x[i])^2 in 8 double lanes (lane i % 8), added lane by lane at the end;
  // a product and a sum each rounded on their own (adamw.cpp: no contraction), so every level gives
  // the same bits. One block of the gradient norm (kernels/adamw.h: sum_of_squares).
  double (*sum_of_squares_f64)(const float* x, int64_t n);
  // The bf16 conversions above with the result widened back, for a CPU whose bf16 products widen
  // their inputs to fp32 anyway (kernels/gemm.h): the values a bf16 operand holds, kept as fp32.
  // dst[c] = float(bf16(src[c] * factor)); dst may be src.
  void (*scale_round_bf16)(const float* src, float factor, float* dst, int64_t n);
  // softmax_grad in place, its two results rounded as softmax_grad_to_bf16 rounds them (ds from
  // the unrounded p).
  void (*softmax_grad_round_bf16)(float* s, float* dp, int64_t n, float scale, float lse, RowVisibility mask);
  // dst[c] = float(src[c]), exact: a widened product's operand tiles (gemm.cpp), a register of
  // bf16 zero-extended and shifted at a time (the portable core/dtype.h loop runs at SSE2's width).
  void (*widen_bf16)(const bf16* src, float* dst, int64_t n);
};

// The table for this CPU (and KEEL_ISA), chosen on first use.
const VectorOps& vector_ops();
// The table of one level; throws keel::Error when this CPU lacks it. For tests.
const VectorOps& vector_ops_for(Isa isa);
// The best level this CPU supports.
Isa cpu_isa();

}  // namespace keel::kernels
