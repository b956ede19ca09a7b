// Dense matrix products through oneDNN matmul primitives, created once per shape and cached.
// All matrices are row-major. op(X) is X or its transpose. C = op(A) * op(B) + beta * C.
// A linear layer with HF weight W [out, in] is y = x W^T: gemm(N, T, tokens, out, in, x, W, y).
#pragma once
#include <cstdint>

#include "keel/core/dtype.h"

namespace keel::kernels {

enum class Trans : uint8_t { N, T };

struct GemmShape {
  Trans trans_a, trans_b;
  int64_t m, n, k;
  int64_t lda, ldb, ldc;  // leading dimensions (row strides in elements) as stored
};

// beta must be 0 (overwrite) or 1 (accumulate into C, as for gradients).
void gemm_f32(const GemmShape& s, const float* a, const float* b, float* c, float beta);
// bf16 inputs, fp32 accumulation and fp32 output. Where oneDNN has no bf16 matmul for this CPU
// (x86 before AVX-512), the inputs are widened to fp32 (exactly) and an fp32 matmul runs.
void gemm_bf16(const GemmShape& s, const bf16* a, const bf16* b, float* c, float beta);
// Builds the calling thread's plan for this product now, as its first gemm_f32 (bf16_inputs =
// false) or gemm_bf16 call would: a step loop that meets the shape later allocates nothing.
void gemm_prepare(const GemmShape& s, bool bf16_inputs, float beta);
// True once some gemm_bf16 call had to widen its inputs (reported with the run's kernels).
bool gemm_bf16_emulated();
// Whether oneDNN has a bf16 matmul on this CPU (probed once), for the run's report.
bool bf16_matmul_native();
// Plain triple loop in double: the reference the kernels' tests compare against.
void gemm_reference(const GemmShape& s, const double* a, const double* b, double* c, double beta);

// Convenience for the common case of tightly packed operands.
inline GemmShape packed_gemm(Trans ta, Trans tb, int64_t m, int64_t n, int64_t k) {
  return {ta, tb, m, n, k, ta == Trans::N ? k : m, tb == Trans::N ? n : k, n};
}

// Measures the bf16 (or f32) matmul throughput of this machine on a large square GEMM, in FLOP/s.
double measure_matmul_peak(bool use_bf16, int64_t size = 2048, int repeats = 5);

}  // namespace keel::kernels
