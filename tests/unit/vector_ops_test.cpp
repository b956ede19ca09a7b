// The row kernels of every instruction-set level this CPU has, against double-precision formulas.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "keel/kernels/cpu/vector_math.h"
#include "keel/kernels/cpu/vector_ops.h"

namespace keel::kernels {
namespace {

std::vector<Isa> levels_here() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::Portable, Isa::Avx2, Isa::Avx512})
    if (isa <= cpu_isa()) out.push_back(isa);
  return out;
}

std::vector<float> uniform(size_t n, float lo, float hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Relative error of float exp against double; below -87.3 (results under FLT_MIN) the
// approximation returns about 1.2e-38 instead of a subnormal.
void expect_exp_close(float got, double x) {
  const double want = std::exp(x);
  if (x < -87.3) {
    EXPECT_LT(got, 2e-38f) << "exp(" << x << ")";
    return;
  }
  // 2 ulp of the polynomial, plus the rounding of an argument computed in float (x*scale - shift,
  // fused or not): half an ulp of x moves exp(x) by |x| * 2^-24 relative.
  EXPECT_NEAR(got / want, 1.0, 3e-7 + std::fabs(x) * 6e-8) << "exp(" << x << ")";
}

TEST(VectorMath, ScalarExpWithinTwoUlp) {
  for (float x : uniform(20000, -87.0f, 88.0f, 1)) expect_exp_close(exp_approx(x), double(x));
  EXPECT_EQ(exp_approx(0.0f), 1.0f);
  EXPECT_LT(exp_approx(-std::numeric_limits<float>::infinity()), 2e-38f);
}

TEST(VectorOps, ExpAndSumMasksAndMatchesDouble) {
  for (Isa isa : levels_here()) {
    SCOPED_TRACE(std::string(isa_name(isa)));
    const VectorOps& ops = vector_ops_for(isa);
    for (int64_t n : {1, 15, 16, 17, 40, 64, 100}) {
      const std::vector<float> x = uniform(size_t(n), -30.0f, 3.0f, uint32_t(n));
      std::vector<int32_t> seg(static_cast<size_t>(n));
      for (int64_t c = 0; c < n; ++c) seg[size_t(c)] = int32_t(c % 5 == 2);
      for (bool with_seg : {false, true}) {
        const int64_t visible = std::max<int64_t>(1, n * 3 / 4);
        const RowVisibility vis{visible, with_seg ? seg.data() : nullptr, 0};
        std::vector<float> s = x;
        const float scale = 0.7f, shift = -1.5f;
        const float sum = ops.exp_and_sum(s.data(), n, scale, shift, vis);
        double want_sum = 0;
        for (int64_t c = 0; c < n; ++c) {
          const bool on = c < visible && (!with_seg || seg[size_t(c)] == 0);
          if (!on) {
            ASSERT_EQ(s[size_t(c)], 0.0f) << c;
            continue;
          }
          const double arg = double(x[size_t(c)]) * scale - shift;
          expect_exp_close(s[size_t(c)], arg);
          want_sum += std::exp(arg);
        }
        if (want_sum == 0)
          EXPECT_EQ(sum, 0.0f);
        else
          EXPECT_NEAR(sum / want_sum, 1.0, 3e-6);
        float want_max = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < visible; ++c)
          if (!with_seg || seg[size_t(c)] == 0) want_max = std::max(want_max, x[size_t(c)]);
        EXPECT_EQ(ops.masked_max(x.data(), vis), want_max);
      }
    }
    EXPECT_EQ(ops.masked_max(nullptr, RowVisibility{0, nullptr, 0}), -std::numeric_limits<float>::infinity());
  }
}

TEST(VectorOps, SoftmaxGradMatchesDouble) {
  // D is the row's own sum of p * dp over visible keys, so ds sums to ~0 over the row: softmax
  // ignores a shift of all of a row's scores, and so must its gradient.
  for (Isa isa : levels_here()) {
    SCOPED_TRACE(std::string(isa_name(isa)));
    const VectorOps& ops = vector_ops_for(isa);
    const int64_t n = 77, visible = 70;
    const std::vector<float> s0 = uniform(n, -4.0f, 2.0f, 7), dp0 = uniform(n, -1.0f, 1.0f, 8);
    std::vector<float> s = s0, dp = dp0;
    const float scale = 0.125f;
    double row_sum = 0.0;  // the row's own log-sum-exp, as the forward pass saved it
    for (int64_t c = 0; c < visible; ++c) row_sum += std::exp(double(s0[size_t(c)]) * scale);
    const float lse = float(std::log(row_sum));
    ops.softmax_grad(s.data(), dp.data(), n, scale, lse, RowVisibility{visible, nullptr, 0});
    double delta = 0.0, ds_sum = 0.0, ds_size = 0.0;
    for (int64_t c = 0; c < visible; ++c)
      delta += std::exp(double(s0[size_t(c)]) * scale - lse) * double(dp0[size_t(c)]);
    for (int64_t c = 0; c < n; ++c) {
      if (c >= visible) {
        ASSERT_EQ(s[size_t(c)], 0.0f);
        ASSERT_EQ(dp[size_t(c)], 0.0f);
        continue;
      }
      const double p = std::exp(double(s0[size_t(c)]) * scale - lse);
      EXPECT_NEAR(s[size_t(c)], p, 4e-7 * p);
      EXPECT_NEAR(dp[size_t(c)], scale * p * (double(dp0[size_t(c)]) - delta), 2e-6 * p + 1e-9);
      ds_sum += dp[size_t(c)];
      ds_size += std::fabs(dp[size_t(c)]);
    }
    EXPECT_LT(std::fabs(ds_sum), 1e-6 * ds_size);
  }
}

TEST(VectorOps, SoftmaxGradToBf16IsSoftmaxGradThenTheConversion) {
  // bf16 attention's backward takes the fused kernel: its bf16 rows must be bit for bit what the
  // fp32 kernel and scale_to_bf16 gave, masks and tails included.
  for (Isa isa : levels_here()) {
    SCOPED_TRACE(std::string(isa_name(isa)));
    const VectorOps& ops = vector_ops_for(isa);
    for (int64_t n : {1, 15, 16, 17, 64, 200}) {
      const std::vector<float> s0 = uniform(size_t(n), -6.0f, 3.0f, uint32_t(n)),
                               dp0 = uniform(size_t(n), -1.0f, 1.0f, uint32_t(n + 1));
      const size_t count = static_cast<size_t>(n);
      std::vector<int32_t> seg(count);
      for (int64_t c = 0; c < n; ++c) seg[size_t(c)] = int32_t(c / 5 % 2);
      for (const RowVisibility vis : {RowVisibility{n, nullptr, 0}, RowVisibility{n - n / 3, nullptr, 0},
                                      RowVisibility{n, seg.data(), 1}, RowVisibility{n, nullptr, 0, n / 2}}) {
        std::vector<float> s = s0, dp = dp0;
        ops.softmax_grad(s.data(), dp.data(), n, 0.125f, 0.75f, vis);
        std::vector<bf16> want_p(count), want_ds(count), p(count), ds(count);
        ops.scale_to_bf16(s.data(), 1.0f, want_p.data(), n);
        ops.scale_to_bf16(dp.data(), 1.0f, want_ds.data(), n);
        std::vector<float> s_in = s0;  // left holding p in fp32
        ops.softmax_grad_to_bf16(s_in.data(), dp0.data(), n, 0.125f, 0.75f, vis, p.data(), ds.data());
        for (int64_t c = 0; c < n; ++c) {
          ASSERT_EQ(p[size_t(c)].bits, want_p[size_t(c)].bits) << "n " << n << " c " << c;
          ASSERT_EQ(ds[size_t(c)].bits, want_ds[size_t(c)].bits) << "n " << n << " c " << c;
          ASSERT_EQ(s_in[size_t(c)], s[size_t(c)]) << "n " << n << " c " << c;
        }
      }
    }
  }
}

TEST(VectorOps, WidenBf16IsExactOnEveryLevel) {
  // Every bit pattern a bf16 holds (NaNs, infinities, subnormals, signed zeros) becomes the float
  // with those bits on top, at lengths that leave every tail.
  std::vector<bf16> all(1 << 16);
  for (size_t i = 0; i < all.size(); ++i) all[i].bits = uint16_t(i);
  for (Isa isa : levels_here()) {
    SCOPED_TRACE(std::string(isa_name(isa)));
    const VectorOps& ops = vector_ops_for(isa);
    for (int64_t n : {int64_t(0), int64_t(1), int64_t(7), int64_t(15), int64_t(16), int64_t(17), int64_t(1) << 16}) {
      std::vector<float> got(size_t(n) + 1, -1.0f);
      ops.widen_bf16(all.data() + (n < 100 ? 0x7f70 : 0), got.data(), n);
      for (int64_t c = 0; c < n; ++c) {
        const uint16_t bits = all[size_t(c + (n < 100 ? 0x7f70 : 0))].bits;
        ASSERT_EQ(std::bit_cast<uint32_t>(got[size_t(c)]), uint32_t(bits) << 16) << n << " " << c;
      }
      ASSERT_EQ(got[size_t(n)], -1.0f) << "wrote past the end, n " << n;
    }
  }
}

TEST(VectorOps, RoundedBf16RowsAreTheBf16RowsWidened) {
  // Where bf16 products widen their inputs, attention keeps its bf16 operands widened: the fp32
  // values must be exactly the bf16 ones scale_to_bf16 and softmax_grad_to_bf16 write.
  for (Isa isa : levels_here()) {
    SCOPED_TRACE(std::string(isa_name(isa)));
    const VectorOps& ops = vector_ops_for(isa);
    for (int64_t n : {1, 15, 16, 17, 64, 200}) {
      const size_t count = static_cast<size_t>(n);
      std::vector<float> s0 = uniform(count, -6.0f, 3.0f, uint32_t(n)),
                         dp0 = uniform(count, -1.0f, 1.0f, uint32_t(n + 1));
      s0[0] = std::numeric_limits<float>::quiet_NaN();  // kept a NaN, as the conversion keeps it
      std::vector<bf16> want(count);
      ops.scale_to_bf16(s0.data(), 0.3f, want.data(), n);
      std::vector<float> got(count), in_place = s0;
      ops.scale_round_bf16(s0.data(), 0.3f, got.data(), n);
      ops.scale_round_bf16(in_place.data(), 0.3f, in_place.data(), n);
      for (int64_t c = 0; c < n; ++c) {
        ASSERT_EQ(std::bit_cast<uint32_t>(got[size_t(c)]), uint32_t(want[size_t(c)].bits) << 16) << n << " " << c;
        ASSERT_EQ(std::bit_cast<uint32_t>(in_place[size_t(c)]), uint32_t(want[size_t(c)].bits) << 16);
      }
      s0[0] = -2.0f;
      std::vector<int32_t> seg(count);
      for (int64_t c = 0; c < n; ++c) seg[size_t(c)] = int32_t(c / 5 % 2);
      for (const RowVisibility vis : {RowVisibility{n, nullptr, 0}, RowVisibility{n - n / 3, nullptr, 0},
                                      RowVisibility{n, seg.data(), 1}, RowVisibility{n, nullptr, 0, n / 2}}) {
        std::vector<bf16> want_p(count), want_ds(count);
        std::vector<float> s_in = s0;
        ops.softmax_grad_to_bf16(s_in.data(), dp0.data(), n, 0.125f, 0.75f, vis, want_p.data(), want_ds.data());
        std::vector<float> s = s0, dp = dp0;
        ops.softmax_grad_round_bf16(s.data(), dp.data(), n, 0.125f, 0.75f, vis);
        for (int64_t c = 0; c < n; ++c) {
          ASSERT_EQ(std::bit_cast<uint32_t>(s[size_t(c)]), uint32_t(want_p[size_t(c)].bits) << 16) << n << " " << c;
          ASSERT_EQ(std::bit_cast<uint32_t>(dp[size_t(c)]), uint32_t(want_ds[size_t(c)].bits) << 16) << n << " " << c;
        }
      }
    }
  }
}

// The gradient norm's block sums: the same bits on every level (the clipping coefficient, and so
// every weight after a clipped step, must not depend on the CPU), and the plain 8-lane sum.
TEST(VectorOps, SumOfSquaresGivesThePortableBitsOnEveryLevel) {
  for (int64_t n : {int64_t(0), int64_t(5), int64_t(8), int64_t(16387)}) {
    const std::vector<float> x = uniform(size_t(n), -3.0f, 3.0f, 35);
    double lane[8] = {};
    for (int64_t i = 0; i < n; ++i) lane[i % 8] += double(x[size_t(i)]) * double(x[size_t(i)]);
    double want = 0;
    for (double l : lane) want += l;
    for (Isa isa : levels_here()) {
      SCOPED_TRACE(std::string(isa_name(isa)) + " n " + std::to_string(n));
      const double got = vector_ops_for(isa).sum_of_squares_f64(x.data(), n);
      ASSERT_EQ(std::memcmp(&got, &want, sizeof got), 0) << got << " vs " << want;
    }
  }
}

// RMSNorm's backward rows and weight-gradient sums on every level against the portable one: the
// same double arithmetic, except that a level with FMA fuses multiply-adds (last-bit differences).
TEST(VectorOps, RmsNormBackwardRowAgreesOnEveryLevel) {
  for (int64_t dim : {int64_t(7), int64_t(64), int64_t(301)}) {
    const std::vector<float> x = uniform(size_t(dim), -2.0f, 2.0f, 36), w = uniform(size_t(dim), 0.5f, 1.5f, 37),
                             dy = uniform(size_t(dim), -1.0f, 1.0f, 38), res = uniform(size_t(dim), -1.0f, 1.0f, 39);
    std::vector<float> want(static_cast<size_t>(dim)), want_res(static_cast<size_t>(dim));
    std::vector<double> acc_want(static_cast<size_t>(dim), 0.25);
    const VectorOps& portable = vector_ops_for(Isa::Portable);
    portable.rmsnorm_row_backward(x.data(), w.data(), 1.0f, 0.7f, dy.data(), dim, want.data(), nullptr);
    portable.rmsnorm_row_backward(x.data(), w.data(), 1.0f, 0.7f, dy.data(), dim, want_res.data(), res.data());
    portable.accumulate_scaled_products_f64(acc_want.data(), dy.data(), x.data(), 0.7, dim);
    for (Isa isa : levels_here()) {
      SCOPED_TRACE(std::string(isa_name(isa)) + " dim " + std::to_string(dim));
      std::vector<float> got(static_cast<size_t>(dim)), got_res(static_cast<size_t>(dim));
      std::vector<double> acc(static_cast<size_t>(dim), 0.25);
      const VectorOps& ops = vector_ops_for(isa);
      ops.rmsnorm_row_backward(x.data(), w.data(), 1.0f, 0.7f, dy.data(), dim, got.data(), nullptr);
      ops.rmsnorm_row_backward(x.data(), w.data(), 1.0f, 0.7f, dy.data(), dim, got_res.data(), res.data());
      ops.accumulate_scaled_products_f64(acc.data(), dy.data(), x.data(), 0.7, dim);
      for (int64_t c = 0; c < dim; ++c) {
        const size_t i = size_t(c);
        ASSERT_NEAR(got[i], want[i], 1e-6f * (1.0f + std::fabs(want[i]))) << c;
        ASSERT_EQ(got_res[i], got[i] + res[i]) << "the residual is added in float: " << c;
        ASSERT_NEAR(acc[i], acc_want[i], 1e-14 * (1.0 + std::fabs(acc_want[i]))) << c;
      }
    }
  }
}

TEST(VectorOps, AdamWGivesThePortableBitsOnEveryLevel) {
  // kernels_test checks adamw_update (this CPU's level) against torch's arithmetic bit for bit;
  // here every level against the portable one, which rounds the fma in double.
  const int64_t n = 4099;  // a tail on every vector width
  const AdamWConstants k{.decay = 0.999f,
                         .beta1 = 0.9f,
                         .one_minus_beta1 = 0.1f,
                         .beta2 = 0.999f,
                         .one_minus_beta2 = 0.001f,
                         .neg_step_size = -3e-4f,
                         .bias_correction2_sqrt = 0.0447f,
                         .eps = 1e-8f};
  const std::vector<float> w0 = uniform(size_t(n), -1.0f, 1.0f, 31), g = uniform(size_t(n), -1e-2f, 1e-2f, 32),
                           m0 = uniform(size_t(n), -1e-3f, 1e-3f, 33), v0 = uniform(size_t(n), 0.0f, 1e-5f, 34);
  auto run = [&](Isa isa, std::vector<float>& w, std::vector<float>& m, std::vector<float>& v, std::vector<bf16>& b) {
    w = w0, m = m0, v = v0, b.assign(size_t(n), bf16{});
    for (int step = 0; step < 3; ++step)
      vector_ops_for(isa).adamw(w.data(), g.data(), m.data(), v.data(), n, k, b.data());
  };
  std::vector<float> w_ref, m_ref, v_ref;
  std::vector<bf16> b_ref;
  run(Isa::Portable, w_ref, m_ref, v_ref, b_ref);
  for (Isa isa : levels_here()) {
    SCOPED_TRACE(std::string(isa_name(isa)));
    std::vector<float> w, m, v;
    std::vector<bf16> b;
    run(isa, w, m, v, b);
    ASSERT_EQ(std::memcmp(w.data(), w_ref.data(), sizeof(float) * size_t(n)), 0);
    ASSERT_EQ(std::memcmp(m.data(), m_ref.data(), sizeof(float) * size_t(n)), 0);
    ASSERT_EQ(std::memcmp(v.data(), v_ref.data(), sizeof(float) * size_t(n)), 0);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(b[size_t(i)].bits, float_to_bf16(w[size_t(i)]).bits) << i;
  }
}

TEST(VectorOps, Bf16ConversionIsRoundToNearestEvenOnEveryLevel) {
  std::vector<float> x = uniform(1000, -1e4f, 1e4f, 9);
  // Ties, both parities, infinities, NaN, the largest finite values, subnormals.
  for (uint32_t bits : {0x3f808000u, 0x3f818000u, 0x7f800000u, 0xff800000u, 0x7fc00001u, 0x7f7fffffu, 0x00000001u,
                        0x807fffffu, 0x3f80ffffu}) {
    float f;
    std::memcpy(&f, &bits, 4);
    x.push_back(f);
  }
  for (Isa isa : levels_here()) {
    SCOPED_TRACE(std::string(isa_name(isa)));
    for (float factor : {1.0f, 0.37f}) {
      std::vector<bf16> got(x.size());
      vector_ops_for(isa).scale_to_bf16(x.data(), factor, got.data(), int64_t(x.size()));
      for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(got[i].bits, float_to_bf16(x[i] * factor).bits) << i;
    }
  }
}

TEST(VectorOps, LevelsAgree) {
  const std::vector<float> x = uniform(203, -20.0f, 0.0f, 10);
  std::vector<float> reference = x;
  vector_ops_for(Isa::Portable).exp_and_sum(reference.data(), 203, 1.0f, 0.0f, RowVisibility{203, nullptr, 0});
  for (Isa isa : levels_here()) {
    std::vector<float> s = x;
    vector_ops_for(isa).exp_and_sum(s.data(), 203, 1.0f, 0.0f, RowVisibility{203, nullptr, 0});
    for (size_t i = 0; i < s.size(); ++i) EXPECT_NEAR(s[i], reference[i], 2.5e-7f * reference[i]) << isa_name(isa);
  }
}

TEST(VectorOps, ExpSumInDoubleAndSwigluMatchDouble) {
  for (Isa isa : levels_here()) {
    SCOPED_TRACE(std::string(isa_name(isa)));
    const VectorOps& ops = vector_ops_for(isa);
    for (int64_t n : {1, 16, 37, 1000}) {
      const std::vector<float> x = uniform(size_t(n), -20.0f, 1.0f, uint32_t(n) + 50);
      std::vector<float> e = x;
      const double sum = ops.exp_sum_f64(e.data(), n, 1.0f);
      double want = 0;
      for (int64_t c = 0; c < n; ++c) {
        expect_exp_close(e[size_t(c)], double(x[size_t(c)]) - 1.0);
        want += std::exp(double(x[size_t(c)]) - 1.0);
      }
      EXPECT_NEAR(sum / want, 1.0, 2e-6);

      const std::vector<float> g = uniform(size_t(n), -8.0f, 8.0f, 1), u = uniform(size_t(n), -2.0f, 2.0f, 2),
                               dy = uniform(size_t(n), -1.0f, 1.0f, 3);
      std::vector<float> out(size_t(n) + 1, 7.0f), dg(size_t(n) + 1, 7.0f), du(size_t(n) + 1, 7.0f);
      ops.silu_mul(g.data(), u.data(), out.data(), n);
      ops.silu_mul_backward(g.data(), u.data(), dy.data(), dg.data(), du.data(), n);
      for (int64_t c = 0; c < n; ++c) {
        const double gd = g[size_t(c)], ud = u[size_t(c)], dyd = dy[size_t(c)];
        const double sig = 1.0 / (1.0 + std::exp(-gd));
        EXPECT_NEAR(out[size_t(c)], gd * sig * ud, 1e-6 * (1 + std::fabs(gd * ud)));
        EXPECT_NEAR(du[size_t(c)], dyd * gd * sig, 1e-6 * (1 + std::fabs(gd)));
        EXPECT_NEAR(dg[size_t(c)], dyd * ud * sig * (1 + gd * (1 - sig)), 1e-6 * (1 + std::fabs(gd * ud)));
      }
      EXPECT_EQ(out[size_t(n)], 7.0f);  // nothing written past n
      EXPECT_EQ(dg[size_t(n)], 7.0f);
      EXPECT_EQ(du[size_t(n)], 7.0f);
    }
  }
}

// Gemma's GeGLU and soft caps: tanh through exp, within 1e-7 absolutely on every level.
TEST(VectorOps, GeluTanhAndSoftCapMatchDouble) {
  const double beta = std::sqrt(2.0 / M_PI), kappa = 0.044715;
  for (Isa isa : levels_here()) {
    SCOPED_TRACE(std::string(isa_name(isa)));
    const VectorOps& ops = vector_ops_for(isa);
    for (int64_t n : {1, 16, 37, 1000}) {
      const std::vector<float> g = uniform(size_t(n), -8.0f, 8.0f, 4), u = uniform(size_t(n), -2.0f, 2.0f, 5),
                               dy = uniform(size_t(n), -1.0f, 1.0f, 6);
      std::vector<float> out(size_t(n) + 1, 7.0f), dg(size_t(n) + 1, 7.0f), du(size_t(n) + 1, 7.0f);
      ops.gelu_tanh_mul(g.data(), u.data(), out.data(), n);
      ops.gelu_tanh_mul_backward(g.data(), u.data(), dy.data(), dg.data(), du.data(), n);
      for (int64_t c = 0; c < n; ++c) {
        const double x = g[size_t(c)], ud = u[size_t(c)], dyd = dy[size_t(c)];
        const double t = std::tanh(beta * (x + kappa * x * x * x));
        const double gelu = 0.5 * x * (1 + t);
        const double d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * beta * (1 + 3 * kappa * x * x);
        EXPECT_NEAR(out[size_t(c)], gelu * ud, 1e-6 * (1 + std::fabs(x * ud)));
        EXPECT_NEAR(du[size_t(c)], dyd * gelu, 1e-6 * (1 + std::fabs(x)));
        EXPECT_NEAR(dg[size_t(c)], dyd * ud * d, 2e-6 * (1 + std::fabs(x * ud)));
      }
      EXPECT_EQ(out[size_t(n)], 7.0f);  // nothing written past n
      EXPECT_EQ(dg[size_t(n)], 7.0f);
      EXPECT_EQ(du[size_t(n)], 7.0f);

      const float scale = 0.3f, cap = 2.5f;
      std::vector<float> x = uniform(size_t(n), -40.0f, 40.0f, 7), slope(size_t(n) + 1, 7.0f);
      x.push_back(7.0f);
      const std::vector<float> raw = x;
      ops.soft_cap(x.data(), n, scale, cap, slope.data());
      for (int64_t c = 0; c < n; ++c) {
        const double th = std::tanh(double(raw[size_t(c)]) * scale / cap);
        EXPECT_NEAR(x[size_t(c)], cap * th, 1e-6 * cap);
        EXPECT_NEAR(slope[size_t(c)], scale * (1 - th * th), 1e-6 * scale);
      }
      EXPECT_EQ(x[size_t(n)], 7.0f);
      EXPECT_EQ(slope[size_t(n)], 7.0f);
    }
  }
}

// KEEL_ISA (set by CI for the portable run) is what the kernels use, capped by the CPU.
// The decoding product of keel generate's bf16 weights: every length around the 16- and 32-lane
// steps (tails), against the double sum of the same widened values.
TEST(VectorOps, DotBf16MatchesDouble) {
  for (Isa isa : levels_here()) {
    const VectorOps& ops = vector_ops_for(isa);
    for (int64_t n : {1, 7, 15, 16, 17, 31, 32, 33, 48, 100, 1000, 4097}) {
      const auto x = uniform(size_t(n), -2.0f, 2.0f, uint32_t(n));
      const auto wf = uniform(size_t(n), -1.0f, 1.0f, uint32_t(n) + 1);
      std::vector<bf16> w(static_cast<size_t>(n));
      double want = 0, magnitude = 0;
      for (int64_t i = 0; i < n; ++i) {
        w[size_t(i)] = float_to_bf16(wf[size_t(i)]);
        want += double(x[size_t(i)]) * double(bf16_to_float(w[size_t(i)]));
        magnitude += std::abs(double(x[size_t(i)]) * double(bf16_to_float(w[size_t(i)])));
      }
      const float got = ops.dot_bf16(x.data(), w.data(), n);
      // fp32 sums in 32 lanes: each rounding is within 2^-24 of the running sum's magnitude.
      EXPECT_NEAR(got, want, 1e-6 * magnitude + 1e-30) << isa_name(isa) << " n=" << n;
      // dot4: the row scaled by 1, 2, 4, 8 (exact in bf16) at a stride: each row its own sum.
      std::vector<bf16> four(static_cast<size_t>(4 * (n + 3)));
      for (int r = 0; r < 4; ++r)
        for (int64_t i = 0; i < n; ++i) four[size_t(r * (n + 3) + i)] = float_to_bf16(wf[size_t(i)] * float(1 << r));
      float dots[4];
      ops.dot4_bf16(x.data(), four.data(), n + 3, n, dots);
      for (int r = 0; r < 4; ++r)
        EXPECT_NEAR(dots[r], double(1 << r) * want, 1e-6 * double(1 << r) * magnitude + 1e-30)
            << isa_name(isa) << " n=" << n << " row " << r;
    }
  }
}

TEST(VectorOps, ChosenLevelFollowsKeelIsa) {
  const char* env = std::getenv("KEEL_ISA");
  Isa want = cpu_isa();
  if (env && std::string(env) == "portable") want = Isa::Portable;
  if (env && std::string(env) == "avx2") want = std::min(want, Isa::Avx2);
  EXPECT_EQ(vector_ops().isa, want) << "KEEL_ISA=" << (env ? env : "(unset)");
}

}  // namespace
}  // namespace keel::kernels
