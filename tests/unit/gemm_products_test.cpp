// Products that kernels/gemm.cpp cuts into pieces, against the same products in double:
// - bf16 products larger than one widened tile (kernels/gemm.h: kWidenedOperandElements). Where
//   oneDNN has no bf16 matmul (AVX2, and the portable run's ONEDNN_MAX_CPU_ISA=AVX2) they run as
//   fp32 products over widened tiles — cut along K, M or N by which operand is too large — and
//   these are the shapes that cut each way; with a native bf16 matmul they check that path on the
//   same shapes.
// - fp32 products longer than kKChunk, which run as K-chunks accumulating into C.
// - bf16 products split over the threads, one single-threaded product a thread.
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <random>
#include <vector>

#include "keel/core/dtype.h"
#include "keel/kernels/backend.h"
#include "keel/kernels/bf16_widening.h"
#include "keel/kernels/gemm.h"
#include "finite_difference.h"

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

// The product of bf16 values, by gemm_bf16, or (`fp32`) by gemm_f32 on the same values in fp32, once
// for each beta. The double reference is computed once per case, over rows of A and columns of B
// copied contiguous: these shapes are a few hundred million products, and the strided reads and
// conversions per term were most of the unit tests' time under the sanitizers.
void expect_product_matches_double(const Case& c, std::initializer_list<float> betas, bool fp32 = false) {
  // Padded leading dimensions: the tiles must follow them, and leave C's padding alone.
  const int64_t lda = (c.ta == Trans::N ? c.k : c.m) + 3, ldb = (c.tb == Trans::N ? c.n : c.k) + 5, ldc = c.n + 2;
  const int64_t a_rows = c.ta == Trans::N ? c.m : c.k, b_rows = c.tb == Trans::N ? c.k : c.n;
  const std::vector<bf16> a = random_bf16(size_t(a_rows * lda), 11), b = random_bf16(size_t(b_rows * ldb), 12);
  // A as m rows of k, B as n rows of k (B transposed), in double.
  std::vector<double> a_rows_k(size_t(c.m * c.k)), b_cols_k(size_t(c.n * c.k));
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t p = 0; p < c.k; ++p)
      a_rows_k[size_t(i * c.k + p)] = double(bf16_to_float(c.ta == Trans::N ? a[i * lda + p] : a[p * lda + i]));
  for (int64_t j = 0; j < c.n; ++j)
    for (int64_t p = 0; p < c.k; ++p)
      b_cols_k[size_t(j * c.k + p)] = double(bf16_to_float(c.tb == Trans::N ? b[p * ldb + j] : b[j * ldb + p]));
  // A·B and the sum of the terms' magnitudes, per element of C.
  std::vector<double> product(size_t(c.m * c.n)), magnitude(size_t(c.m * c.n));
  for (int64_t i = 0; i < c.m; ++i) {
    const double* row = a_rows_k.data() + i * c.k;
    for (int64_t j = 0; j < c.n; ++j) {
      const double* col = b_cols_k.data() + j * c.k;
      double sum = 0.0, size = 0.0;
      for (int64_t p = 0; p < c.k; ++p) {
        const double term = row[p] * col[p];
        sum += term;
        size += std::fabs(term);
      }
      product[size_t(i * c.n + j)] = sum;
      magnitude[size_t(i * c.n + j)] = size;
    }
  }
  const GemmShape shape{c.ta, c.tb, c.m, c.n, c.k, lda, ldb, ldc};
  for (const float beta : betas) {
    SCOPED_TRACE(::testing::Message() << c.cut << " m " << c.m << " n " << c.n << " k " << c.k << " ta " << int(c.ta)
                                      << " tb " << int(c.tb) << " beta " << beta << (fp32 ? " fp32" : " bf16"));
    std::vector<float> out(size_t(c.m * ldc));
    for (size_t i = 0; i < out.size(); ++i) out[i] = float(i % 7) - 3.0f;  // C's earlier contents
    const std::vector<float> before = out;
    if (fp32) {
      std::vector<float> fa(a.size()), fb(b.size());
      std::transform(a.begin(), a.end(), fa.begin(), bf16_to_float);
      std::transform(b.begin(), b.end(), fb.begin(), bf16_to_float);
      gemm_f32(shape, fa.data(), fb.data(), out.data(), beta);
    } else {
      gemm_bf16(shape, a.data(), b.data(), out.data(), beta);
    }
    for (int64_t i = 0; i < c.m; ++i) {
      for (int64_t j = 0; j < ldc; ++j) {
        const size_t at_c = size_t(i * ldc + j);
        if (j >= c.n) {
          ASSERT_EQ(out[at_c], before[at_c]) << "padding of row " << i << " written";
          continue;
        }
        const double earlier = beta * double(before[at_c]);
        const double want = earlier + product[size_t(i * c.n + j)];
        // fp32 accumulation of exact products: a few float roundings of the running magnitude.
        const double bound = 2e-6 * (std::fabs(earlier) + magnitude[size_t(i * c.n + j)]) + 1e-6;
        ASSERT_NEAR(out[at_c], want, bound) << "C[" << i << ", " << j << "]";
      }
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
    expect_product_matches_double(c, {0.0f, 1.0f});
}

// Every transpose of an fp32 product three chunks long (two whole chunks and a remainder): each
// chunk must start at its own column of A (row of a transposed A) and row of B (column of a
// transposed B), the first overwrite C or add to it as beta says and the rest add.
TEST(GemmKChunks, LongFp32ProductsMatchDouble) {
  const int64_t k = 2 * kKChunk + 333;
  for (Trans ta : {Trans::N, Trans::T})
    for (Trans tb : {Trans::N, Trans::T})
      expect_product_matches_double({ta, tb, 37, 53, k, "K chunks"}, {0.0f, 1.0f}, true);
  // One chunk exactly: not cut.
  expect_product_matches_double({Trans::N, Trans::N, 37, 53, kKChunk, "one chunk"}, {1.0f}, true);
}

// bf16 products wide enough for keel's split over two threads (gemm.cpp: ThreadSplit): columns
// of C for a product of A, rows for one of A^T (a weight gradient), in parts of unequal width
// (1,000 = 512 + 488), with every leading dimension padded; each part must read its own columns
// of B (rows of a transposed B) or rows of A^T and write its own block of C, as beta says.
TEST(GemmThreadSplit, SplitProductsMatchDouble) {
  test::with_threads(2, [] {
    if (!bf16_products_split()) GTEST_SKIP() << "no native bf16 matmul, or one thread: nothing is split";
    for (Trans tb : {Trans::N, Trans::T}) {
      expect_product_matches_double({Trans::N, tb, 40, 1000, 96, "N split"}, {0.0f, 1.0f});
      expect_product_matches_double({Trans::T, tb, 1000, 40, 96, "M split"}, {0.0f, 1.0f});
    }
    expect_product_matches_double({Trans::N, Trans::T, 40, 511, 96, "too narrow to split"}, {0.0f});
  });
}

// A product of bf16 operands at a and b, into a zeroed C.
std::vector<float> product(const GemmShape& s, const bf16* a, const bf16* b) {
  std::vector<float> c(size_t(s.m * s.ldc), 0.0f);
  gemm_bf16(s, a, b, c.data(), 0.0f);
  return c;
}

// A module's columns of a fused output gradient held (as the decoder holds them for dB and du),
// then every value of the gradient changed: while held, products over those columns read the copy
// made at the hold (where products widen), so they give the original values' products.
TEST(GemmWidening, HeldMatricesAreWidenedOnceAndReadUntilReleased) {
  const int64_t N = 300, ld = 112, cols = 40, col0 = 24, r = 8;  // col0 + 2 cols <= ld: `beside` fits
  std::vector<bf16> dy = random_bf16(size_t(N * ld), 21);
  const std::vector<bf16> u = random_bf16(size_t(N * r), 22), bw = random_bf16(size_t(cols * r), 23);
  const bf16* slice = dy.data() + col0;          // [N, cols], leading dimension ld
  const bf16* beside = dy.data() + col0 + cols;  // the columns next to it, not held
  // dB = dy[:, cols]^T u and du = dy[:, cols] B: the slice as A, transposed and not.
  const GemmShape db{Trans::T, Trans::N, cols, r, N, ld, r, r}, du{Trans::N, Trans::N, N, r, cols, ld, r, r};
  const std::vector<float> db_want = product(db, slice, u.data()), du_want = product(du, slice, bw.data());
  const std::vector<float> beside_before = product(du, beside, bw.data());

  std::vector<float> copy(size_t(N * cols));
  gemm_hold_widened(1, slice, N, cols, ld, copy.data());
  for (auto& v : dy) v = float_to_bf16(bf16_to_float(v) + 1.0f);
  const std::vector<float> db_held = product(db, slice, u.data()), du_held = product(du, slice, bw.data());
  const std::vector<float> beside_held = product(du, beside, bw.data());
  gemm_release_widened(1);
  const std::vector<float> db_released = product(db, slice, u.data());

  if (!bf16_matmul_native()) {
    EXPECT_EQ(db_held, db_want) << "dB read the held copy: the unheld product's bits";
    EXPECT_EQ(du_held, du_want) << "du read the held copy: the unheld product's bits";
  } else {  // nothing is held where oneDNN multiplies bf16 itself
    EXPECT_EQ(db_held, db_released);
  }
  EXPECT_NE(db_released, db_want) << "after the release the operand is read as it is";
  EXPECT_NE(beside_held, beside_before) << "a product over columns outside the held block reads them as they are";
}

// The held matrix as operand B (dA = du^T x) and as an A cut into M tiles (one larger than a
// widened tile): tiles are read at their offsets in the copy.
TEST(GemmWidening, HeldOperandsAreReadTileByTile) {
  const bool widens = !bf16_matmul_native();
  const int64_t E = int64_t(kWidenedOperandElements), cols = 480, rows = E / cols + 700, r = 8;
  std::vector<bf16> x = random_bf16(size_t(rows * cols), 31);
  const std::vector<bf16> du = random_bf16(size_t(rows * r), 32), a_w = random_bf16(size_t(r * cols), 33);
  const GemmShape da{Trans::T, Trans::N, r, cols, rows, r, cols, cols};  // x as B
  const GemmShape u{Trans::N, Trans::T, rows, r, cols, cols, cols, r};   // x as A, cut along M
  std::vector<float> da_want(size_t(r * cols)), u_want(size_t(rows * r));
  gemm_bf16(da, du.data(), x.data(), da_want.data(), 0.0f);
  gemm_bf16(u, x.data(), a_w.data(), u_want.data(), 0.0f);

  std::vector<float> copy(size_t(rows * cols));
  gemm_hold_widened(0, x.data(), rows, cols, cols, copy.data());
  for (auto& v : x) v = float_to_bf16(-bf16_to_float(v));
  std::vector<float> da_held(da_want.size()), u_held(u_want.size());
  gemm_bf16(da, du.data(), x.data(), da_held.data(), 0.0f);
  gemm_bf16(u, x.data(), a_w.data(), u_held.data(), 0.0f);
  gemm_release_widened(0);
  if (widens) {
    EXPECT_EQ(da_held, da_want);
    EXPECT_EQ(u_held, u_want);
  } else {
    EXPECT_NE(da_held, da_want);
    EXPECT_NE(u_held, u_want);
  }
}

// Widening is the CPU backend's own interface, not Backend's: the CPU offers it and it says what
// gemm_bf16 does; the reference, whose products read bf16 as they are, offers none.
TEST(GemmWidening, OnlyTheCpuBackendOffersIt) {
  Bf16Widening* cpu = bf16_widening(backend_named("cpu"));
  ASSERT_NE(cpu, nullptr);
  EXPECT_EQ(cpu->widens(), !bf16_matmul_native());
  EXPECT_EQ(widens_bf16_products(backend_named("cpu")), !bf16_matmul_native());
  EXPECT_EQ(bf16_widening(backend_named("reference")), nullptr);
  EXPECT_FALSE(widens_bf16_products(backend_named("reference")));
}

// The choice of how bf16 products run (gemm.h: bf16_products) keeps its rule, and a widened product
// is the fp32 product of its operands widened, bit for bit. CTest runs these tests again with
// KEEL_BF16_MATMUL=native and =widened (unit.bf16_matmul_*), so both paths are checked on a CPU
// whichever the measurement picks there.
TEST(Bf16Products, ChoiceFollowsItsRule) {
  const Bf16Products& p = bf16_products();
  ASSERT_FALSE(p.reason.empty());
  EXPECT_EQ(bf16_matmul_native(), p.native);
  const char* env = std::getenv("KEEL_BF16_MATMUL");
  if (env != nullptr && *env != '\0' && p.reason.rfind("no oneDNN", 0) != 0) {
    EXPECT_EQ(p.native, std::string(env) == "native") << p.reason;
    EXPECT_NE(p.reason.find(env), std::string::npos) << p.reason;
  }
  if (p.bf16_flops > 0) {  // measured: widened exactly when fp32 runs kWidenAbove times bf16 or more
    EXPECT_GT(p.f32_flops, 0.0);
    EXPECT_EQ(p.native, p.f32_flops < kWidenAbove * p.bf16_flops) << p.reason;
  }
  EXPECT_EQ(gemm_widened_operand_bytes(true), p.native ? 0 : 2 * kWidenedOperandElements * sizeof(float));

  const int64_t m = 37, n = 45, k = 129;
  const std::vector<bf16> a = random_bf16(size_t(m * k), 41), b = random_bf16(size_t(k * n), 42);
  std::vector<float> wa(a.size()), wb(b.size()), got(size_t(m * n)), f32(size_t(m * n));
  for (size_t i = 0; i < a.size(); ++i) wa[i] = bf16_to_float(a[i]);
  for (size_t i = 0; i < b.size(); ++i) wb[i] = bf16_to_float(b[i]);
  const GemmShape s{Trans::N, Trans::N, m, n, k, k, n, n};
  gemm_bf16(s, a.data(), b.data(), got.data(), 0.0f);
  gemm_f32(s, wa.data(), wb.data(), f32.data(), 0.0f);
  if (!p.native) {
    EXPECT_EQ(got, f32) << "a widened product is the fp32 product of the widened operands";
  } else {
    double worst = 0;  // native: the same sums within fp32 accumulation's rounding
    for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(double(got[i]) - double(f32[i])));
    EXPECT_LT(worst, 1e-3);
  }
}

}  // namespace
}  // namespace keel::kernels
