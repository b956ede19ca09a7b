// Element types keel stores and converts: fp32 (master weights, gradients, optimizer state),
// bf16 (compute copies and activations for GEMMs), fp16 (accepted in checkpoints).
#pragma once
#include <cstdint>
#include <cstring>
#include <string_view>

namespace keel {

enum class DType : uint8_t { F32, BF16, F16 };

constexpr size_t dtype_size(DType t) { return t == DType::F32 ? 4 : 2; }
std::string_view dtype_name(DType t);  // safetensors spelling: "F32", "BF16", "F16"

// bfloat16 as raw bits; conversions round to nearest even like PyTorch's .to(torch.bfloat16).
struct bf16 {
  uint16_t bits;
};

inline float bf16_to_float(bf16 v) {
  uint32_t u = uint32_t(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Branch-free (a select, not a jump) so that loops converting arrays vectorise.
inline bf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return bf16{uint16_t((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded)};
}

// IEEE binary16 <-> binary32, exact for every half value, round-to-nearest-even the other way.
float f16_to_float(uint16_t h);
uint16_t float_to_f16(float f);

// Bulk conversions (vectorised where the CPU allows).
void convert_f32_to_bf16(const float* src, bf16* dst, size_t n);
void convert_bf16_to_f32(const bf16* src, float* dst, size_t n);

}  // namespace keel
