#include "keel/formats/gguf_quants.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "keel/core/dtype.h"
#include "keel/core/error.h"
#include "keel/core/threads.h"
#include "keel/formats/gguf_k_quants.h"

namespace keel::formats {
namespace {

constexpr int64_t kQuantBlock = 32;  // QK8_0 = QK4_0 = 32

uint32_t float_bits(float f) { return std::bit_cast<uint32_t>(f); }

void store_u16(uint8_t* out, uint16_t v) { std::memcpy(out, &v, 2); }

// ggml_compute_fp32_to_bf16 (gguf-py's BF16.quantize_blocks).
uint16_t ggml_float_to_bf16(float f) {
  uint32_t n = float_bits(f);
  if ((n & 0x7fffffffu) > 0x7f800000u) n = (n & 0xffff0000u) | (64u << 16);  // NaN: quiet
  return uint16_t((uint64_t(n) + (0x7fffu + ((n >> 16) & 1u))) >> 16);
}

// np_roundf: |n| floored, plus one if the fraction is at least a half (halves away from zero), in
// float32 as numpy evaluates it.
float np_roundf(float n) {
  const float a = std::fabs(n);
  const float floored = std::floor(a);
  const float b = floored + std::floor(2.0f * (a - floored));
  return n < 0 ? -b : b;
}

void quantize_q8_0_block(const float* x, uint8_t* out) {
  float amax = 0.0f;
  for (int64_t j = 0; j < kQuantBlock; ++j) amax = std::fmax(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  store_u16(out, numpy_float_to_half(d));
  for (int64_t j = 0; j < kQuantBlock; ++j) out[2 + j] = uint8_t(int8_t(np_roundf(x[j] * id)));
}

void quantize_q4_0_block(const float* x, uint8_t* out) {
  int64_t imax = 0;  // numpy's argmax: the first of equal maxima
  for (int64_t j = 1; j < kQuantBlock; ++j)
    if (std::fabs(x[j]) > std::fabs(x[imax])) imax = j;
  const float d = x[imax] / -8.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  store_u16(out, numpy_float_to_half(d));
  uint8_t q[kQuantBlock];
  for (int64_t j = 0; j < kQuantBlock; ++j) {
    // trunc(x * id + 8.5) lies in [0, 16.5]; astype(uint8) then clip(0, 15).
    const float t = std::trunc(x[j] * id + 8.5f);
    q[j] = uint8_t(std::fmin(t, 15.0f));
  }
  for (int64_t j = 0; j < kQuantBlock / 2; ++j) out[2 + j] = uint8_t(q[j] | (q[j + kQuantBlock / 2] << 4));
}

}  // namespace

uint16_t numpy_float_to_half(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: numpy keeps the payload's top bits, and a NaN
    const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
    uint16_t nan = uint16_t(0x7c00u + ((u & 0x007fffffu) >> 13));
    if (nan == 0x7c00u) ++nan;
    return sign | nan;
  }
  // Everything else is IEEE round to nearest even, subnormals and overflow to inf included, which
  // keel's own conversion computes.
  return float_to_f16(f);
}

std::string_view ggml_type_name(GgmlType type) {
  switch (type) {
    case GgmlType::F32: return "F32";
    case GgmlType::F16: return "F16";
    case GgmlType::Q4_0: return "Q4_0";
    case GgmlType::Q5_0: return "Q5_0";
    case GgmlType::Q8_0: return "Q8_0";
    case GgmlType::Q4_K: return "Q4_K";
    case GgmlType::Q6_K: return "Q6_K";
    case GgmlType::BF16: return "BF16";
  }
  return "?";
}

int64_t ggml_block_size(GgmlType type) {
  switch (type) {
    case GgmlType::Q4_0:
    case GgmlType::Q5_0:
    case GgmlType::Q8_0: return kQuantBlock;
    case GgmlType::Q4_K:
    case GgmlType::Q6_K: return kQK_K;
    default: return 1;
  }
}

int64_t ggml_type_size(GgmlType type) {
  switch (type) {
    case GgmlType::F32: return 4;
    case GgmlType::F16:
    case GgmlType::BF16: return 2;
    case GgmlType::Q4_0: return 2 + kQuantBlock / 2;
    case GgmlType::Q8_0: return 2 + kQuantBlock;
    case GgmlType::Q5_0: return kQ5_0Bytes;
    case GgmlType::Q4_K: return kQ4_KBytes;
    case GgmlType::Q6_K: return kQ6_KBytes;
  }
  return 0;
}

bool ggml_row_fits(GgmlType type, int64_t row_size) { return row_size % ggml_block_size(type) == 0; }

uint64_t ggml_nbytes(GgmlType type, int64_t count) {
  return uint64_t(count / ggml_block_size(type)) * uint64_t(ggml_type_size(type));
}

bool ggml_converts_to_itself(GgmlType type, const uint8_t* bytes, int64_t count) {
  if (type == GgmlType::F32) return true;
  if (type != GgmlType::F16 && type != GgmlType::BF16) return false;
  // A NaN: exponent all ones, mantissa not zero, i.e. the magnitude bits above infinity's.
  const uint16_t infinity = type == GgmlType::F16 ? 0x7c00 : 0x7f80;
  uint16_t largest = 0;  // one pass without an early exit, so the compiler vectorizes it
  for (int64_t i = 0; i < count; ++i) {
    uint16_t v;
    std::memcpy(&v, bytes + 2 * i, 2);
    largest = std::max<uint16_t>(largest, v & 0x7fff);
  }
  return largest <= infinity;
}

void ggml_quantize(GgmlType type, const float* x, int64_t count, uint8_t* dst) {
  require(count % ggml_block_size(type) == 0, "GGUF {}: expected whole blocks of {} values, found {} values",
          ggml_type_name(type), ggml_block_size(type), count);
  const int64_t blocks = count / ggml_block_size(type);
  const int64_t bytes = ggml_type_size(type);
  // One loop per type (the float types are a block per element: no dispatch inside them). Every
  // block is quantized on its own, so the split across threads changes no byte.
  const int64_t per_block = type == GgmlType::Q4_K || type == GgmlType::Q6_K ? 64 : 1;  // work per block
  parallel_for(blocks, blocks * per_block > 4096, [&](int64_t begin, int64_t end) {
    switch (type) {
      case GgmlType::F32: std::memcpy(dst + begin * 4, x + begin, size_t(end - begin) * 4); break;
      case GgmlType::F16:
        for (int64_t i = begin; i < end; ++i) store_u16(dst + 2 * i, numpy_float_to_half(x[i]));
        break;
      case GgmlType::BF16:
        for (int64_t i = begin; i < end; ++i) store_u16(dst + 2 * i, ggml_float_to_bf16(x[i]));
        break;
      case GgmlType::Q8_0:
        for (int64_t b = begin; b < end; ++b) quantize_q8_0_block(x + b * kQuantBlock, dst + b * bytes);
        break;
      case GgmlType::Q4_0:
        for (int64_t b = begin; b < end; ++b) quantize_q4_0_block(x + b * kQuantBlock, dst + b * bytes);
        break;
      case GgmlType::Q5_0:
        for (int64_t b = begin; b < end; ++b) quantize_q5_0_block(x + b * kQuantBlock, dst + b * bytes);
        break;
      case GgmlType::Q4_K:
        for (int64_t b = begin; b < end; ++b) quantize_q4_k_block(x + b * kQK_K, dst + b * bytes);
        break;
      case GgmlType::Q6_K:
        for (int64_t b = begin; b < end; ++b) quantize_q6_k_block(x + b * kQK_K, dst + b * bytes);
        break;
    }
  });
}

}  // namespace keel::formats
