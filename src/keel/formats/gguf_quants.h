// The tensor types of GGUF files (ggml's `ggml_type`) that keel writes, and their quantizers, bit
// for bit as llama.cpp's Python package computes them (gguf-py's quants.py): a file keel writes
// holds the bytes llama.cpp's own converter would write from the same fp32 values.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace keel::formats {

// The values are ggml's (ggml.h `enum ggml_type`), written into the file as they are. Q5_0, Q4_K
// and Q6_K are llama-quantize's (gguf_k_quants.h), for --outtype q4_k_m.
enum class GgmlType : uint32_t { F32 = 0, F16 = 1, Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14, BF16 = 30 };

// "F32", "F16", "Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K", "BF16": the names ggml and gguf-py print.
std::string_view ggml_type_name(GgmlType type);

// Elements per block (1 for the float types, 32 for Q4_0, Q5_0 and Q8_0, 256 for Q4_K and Q6_K)
// and bytes per block
// (gguf-py's GGML_QUANT_SIZES).
int64_t ggml_block_size(GgmlType type);
int64_t ggml_type_size(GgmlType type);

// Bytes of `count` elements of `type`; count must be whole blocks (checked by the caller, which
// knows the tensor's name: `ggml_row_fits`).
uint64_t ggml_nbytes(GgmlType type, int64_t count);
bool ggml_row_fits(GgmlType type, int64_t row_size);

// Writes `count` fp32 values as `type` into dst (ggml_nbytes(type, count) bytes). For the block
// types count is a multiple of the block size, and blocks never cross rows since every row is.
//  F16:  numpy's astype(float16): round to nearest even, overflow to inf, NaN kept NaN.
//  BF16: ggml_compute_fp32_to_bf16: NaN made quiet, round to nearest even.
//  Q8_0: d = max|x| / 127 stored as f16; q = round(x / d), halves away from zero (np_roundf).
//  Q4_0: d = x_m / -8 (x_m: the first element of largest |x|), q = min(15, trunc(x / d + 8.5)),
//        two per byte (element j low nibble, element j + 16 high nibble).
void ggml_quantize(GgmlType type, const float* x, int64_t count, uint8_t* dst);

// Whether `count` values stored as `type`, widened to fp32 and written back by ggml_quantize, come
// out as the same bytes: always for F32 (both ways copy); for F16 and BF16 unless one is a NaN
// (gguf-py's bf16 conversion quiets a NaN; no NaN is assumed to keep its payload through the
// widening). Every other pattern converts to itself (checked for all 65,536 of each in the unit
// tests). The GGUF writer copies such bytes as they are (gguf_writer.h: GgufTensor::stored).
bool ggml_converts_to_itself(GgmlType type, const uint8_t* bytes, int64_t count);

// numpy's float32 -> float16 conversion (npy_floatbits_to_halfbits), exposed for tests.
uint16_t numpy_float_to_half(float f);

}  // namespace keel::formats
