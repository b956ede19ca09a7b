#include "keel/core/dtype.h"

#include <cmath>

#include "keel/core/threads.h"

namespace keel {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
  }
  return "?";
}

float f16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal half: renormalise
      int e = -1;
      do {
        ++e;
        mantissa <<= 1;
      } while ((mantissa & 0x400u) == 0);
      bits = sign | uint32_t(127 - 15 - e) << 23 | (mantissa & 0x3ffu) << 13;
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | mantissa << 13;
  } else {
    bits = sign | (exponent + 127 - 15) << 23 | mantissa << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // overflow (incl. values rounding up) -> inf
  if (abs < 0x38800000u) {                        // result is subnormal or zero
    if (abs < 0x33000000u) return sign;           // below half of the smallest subnormal
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    int shift = 126 - int(abs >> 23);  // 14 .. 24
    uint32_t half_ulp = 1u << (shift - 1 + 0);
    uint32_t rounded = mant >> shift;
    uint32_t rest = mant & ((1u << shift) - 1);
    if (rest > half_ulp || (rest == half_ulp && (rounded & 1u))) ++rounded;
    return sign | uint16_t(rounded);
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return sign | uint16_t((rounded - (112u << 23)) >> 13);
}

void convert_f32_to_bf16(const float* src, bf16* dst, size_t n) {
  parallel_for(int64_t(n), n > (1u << 16), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dst[i] = float_to_bf16(src[i]);
  });
}

void convert_bf16_to_f32(const bf16* src, float* dst, size_t n) {
  parallel_for(int64_t(n), n > (1u << 16), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dst[i] = bf16_to_float(src[i]);
  });
}

}  // namespace keel
