#include "keel/kernels/reference/gemm.h"

namespace keel::kernels {

void gemm_reference(const GemmShape& s, const double* a, const double* b, double* c, double beta) {
  for (int64_t i = 0; i < s.m; ++i)
    for (int64_t j = 0; j < s.n; ++j) {
      double sum = 0;
      for (int64_t p = 0; p < s.k; ++p) {
        double av = s.trans_a == Trans::N ? a[i * s.lda + p] : a[p * s.lda + i];
        double bv = s.trans_b == Trans::N ? b[p * s.ldb + j] : b[j * s.ldb + p];
        sum += av * bv;
      }
      c[i * s.ldc + j] = sum + (beta == 0 ? 0.0 : beta * c[i * s.ldc + j]);
    }
}

}  // namespace keel::kernels
