// RMSNorm, RoPE, SwiGLU, embedding, cross-entropy and AdamW kernels against naive formulas and
// central finite differences in double precision; fp32 determinism across thread counts.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "finite_difference.h"
#include "keel/core/error.h"
#include "keel/kernels/adamw.h"
#include "keel/kernels/cross_entropy.h"
#include "keel/kernels/embedding.h"
#include "keel/kernels/rmsnorm.h"
#include "keel/kernels/rope.h"
#include "keel/kernels/glu.h"

namespace keel::kernels {
namespace {

using test::expect_gradient_matches;
using test::random_vector;
using test::sample_indices;
using test::weighted_sum;

template <typename T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// ---------------------------------------------------------------------------------- RMSNorm

TEST(RmsNorm, ForwardMatchesFormula) {
  const int64_t rows = 5, dim = 300;
  const double eps = 1e-5;
  std::vector<double> x = random_vector(rows * dim, 1), w = random_vector(dim, 2);
  std::vector<double> y(rows * dim), rstd(rows);
  rmsnorm_forward(packed_rmsnorm(rows, dim, eps, 0.0), x.data(), w.data(), y.data(), rstd.data());
  std::vector<float> yf(rows * dim), rstdf(rows);
  const std::vector<float> xf = test::to_float(x), wf = test::to_float(w);
  rmsnorm_forward(packed_rmsnorm(rows, dim, eps, 0.0), xf.data(), wf.data(), yf.data(), rstdf.data());
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0;
    for (int64_t c = 0; c < dim; ++c) ms += x[r * dim + c] * x[r * dim + c] / dim;
    const double ref_rstd = 1 / std::sqrt(ms + eps);
    EXPECT_NEAR(rstd[r], ref_rstd, 1e-14 * ref_rstd);
    for (int64_t c = 0; c < dim; ++c) {
      const double ref = w[c] * x[r * dim + c] * ref_rstd;
      ASSERT_NEAR(y[r * dim + c], ref, 1e-14);
      ASSERT_NEAR(yf[r * dim + c], ref, 1e-6);
    }
  }
}

// The bf16 copy a kernel writes beside its fp32 output (the next GEMM's input) is exactly the cast
// of that output: fusing the cast changes no bit of what the products read.
std::vector<bf16> cast_all(const std::vector<float>& x) {
  std::vector<bf16> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = float_to_bf16(x[i]);
  return out;
}

TEST(FusedBf16Copy, NormAndGluOutputsEqualTheirCast) {
  const int64_t rows = 37, dim = 200, inter = 203;  // odd sizes: the row kernels' tails
  const std::vector<float> x = test::to_float(random_vector(rows * dim, 41)),
                           w = test::to_float(random_vector(dim, 42));
  for (double offset : {0.0, 1.0}) {
    std::vector<float> y(rows * dim), y_plain(rows * dim), rstd(rows);
    std::vector<bf16> yb(rows * dim);
    rmsnorm_forward(packed_rmsnorm(rows, dim, 1e-6, offset), x.data(), w.data(), y.data(), rstd.data(), yb.data());
    rmsnorm_forward(packed_rmsnorm(rows, dim, 1e-6, offset), x.data(), w.data(), y_plain.data(), rstd.data());
    ASSERT_TRUE(bitwise_equal(y, y_plain)) << "the fp32 output is unchanged";
    ASSERT_TRUE(bitwise_equal(yb, cast_all(y)));
  }
  const std::vector<float> gu = test::to_float(random_vector(rows * 2 * inter, 43, -4.0, 4.0)),
                           dy = test::to_float(random_vector(rows * inter, 44));
  for (GluActivation act : {GluActivation::Silu, GluActivation::GeluTanh}) {
    std::vector<float> out(rows * inter), dgu(rows * 2 * inter);
    std::vector<bf16> out_b(rows * inter), dgu_b(rows * 2 * inter);
    glu_forward(act, gu.data(), rows, inter, out.data(), out_b.data());
    glu_backward(act, gu.data(), dy.data(), rows, inter, dgu.data(), dgu_b.data());
    ASSERT_TRUE(bitwise_equal(out_b, cast_all(out)));
    ASSERT_TRUE(bitwise_equal(dgu_b, cast_all(dgu)));
  }
}

TEST(RmsNorm, BackwardMatchesFiniteDifferences) {
  const int64_t rows = 4, dim = 300;  // dim spans two dw column blocks
  const double eps = 1e-5;
  for (double offset : {0.0, 1.0}) {  // Llama's w, Gemma's 1 + w (weights around 0 then)
    SCOPED_TRACE(offset);
    const RmsNormShape s = packed_rmsnorm(rows, dim, eps, offset);
    std::vector<double> x = random_vector(rows * dim, 3), w = random_vector(dim, 4, 0.5 - offset, 1.5 - offset);
    const std::vector<double> dy = random_vector(rows * dim, 5);
    auto loss = [&] {
      std::vector<double> y(rows * dim), rstd(rows);
      rmsnorm_forward(s, x.data(), w.data(), y.data(), rstd.data());
      return weighted_sum(y, dy);
    };
    std::vector<double> y(rows * dim), rstd(rows), dx(rows * dim);
    rmsnorm_forward(s, x.data(), w.data(), y.data(), rstd.data());
    const std::vector<double> dw0 = random_vector(dim, 6);  // dw accumulates into what is there
    std::vector<double> dw = dw0;
    rmsnorm_backward(s, x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data());
    for (int64_t c = 0; c < dim; ++c) dw[c] -= dw0[c];
    expect_gradient_matches("dx", x, dx, sample_indices(rows * dim, 1 << 30, 0), loss);
    expect_gradient_matches("dw", w, dw, sample_indices(dim, 1 << 30, 0), loss);
  }
}

// The float backward (this CPU's vector level) against the double one, and the residual stream's
// gradient added in the same pass bit for bit as a separate float add would add it.
TEST(RmsNorm, FloatBackwardAgreesWithDoubleAndAddsTheResidualExactly) {
  const int64_t rows = 9, dim = 300 + 5;  // a tail past the 8-lane vectors, two dw column blocks
  for (double offset : {0.0, 1.0}) {
    SCOPED_TRACE(offset);
    const RmsNormShape s = packed_rmsnorm(rows, dim, 1e-5, offset);
    const std::vector<double> x = random_vector(rows * dim, 51), w = random_vector(dim, 52, 0.5 - offset, 1.5 - offset),
                              dy = random_vector(rows * dim, 53);
    std::vector<double> y(rows * dim), rstd(rows), dx(rows * dim), dw(dim, 0.0);
    rmsnorm_forward(s, x.data(), w.data(), y.data(), rstd.data());
    rmsnorm_backward(s, x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data());
    const std::vector<float> xf = test::to_float(x), wf = test::to_float(w), dyf = test::to_float(dy),
                             residual = test::to_float(random_vector(rows * dim, 54));
    std::vector<float> yf(rows * dim), rf(rows), dxf(rows * dim), dwf(dim, 0.0f), dx_res(rows * dim), dw2(dim, 0.0f);
    rmsnorm_forward(s, xf.data(), wf.data(), yf.data(), rf.data());
    rmsnorm_backward(s, xf.data(), wf.data(), rf.data(), dyf.data(), dxf.data(), dwf.data());
    for (int64_t i = 0; i < rows * dim; ++i) ASSERT_NEAR(dxf[i], dx[i], 2e-6 * (1 + std::fabs(dx[i]))) << i;
    for (int64_t c = 0; c < dim; ++c) ASSERT_NEAR(dwf[c], dw[c], 2e-6 * (1 + std::fabs(dw[c]))) << c;
    std::vector<bf16> dx_res_b(rows * dim);
    rmsnorm_backward(s, xf.data(), wf.data(), rf.data(), dyf.data(), dx_res.data(), dw2.data(), residual.data(),
                     dx_res_b.data());
    for (int64_t i = 0; i < rows * dim; ++i) ASSERT_EQ(dx_res[i], dxf[i] + residual[i]) << i;
    ASSERT_TRUE(bitwise_equal(dw2, dwf));
    ASSERT_TRUE(bitwise_equal(dx_res_b, cast_all(dx_res))) << "the bf16 copy is the cast of dx";
  }
}

TEST(RmsNorm, GemmaOffsetScalesByOnePlusW) {
  const int64_t rows = 2, dim = 8;
  const std::vector<double> x = random_vector(rows * dim, 7), w = random_vector(dim, 8, -0.2, 0.2);
  std::vector<double> one_plus_w = w, y(rows * dim), y1(rows * dim), rstd(rows);
  for (double& v : one_plus_w) v += 1.0;
  rmsnorm_forward(packed_rmsnorm(rows, dim, 1e-6, 1.0), x.data(), w.data(), y.data(), rstd.data());
  rmsnorm_forward(packed_rmsnorm(rows, dim, 1e-6, 0.0), x.data(), one_plus_w.data(), y1.data(), rstd.data());
  EXPECT_EQ(y, y1);
}

// dw's columns are cut into each thread count's own blocks (rmsnorm.cpp: dw_column_block): 700
// in 3 blocks on one thread and 4 on two, 64 (a Qwen3 head's q/k norm) whole and in two halves.
TEST(RmsNorm, BackwardIsIdenticalForOneAndTwoThreads) {
  // Each large enough to run in parallel.
  for (const auto& [rows, dim] : {std::pair<int64_t, int64_t>{64, 700}, {1024, 64}}) {
    const std::vector<float> x = test::to_float(random_vector(rows * dim, 7));
    const std::vector<float> w = test::to_float(random_vector(dim, 8));
    const std::vector<float> dy = test::to_float(random_vector(rows * dim, 9));
    std::vector<float> y(rows * dim), rstd(rows);
    rmsnorm_forward(packed_rmsnorm(rows, dim, 1e-6, 0.0), x.data(), w.data(), y.data(), rstd.data());
    std::vector<float> dx[2], dw[2];
    for (int threads : {1, 2})
      test::with_threads(threads, [&] {
        dx[threads - 1].assign(rows * dim, 0.f);
        dw[threads - 1].assign(dim, 0.25f);
        rmsnorm_backward(packed_rmsnorm(rows, dim, 1e-6, 0.0), x.data(), w.data(), rstd.data(), dy.data(),
                         dx[threads - 1].data(), dw[threads - 1].data());
      });
    EXPECT_TRUE(bitwise_equal(dx[0], dx[1])) << "dim " << dim;
    EXPECT_TRUE(bitwise_equal(dw[0], dw[1])) << "dim " << dim;
  }
}

// Qwen3's q_norm/k_norm: each head of a strided [tokens, heads, head_dim] view normalised with one
// weight, leaving the other columns of the fused row alone.
TEST(HeadRmsNorm, EqualsRmsNormOfEachHeadAndKeepsOtherColumns) {
  const int64_t tokens = 5, heads = 3, dim = 8, ld = heads * dim + 7, ldy = heads * dim + 2;
  const double eps = 1e-6;
  std::vector<double> x = random_vector(tokens * ld, 40), w = random_vector(dim, 41, 0.5, 1.5);
  std::vector<double> y(size_t(tokens * ldy), -9.0), rstd(tokens * heads);
  rmsnorm_forward(RmsNormShape{tokens, heads, dim, ld, ldy, ld, eps, 0.0}, x.data(), w.data(), y.data(), rstd.data());
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      std::vector<double> y1(dim), r1(1);
      rmsnorm_forward(packed_rmsnorm(1, dim, eps, 0.0), x.data() + t * ld + h * dim, w.data(), y1.data(), r1.data());
      EXPECT_EQ(rstd[t * heads + h], r1[0]);
      for (int64_t c = 0; c < dim; ++c) ASSERT_EQ(y[t * ldy + h * dim + c], y1[c]);
    }
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t c = heads * dim; c < ldy; ++c) ASSERT_EQ(y[t * ldy + c], -9.0);  // row padding untouched
  // In place (y = x), as generation normalises the fused projection output.
  std::vector<double> inplace = x;
  rmsnorm_forward(RmsNormShape{tokens, heads, dim, ld, ld, ld, eps, 0.0}, inplace.data(), w.data(), inplace.data(),
                  rstd.data());
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t c = 0; c < ld; ++c)
      ASSERT_EQ(inplace[t * ld + c], c < heads * dim ? y[t * ldy + c] : x[t * ld + c]);
}

TEST(HeadRmsNorm, BackwardMatchesFiniteDifferences) {
  const int64_t tokens = 4, heads = 3, dim = 6, ld = heads * dim + 5, ldy = heads * dim + 1, lddx = heads * dim + 3;
  const double eps = 1e-5;
  const RmsNormShape s{tokens, heads, dim, ld, ldy, lddx, eps, 0.0};  // dx at its own stride
  std::vector<double> x = random_vector(tokens * ld, 42), w = random_vector(dim, 43, 0.5, 1.5);
  std::vector<double> dy = random_vector(tokens * ldy, 44);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t c = heads * dim; c < ldy; ++c) dy[t * ldy + c] = 0;  // padding is not an output
  auto loss = [&] {
    std::vector<double> y(tokens * ldy), rstd(tokens * heads);
    rmsnorm_forward(s, x.data(), w.data(), y.data(), rstd.data());
    return weighted_sum(y, dy);
  };
  std::vector<double> y(tokens * ldy), rstd(tokens * heads), dx(tokens * lddx), dw(dim, 0.0);
  rmsnorm_forward(s, x.data(), w.data(), y.data(), rstd.data());
  rmsnorm_backward(s, x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data());
  // dx in x's layout for the comparison.
  std::vector<double> dx_at_x(x.size(), 0.0);
  std::vector<int64_t> data;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t c = 0; c < heads * dim; ++c) dx_at_x[t * ld + c] = dx[t * lddx + c], data.push_back(t * ld + c);
  expect_gradient_matches("dx", x, dx_at_x, data, loss);
  expect_gradient_matches("dw", w, dw, sample_indices(dim, 1 << 30, 0), loss);
}

// -------------------------------------------------------------------------------------- RoPE

struct RopeCase {
  bool interleaved;
  int64_t head_dim, rotary_dim;
};

class RopeTest : public ::testing::TestWithParam<RopeCase> {};

// Strided [tokens, heads, head_dim] rows with 3 padding elements per token.
constexpr int64_t kRopeTokens = 6, kRopeHeads = 3, kRopeMaxPositions = 50;

TEST_P(RopeTest, ForwardMatchesRotationFormula) {
  const RopeCase rc = GetParam();
  const RopeTable table = RopeTable::build(rc.rotary_dim, rc.interleaved, 10000.0, kRopeMaxPositions);
  const int64_t ld = kRopeHeads * rc.head_dim + 3;
  const std::vector<int32_t> positions = {0, 1, 7, 3, 49, 20};
  const std::vector<double> x = random_vector(kRopeTokens * ld, 10);
  std::vector<double> y = x;
  rope_forward(y.data(), ld, positions.data(), kRopeTokens, kRopeHeads, rc.head_dim, table);
  const int64_t half = rc.rotary_dim / 2;
  for (int64_t t = 0; t < kRopeTokens; ++t) {
    for (int64_t h = 0; h < kRopeHeads; ++h) {
      const double* xi = x.data() + t * ld + h * rc.head_dim;
      const double* yi = y.data() + t * ld + h * rc.head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t a = rc.interleaved ? 2 * i : i, b = rc.interleaved ? 2 * i + 1 : i + half;
        const double c = table.cos[positions[t] * half + i], s = table.sin[positions[t] * half + i];
        EXPECT_NEAR(yi[a], xi[a] * c - xi[b] * s, 1e-15);
        EXPECT_NEAR(yi[b], xi[b] * c + xi[a] * s, 1e-15);
      }
      for (int64_t d = rc.rotary_dim; d < rc.head_dim; ++d) EXPECT_EQ(yi[d], xi[d]);  // pass-through
    }
    for (int64_t p = kRopeHeads * rc.head_dim; p < ld; ++p) EXPECT_EQ(y[t * ld + p], x[t * ld + p]);
  }
}

TEST_P(RopeTest, BackwardMatchesFiniteDifferences) {
  const RopeCase rc = GetParam();
  const RopeTable table = RopeTable::build(rc.rotary_dim, rc.interleaved, 500.0, kRopeMaxPositions);
  const int64_t ld = kRopeHeads * rc.head_dim + 3;
  const std::vector<int32_t> positions = {5, 0, 17, 3, 49, 20};
  std::vector<double> x = random_vector(kRopeTokens * ld, 11);
  const std::vector<double> dy = random_vector(kRopeTokens * ld, 12);
  std::vector<double> dx = dy;
  rope_backward(dx.data(), ld, positions.data(), kRopeTokens, kRopeHeads, rc.head_dim, table);
  expect_gradient_matches("dx", x, dx, sample_indices(kRopeTokens * ld, 1 << 30, 0), [&] {
    std::vector<double> y = x;
    rope_forward(y.data(), ld, positions.data(), kRopeTokens, kRopeHeads, rc.head_dim, table);
    return weighted_sum(y, dy);
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts, RopeTest,
                         ::testing::Values(RopeCase{false, 8, 8}, RopeCase{true, 8, 8}, RopeCase{false, 8, 4},
                                           RopeCase{true, 12, 6}));

TEST(RopeTable, FollowsHfInverseFrequencies) {
  const int64_t dim = 64;
  const double theta = 10000.0;
  const RopeTable t = RopeTable::build(dim, false, theta, 4096);
  ASSERT_EQ(t.cos.size(), size_t(4096 * dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i) {
    EXPECT_EQ(t.cos[i], 1.0f);  // position 0
    EXPECT_EQ(t.sin[i], 0.0f);
  }
  // Against the exact angle pos * theta^(-2i/dim): the fp32 angle is off by at most a few ulp of
  // the angle, which at position 4000 is ~1e-3 * 4e-4 rad.
  for (int64_t p : {1, 100, 4000})
    for (int64_t i = 0; i < dim / 2; ++i) {
      const double angle = p * std::pow(theta, -2.0 * i / dim);
      EXPECT_NEAR(t.cos[p * dim / 2 + i], std::cos(angle), 2e-7 + 3e-7 * angle);
      EXPECT_NEAR(t.sin[p * dim / 2 + i], std::sin(angle), 2e-7 + 3e-7 * angle);
    }
  // The fp32 recipe exactly: float(p) * (1.0f / powf(theta, float(2i)/float(dim))).
  const float inv_freq = 1.0f / std::pow(10000.0f, float(2 * 5) / float(dim));
  EXPECT_EQ(t.cos[4000 * dim / 2 + 5], float(std::cos(double(4000.0f * inv_freq))));
}

// ------------------------------------------------------------------------------------ SwiGLU

TEST(SwiGlu, ForwardMatchesFormula) {
  const int64_t rows = 3, inter = 17;
  const std::vector<double> gu = random_vector(rows * 2 * inter, 13, -6, 6);
  std::vector<double> out(rows * inter);
  glu_forward(GluActivation::Silu, gu.data(), rows, inter, out.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < inter; ++c) {
      const double g = gu[r * 2 * inter + c], u = gu[r * 2 * inter + inter + c];
      EXPECT_NEAR(out[r * inter + c], g / (1 + std::exp(-g)) * u, 1e-15);
    }
}

TEST(Glu, BackwardMatchesFiniteDifferences) {
  const int64_t rows = 3, inter = 17;
  for (GluActivation act : {GluActivation::Silu, GluActivation::GeluTanh}) {
    SCOPED_TRACE(act == GluActivation::Silu ? "SwiGLU" : "GeGLU");
    std::vector<double> gu = random_vector(rows * 2 * inter, 14, -6, 6);
    const std::vector<double> dy = random_vector(rows * inter, 15);
    std::vector<double> dgu(rows * 2 * inter);
    glu_backward(act, gu.data(), dy.data(), rows, inter, dgu.data());
    expect_gradient_matches("dgate_up", gu, dgu, sample_indices(rows * 2 * inter, 1 << 30, 0), [&] {
      std::vector<double> out(rows * inter);
      glu_forward(act, gu.data(), rows, inter, out.data());
      return weighted_sum(out, dy);
    });
  }
}

// GeGLU (Gemma): GELU with torch's tanh approximation.
TEST(GeGlu, ForwardMatchesTorchsTanhGelu) {
  const int64_t rows = 3, inter = 17;
  const std::vector<double> gu = random_vector(rows * 2 * inter, 22, -6, 6);
  std::vector<double> out(rows * inter);
  glu_forward(GluActivation::GeluTanh, gu.data(), rows, inter, out.data());
  std::vector<float> out_f(rows * inter);
  const std::vector<float> gu_f = test::to_float(gu);
  glu_forward(GluActivation::GeluTanh, gu_f.data(), rows, inter, out_f.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < inter; ++c) {
      const double g = gu[r * 2 * inter + c], u = gu[r * 2 * inter + inter + c];
      const double gelu = 0.5 * g * (1 + std::tanh(std::sqrt(2 / M_PI) * (g + 0.044715 * g * g * g)));
      EXPECT_NEAR(out[r * inter + c], gelu * u, 1e-14);
      EXPECT_NEAR(out_f[r * inter + c], gelu * u, 1e-5 * (1 + std::fabs(gelu * u)));
    }
}

// --------------------------------------------------------------------------------- Embedding

TEST(Embedding, ForwardGathersRows) {
  const int64_t vocab = 11, hidden = 5;
  const std::vector<double> table = random_vector(vocab * hidden, 16);
  const std::vector<int32_t> ids = {3, 0, 10, 3};
  std::vector<double> out(ids.size() * hidden);
  embedding_forward(ids.data(), int64_t(ids.size()), table.data(), hidden, out.data());
  for (size_t i = 0; i < ids.size(); ++i)
    for (int64_t c = 0; c < hidden; ++c) EXPECT_EQ(out[i * hidden + c], table[ids[i] * hidden + c]);
}

TEST(Embedding, ForwardFromABf16TableWidensExactly) {
  const int64_t vocab = 7, hidden = 300;  // rows long enough for the vector conversion path
  std::vector<bf16> table(size_t(vocab * hidden));
  const auto values = random_vector(table.size(), 17, -3, 3);
  for (size_t i = 0; i < table.size(); ++i) table[i] = float_to_bf16(float(values[i]));
  const std::vector<int32_t> ids = {6, 0, 6, 2};
  std::vector<float> out(ids.size() * hidden);
  embedding_forward_bf16(ids.data(), int64_t(ids.size()), table.data(), hidden, out.data());
  for (size_t i = 0; i < ids.size(); ++i)
    for (int64_t c = 0; c < hidden; ++c) ASSERT_EQ(out[i * hidden + c], bf16_to_float(table[ids[i] * hidden + c]));
}

TEST(Embedding, BackwardMatchesFiniteDifferences) {
  const int64_t vocab = 9, hidden = 70;  // two column blocks
  std::vector<double> table = random_vector(vocab * hidden, 17);
  const std::vector<int32_t> ids = {3, 0, 8, 3, 3, 5};  // repeats accumulate
  const int64_t n = int64_t(ids.size());
  const std::vector<double> dy = random_vector(n * hidden, 18);
  std::vector<double> dtable(vocab * hidden, 0.0);
  embedding_backward(ids.data(), n, dy.data(), hidden, vocab, /*padding_idx=*/-1, dtable.data());
  expect_gradient_matches("dtable", table, dtable, sample_indices(vocab * hidden, 1 << 30, 0), [&] {
    std::vector<double> out(n * hidden);
    embedding_forward(ids.data(), n, table.data(), hidden, out.data());
    return weighted_sum(out, dy);
  });
}

TEST(Embedding, BackwardAccumulatesAndIsIdenticalForOneAndTwoThreads) {
  const int64_t vocab = 50, hidden = 300, n = 500;
  std::vector<int32_t> ids(n);
  for (int64_t i = 0; i < n; ++i) ids[i] = int32_t((i * 7) % 13);  // heavy repeats
  const std::vector<float> dy = test::to_float(random_vector(n * hidden, 19));
  std::vector<float> dtable[2];
  for (int threads : {1, 2})
    test::with_threads(threads, [&] {
      dtable[threads - 1].assign(vocab * hidden, 1.0f);
      embedding_backward(ids.data(), n, dy.data(), hidden, vocab, /*padding_idx=*/-1, dtable[threads - 1].data());
    });
  EXPECT_TRUE(bitwise_equal(dtable[0], dtable[1]));
  EXPECT_EQ(dtable[0][20 * hidden], 1.0f);  // unused rows keep what they had
}

TEST(Embedding, BackwardRejectsOutOfRangeIds) {
  const std::vector<int32_t> ids = {1, 9};
  std::vector<float> dy(2 * 4, 1.f), dtable(9 * 4, 0.f);
  EXPECT_THROW(embedding_backward(ids.data(), 2, dy.data(), 4, 9, -1, dtable.data()), keel::Error);
}

// nn.Embedding(padding_idx=p): the lookups of row p add nothing to it (what is there stays: a tied
// LM head's gradient), every other row gets exactly what it gets without a padding index.
TEST(Embedding, BackwardLeavesThePaddingRowToOthers) {
  const int64_t vocab = 9, hidden = 70, pad = 3;
  const std::vector<int32_t> ids = {3, 0, 8, 3, 3, 5, 0};
  const int64_t n = int64_t(ids.size());
  const std::vector<float> dy = test::to_float(random_vector(n * hidden, 20));
  std::vector<float> with(vocab * hidden, 0.5f), without(vocab * hidden, 0.5f);
  embedding_backward(ids.data(), n, dy.data(), hidden, vocab, pad, with.data());
  embedding_backward(ids.data(), n, dy.data(), hidden, vocab, -1, without.data());
  for (int64_t r = 0; r < vocab; ++r)
    for (int64_t c = 0; c < hidden; ++c) {
      const size_t k = size_t(r * hidden + c);
      if (r == pad)
        ASSERT_EQ(with[k], 0.5f) << "column " << c;
      else
        ASSERT_EQ(with[k], without[k]) << "row " << r << " column " << c;
    }
  EXPECT_NE(without[size_t(pad * hidden)], 0.5f);  // the row is used: skipping it is what differs
}

// ----------------------------------------------------------------------------- Cross-entropy

TEST(CrossEntropy, LossAndGradientMatchFormula) {
  const int64_t rows = 5, vocab = 37, ld = 40;
  const std::vector<int32_t> labels = {3, kIgnoreIndex, 36, 0, 12};
  const std::vector<double> x = random_vector(rows * ld, 20, -8, 8);
  const double grad_scale = 0.25;
  std::vector<double> g = x;
  const double loss = cross_entropy_forward_backward(g.data(), ld, labels.data(), rows, vocab, grad_scale);
  std::vector<float> gf = test::to_float(x);
  const double loss_f = cross_entropy_forward_backward(gf.data(), ld, labels.data(), rows, vocab, grad_scale);
  double ref_loss = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const double* xr = x.data() + r * ld;
    for (int64_t j = vocab; j < ld; ++j) EXPECT_EQ(g[r * ld + j], xr[j]);  // padding untouched
    if (labels[r] == kIgnoreIndex) {
      for (int64_t j = 0; j < vocab; ++j) EXPECT_EQ(g[r * ld + j], 0.0);
      continue;
    }
    long double sum = 0;
    for (int64_t j = 0; j < vocab; ++j) sum += std::exp((long double)xr[j]);
    ref_loss += double(std::log(sum) - xr[labels[r]]);
    for (int64_t j = 0; j < vocab; ++j) {
      const double ref = (double(std::exp((long double)xr[j]) / sum) - (j == labels[r])) * grad_scale;
      EXPECT_NEAR(g[r * ld + j], ref, 1e-15);
      EXPECT_NEAR(gf[r * ld + j], ref, 1e-7);
    }
  }
  EXPECT_NEAR(loss, ref_loss, 1e-12);
  EXPECT_NEAR(loss_f, ref_loss, 1e-5);
}

// LossRows: each row's loss and mean (capped) logit out, and a gradient scale per row, which is
// what calling the kernel once per row with that row's scale gives (the sequence-level objectives'
// per-sequence weights), in float and in double, with and without the cap.
TEST(CrossEntropy, PerRowLossesMeanLogitsAndGradientScales) {
  const int64_t rows = 5, vocab = 37, ld = 40;
  const std::vector<int32_t> labels = {3, kIgnoreIndex, 36, 0, 12};
  const std::vector<double> x = random_vector(rows * ld, 21, -8, 8);
  const std::vector<float> scales = {0.5f, 2.0f, -1.25f, 0.0f, 3.0f};
  for (double softcap : {0.0, 5.0}) {
    SCOPED_TRACE(softcap);
    std::vector<double> g = x, loss(rows, -1.0), mean(rows, -1.0);
    const double total = cross_entropy_forward_backward(g.data(), ld, labels.data(), rows, vocab, 0.25, softcap,
                                                        nullptr, LossRows{scales.data(), loss.data(), mean.data()});
    std::vector<float> gf = test::to_float(x);
    std::vector<double> loss_f(rows), mean_f(rows);
    cross_entropy_forward_backward(gf.data(), ld, labels.data(), rows, vocab, 0.25, softcap, nullptr,
                                   LossRows{scales.data(), loss_f.data(), mean_f.data()});
    double summed = 0;
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<double> one(x.begin() + r * ld, x.begin() + (r + 1) * ld);
      const double row_loss =
          cross_entropy_forward_backward(one.data(), ld, &labels[size_t(r)], 1, vocab, 0.25 * scales[r], softcap);
      EXPECT_EQ(loss[size_t(r)], row_loss) << "row " << r;
      EXPECT_NEAR(loss_f[size_t(r)], row_loss, 1e-5) << "row " << r;
      summed += row_loss;
      double m = 0;
      for (int64_t j = 0; j < vocab; ++j)
        m += softcap > 0 ? softcap * std::tanh(x[size_t(r * ld + j)] / softcap) : x[size_t(r * ld + j)];
      EXPECT_NEAR(mean[size_t(r)], m / double(vocab), 1e-12) << "row " << r;
      EXPECT_NEAR(mean_f[size_t(r)], m / double(vocab), 1e-5) << "row " << r;
      for (int64_t j = 0; j < vocab; ++j) {
        EXPECT_EQ(g[size_t(r * ld + j)], one[size_t(j)]) << "row " << r << " column " << j;
        EXPECT_NEAR(gf[size_t(r * ld + j)], one[size_t(j)], 1e-6) << "row " << r << " column " << j;
      }
    }
    EXPECT_EQ(total, summed);
    EXPECT_EQ(loss[1], 0.0);  // the ignored row
  }
}

TEST(CrossEntropy, ABf16GradientIsTheFp32GradientConverted) {
  // bf16 training takes the gradient straight in bf16: the same loss, and bit for bit the bf16 of
  // the fp32 gradient, for plain, ignored and soft-capped rows.
  const int64_t rows = 4, vocab = 101, ld = 104;
  const std::vector<int32_t> labels = {3, kIgnoreIndex, 100, 0};
  const std::vector<float> x = test::to_float(random_vector(rows * ld, 24, -8, 8));
  for (double softcap : {0.0, 30.0}) {
    std::vector<float> fp32 = x, scratch = x;
    std::vector<bf16> fused(size_t(rows * ld), bf16{0x7fc0});  // NaN: padding must stay as it was
    const double loss = cross_entropy_forward_backward(fp32.data(), ld, labels.data(), rows, vocab, 0.5, softcap);
    const double loss_b =
        cross_entropy_forward_backward(scratch.data(), ld, labels.data(), rows, vocab, 0.5, softcap, fused.data());
    EXPECT_EQ(loss, loss_b);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < vocab; ++j)
        ASSERT_EQ(fused[size_t(r * ld + j)].bits, float_to_bf16(fp32[size_t(r * ld + j)]).bits) << r << " " << j;
      for (int64_t j = vocab; j < ld; ++j) ASSERT_EQ(fused[size_t(r * ld + j)].bits, 0x7fc0);
    }
  }
}

TEST(CrossEntropy, GradientMatchesFiniteDifferences) {
  const int64_t rows = 3, vocab = 20;
  const std::vector<int32_t> labels = {4, 19, kIgnoreIndex};
  std::vector<double> x = random_vector(rows * vocab, 21, -3, 3);
  const double grad_scale = 0.5;
  std::vector<double> g = x;
  cross_entropy_forward_backward(g.data(), vocab, labels.data(), rows, vocab, grad_scale);
  expect_gradient_matches("dlogits", x, g, sample_indices(rows * vocab, 1 << 30, 0), [&] {
    std::vector<double> y = x;
    return grad_scale * cross_entropy_forward_backward(y.data(), vocab, labels.data(), rows, vocab, 1.0);
  });
}

// Gemma 2's final-logit soft-capping: the loss of cap * tanh(x / cap), differentiated through the cap.
TEST(CrossEntropy, SoftCappedLossAndGradientMatchFiniteDifferences) {
  const int64_t rows = 3, vocab = 20;
  const double cap = 2.5;
  const std::vector<int32_t> labels = {4, 19, kIgnoreIndex};
  std::vector<double> x = random_vector(rows * vocab, 25, -6, 6);  // well into tanh's curve
  std::vector<double> capped = x;
  for (double& v : capped) v = cap * std::tanh(v / cap);
  std::vector<double> plain = capped;
  const double expected = cross_entropy_forward_backward(plain.data(), vocab, labels.data(), rows, vocab, 1.0);
  std::vector<double> g = x;
  EXPECT_NEAR(cross_entropy_forward_backward(g.data(), vocab, labels.data(), rows, vocab, 1.0, cap), expected, 1e-13);
  expect_gradient_matches("dlogits", x, g, sample_indices(rows * vocab, 1 << 30, 0), [&] {
    std::vector<double> y = x;
    return cross_entropy_forward_backward(y.data(), vocab, labels.data(), rows, vocab, 1.0, cap);
  });
  // float agrees.
  std::vector<float> gf = test::to_float(x);
  EXPECT_NEAR(cross_entropy_forward_backward(gf.data(), vocab, labels.data(), rows, vocab, 1.0, cap), expected, 1e-5);
  for (int64_t i = 0; i < rows * vocab; ++i) ASSERT_NEAR(gf[i], g[i], 1e-6) << i;
}

TEST(CrossEntropy, RejectsOutOfRangeLabels) {
  std::vector<float> x(2 * 5, 0.f);
  const std::vector<int32_t> labels = {1, 5};
  EXPECT_THROW(cross_entropy_forward_backward(x.data(), 5, labels.data(), 2, 5, 1.0), keel::Error);
  const std::vector<int32_t> negative = {-1, 0};
  EXPECT_THROW(cross_entropy_forward_backward(x.data(), 5, negative.data(), 2, 5, 1.0), keel::Error);
}

// ------------------------------------------------------------------------------------- AdamW

// torch 1.13 _single_tensor_adamw restated per element in fp32 (add_ with alpha is an fma in
// torch's vectorised kernel; addcdiv is (value * t1) / t2).
void torch_adamw_step(std::vector<float>& w, const std::vector<float>& g, std::vector<float>& m, std::vector<float>& v,
                      const AdamWStep& s, double wd) {
  const double bc1 = 1 - std::pow(s.beta1, double(s.step));
  const double bc2 = 1 - std::pow(s.beta2, double(s.step));
  for (size_t i = 0; i < w.size(); ++i) {
    w[i] = w[i] * float(1 - s.lr * wd);
    m[i] = std::fma(g[i], float(1 - s.beta1), m[i] * float(s.beta1));
    v[i] = v[i] * float(s.beta2) + float(1 - s.beta2) * g[i] * g[i];
    const float denom = std::sqrt(v[i]) / float(std::sqrt(bc2)) + float(s.eps);
    w[i] = w[i] + float(-(s.lr / bc1)) * m[i] / denom;
  }
}

TEST(AdamW, MatchesTorchArithmeticOverSeveralSteps) {
  const int64_t n = 100003;
  std::vector<float> w = test::to_float(random_vector(n, 22));
  std::vector<float> m(n, 0.f), v(n, 0.f), w_ref = w, m_ref = m, v_ref = v;
  std::vector<bf16> w_bf16(n);
  for (double wd : {0.1, 0.0})
    for (int64_t step = 1; step <= 4; ++step) {
      const std::vector<float> g = test::to_float(random_vector(n, 100 + step, -1e-2, 1e-2));
      const AdamWStep s{1e-3 * step, 0.9, 0.999, 1e-8, step};
      adamw_update(w.data(), g.data(), m.data(), v.data(), n, s, wd, w_bf16.data());
      torch_adamw_step(w_ref, g, m_ref, v_ref, s, wd);
      ASSERT_TRUE(bitwise_equal(w, w_ref)) << "step " << step;
      ASSERT_TRUE(bitwise_equal(m, m_ref)) << "step " << step;
      ASSERT_TRUE(bitwise_equal(v, v_ref)) << "step " << step;
      for (int64_t i = 0; i < n; i += 997) ASSERT_EQ(w_bf16[i].bits, float_to_bf16(w[i]).bits);
    }
}

// Clipping folded into the update: torch's clip_grad_norm_ multiplies the gradients in place by
// float(coef) (one fp32 rounding each) and AdamW then reads them; grad_scale must give the same bits
// and leave the gradients as they were.
TEST(AdamW, GradScaleEqualsClippingTheGradientsFirst) {
  const int64_t n = 50021;
  const std::vector<float> w0 = test::to_float(random_vector(n, 31));
  std::vector<float> w = w0, m(n, 0.f), v(n, 0.f), w_ref = w0, m_ref = m, v_ref = v;
  std::vector<bf16> w_bf16(n);
  for (int64_t step = 1; step <= 3; ++step) {
    const std::vector<float> g = test::to_float(random_vector(n, 300 + step, -3.0, 3.0));
    const double coef = 1.0 / (std::sqrt(double(n)) * (1.0 + 0.37 * double(step)) + 1e-6);
    std::vector<float> clipped = g;
    for (float& e : clipped) e *= float(coef);
    AdamWStep s{1e-3, 0.9, 0.999, 1e-8, step};
    s.grad_scale = coef;
    const std::vector<float> g_before = g;
    adamw_update(w.data(), g.data(), m.data(), v.data(), n, s, 0.01, w_bf16.data());
    torch_adamw_step(w_ref, clipped, m_ref, v_ref, AdamWStep{1e-3, 0.9, 0.999, 1e-8, step}, 0.01);
    ASSERT_TRUE(bitwise_equal(w, w_ref)) << "step " << step;
    ASSERT_TRUE(bitwise_equal(m, m_ref)) << "step " << step;
    ASSERT_TRUE(bitwise_equal(v, v_ref)) << "step " << step;
    ASSERT_TRUE(bitwise_equal(g, g_before)) << "the gradients are read, not scaled in place";
  }
}

// The same algebra in double, to check the formula itself and not only its rounding.
TEST(AdamW, AgreesWithDoublePrecisionAdamW) {
  const int64_t n = 1000;
  const double lr = 2e-3, b1 = 0.8, b2 = 0.95, eps = 1e-6, wd = 0.05;
  std::vector<double> wd_ = random_vector(n, 23), md(n, 0), vd(n, 0);
  std::vector<float> w = test::to_float(wd_), m(n, 0.f), v(n, 0.f);
  for (int64_t t = 1; t <= 3; ++t) {
    const std::vector<double> g = random_vector(n, 200 + t);
    const std::vector<float> gf = test::to_float(g);
    adamw_update(w.data(), gf.data(), m.data(), v.data(), n, AdamWStep{lr, b1, b2, eps, t}, wd, nullptr);
    for (int64_t i = 0; i < n; ++i) {
      wd_[i] *= 1 - lr * wd;
      md[i] = b1 * md[i] + (1 - b1) * double(gf[i]);
      vd[i] = b2 * vd[i] + (1 - b2) * double(gf[i]) * double(gf[i]);
      const double m_hat = md[i] / (1 - std::pow(b1, t)), v_hat = vd[i] / (1 - std::pow(b2, t));
      wd_[i] -= lr * m_hat / (std::sqrt(v_hat) + eps);
    }
  }
  for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(w[i], wd_[i], 1e-6 * (1 + std::fabs(wd_[i]))) << i;
}

TEST(SumOfSquares, MatchesLongDoubleAndIsIdenticalForOneAndTwoThreads) {
  const int64_t n = 257 * (int64_t(1) << 14) + 123;  // more than one round of blocks, ragged end
  const std::vector<float> x = test::to_float(random_vector(n, 24));
  long double ref = 0;
  for (float e : x) ref += (long double)e * e;
  double sums[2];
  for (int threads : {1, 2}) test::with_threads(threads, [&] { sums[threads - 1] = sum_of_squares(x.data(), n); });
  EXPECT_NEAR(sums[0], double(ref), 1e-12 * double(ref));
  EXPECT_EQ(std::memcmp(&sums[0], &sums[1], sizeof(double)), 0);
  EXPECT_EQ(sum_of_squares(x.data(), 0), 0.0);
  EXPECT_EQ(sum_of_squares(x.data(), 3), double(x[0]) * x[0] + double(x[1]) * x[1] + double(x[2]) * x[2]);
}

TEST(ScaleInPlace, MultipliesEveryElement) {
  std::vector<float> x = {1.f, -2.f, 3.5f};
  scale_in_place(x.data(), 3, 0.5f);
  EXPECT_EQ(x, (std::vector<float>{0.5f, -1.f, 1.75f}));
}

}  // namespace
}  // namespace keel::kernels
