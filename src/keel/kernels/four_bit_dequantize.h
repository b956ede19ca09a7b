// 4-bit weights (core/four_bit.h: NF4 or FP4) widened for a GEMM: QLoRA's frozen matrices, a tile of
// rows at a time.
#pragma once
#include <cstdint>

#include "keel/core/dtype.h"
#include "keel/core/four_bit.h"

namespace keel::kernels {

// out[i] = four_bit_values(type)[code i] * absmax[i / 64] for n elements (a multiple of 64); bf16 rounds to
// nearest even, as bitsandbytes' dequantize_4bit to bfloat16 does.
void dequantize_4bit(FourBitType type, const uint8_t* packed, const float* absmax, int64_t n, float* out);
void dequantize_4bit(FourBitType type, const uint8_t* packed, const float* absmax, int64_t n, bf16* out);

}  // namespace keel::kernels
