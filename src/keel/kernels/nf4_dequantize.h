// NF4 weights (core/nf4.h) widened for a GEMM: QLoRA's frozen matrices, a tile of rows at a time.
#pragma once
#include <cstdint>

#include "keel/core/dtype.h"

namespace keel::kernels {

// out[i] = kNf4Values[code i] * absmax[i / 64] for n elements (a multiple of 64); bf16 rounds to
// nearest even, as bitsandbytes' dequantize_4bit to bfloat16 does.
void dequantize_nf4(const uint8_t* packed, const float* absmax, int64_t n, float* out);
void dequantize_nf4(const uint8_t* packed, const float* absmax, int64_t n, bf16* out);

}  // namespace keel::kernels
