// bf16 products larger than one widened tile (kernels/gemm.h: kWidenedOperandElements), against
// the same products in double. Where oneDNN has no bf16 matmul (AVX2, and the portable run's
// ONEDNN_MAX_CPU_ISA=AVX2) they run as fp32 products over widened tiles — cut along K, M or N by
// which operand is too large — and these are the shapes that cut each way; with a native bf16
// matmul they check that path on the same shapes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "keel/core/dtype.h"
#include "keel/kernels/gemm.h"

namespace keel::kernels {
namespace {

struct Case {
  Trans ta, tb;
  int64_t m, n, k;
  const char* cut;  // how a widened product is tiled
};

std::vector<bf16> random_bf16(size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<bf16> v(count);
  for (auto& x : v) x = float_to_bf16(u(rng));
  return v;
}

void expect_product_matches_double(const Case& c, float beta) {
  SCOPED_TRACE(::testing::Message() << c.cut << " m " << c.m << " n " << c.n << " k " << c.k << " ta " << int(c.ta)
                                    << " tb " << int(c.tb) << " beta " << beta);
  // Padded leading dimensions: the tiles must follow them, and leave C's padding alone.
  const int64_t lda = (c.ta == Trans::N ? c.k : c.m) + 3, ldb = (c.tb == Trans::N ? c.n : c.k) + 5, ldc = c.n + 2;
  const int64_t a_rows = c.ta == Trans::N ? c.m : c.k, b_rows = c.tb == Trans::N ? c.k : c.n;
  const std::vector<bf16> a = random_bf16(size_t(a_rows * lda), 11), b = random_bf16(size_t(b_rows * ldb), 12);
  auto at = [&](int64_t i, int64_t p) {
    return double(bf16_to_float(c.ta == Trans::N ? a[i * lda + p] : a[p * lda + i]));
  };
  auto bt = [&](int64_t p, int64_t j) {
    return double(bf16_to_float(c.tb == Trans::N ? b[p * ldb + j] : b[j * ldb + p]));
  };
  std::vector<float> out(size_t(c.m * ldc));
  for (size_t i = 0; i < out.size(); ++i) out[i] = float(i % 7) - 3.0f;  // C's earlier contents
  const std::vector<float> before = out;
  gemm_bf16(GemmShape{c.ta, c.tb, c.m, c.n, c.k, lda, ldb, ldc}, a.data(), b.data(), out.data(), beta);
  for (int64_t i = 0; i < c.m; ++i) {
    for (int64_t j = 0; j < ldc; ++j) {
      const size_t at_c = size_t(i * ldc + j);
      if (j >= c.n) {
        ASSERT_EQ(out[at_c], before[at_c]) << "padding of row " << i << " written";
        continue;
      }
      double want = beta * double(before[at_c]), magnitude = std::fabs(want);
      for (int64_t p = 0; p < c.k; ++p) {
        const double term = at(i, p) * bt(p, j);
        want += term;
        magnitude += std::fabs(term);
      }
      // fp32 accumulation of exact products: a few float roundings of the running magnitude.
      ASSERT_NEAR(out[at_c], want, 2e-6 * magnitude + 1e-6) << "C[" << i << ", " << j << "]";
    }
  }
}

TEST(GemmWidening, ProductsLargerThanOneTileMatchDouble) {
  const int64_t E = int64_t(kWidenedOperandElements);
  const std::vector<Case> cases = {
      // both whole operands over a tile: cut along K, the chunks accumulate into C
      {Trans::N, Trans::N, 48, 72, E / 48 + 3000, "K"},
      {Trans::T, Trans::T, 48, 72, E / 48 + 3000, "K"},
      // only A over a tile: cut along M
      {Trans::N, Trans::N, E / 480 + 700, 8, 480, "M"},
      {Trans::T, Trans::T, E / 480 + 700, 8, 480, "M"},
      // only B over a tile: cut along N
      {Trans::N, Trans::T, 8, E / 480 + 700, 480, "N"},
      {Trans::T, Trans::N, 8, E / 480 + 700, 480, "N"},
  };
  for (const Case& c : cases)
    for (float beta : {0.0f, 1.0f}) expect_product_matches_double(c, beta);
}

}  // namespace
}  // namespace keel::kernels
