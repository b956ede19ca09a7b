// bitsandbytes' 4-bit formats (Dettmers et al. 2023, "QLoRA"): NF4 (4-bit NormalFloat) and FP4,
// bit for bit as its CPU path stores them, so that keel's quantized weights are the ones PEFT +
// bitsandbytes train against and a checkpoint transformers saved with bitsandbytes loads as is:
//   - blocks of 64 consecutive elements (of the flattened tensor), each with an fp32 absmax;
//   - each element x * (1 / absmax), clamped to [-1, 1], takes the code of the type's value it is
//     nearest to: the number of midpoints between the sorted values strictly below it
//     (torch.bucketize), so a value exactly on a midpoint takes the lower one; a last, partial
//     block divides by its absmax instead (bitsandbytes' tail). FP4's codes are not in value
//     order: the sorted position maps back through torch.argsort's order of the code table
//     (its two zeros, codes 0 and 8, in that order);
//   - two codes per byte, the first element in the high nibble (an odd count is padded with 0.0);
//   - dequantized, element = value of its code * absmax in fp32.
// Double quantization (bitsandbytes' compress_statistics) stores the absmax values themselves in
// 8 bits: offset = their mean, then (absmax - offset) in blocks of 256 with the signed dynamic map
// (create_dynamic_map(signed=True)) and an fp32 absmax per block, each value scaled as above and
// given the nearest code (ties to the lower one), as bitsandbytes' reference (torch) kernel does;
// absmax = code * absmax2 + offset when dequantized. (bitsandbytes' native CPU kernel looks codes up
// with an approximate table search that picks a neighbouring code for about 0.1% of the values;
// keel does not reproduce that. The offset is the mean in double, rounded once, where torch's fp32
// mean may differ by an ulp. A checkpoint saved by bitsandbytes is read with its own codes.)
#pragma once
#include <cstdint>
#include <optional>
#include <string_view>

namespace keel {

enum class FourBitType : uint8_t { Nf4, Fp4 };

// bitsandbytes' quant_type: "nf4" / "fp4".
std::string_view four_bit_type_name(FourBitType type);
std::optional<FourBitType> parse_four_bit_type(std::string_view name);

inline constexpr int64_t kFourBitBlockSize = 64;
inline constexpr int64_t kAbsmaxBlockSize = 256;

// The 16 values of a type's codes, indexed by code (bitsandbytes' get_4bit_type): NF4 ascending;
// FP4 sign-magnitude (codes 8-15 the negatives of 0-7).
const float* four_bit_values(FourBitType type);
// bitsandbytes' signed dynamic map (create_dynamic_map(signed=True)): double quantization's 256
// code values, ascending.
const float* dynamic_map_values();

// Quantizes n values: packed[(n + 1) / 2] bytes, absmax[ceil(n / 64)].
void four_bit_quantize(FourBitType type, const float* x, int64_t n, uint8_t* packed, float* absmax);
// out[i] = four_bit_values(type)[code i] * absmax[i / 64], for n elements.
void four_bit_dequantize(FourBitType type, const uint8_t* packed, const float* absmax, int64_t n, float* out);

// Double quantization of `count` absmax values: codes[count], absmax2[ceil(count / 256)], offset.
void quantize_absmax(const float* absmax, int64_t count, uint8_t* codes, float* absmax2, float* offset);
// absmax[i] = map[codes[i]] * absmax2[i / 256] + offset in fp32 (two roundings, as bitsandbytes'
// dequantize_blockwise then its += offset); map is dynamic_map_values() unless a checkpoint
// stores its own (nested_quant_map).
void dequantize_absmax(const uint8_t* codes, const float* absmax2, float offset, int64_t count, float* absmax,
                       const float* map = nullptr);

}  // namespace keel
