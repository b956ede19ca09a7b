// core/dtype's conversions against an independent rounding: every bf16 GEMM input, weight copy and
// checkpoint write goes through them, so a truncating or tie-breaking slip would move every bf16
// run while each kernel test compared the slip with itself.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "keel/core/dtype.h"

namespace keel {
namespace {

float from_bits(uint32_t u) { return std::bit_cast<float>(u); }

// Round to nearest, ties to even, by distance in double: of the two bf16 values around x, the
// nearer; at equal distance, the one whose last mantissa bit is 0. Overflow past the largest
// finite bf16 by half an ulp or more goes to infinity, as IEEE rounding does.
uint16_t nearest_even_bf16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint16_t down = uint16_t(u >> 16);  // toward zero
  const uint16_t up = uint16_t(down + 1);   // away from zero
  const double a = std::fabs(double(x));
  const double lo = std::fabs(double(from_bits(uint32_t(down) << 16)));
  // Past the largest finite bf16 the next value up is 2^128, where infinity begins.
  const double hi = (up & 0x7fffu) == 0x7f80u ? std::ldexp(1.0, 128) : std::fabs(double(from_bits(uint32_t(up) << 16)));
  if (a - lo < hi - a) return down;
  if (hi - a < a - lo) return up;
  return (down & 1u) ? up : down;
}

TEST(Dtype, Bf16RoundsToNearestEvenAndQuietsNan) {
  EXPECT_EQ(float_to_bf16(1.0f).bits, 0x3f80);
  EXPECT_EQ(float_to_bf16(from_bits(0x3f808000)).bits, 0x3f80);  // a tie: even stays
  EXPECT_EQ(float_to_bf16(from_bits(0x3f818000)).bits, 0x3f82);  // a tie: odd goes up
  EXPECT_EQ(float_to_bf16(from_bits(0x3f807fff)).bits, 0x3f80);  // below the tie
  EXPECT_EQ(float_to_bf16(from_bits(0x3f808001)).bits, 0x3f81);  // above it
  EXPECT_EQ(float_to_bf16(from_bits(0xbf818000)).bits, 0xbf82);  // negative: the same, mirrored
  EXPECT_EQ(float_to_bf16(from_bits(0x7f7fffff)).bits, 0x7f80);  // the largest float: past bf16's max
  EXPECT_EQ(float_to_bf16(from_bits(0x7f800000)).bits, 0x7f80);  // infinity stays
  EXPECT_EQ(float_to_bf16(from_bits(0x00008000)).bits, 0x0000);  // subnormal tie: to even zero
  EXPECT_EQ(float_to_bf16(from_bits(0x7f800001)).bits, 0x7fc0);  // a signalling NaN comes back quiet
  EXPECT_EQ(float_to_bf16(from_bits(0xff812345)).bits, 0xffc1);
}

TEST(Dtype, Bf16ConversionsAreNearestEvenOverRandomAndTiePatterns) {
  // Random bit patterns (every exponent, subnormals, both signs), each also with its low half set
  // to the tie 0x8000 and to either side of it; NaNs left to the test above.
  std::mt19937 rng(11);
  std::vector<float> x;
  for (int i = 0; i < 200000; ++i) {
    const uint32_t u = rng();
    for (uint32_t low : {u & 0xffffu, 0x8000u, 0x7fffu, 0x8001u}) {
      const float f = from_bits((u & 0xffff0000u) | low);
      if (!std::isnan(f)) x.push_back(f);
    }
  }
  std::vector<bf16> bulk(x.size());
  convert_f32_to_bf16(x.data(), bulk.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const uint16_t want = nearest_even_bf16(x[i]);
    ASSERT_EQ(float_to_bf16(x[i]).bits, want) << std::hex << std::bit_cast<uint32_t>(x[i]);
    ASSERT_EQ(bulk[i].bits, want) << "bulk, " << std::hex << std::bit_cast<uint32_t>(x[i]);
  }
}

TEST(Dtype, EveryBf16WidensExactlyAndComesBack) {
  std::vector<bf16> all(65536);
  for (uint32_t p = 0; p < 65536; ++p) all[p].bits = uint16_t(p);
  std::vector<float> wide(all.size());
  convert_bf16_to_f32(all.data(), wide.data(), all.size());
  for (uint32_t p = 0; p < 65536; ++p) {
    ASSERT_EQ(std::bit_cast<uint32_t>(wide[p]), p << 16) << std::hex << p;
    ASSERT_EQ(std::bit_cast<uint32_t>(bf16_to_float(all[p])), p << 16) << std::hex << p;
    if (!std::isnan(wide[p])) {
      ASSERT_EQ(float_to_bf16(wide[p]).bits, p) << std::hex << p;
    }
  }
}

TEST(Dtype, F16IsExactOneWayAndNearestEvenTheOther) {
  for (uint32_t p = 0; p < 65536; ++p) {
    const uint16_t h = uint16_t(p);
    const float f = f16_to_float(h);
    const uint32_t exponent = (p >> 10) & 0x1fu, mantissa = p & 0x3ffu;
    if (exponent == 0x1f && mantissa != 0) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << p;
      continue;
    }
    // The value by its definition: (-1)^s 2^(e-15) (1 + m/1024), or 2^-14 m/1024 when e is 0.
    const double magnitude = exponent == 0x1f ? INFINITY
                             : exponent == 0  ? std::ldexp(double(mantissa), -24)
                                              : std::ldexp(1.0 + double(mantissa) / 1024.0, int(exponent) - 15);
    ASSERT_EQ(double(f), (p & 0x8000u) ? -magnitude : magnitude) << std::hex << p;
    ASSERT_EQ(float_to_f16(f), h) << std::hex << p;
  }
  EXPECT_EQ(float_to_f16(1.0f + 1.0f / 2048), 0x3c00);         // a tie: even stays
  EXPECT_EQ(float_to_f16(1.0f + 3.0f / 2048), 0x3c02);         // a tie: odd goes up
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -25)), 0x0000);      // half the smallest subnormal: to even zero
  EXPECT_EQ(float_to_f16(std::ldexp(3.0f, -25)), 0x0002);      // 1.5 subnormal ulps: to even 2
  EXPECT_EQ(float_to_f16(65519.0f), 0x7bff);                   // below the tie past 65504
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);                   // the tie past the largest half: infinity
  EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(NAN))));
}

}  // namespace
}  // namespace keel
