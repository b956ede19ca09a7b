// bitsandbytes' 4-bit NormalFloat (NF4; Dettmers et al. 2023, "QLoRA"), bit for bit as its CPU path
// stores it, so that keel's quantized weights are the ones PEFT + bitsandbytes train against:
//   - blocks of 64 consecutive elements (of the flattened tensor), each with an fp32 absmax;
//   - each element x * (1 / absmax), clamped to [-1, 1], takes the code of the NF4 value it is
//     nearest to: the number of midpoints between sorted codes strictly below it (torch.bucketize),
//     so a value exactly on a midpoint takes the lower code; a last, partial block divides by its
//     absmax instead (bitsandbytes' tail);
//   - two codes per byte, the first element in the high nibble (an odd count is padded with 0.0);
//   - dequantized, element = code value * absmax in fp32.
// Double quantization (bitsandbytes' compress_statistics) stores the absmax values themselves in
// 8 bits: offset = their mean, then (absmax - offset) in blocks of 256 with the signed dynamic map
// (create_dynamic_map(signed=True)) and an fp32 absmax per block, each value scaled as above and
// given the nearest code (ties to the lower one), as bitsandbytes' reference (torch) kernel does;
// absmax = code * absmax2 + offset when dequantized. (bitsandbytes' native CPU kernel looks codes up
// with an approximate table search that picks a neighbouring code for about 0.1% of the values;
// keel does not reproduce that. The offset is the mean in double, rounded once, where torch's fp32
// mean may differ by an ulp.)
#pragma once
#include <cstdint>

namespace keel {

inline constexpr int64_t kNf4BlockSize = 64;
inline constexpr int64_t kNf4DoubleBlockSize = 256;

// The 16 NF4 values (bitsandbytes' get_4bit_type("nf4")), ascending.
extern const float kNf4Values[16];

// Quantizes n values: packed[(n + 1) / 2] bytes, absmax[ceil(n / 64)].
void nf4_quantize(const float* x, int64_t n, uint8_t* packed, float* absmax);
// out[i] = kNf4Values[code i] * absmax[i / 64], for n elements.
void nf4_dequantize(const uint8_t* packed, const float* absmax, int64_t n, float* out);

// Double quantization of `count` absmax values: codes[count], absmax2[ceil(count / 256)], offset.
void nf4_quantize_absmax(const float* absmax, int64_t count, uint8_t* codes, float* absmax2, float* offset);
void nf4_dequantize_absmax(const uint8_t* codes, const float* absmax2, float offset, int64_t count, float* absmax);

}  // namespace keel
