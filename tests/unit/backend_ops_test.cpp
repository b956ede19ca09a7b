// Every compute operation of kernels::Backend, on every backend, through the interface
// (CTranslate2's and ggml's test-backend-ops are the models). Each test gives the backend random
// inputs, compares what it writes with a naive double-precision evaluation of the operation's
// formula written here (a loop over the definition, never a call into keel's kernels), and compares
// a backend other than the reference with the reference backend on the same inputs. Shapes are
// small and odd: widths and row counts that are no multiple of the row kernels' 16 lanes or of
// attention's 64-row blocks, strided views whose padding must stay as it was, ignored labels,
// sliding windows, soft caps, packed documents, bf16 inputs.
//
// Each test is named after the one operation it covers. BackendOpsCoverage reads backend.h and
// fails when a pure-virtual operation has neither a test of its name nor a place in kSkipped, or a
// test names no operation: adding an operation to the seam without a test here fails.
//
// Not computed here (kSkipped), and why:
//   name, description: the backend's name and log line, text.
//   allocate, copy_to_device, copy_to_host, copy_on_device, record_event, wait_event,
//   synchronize: memory and ordering, not arithmetic (both backends are host memory whose calls
//   finish before returning); every decoder test runs through them.
//   gemm_scratch_bytes: a figure for the memory plan (memory_planning_test checks the plan).
//   matmul_peak_flops: a timing.
// (How the CPU runs bf16 products, widened or not, is not Backend's but its own optional
// interface, kernels/bf16_widening.h, checked in gemm_products_test.cpp.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "decoder_test_support.h"
#include "finite_difference.h"
#include "keel/core/dropout_mask.h"
#include "keel/core/four_bit.h"
#include "keel/core/threads.h"
#include "keel/kernels/backend.h"

namespace keel::kernels {
namespace {

using Doubles = std::vector<double>;
using Floats = std::vector<float>;

// Tolerances, relative to max(1, |expected|): exact; one rounding of an fp32 formula (a few ulps);
// fp32 accumulations over up to a few thousand terms; values rounded to bf16 (2^-8 is one ulp).
constexpr double kExact = 0.0;
constexpr double kF32 = 1e-6;
constexpr double kF32Sum = 2e-5;
constexpr double kBf16 = 1e-2;

Floats random_floats(size_t n, uint64_t seed, double lo = -1, double hi = 1) {
  return test::to_float(test::random_vector(n, seed, lo, hi));
}

// bf16 rounding written out: round to nearest even on the bits (no NaN is used here).
bf16 round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return bf16{uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
double value(bf16 b) {
  const uint32_t u = uint32_t(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
std::vector<bf16> random_bf16(size_t n, uint64_t seed, double lo = -1, double hi = 1) {
  std::vector<bf16> out;
  for (float f : random_floats(n, seed, lo, hi)) out.push_back(round_bf16(f));
  return out;
}

Doubles widen(const Floats& x) { return Doubles(x.begin(), x.end()); }
Doubles widen(const std::vector<bf16>& x) {
  Doubles d;
  for (bf16 b : x) d.push_back(value(b));
  return d;
}
Floats narrow(const Doubles& x) { return Floats(x.begin(), x.end()); }
// Bits as numbers, for comparisons that must tell -0 from 0.
Doubles bits(const std::vector<bf16>& x) {
  Doubles d;
  for (bf16 b : x) d.push_back(b.bits);
  return d;
}

// copy[i] must be exactly round_bf16(x[i]) for the n elements of each of `rows` rows (row stride
// ld): an operation's bf16 copy of its own fp32 output, "what cast_to_bf16 would give".
void expect_bf16_copy(const char* what, const bf16* copy, const float* x, int64_t rows, int64_t n, int64_t ld) {
  int64_t wrong = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; ++i) wrong += copy[r * ld + i].bits != round_bf16(x[r * ld + i]).bits;
  EXPECT_EQ(wrong, 0) << what << ": elements whose bf16 copy is not their rounding";
}

// |got - want| <= tol * max(1, |want|) elementwise; reports the largest miss.
void expect_close(const std::string& what, const Doubles& got, const Doubles& want, double tol) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t wrong = 0, worst = -1;
  double worst_ratio = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double allowed = tol * std::max(1.0, std::fabs(want[i])), miss = std::fabs(got[i] - want[i]);
    if (got[i] != want[i] && !(miss <= allowed)) {  // equal infinities have no finite difference
      ++wrong;
      const double ratio = allowed > 0 ? miss / allowed : HUGE_VAL;
      if (worst < 0 || !(ratio <= worst_ratio)) worst = int64_t(i), worst_ratio = ratio;
    }
  }
  EXPECT_EQ(wrong, 0) << what << ": " << wrong << " of " << got.size() << " elements outside " << tol
                      << "; worst [" << worst << "] got " << (worst >= 0 ? got[worst] : 0) << " want "
                      << (worst >= 0 ? want[worst] : 0);
}

// What one call writes, by name (strided outputs whole, padding included).
using Outputs = std::map<std::string, Doubles>;

// The test's parameter is the backend's name.
class BackendOps : public ::testing::TestWithParam<std::string> {
 public:
  Backend& backend() const { return backend_named(GetParam()); }

  // Runs `run` on this backend and compares each output with `want` and, on a backend other than
  // the reference, with the reference backend's from the same inputs. The reference backend itself
  // is held to fp32 whatever `tol` allows: it computes in double from the inputs as given (rounded
  // to bf16 where the operation says so, as the naive versions do), rounding once at the end.
  void check(const std::function<Outputs(Backend&)>& run, const Outputs& want, double tol) const {
    const Outputs got = run(backend());
    compare(got, want, GetParam() == "reference" ? std::min(tol, kF32Sum) : tol, "naive double");
    if (GetParam() != "reference") compare(got, run(backend_named("reference")), tol, "reference backend");
  }

 private:
  void compare(const Outputs& got, const Outputs& want, double tol, const char* against) const {
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, values] : want) {
      ASSERT_TRUE(got.count(name)) << name;
      expect_close(GetParam() + " " + name + " against the " + against, got.at(name), values, tol);
    }
  }
};

// ---- GEMM

struct GemmCase {
  Trans ta, tb;
  int64_t m, n, k, pad;  // pad: extra elements in every row stride
  float beta;
};
const GemmCase kGemmCases[] = {
    {Trans::N, Trans::N, 37, 29, 67, 0, 0.0f}, {Trans::N, Trans::T, 37, 29, 67, 3, 1.0f},
    {Trans::T, Trans::N, 19, 33, 65, 5, 0.0f}, {Trans::T, Trans::T, 8, 13, 17, 1, 1.0f},
    {Trans::N, Trans::T, 5, 7, 2100, 2, 1.0f},  // K past kKChunk: the CPU's K-chunked product
};

// C = op(A) op(B) + beta C in double over s's view of the operands (C's padding kept); beta 0
// never reads C (its view may be NaN).
Doubles naive_gemm(const GemmShape& s, const Doubles& a, const Doubles& b, Doubles c, float beta) {
  for (int64_t i = 0; i < s.m; ++i)
    for (int64_t j = 0; j < s.n; ++j) {
      double sum = beta == 0.0f ? 0.0 : beta * c[i * s.ldc + j];
      for (int64_t p = 0; p < s.k; ++p)
        sum += (s.trans_a == Trans::N ? a[i * s.lda + p] : a[p * s.lda + i]) *
               (s.trans_b == Trans::N ? b[p * s.ldb + j] : b[j * s.ldb + p]);
      c[i * s.ldc + j] = sum;
    }
  return c;
}

// a, b: float or bf16 inputs; c's view is NaN when beta is 0 (overwritten, never read), its padding
// random and kept.
template <typename T>
void check_gemm(const BackendOps& t, bool prepare) {
  uint64_t seed = 100;
  for (const GemmCase& g : kGemmCases) {
    SCOPED_TRACE(::testing::Message() << "m " << g.m << " n " << g.n << " k " << g.k << " ta " << int(g.ta)
                                      << " tb " << int(g.tb) << " beta " << g.beta);
    const int64_t lda = (g.ta == Trans::N ? g.k : g.m) + g.pad, ldb = (g.tb == Trans::N ? g.n : g.k) + g.pad,
                  ldc = g.n + g.pad;
    const GemmShape s{g.ta, g.tb, g.m, g.n, g.k, lda, ldb, ldc};
    const int64_t a_rows = g.ta == Trans::N ? g.m : g.k, b_rows = g.tb == Trans::N ? g.k : g.n;
    std::vector<T> a, b;
    if constexpr (std::is_same_v<T, bf16>)
      a = random_bf16(a_rows * lda, ++seed), b = random_bf16(b_rows * ldb, ++seed);
    else
      a = random_floats(a_rows * lda, ++seed), b = random_floats(b_rows * ldb, ++seed);
    Floats c = random_floats(g.m * ldc, ++seed);
    if (g.beta == 0.0f)
      for (int64_t i = 0; i < g.m; ++i)
        for (int64_t j = 0; j < g.n; ++j) c[i * ldc + j] = NAN;

    const Doubles want = naive_gemm(s, widen(a), widen(b), widen(c), g.beta);
    t.check(
        [&](Backend& be) {
          constexpr bool kBf16Inputs = std::is_same_v<T, bf16>;
          if (prepare) be.prepare_gemm(s, kBf16Inputs, g.beta);
          Floats out = c;
          if constexpr (kBf16Inputs)
            be.gemm_bf16(s, a.data(), b.data(), out.data(), g.beta);
          else
            be.gemm(s, a.data(), b.data(), out.data(), g.beta);
          return Outputs{{"c", widen(out)}};
        },
        {{"c", want}}, kF32Sum);
  }
}

TEST_P(BackendOps, gemm) { check_gemm<float>(*this, false); }
TEST_P(BackendOps, gemm_bf16) { check_gemm<bf16>(*this, false); }
// A product's shares (columns, or a weight gradient's rows) tile its output exactly, and once the
// product is prepared, each share run as gemm_bf16 from a task on whichever thread takes it (as the
// experts run theirs: experts.cpp) gives the whole product. Two threads, shapes the CPU cuts (where
// its bf16 matmul is native) and one too narrow to cut; the reference backend cuts nothing.
TEST_P(BackendOps, bf16_product_shares) {
  test::with_threads(2, [&] {
    uint64_t seed = 300;
    for (const GemmCase& g : {GemmCase{Trans::N, Trans::T, 40, 1000, 96, 3, 0.0f},
                              GemmCase{Trans::N, Trans::N, 40, 1000, 96, 0, 1.0f},
                              GemmCase{Trans::T, Trans::N, 1000, 40, 96, 5, 1.0f},
                              GemmCase{Trans::N, Trans::T, 40, 300, 96, 0, 0.0f}}) {
      SCOPED_TRACE(::testing::Message() << "m " << g.m << " n " << g.n << " ta " << int(g.ta) << " tb " << int(g.tb));
      const int64_t lda = (g.ta == Trans::N ? g.k : g.m) + g.pad, ldb = (g.tb == Trans::N ? g.n : g.k) + g.pad,
                    ldc = g.n + g.pad;
      const GemmShape s{g.ta, g.tb, g.m, g.n, g.k, lda, ldb, ldc};
      const ProductShares shares = backend().bf16_product_shares(s);
      const int64_t extent = shares.by_rows ? g.m : g.n;
      ASSERT_GE(shares.parts, 1);
      if (shares.parts > 1) {
        EXPECT_EQ(shares.by_rows, g.ta == Trans::T) << "a weight gradient is cut by rows, the rest by columns";
        int64_t covered = 0;
        for (int64_t t = 0; t < shares.parts; ++t) {
          const ProductShares::Part p = shares.part(s, t);
          const int64_t width = shares.by_rows ? p.shape.m : p.shape.n;
          EXPECT_GT(width, 0) << "part " << t;
          EXPECT_EQ(p.c, shares.by_rows ? covered * ldc : covered) << "part " << t << " starts where the last ended";
          covered += width;
        }
        EXPECT_EQ(covered, extent) << "the parts cover the output once";
      }
      const std::vector<bf16> a = random_bf16((g.ta == Trans::N ? g.m : g.k) * lda, ++seed),
                              b = random_bf16((g.tb == Trans::N ? g.k : g.n) * ldb, ++seed);
      const Floats c = random_floats(g.m * ldc, ++seed);
      const Doubles want = naive_gemm(s, widen(a), widen(b), widen(c), g.beta);
      check(
          [&](Backend& be) {
            const ProductShares cut = be.bf16_product_shares(s);
            be.prepare_gemm(s, true, g.beta);
            Floats out = c;
            for_each_task(cut.parts, true, [&](int64_t t, int) {
              const ProductShares::Part p = cut.part(s, t);
              be.gemm_bf16(p.shape, a.data() + p.a, b.data() + p.b, out.data() + p.c, g.beta);
            });
            return Outputs{{"c", widen(out)}};
          },
          {{"c", want}}, kF32Sum);
    }
  });
}

// A prepared product (plans built before the step) multiplies as an unprepared one.
TEST_P(BackendOps, prepare_gemm) {
  check_gemm<float>(*this, true);
  check_gemm<bf16>(*this, true);
}

TEST_P(BackendOps, gemv_bf16) {
  for (int64_t rows : {37, 4, 1})
    for (float beta : {0.0f, 1.0f}) {
      SCOPED_TRACE(::testing::Message() << "rows " << rows << " beta " << beta);
      const int64_t in = 67;
      const Floats x = random_floats(in, 1), y0 = random_floats(rows, 2);
      const std::vector<bf16> w = random_bf16(rows * in, 3);
      Doubles want(rows);
      for (int64_t r = 0; r < rows; ++r) {
        want[r] = beta * double(y0[r]);
        for (int64_t i = 0; i < in; ++i) want[r] += double(x[i]) * value(w[r * in + i]);
      }
      check(
          [&](Backend& be) {
            Floats y = y0;
            if (beta == 0.0f) std::fill(y.begin(), y.end(), NAN);
            be.gemv_bf16(x.data(), w.data(), rows, in, y.data(), beta);
            return Outputs{{"y", widen(y)}};
          },
          {{"y", want}}, kF32Sum);
    }
}

// ---- elementwise

constexpr int64_t kElements = 1001;  // a vector tail on every ISA

TEST_P(BackendOps, cast_to_bf16) {
  Floats x = random_floats(kElements, 4, -3e4, 3e4);
  // Ties both ways (1 + 2^-8 goes down to even, 1 + 3*2^-8 up), signed zeros, infinities, the
  // largest float (rounds to infinity), tiny and large magnitudes, subnormals.
  for (uint32_t u : {0x3f808000u, 0x3f818000u, 0xbf808000u, 0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u,
                     0x7f7fffffu, 0x0b1e3a7fu, 0x7e012345u, 0x00012345u, 0x80400001u}) {
    float f;
    std::memcpy(&f, &u, 4);
    x.push_back(f);
  }
  std::vector<bf16> want;
  for (float f : x) want.push_back(round_bf16(f));
  check(
      [&](Backend& be) {
        std::vector<bf16> y(x.size());
        be.cast_to_bf16(x.data(), y.data(), int64_t(x.size()));
        return Outputs{{"bits", bits(y)}};
      },
      {{"bits", bits(want)}}, kExact);
}

TEST_P(BackendOps, cast_to_f32) {
  std::vector<bf16> x = random_bf16(kElements, 5, -1e5, 1e5);
  x.push_back(bf16{0x8000}), x.push_back(bf16{0x7f80}), x.push_back(bf16{0x0001});
  check(
      [&](Backend& be) {
        Floats y(x.size());
        be.cast_to_f32(x.data(), y.data(), int64_t(x.size()));
        return Outputs{{"y", widen(y)}};
      },
      {{"y", widen(x)}}, kExact);
}

// dst may be a (the reference's norm backward adds in place).
TEST_P(BackendOps, add) {
  const Floats a = random_floats(kElements, 6, -100, 100), b = random_floats(kElements, 7);
  Doubles want(kElements);
  for (int64_t i = 0; i < kElements; ++i) want[i] = double(a[i]) + double(b[i]);
  check(
      [&](Backend& be) {
        Floats dst(kElements, NAN), in_place = a;
        be.add(dst.data(), a.data(), b.data(), kElements);
        be.add(in_place.data(), in_place.data(), b.data(), kElements);
        return Outputs{{"dst", widen(dst)}, {"in place", widen(in_place)}};
      },
      {{"dst", want}, {"in place", want}}, kF32);
}

// An operation on x in place: op(backend, a copy of x).
void check_in_place(const BackendOps& t, const Floats& x, const std::function<void(Backend&, float*)>& op,
                    const Doubles& want, double tol) {
  t.check(
      [&](Backend& be) {
        Floats y = x;
        op(be, y.data());
        return Outputs{{"x", widen(y)}};
      },
      {{"x", want}}, tol);
}

TEST_P(BackendOps, soft_cap) {
  const double cap = 5.0;
  const Floats x = random_floats(kElements, 8, -40, 40);
  Doubles want;
  for (float f : x) want.push_back(cap * std::tanh(double(f) / cap));
  check_in_place(*this, x, [&](Backend& be, float* y) { be.soft_cap(y, kElements, cap); }, want, kF32);
}

// The mask is core/dropout_mask.h's function of (key, index): the contract every backend shares.
// Past the CPU's parallel threshold (2^15 elements); in place as well (y may be x).
constexpr int64_t kDropoutElements = 33001;
constexpr double kDropP = 0.3;
constexpr uint64_t kDropKey = 0x5eed;

// fp32 or bf16 (scaled in fp32, rounded once).
template <typename T>
void check_dropout(const BackendOps& t, const std::vector<T>& x) {
  const uint64_t threshold = dropout_keep_threshold(kDropP);
  const Doubles xd = widen(x);
  Doubles want(x.size());
  int64_t kept = 0;
  for (size_t i = 0; i < x.size(); ++i)
    if (dropout_keeps(kDropKey, i, threshold)) want[i] = xd[i] / (1.0 - kDropP), ++kept;
  EXPECT_NEAR(double(kept) / double(x.size()), 1.0 - kDropP, 0.02);  // about 8 standard deviations
  constexpr bool kBf16Values = std::is_same_v<T, bf16>;
  if (kBf16Values)
    for (double& v : want) v = value(round_bf16(float(v)));
  t.check(
      [&](Backend& be) {
        T nan;  // all bits set: NaN in either type, where the call must write zeros
        std::memset(&nan, 0xff, sizeof nan);
        std::vector<T> y(x.size(), nan), in_place = x;
        if constexpr (kBf16Values) {
          be.dropout_bf16(x.data(), y.data(), kDropoutElements, kDropP, kDropKey);
          be.dropout_bf16(in_place.data(), in_place.data(), kDropoutElements, kDropP, kDropKey);
        } else {
          be.dropout(x.data(), y.data(), kDropoutElements, kDropP, kDropKey);
          be.dropout(in_place.data(), in_place.data(), kDropoutElements, kDropP, kDropKey);
        }
        return Outputs{{"y", widen(y)}, {"in place", widen(in_place)}};
      },
      {{"y", want}, {"in place", want}}, kBf16Values ? kBf16 : kF32);
}

TEST_P(BackendOps, dropout) { check_dropout(*this, random_floats(kDropoutElements, 9)); }
TEST_P(BackendOps, dropout_bf16) { check_dropout(*this, random_bf16(kDropoutElements, 10)); }

TEST_P(BackendOps, scale_in_place) {
  const Floats x = random_floats(kElements, 11, -10, 10);
  const float factor = 0.37f;
  Doubles want;
  for (float f : x) want.push_back(double(f) * double(factor));
  for (double& v : want) v = float(v);  // one fp32 rounding
  check_in_place(*this, x, [&](Backend& be, float* y) { be.scale_in_place(y, kElements, factor); }, want, kExact);
}

TEST_P(BackendOps, sum_of_squares) {
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(10007), int64_t(40009)}) {
    const Floats x = random_floats(n, 12, -3, 3);
    double want = 0;
    for (float f : x) want += double(f) * double(f);
    check([&](Backend& be) { return Outputs{{"sum", {be.sum_of_squares(x.data(), n)}}}; }, {{"sum", {want}}},
          kF32);
  }
}

constexpr int64_t kRows = 13, kCols = 37;

TEST_P(BackendOps, add_bias_rows) {
  const Floats y0 = random_floats(kRows * kCols, 13), bias = random_floats(kCols, 14);
  Doubles want = widen(y0);
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < kCols; ++c) want[r * kCols + c] += bias[c];
  check(
      [&](Backend& be) {
        Floats y = y0;
        be.add_bias_rows(y.data(), bias.data(), kRows, kCols);
        return Outputs{{"y", widen(y)}};
      },
      {{"y", want}}, kF32);
}

TEST_P(BackendOps, accumulate_bias_grad) {
  const int64_t rows = 67;
  const Floats dy = random_floats(rows * kCols, 15), db0 = random_floats(kCols, 16);
  Doubles want = widen(db0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < kCols; ++c) want[c] += dy[r * kCols + c];
  check(
      [&](Backend& be) {
        Floats db = db0;
        be.accumulate_bias_grad(dy.data(), rows, kCols, db.data());
        return Outputs{{"db", widen(db)}};
      },
      {{"db", want}}, kF32Sum);
}

// ---- RMSNorm: y = x * rstd * (offset + w), rstd = 1 / sqrt(mean(x^2) + eps), over each head of
// dim elements of each token's row; token t's head h at t * ld + h * dim.

struct NormLayout {
  int64_t tokens, heads, dim, ldx, ldy;
};

Doubles naive_rstd(const Doubles& x, const NormLayout& l, double eps) {
  Doubles rstd;
  for (int64_t t = 0; t < l.tokens; ++t)
    for (int64_t h = 0; h < l.heads; ++h) {
      double ss = 0;
      for (int64_t i = 0; i < l.dim; ++i) ss += x[t * l.ldx + h * l.dim + i] * x[t * l.ldx + h * l.dim + i];
      rstd.push_back(1.0 / std::sqrt(ss / double(l.dim) + eps));
    }
  return rstd;
}

// y's view written over its former contents.
void naive_norm_forward(const Doubles& x, const Doubles& w, double offset, const Doubles& rstd, const NormLayout& l,
                        Doubles& y) {
  for (int64_t t = 0; t < l.tokens; ++t)
    for (int64_t h = 0; h < l.heads; ++h)
      for (int64_t i = 0; i < l.dim; ++i)
        y[t * l.ldy + h * l.dim + i] = x[t * l.ldx + h * l.dim + i] * rstd[t * l.heads + h] * (offset + w[i]);
}

// With g = offset + w, r = rstd: dx_i = r g_i dy_i - r^3 x_i / dim * sum_j dy_j g_j x_j (dy and dx
// at ldy: the same layout), dw_i += sum over tokens and heads of dy_i x_i r.
void naive_norm_backward(const Doubles& x, const Doubles& w, double offset, const Doubles& rstd, const Doubles& dy,
                         const NormLayout& l, Doubles& dx, Doubles* dw) {
  for (int64_t t = 0; t < l.tokens; ++t)
    for (int64_t h = 0; h < l.heads; ++h) {
      const double r = rstd[t * l.heads + h];
      const double* xr = x.data() + t * l.ldx + h * l.dim;
      const double* dyr = dy.data() + t * l.ldy + h * l.dim;
      double dot = 0;
      for (int64_t i = 0; i < l.dim; ++i) dot += dyr[i] * (offset + w[i]) * xr[i];
      for (int64_t i = 0; i < l.dim; ++i) {
        dx[t * l.ldy + h * l.dim + i] = r * (offset + w[i]) * dyr[i] - r * r * r * xr[i] / double(l.dim) * dot;
        if (dw) (*dw)[i] += dyr[i] * xr[i] * r;
      }
    }
}

constexpr double kEps = 1e-5;

// The seam's shape for a layout of the naive's.
RmsNormShape shape_of(const NormLayout& l, int64_t lddx, double offset) {
  return {l.tokens, l.heads, l.dim, l.ldx, l.ldy, lddx, kEps, offset};
}

// A block's norm over packed rows, with and without the fused bf16 copy.
void check_rmsnorm_forward_rows(const BackendOps& t) {
  for (int64_t dim : {67, 515})
    for (double offset : {0.0, 1.0})
      for (bool with_bf16 : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "dim " << dim << " offset " << offset << " bf16 " << with_bf16);
        const NormLayout l{kRows, 1, dim, dim, dim};
        const Floats x = random_floats(kRows * dim, 17, -2, 2), w = random_floats(dim, 18);
        const Doubles rstd = naive_rstd(widen(x), l, kEps);
        Doubles y(x.size());
        naive_norm_forward(widen(x), widen(w), offset, rstd, l, y);
        t.check(
            [&](Backend& be) {
              Floats out(x.size(), NAN), r(kRows, NAN);
              std::vector<bf16> out_bf16(with_bf16 ? x.size() : 0);
              be.rmsnorm_forward(shape_of(l, dim, offset), x.data(), w.data(), out.data(), r.data(),
                                 with_bf16 ? out_bf16.data() : nullptr);
              if (with_bf16) expect_bf16_copy("y_bf16", out_bf16.data(), out.data(), 1, kRows * dim, 0);
              return Outputs{{"y", widen(out)}, {"rstd", widen(r)}};
            },
            {{"y", y}, {"rstd", rstd}}, kF32);
      }
}

// Qwen3's q/k norms: heads inside a strided row; y's padding columns keep what they held. In place
// (y = x, ldy = ldx) as well.
const NormLayout kHeadNorm{7, 3, 16, 3 * 16 + 5, 3 * 16 + 2};

void check_rmsnorm_forward_heads(const BackendOps& t) {
  const NormLayout& l = kHeadNorm;
  const Floats x = random_floats(l.tokens * l.ldx, 24, -2, 2), w = random_floats(l.dim, 25),
               y0 = random_floats(l.tokens * l.ldy, 26);
  for (double offset : {0.0, 1.0}) {
    SCOPED_TRACE(::testing::Message() << "heads, offset " << offset);
    const Doubles rstd = naive_rstd(widen(x), l, kEps);
    const NormLayout in_place_layout{l.tokens, l.heads, l.dim, l.ldx, l.ldx};
    Doubles y = widen(y0), in_place = widen(x);
    naive_norm_forward(widen(x), widen(w), offset, rstd, l, y);
    naive_norm_forward(widen(x), widen(w), offset, rstd, in_place_layout, in_place);
    t.check(
        [&](Backend& be) {
          Floats got = y0, got_in_place = x, r(rstd.size(), NAN), r2(rstd.size(), NAN);
          be.rmsnorm_forward(shape_of(l, l.ldx, offset), x.data(), w.data(), got.data(), r.data(), nullptr);
          be.rmsnorm_forward(shape_of(in_place_layout, l.ldx, offset), got_in_place.data(), w.data(),
                             got_in_place.data(), r2.data(), nullptr);
          return Outputs{{"y", widen(got)}, {"rstd", widen(r)}, {"y in place", widen(got_in_place)}};
        },
        {{"y", y}, {"rstd", rstd}, {"y in place", in_place}}, kF32);
  }
}

TEST_P(BackendOps, rmsnorm_forward) {
  check_rmsnorm_forward_rows(*this);
  check_rmsnorm_forward_heads(*this);
}

// Packed rows with each optional part (the residual, dw, the bf16 copy); then heads in strided
// rows, dy at ldy and dx at its own stride lddx (the naive writes at ldy, then moves the rows).
TEST_P(BackendOps, rmsnorm_backward) {
  {
    const int64_t dim = 67;
    const NormLayout l{kRows, 1, dim, dim, dim};
    const Floats x = random_floats(kRows * dim, 19, -2, 2), w = random_floats(dim, 20),
                 dy = random_floats(x.size(), 21), residual = random_floats(x.size(), 22),
                 dw0 = random_floats(dim, 23);
    const Floats rstd = narrow(naive_rstd(widen(x), l, kEps));
    for (double offset : {0.0, 1.0})
      for (int variant = 0; variant < 8; ++variant) {  // bits: residual, dw, dx_bf16
        const bool with_residual = variant & 1, with_dw = variant & 2, with_bf16 = variant & 4;
        SCOPED_TRACE(::testing::Message() << "offset " << offset << " residual " << with_residual << " dw "
                                          << with_dw << " bf16 " << with_bf16);
        Doubles dx(x.size()), dw = widen(dw0);
        naive_norm_backward(widen(x), widen(w), offset, widen(rstd), widen(dy), l, dx, with_dw ? &dw : nullptr);
        if (with_residual)
          for (size_t i = 0; i < dx.size(); ++i) dx[i] += residual[i];
        check(
            [&](Backend& be) {
              Floats got_dx(x.size(), NAN), got_dw = dw0;
              std::vector<bf16> dx_bf16(with_bf16 ? x.size() : 0);
              be.rmsnorm_backward(shape_of(l, dim, offset), x.data(), w.data(), rstd.data(), dy.data(),
                                  got_dx.data(), with_dw ? got_dw.data() : nullptr,
                                  with_residual ? residual.data() : nullptr, with_bf16 ? dx_bf16.data() : nullptr);
              if (with_bf16) expect_bf16_copy("dx_bf16", dx_bf16.data(), got_dx.data(), 1, kRows * dim, 0);
              return Outputs{{"dx", widen(got_dx)}, {"dw", widen(got_dw)}};
            },
            {{"dx", dx}, {"dw", dw}}, kF32Sum);
      }
  }
  const NormLayout& l = kHeadNorm;
  const int64_t lddx = l.heads * l.dim + 7;
  const Floats x = random_floats(l.tokens * l.ldx, 27, -2, 2), w = random_floats(l.dim, 28),
               dy = random_floats(l.tokens * l.ldy, 29), dx0 = random_floats(l.tokens * lddx, 30),
               dw0 = random_floats(l.dim, 31);
  const Floats rstd = narrow(naive_rstd(widen(x), l, kEps));
  for (double offset : {0.0, 1.0})
    for (bool with_dw : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "heads, offset " << offset << " dw " << with_dw);
      Doubles dx_at_ldy(dy.size()), dw = widen(dw0), dx = widen(dx0);
      naive_norm_backward(widen(x), widen(w), offset, widen(rstd), widen(dy), l, dx_at_ldy, with_dw ? &dw : nullptr);
      for (int64_t t = 0; t < l.tokens; ++t)
        for (int64_t c = 0; c < l.heads * l.dim; ++c) dx[t * lddx + c] = dx_at_ldy[t * l.ldy + c];
      check(
          [&](Backend& be) {
            Floats got_dx = dx0, got_dw = dw0;
            be.rmsnorm_backward(shape_of(l, lddx, offset), x.data(), w.data(), rstd.data(), dy.data(), got_dx.data(),
                                with_dw ? got_dw.data() : nullptr, nullptr, nullptr);
            return Outputs{{"dx", widen(got_dx)}, {"dw", widen(got_dw)}};
          },
          {{"dx", dx}, {"dw", dw}}, kF32Sum);
    }
}

// ---- RoPE: each pair (i, i + rotary/2) (half layout) or (2i, 2i+1) (interleaved) of the first
// rotary_dim channels of a head turns by angle position * inv_freq_i (cos and sin from the table,
// an input here): (a, b) -> (a cos - b sin, b cos + a sin); the backward turns by the negative angle.

void check_rope(const BackendOps& t, bool backward) {
  const int64_t tokens = 9, heads = 3, head_dim = 16, ld = heads * head_dim + 4, max_positions = 50;
  std::vector<int32_t> positions;
  for (int64_t i = 0; i < tokens; ++i) positions.push_back(int32_t((i * 17 + 3) % max_positions));
  const Floats x = random_floats(tokens * ld, 32);
  for (int64_t rotary : {head_dim, head_dim / 2})
    for (bool interleaved : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "rotary " << rotary << " interleaved " << interleaved);
      const RopeTable table = RopeTable::build(rotary, interleaved, 10000.0, max_positions);
      const int64_t half = rotary / 2;
      Doubles want = widen(x);
      for (int64_t tok = 0; tok < tokens; ++tok)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t i = 0; i < half; ++i) {
            const double c = table.cos[positions[tok] * half + i],
                         s = (backward ? -1.0 : 1.0) * table.sin[positions[tok] * half + i];
            const int64_t base = tok * ld + h * head_dim, ia = base + (interleaved ? 2 * i : i),
                          ib = base + (interleaved ? 2 * i + 1 : i + half);
            const double a = x[ia], b = x[ib];
            want[ia] = a * c - b * s, want[ib] = b * c + a * s;
          }
      t.check(
          [&](Backend& be) {
            Floats got = x;
            if (backward)
              be.rope_backward(got.data(), ld, positions.data(), tokens, heads, head_dim, table);
            else
              be.rope_forward(got.data(), ld, positions.data(), tokens, heads, head_dim, table);
            return Outputs{{"x", widen(got)}};
          },
          {{"x", want}}, kF32);
    }
}

TEST_P(BackendOps, rope_forward) { check_rope(*this, false); }
TEST_P(BackendOps, rope_backward) { check_rope(*this, true); }

// ---- GLU: out = act(gate) * up, gate_up rows [gate | up].

double act(GluActivation a, double g) {
  if (a == GluActivation::Silu) return g / (1.0 + std::exp(-g));
  return 0.5 * g * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (g + 0.044715 * g * g * g)));
}
double act_slope(GluActivation a, double g) {
  if (a == GluActivation::Silu) {
    const double s = 1.0 / (1.0 + std::exp(-g));
    return s * (1.0 + g * (1.0 - s));
  }
  const double k = std::sqrt(2.0 / M_PI), th = std::tanh(k * (g + 0.044715 * g * g * g));
  return 0.5 * (1.0 + th) + 0.5 * g * (1.0 - th * th) * k * (1.0 + 3 * 0.044715 * g * g);
}

constexpr int64_t kGluRows = 5, kInter = 37;

// Tolerance kF32Sum: GELU's 1 + tanh(z) cancels in fp32 for negative gates (the CPU's tanh is
// 1 - 2 / (exp(2z) + 1), torch's formula in fp32 as well), an absolute error up to about 4e-6 in
// the gate's gradient here.
void check_glu(const BackendOps& t, bool backward) {
  const int64_t n = kGluRows * kInter;
  // Gates far enough out that GELU's tanh saturates in fp32, ups and dout in [-1, 1].
  Floats gate_up = random_floats(2 * n, 33), dout = random_floats(n, 34);
  for (int64_t r = 0; r < kGluRows; ++r)
    for (int64_t i = 0; i < kInter; ++i) gate_up[r * 2 * kInter + i] *= 6;
  for (GluActivation a : {GluActivation::Silu, GluActivation::GeluTanh})
    for (bool with_bf16 : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "activation " << int(a) << " bf16 " << with_bf16);
      Doubles want(backward ? 2 * n : n);
      for (int64_t r = 0; r < kGluRows; ++r)
        for (int64_t i = 0; i < kInter; ++i) {
          const double g = gate_up[r * 2 * kInter + i], u = gate_up[r * 2 * kInter + kInter + i];
          if (!backward) {
            want[r * kInter + i] = act(a, g) * u;
          } else {
            want[r * 2 * kInter + i] = dout[r * kInter + i] * u * act_slope(a, g);
            want[r * 2 * kInter + kInter + i] = dout[r * kInter + i] * act(a, g);
          }
        }
      t.check(
          [&](Backend& be) {
            Floats out(want.size(), NAN);
            std::vector<bf16> copy(with_bf16 ? want.size() : 0);
            if (backward)
              be.glu_backward(a, gate_up.data(), dout.data(), kGluRows, kInter, out.data(),
                              with_bf16 ? copy.data() : nullptr);
            else
              be.glu_forward(a, gate_up.data(), kGluRows, kInter, out.data(), with_bf16 ? copy.data() : nullptr);
            if (with_bf16) expect_bf16_copy("bf16 copy", copy.data(), out.data(), 1, int64_t(out.size()), 0);
            return Outputs{{backward ? "dgate_up" : "out", widen(out)}};
          },
          {{backward ? "dgate_up" : "out", want}}, kF32Sum);
    }
}

TEST_P(BackendOps, glu_forward) { check_glu(*this, false); }
TEST_P(BackendOps, glu_backward) { check_glu(*this, true); }

// ---- embedding

constexpr int64_t kVocab = 11, kHidden = 19, kLookups = 23;

std::vector<int32_t> lookup_ids() {  // repeats, the first and the last row, row 3 often
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < kLookups; ++i) ids.push_back(int32_t(i % 4 == 0 ? 3 : (i * 7) % kVocab));
  ids.back() = int32_t(kVocab - 1);
  return ids;
}

template <typename T>
void check_embedding_forward(const BackendOps& t, const std::vector<T>& table) {
  const std::vector<int32_t> ids = lookup_ids();
  const Doubles rows = widen(table);
  Doubles want;
  for (int32_t id : ids) want.insert(want.end(), rows.begin() + id * kHidden, rows.begin() + (id + 1) * kHidden);
  t.check(
      [&](Backend& be) {
        Floats out(kLookups * kHidden, NAN);
        if constexpr (std::is_same_v<T, bf16>)
          be.embedding_forward_bf16(ids.data(), kLookups, table.data(), kHidden, out.data());
        else
          be.embedding_forward(ids.data(), kLookups, table.data(), kHidden, out.data());
        return Outputs{{"out", widen(out)}};
      },
      {{"out", want}}, kExact);
}

TEST_P(BackendOps, embedding_forward) { check_embedding_forward(*this, random_floats(kVocab * kHidden, 35)); }
TEST_P(BackendOps, embedding_forward_bf16) { check_embedding_forward(*this, random_bf16(kVocab * kHidden, 36)); }

TEST_P(BackendOps, embedding_backward) {
  const std::vector<int32_t> ids = lookup_ids();
  const Floats dout = random_floats(kLookups * kHidden, 37), dtable0 = random_floats(kVocab * kHidden, 38);
  for (int64_t padding_idx : {int64_t(-1), int64_t(3)}) {
    SCOPED_TRACE(::testing::Message() << "padding_idx " << padding_idx);
    Doubles want = widen(dtable0);
    for (int64_t i = 0; i < kLookups; ++i)
      if (ids[i] != padding_idx)
        for (int64_t h = 0; h < kHidden; ++h) want[ids[i] * kHidden + h] += dout[i * kHidden + h];
    check(
        [&](Backend& be) {
          Floats dtable = dtable0;
          be.embedding_backward(ids.data(), kLookups, dout.data(), kHidden, kVocab, padding_idx, dtable.data());
          return Outputs{{"dtable", widen(dtable)}};
        },
        {{"dtable", want}}, kF32);
  }
}

// ---- 4-bit weights: element i is four_bit_values(type)[its code] * absmax[i / 64], codes two to
// a byte, the first in the high nibble. The 16 values are the format's table (core/four_bit.h,
// data, not a kernel).

void check_dequantize(const BackendOps& t, bool to_bf16) {
  const int64_t n = 5 * kFourBitBlockSize;
  std::vector<uint8_t> packed;
  std::mt19937_64 rng(39);
  for (int64_t i = 0; i < n / 2; ++i) packed.push_back(uint8_t(rng()));
  const Floats absmax = random_floats(n / kFourBitBlockSize, 40, 0.01, 3);
  for (FourBitType type : {FourBitType::Nf4, FourBitType::Fp4}) {
    SCOPED_TRACE(four_bit_type_name(type));
    Doubles want;
    for (int64_t i = 0; i < n; ++i) {
      const int code = i % 2 == 0 ? packed[i / 2] >> 4 : packed[i / 2] & 15;
      const auto v = float(double(four_bit_values(type)[code]) * double(absmax[i / kFourBitBlockSize]));
      want.push_back(to_bf16 ? value(round_bf16(v)) : v);
    }
    t.check(
        [&](Backend& be) {
          if (!to_bf16) {
            Floats out(n, NAN);
            be.dequantize_4bit(type, packed.data(), absmax.data(), n, out.data());
            return Outputs{{"out", widen(out)}};
          }
          std::vector<bf16> out(n, bf16{0x7fc0});
          be.dequantize_4bit_bf16(type, packed.data(), absmax.data(), n, out.data());
          return Outputs{{"out", widen(out)}};
        },
        {{"out", want}}, kExact);
  }
}

TEST_P(BackendOps, dequantize_4bit) { check_dequantize(*this, false); }
TEST_P(BackendOps, dequantize_4bit_bf16) { check_dequantize(*this, true); }

// ---- the fused LM-head loss: z = logits, or cap * tanh(logits / cap); a row's loss is
// logsumexp(z) - z[label] (0 on an ignored row), the call returns their sum; the gradient is
// (softmax(z) - onehot) * grad_scale (times the row's own scale with LossRows) * dz/dlogits,
// zeros on ignored rows; each ld-strided row's padding is kept. LossRows' mean logit: the mean of
// z over the vocabulary, ignored rows included.

TEST_P(BackendOps, cross_entropy_forward_backward) {
  const int64_t rows = 7, vocab = 301, ld = vocab + 4;
  const double grad_scale = 0.37;
  const Floats logits0 = random_floats(rows * ld, 41, -8, 8), row_scale = random_floats(rows, 42, 0.2, 2);
  std::vector<int32_t> labels;
  for (int64_t r = 0; r < rows; ++r) labels.push_back(r == 2 || r == 5 ? kIgnoreIndex : int32_t((r * 97) % vocab));
  labels[0] = int32_t(vocab - 1);
  for (double cap : {0.0, 5.0})
    for (bool per_row : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "softcap " << cap << " per-row outputs " << per_row);
      Doubles grad = widen(logits0), row_loss(rows, 0.0), mean_logit(rows);
      for (int64_t r = 0; r < rows; ++r) {
        double* g = grad.data() + r * ld;
        Doubles z(g, g + vocab), slope(vocab, 1.0);
        if (cap > 0)
          for (int64_t j = 0; j < vocab; ++j) {
            const double th = std::tanh(z[j] / cap);
            z[j] = cap * th, slope[j] = 1 - th * th;
          }
        double sum = 0, z_sum = 0;
        for (double zj : z) sum += std::exp(zj), z_sum += zj;
        mean_logit[r] = z_sum / double(vocab);
        if (labels[r] == kIgnoreIndex) {
          std::fill(g, g + vocab, 0.0);
          continue;
        }
        const double lse = std::log(sum), scale = grad_scale * (per_row ? double(row_scale[r]) : 1.0);
        row_loss[r] = lse - z[labels[r]];
        for (int64_t j = 0; j < vocab; ++j)
          g[j] = (std::exp(z[j] - lse) - (j == labels[r] ? 1.0 : 0.0)) * scale * slope[j];
      }
      Doubles grad_bf16 = grad;  // the view rounded to bf16; its padding is the sentinel below
      for (int64_t i = 0; i < rows * ld; ++i) grad_bf16[i] = i % ld < vocab ? value(round_bf16(float(grad[i]))) : 0.5;
      Outputs want{{"loss", {std::accumulate(row_loss.begin(), row_loss.end(), 0.0)}},
                   {"gradient", grad},
                   {"grad_bf16", grad_bf16}};
      if (per_row) want["row loss"] = row_loss, want["mean logit"] = mean_logit;
      check(
          [&](Backend& be) {
            Floats logits = logits0, scratch = logits0;
            Doubles got_loss(rows, NAN), got_mean(rows, NAN);
            const LossRows all{row_scale.data(), got_loss.data(), got_mean.data()}, scale_only{row_scale.data()};
            std::vector<bf16> g16(rows * ld, round_bf16(0.5f));
            const double l = be.cross_entropy_forward_backward(logits.data(), ld, labels.data(), rows, vocab,
                                                               grad_scale, cap, nullptr, per_row ? all : LossRows{});
            const double l16 = be.cross_entropy_forward_backward(scratch.data(), ld, labels.data(), rows, vocab,
                                                                 grad_scale, cap, g16.data(),
                                                                 per_row ? scale_only : LossRows{});
            EXPECT_EQ(l16, l) << "the loss with the gradient in bf16";
            expect_bf16_copy("grad_bf16", g16.data(), logits.data(), rows, vocab, ld);
            Outputs got{{"loss", {l}}, {"gradient", widen(logits)}, {"grad_bf16", widen(g16)}};
            if (per_row) got["row loss"] = got_loss, got["mean logit"] = got_mean;
            return got;
          },
          want, kF32);
    }
}

// ---- attention: for query i of a sequence, keys j <= i inside the window (j > i - window) and of
// i's document; score s_ij = scale q_i.k_j, or cap tanh(s / cap); p = softmax over the allowed j;
// out_i = sum p_ij v_j, lse_i = log sum exp(s_ij). Backward (from out, lse as given):
// D_i = dout_i.out_i, dv_j += p_ij dout_i, ds_ij = p_ij (dout_i.v_j - D_i) * cap slope,
// dq_i += scale ds_ij k_j, dk_j += scale ds_ij q_i; a kv head gathers its group of q heads.

// q, k, v are views of one fused row per token [q heads | k heads | v heads | 3 padding], as the
// qkv projection lays them out; out rows are padded by 5.
struct Attention {
  AttentionShape s;
  AttentionMatmul precision;
  std::vector<int32_t> segments;  // empty: one document per sequence
  Floats qkv, dout;

  int64_t tokens() const { return s.batch * s.seq; }
  int64_t k_offset() const { return s.q_heads * s.head_dim; }
  int64_t v_offset() const { return (s.q_heads + s.kv_heads) * s.head_dim; }
  const int32_t* segment_ids() const { return segments.empty() ? nullptr : segments.data(); }
};

Attention make_attention(int64_t batch, int64_t seq, int64_t window, double softcap, bool packed,
                         AttentionMatmul precision, uint64_t seed) {
  const int64_t q_heads = 4, kv_heads = 2, head_dim = 16, ld = (q_heads + 2 * kv_heads) * head_dim + 3,
                ldo = q_heads * head_dim + 5;
  Attention a;
  a.s = {batch, seq, q_heads, kv_heads, head_dim, ld, ld, ld, ldo, 1.0 / std::sqrt(double(head_dim)), window, softcap};
  a.precision = precision;
  if (packed)  // documents of 1, 6, 17 and the remaining tokens (the first attends to itself alone)
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t t = 0; t < seq; ++t) a.segments.push_back(t < 1 ? 0 : t < 7 ? 1 : t < 24 ? 2 : 3);
  a.qkv = random_floats(a.tokens() * ld, seed, -1.5, 1.5);
  a.dout = random_floats(a.tokens() * ldo, seed + 1);
  return a;
}

struct AttentionResult {
  Doubles out, lse, dqkv;  // out and dqkv whole, padding included
};

constexpr float kPadding = 0.25f;  // what the padding of out and dqkv holds before a call

// The naive forward and backward in double; the backward reads out and lse rounded to float, as a
// backend does. With BF16 products q, k, v and dout are rounded to bf16 first.
AttentionResult naive_attention(const Attention& a) {
  const AttentionShape& s = a.s;
  const bool bf16_inputs = a.precision == AttentionMatmul::BF16;
  auto input = [&](const Floats& x) {
    Doubles d = widen(x);
    if (bf16_inputs)
      for (double& e : d) e = value(round_bf16(float(e)));
    return d;
  };
  const Doubles qkv = input(a.qkv), dout = input(a.dout);
  const int64_t group = s.q_heads / s.kv_heads, D = s.head_dim;
  AttentionResult r{Doubles(a.tokens() * s.ldo, kPadding), Doubles(s.batch * s.q_heads * s.seq),
                    Doubles(qkv.size(), kPadding)};
  for (int64_t t = 0; t < a.tokens(); ++t)
    for (int64_t c = 0; c < a.v_offset() + s.kv_heads * D; ++c) r.dqkv[t * s.ldq + c] = 0;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.q_heads; ++h)
      for (int64_t i = 0; i < s.seq; ++i) {
        const int64_t ti = b * s.seq + i, kv = h / group;
        const double* q = qkv.data() + ti * s.ldq + h * D;
        std::vector<int64_t> keys;
        Doubles score, slope;
        for (int64_t j = 0; j <= i; ++j) {
          if (s.window > 0 && j <= i - s.window) continue;
          if (!a.segments.empty() && a.segments[ti] != a.segments[b * s.seq + j]) continue;
          const double* k = qkv.data() + (b * s.seq + j) * s.ldk + a.k_offset() + kv * D;
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
          double sc = s.scale * dot, sl = 1;
          if (s.softcap > 0) {
            const double th = std::tanh(sc / s.softcap);
            sc = s.softcap * th, sl = 1 - th * th;
          }
          keys.push_back(j), score.push_back(sc), slope.push_back(sl);
        }
        double sum = 0;
        for (double sc : score) sum += std::exp(sc);
        const double lse = std::log(sum);
        r.lse[(b * s.q_heads + h) * s.seq + i] = lse;
        double* out = r.out.data() + ti * s.ldo + h * D;
        for (int64_t d = 0; d < D; ++d) out[d] = 0;
        for (size_t n = 0; n < keys.size(); ++n)
          for (int64_t d = 0; d < D; ++d)
            out[d] += std::exp(score[n] - lse) * qkv[(b * s.seq + keys[n]) * s.ldv + a.v_offset() + kv * D + d];
        // backward, from the float out and lse a backend is given
        const double* dy = dout.data() + ti * s.ldo + h * D;
        double delta = 0;
        for (int64_t d = 0; d < D; ++d) delta += dy[d] * double(float(out[d]));
        for (size_t n = 0; n < keys.size(); ++n) {
          const int64_t tj = b * s.seq + keys[n];
          const double p = std::exp(score[n] - double(float(lse)));
          const double* v = qkv.data() + tj * s.ldv + a.v_offset() + kv * D;
          double dp = 0;
          for (int64_t d = 0; d < D; ++d) dp += dy[d] * v[d];
          const double ds = p * (dp - delta) * slope[n];
          for (int64_t d = 0; d < D; ++d) {
            r.dqkv[ti * s.ldq + h * D + d] += s.scale * ds * qkv[tj * s.ldk + a.k_offset() + kv * D + d];
            r.dqkv[tj * s.ldk + a.k_offset() + kv * D + d] += s.scale * ds * q[d];
            r.dqkv[tj * s.ldv + a.v_offset() + kv * D + d] += p * dy[d];
          }
        }
      }
  return r;
}

// Attention's workspace: exactly the bytes the backend asks for (what the memory plan holds),
// 64-byte aligned, filled with NaN bytes (a kernel must not count on zeros: the decoder reuses
// it), and followed by a canary that the calls must leave alone.
class Workspace {
 public:
  Workspace(Backend& be, const AttentionShape& s, AttentionMatmul precision)
      : bytes_(be.attention_workspace_bytes(s, precision)),
        memory_(static_cast<unsigned char*>(std::aligned_alloc(64, (bytes_ + kCanary + 63) / 64 * 64))) {
    std::memset(memory_.get(), 0xff, bytes_);
    std::memset(memory_.get() + bytes_, 0xa5, kCanary);
  }
  void* data() const { return memory_.get(); }
  size_t bytes() const { return bytes_; }
  bool intact() const {
    const unsigned char* canary = memory_.get() + bytes_;
    return std::all_of(canary, canary + kCanary, [](unsigned char c) { return c == 0xa5; });
  }

 private:
  static constexpr size_t kCanary = 256;
  struct Free {
    void operator()(unsigned char* p) const { std::free(p); }
  };
  size_t bytes_;
  std::unique_ptr<unsigned char[], Free> memory_;
};

enum Calls { kForward = 1, kBackward = 2, kBoth = 3 };

// The forward and/or the backward call on `be` (the backward from the naive out and lse, so that
// each is checked on its own), in a workspace sized for `planned` (the longest sequence).
Outputs run_attention(Backend& be, const Attention& a, const AttentionResult& naive, const AttentionShape& planned,
                      Calls calls) {
  const AttentionShape& s = a.s;
  Workspace ws(be, planned, a.precision);
  const float* qkv = a.qkv.data();
  Outputs got;
  if (calls & kForward) {
    Floats out(naive.out.size(), kPadding), lse(naive.lse.size(), NAN);
    be.attention_forward(s, a.precision, qkv, qkv + a.k_offset(), qkv + a.v_offset(), a.segment_ids(), out.data(),
                         lse.data(), ws.data(), ws.bytes());
    got["out"] = widen(out), got["lse"] = widen(lse);
  }
  if (calls & kBackward) {
    const Floats given_out = narrow(naive.out), given_lse = narrow(naive.lse);
    Floats dqkv(naive.dqkv.size(), kPadding);
    be.attention_backward(s, a.precision, qkv, qkv + a.k_offset(), qkv + a.v_offset(), a.segment_ids(),
                          given_out.data(), given_lse.data(), a.dout.data(), dqkv.data(), dqkv.data() + a.k_offset(),
                          dqkv.data() + a.v_offset(), ws.data(), ws.bytes());
    got["dqkv"] = widen(dqkv);
  }
  EXPECT_TRUE(ws.intact()) << "attention wrote past attention_workspace_bytes (" << ws.bytes() << ")";
  return got;
}

// Two sequences of 70 (two 64-row blocks, the second partial): plain; a window with a soft cap;
// packed documents (the first of one token); one sequence with both; each with F32 and BF16 products.
std::vector<Attention> attention_cases() {
  std::vector<Attention> cases;
  for (AttentionMatmul p : {AttentionMatmul::F32, AttentionMatmul::BF16}) {
    cases.push_back(make_attention(2, 70, 0, 0.0, false, p, 50));
    cases.push_back(make_attention(2, 70, 5, 3.0, false, p, 52));
    cases.push_back(make_attention(2, 70, 0, 0.0, true, p, 54));
    cases.push_back(make_attention(1, 70, 21, 3.0, true, p, 56));
  }
  return cases;
}

void check_attention(const BackendOps& t, const Attention& a, const AttentionShape& planned, Calls calls) {
  SCOPED_TRACE(::testing::Message() << "batch " << a.s.batch << " seq " << a.s.seq << " window " << a.s.window
                                    << " softcap " << a.s.softcap << " packed " << !a.segments.empty()
                                    << (a.precision == AttentionMatmul::BF16 ? " bf16" : " f32"));
  const AttentionResult naive = naive_attention(a);
  Outputs want;
  if (calls & kForward) want["out"] = naive.out, want["lse"] = naive.lse;
  if (calls & kBackward) want["dqkv"] = naive.dqkv;
  t.check([&](Backend& be) { return run_attention(be, a, naive, planned, calls); }, want,
          a.precision == AttentionMatmul::BF16 ? kBf16 : kF32Sum);
}

TEST_P(BackendOps, attention_forward) {
  for (const Attention& a : attention_cases()) check_attention(*this, a, a.s, kForward);
}
TEST_P(BackendOps, attention_backward) {
  for (const Attention& a : attention_cases()) check_attention(*this, a, a.s, kBackward);
}

// The bytes asked for are enough for both calls: the canary after exactly that many stays, on one
// thread (the forward and backward tests run on all).
TEST_P(BackendOps, attention_workspace_bytes) {
  for (const Attention& a : attention_cases()) {
    if (GetParam() != "reference") {
      EXPECT_GT(backend().attention_workspace_bytes(a.s, a.precision), 0u);
    }
    test::with_threads(1, [&] { check_attention(*this, a, a.s, kBoth); });
  }
}

// Prepared once for the longest sequence, a decoder then runs shorter ones (packed documents, more
// of them) in the workspace planned for the longest.
TEST_P(BackendOps, prepare_attention) {
  for (AttentionMatmul p : {AttentionMatmul::F32, AttentionMatmul::BF16}) {
    const AttentionShape longest = make_attention(2, 70, 0, 0.0, false, p, 0).s;
    backend().prepare_attention(longest, p);
    check_attention(*this, make_attention(3, 45, 0, 0.0, true, p, 58), longest, kBoth);
    check_attention(*this, make_attention(1, 70, 0, 0.0, false, p, 60), longest, kBoth);
  }
}

// Generation: tokens new queries at positions first.. over a cache of every position so far.
TEST_P(BackendOps, cached_attention) {
  const int64_t q_heads = 4, kv_heads = 2, D = 16, Q = q_heads * D, KV = kv_heads * D, tokens = 3, first = 12;
  const int64_t ldq = Q + 3, positions = first + tokens;
  const Floats q = random_floats(tokens * ldq, 61, -1.5, 1.5), k = random_floats(positions * KV, 62, -1.5, 1.5),
               v = random_floats(positions * KV, 63);
  for (int64_t window : {0, 5})
    for (double cap : {0.0, 3.0}) {
      SCOPED_TRACE(::testing::Message() << "window " << window << " softcap " << cap);
      // batch, seq and the other strides are not used: -1 would show if they were.
      const AttentionShape s{-1, -1, q_heads, kv_heads, D, ldq, -1, -1, -1, 1.0 / std::sqrt(double(D)), window, cap};
      Doubles want(tokens * Q, 0.0);
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t h = 0; h < q_heads; ++h) {
          const int64_t i = first + t, kv = h / (q_heads / kv_heads);
          Doubles score;
          for (int64_t j = 0; j <= i; ++j) {
            double dot = 0;
            for (int64_t d = 0; d < D; ++d) dot += double(q[t * ldq + h * D + d]) * double(k[j * KV + kv * D + d]);
            double sc = s.scale * dot;
            if (cap > 0) sc = cap * std::tanh(sc / cap);
            score.push_back(window > 0 && j <= i - window ? -INFINITY : sc);
          }
          double sum = 0;
          for (double sc : score) sum += std::exp(sc);
          for (int64_t j = 0; j <= i; ++j)
            for (int64_t d = 0; d < D; ++d)
              want[t * Q + h * D + d] += std::exp(score[j]) / sum * v[j * KV + kv * D + d];
        }
      check(
          [&](Backend& be) {
            Floats out(tokens * Q, NAN);
            be.cached_attention(s, q.data(), tokens, first, k.data(), v.data(), out.data());
            return Outputs{{"out", widen(out)}};
          },
          {{"out", want}}, kF32Sum);
    }
}

// ---- AdamW, torch.optim.AdamW's update: g' = float(g * float(grad_scale)); w *= 1 - lr wd;
// m = b1 m + (1 - b1) g'; v = b2 v + (1 - b2) g'^2; w -= lr / (1 - b1^t) * m / (sqrt(v) /
// sqrt(1 - b2^t) + eps); w_bf16 = bf16(w); g is left as it was.

TEST_P(BackendOps, adamw_update) {
  const int64_t n = kElements;
  const Floats w0 = random_floats(n, 64), g = random_floats(n, 65, -2, 2);
  for (int variant = 0; variant < 4; ++variant) {
    const bool later = variant & 1, with_bf16 = variant & 2;  // later: step 7, clipped, state carried
    const AdamWStep s{1e-2, 0.9, 0.999, 1e-8, later ? 7 : 1, later ? 0.5 : 1.0};
    const double wd = later ? 0.0 : 0.1;
    const Floats m0 = later ? random_floats(n, 66, -0.5, 0.5) : Floats(n, 0.0f),
                 v0 = later ? random_floats(n, 67, 0, 0.01) : Floats(n, 0.0f);
    SCOPED_TRACE(::testing::Message() << "step " << s.step << " bf16 " << with_bf16);
    Doubles w(n), m(n), v(n);
    for (int64_t i = 0; i < n; ++i) {
      const double gi = float(double(g[i]) * double(float(s.grad_scale)));
      m[i] = s.beta1 * m0[i] + (1 - s.beta1) * gi;
      v[i] = s.beta2 * v0[i] + (1 - s.beta2) * gi * gi;
      const double denom = std::sqrt(v[i]) / std::sqrt(1 - std::pow(s.beta2, s.step)) + s.eps;
      w[i] = w0[i] * (1 - s.lr * wd) - s.lr / (1 - std::pow(s.beta1, s.step)) * m[i] / denom;
    }
    check(
        [&](Backend& be) {
          Floats gw = w0, gm = m0, gv = v0, gg = g;
          std::vector<bf16> copy(with_bf16 ? n : 0);
          be.adamw_update(gw.data(), gg.data(), gm.data(), gv.data(), n, s, wd, with_bf16 ? copy.data() : nullptr);
          if (with_bf16) expect_bf16_copy("w_bf16", copy.data(), gw.data(), 1, n, 0);
          EXPECT_EQ(gg, g) << "the gradient is read, not scaled in place";
          return Outputs{{"w", widen(gw)}, {"m", widen(gm)}, {"v", widen(gv)}};
        },
        {{"w", w}, {"m", m}, {"v", v}}, kF32);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, BackendOps, model::test::each_backend(),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// ---- coverage

// The members that are not arithmetic, with why in the comment at the top.
const std::set<std::string> kSkipped = {"name",
                                        "description",
                                        "allocate",
                                        "copy_to_device",
                                        "copy_to_host",
                                        "copy_on_device",
                                        "record_event",
                                        "wait_event",
                                        "synchronize",
                                        "gemm_scratch_bytes",
                                        "matmul_peak_flops"};

// The pure-virtual members of Backend, from backend.h's text (path compiled in): every statement
// (text up to a ';', comments dropped) that holds `virtual` and ends in `= 0`, named by the
// identifier before its first '('. Read rather than a count or list kept here, so that a new
// operation needs no edit here to fail the check; it depends only on the declarations' syntax.
std::set<std::string> declared_operations() {
  std::ifstream file(KEEL_BACKEND_HEADER);
  EXPECT_TRUE(file) << KEEL_BACKEND_HEADER;
  std::string text, line;
  while (std::getline(file, line)) text += line.substr(0, line.find("//")) + "\n";
  const std::regex pure(R"(=\s*0\s*$)"), name(R"(\bvirtual\b[^(]*?(\w+)\s*\()");
  std::set<std::string> names;
  std::istringstream statements(text);
  std::smatch m;
  for (std::string st; std::getline(statements, st, ';');)
    if (std::regex_search(st, pure) && std::regex_search(st, m, name)) names.insert(m[1]);
  return names;
}

// The operations BackendOps has a test for: its test names without the backend's suffix.
std::set<std::string> tested_operations() {
  std::set<std::string> names;
  const auto& unit = *::testing::UnitTest::GetInstance();
  for (int i = 0; i < unit.total_test_suite_count(); ++i) {
    const ::testing::TestSuite& suite = *unit.GetTestSuite(i);
    if (std::string(suite.name()) != "Backends/BackendOps") continue;
    for (int j = 0; j < suite.total_test_count(); ++j) {
      const std::string name = suite.GetTestInfo(j)->name();
      names.insert(name.substr(0, name.find('/')));
    }
  }
  return names;
}

TEST(BackendOpsCoverage, EveryOperationOfTheSeamHasATest) {
  const std::set<std::string> declared = declared_operations(), tested = tested_operations();
  EXPECT_GE(declared.size(), 40u) << "backend.h no longer reads as expected";
  for (const std::string& op : declared)
    EXPECT_TRUE(tested.count(op) + kSkipped.count(op) == 1)
        << op << ": an operation of Backend needs a BackendOps test of its name (or a reason to be in kSkipped)";
  for (const std::string& op : tested) EXPECT_TRUE(declared.count(op)) << op << ": a test named after no operation";
  for (const std::string& op : kSkipped) EXPECT_TRUE(declared.count(op)) << op << ": skipped but not declared";
}

}  // namespace
}  // namespace keel::kernels
