// GGUF tensors back to fp32: every type keel reads from a GGUF file, value for value as gguf-py's
// dequantizers (quants.py) and ggml's dequantize_row_* compute them, in fp32 and in their order of
// operations (so the results are the same floats, not just close ones).
//  F32, F16, BF16:  widened exactly.
//  Q8_0:  x = d * q                      (d f16, q int8; blocks of 32)
//  Q4_0:  x = d * (q - 8)                (q 4 bits: element j low nibble, j + 16 high)
//  Q4_1:  x = d * q + m
//  Q4_K:  x = (d * sc) * q - dmin * m    (super-blocks of 256: eight 32-value groups with 6-bit
//                                         scales and mins packed into 12 bytes)
//  Q5_K:  as Q4_K with a fifth bit per value from qh
//  Q6_K:  x = (d * sc) * (q - 32)        (sixteen 16-value groups, int8 scales; 6-bit q from ql, qh)
#pragma once
#include <cstdint>
#include <string>

namespace keel::formats {

// Whether keel dequantizes the ggml type `type` (the list above).
bool ggml_can_dequantize(uint32_t type);
// The names of those types, for messages ("F32, F16, ...").
std::string ggml_dequantizable_types();
// `count` values (whole blocks) of `type` at src into dst. keel::Error for a type it does not read.
void ggml_dequantize(uint32_t type, const uint8_t* src, int64_t count, float* dst);

}  // namespace keel::formats
