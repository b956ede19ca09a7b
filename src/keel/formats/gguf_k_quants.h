// llama-quantize's quantizers for the types of a Q4_K_M file, ported from ggml-quants.c
// (llama.cpp as llama-cpp-python 0.3.36 ships it) bit for bit: quantize_row_q4_K_ref,
// quantize_row_q6_K_ref and quantize_row_q5_0_ref, which `llama_model_quantize` runs when no
// importance matrix is given (quantize_q4_K / quantize_q6_K / quantize_q5_0 with quant_weights
// NULL). Compiled without fused multiply-adds (CMakeLists.txt), as ggml's base library is, so every
// float is the one ggml computes.
//  Q4_K: super-blocks of 256 = eight groups of 32, x ~ (d * sc) * q - dmin * m, q in 0..15,
//        6-bit sc and m per group, f16 d and dmin per super-block (144 bytes).
//  Q6_K: super-blocks of 256 = sixteen groups of 16, x ~ (d * sc) * (q - 32), q in 0..63, int8 sc
//        per group, f16 d (210 bytes).
//  Q5_0: blocks of 32, x ~ d * (q - 16), q in 0..31, d = x_m / -16 (22 bytes); llama-quantize's
//        fallback for a Q4_K matrix whose rows are not whole super-blocks.
#pragma once
#include <cstdint>

namespace keel::formats {

constexpr int64_t kQK_K = 256;  // values per k-quant super-block
constexpr int64_t kQ4_KBytes = 144, kQ6_KBytes = 210, kQ5_0Bytes = 22;

// One super-block (or block, for Q5_0) of x into out: the bytes of ggml's block_q4_K / block_q6_K /
// block_q5_0.
void quantize_q4_k_block(const float* x, uint8_t* out);
void quantize_q6_k_block(const float* x, uint8_t* out);
void quantize_q5_0_block(const float* x, uint8_t* out);

}  // namespace keel::formats
