// Elementwise math written so that loops over it vectorise: no calls into libm, no branches.
// libm's expf is a function call per element (and glibc's vector variants need -ffast-math),
// which made exp a visible share of the attention kernel.
#pragma once
#include <algorithm>
#include <bit>
#include <cstdint>

namespace keel::kernels {

// exp(x) in float, within 2 ulp of the correctly rounded result for x in [-87, 88] (the Cephes
// expf polynomial on x - n ln 2, |x - n ln 2| <= ln2/2, scaled by 2^n through the exponent
// bits). Below -87.3 it returns about 1e-38 instead of a denormal or zero; callers that need an
// exact zero (masked softmax entries) select it themselves.
inline float exp_approx(float x) {
  x = x < -87.3f ? -87.3f : x;  // value selects, not std::min/max: those compile to branches here
  x = x > 88.3f ? 88.3f : x;
  // Round x / ln 2 to the nearest integer: adding and subtracting 1.5 * 2^23 leaves the
  // integer part in round-to-nearest mode (vectorises on every x86 level, unlike nearbyint).
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // ln 2 split in two (Cody-Waite)
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const float two_n = std::bit_cast<float>(uint32_t(int32_t(n) + 127) << 23);
  return y * two_n;
}

}  // namespace keel::kernels
