// The CPU backend's causal self-attention with grouped-query heads (layouts in shapes.h), on
// blocks of query rows: each block's products (scores, probabilities x values, and the four
// products of the backward pass) as GEMMs on oneDNN, in fp32 or with bf16 inputs and fp32
// accumulation, softmax in fp32. It holds one [block, seq] row of scores per thread, never
// [seq, seq], in a workspace the caller plans, and recomputes the probabilities in the backward
// pass from the saved log-sum-exp. Same contract as reference/attention.h, up to rounding.
#pragma once
#include <cstddef>
#include <cstdint>

#include "keel/kernels/shapes.h"

namespace keel::kernels {

// How BF16 products hold their inputs: packed as bf16, what a bf16 matmul reads; or `widened`:
// as fp32 values rounded to bf16, exactly what gemm_bf16 widens bf16 inputs to where the CPU has no
// bf16 matmul (kernels/gemm.h), so that there the results are the same bits without widening K
// and V again for every block of queries, or packing anything to 16 bits. `automatic`: widened
// where gemm_bf16 would widen. (Tests choose one to compare the two.)
enum class Bf16Operands : uint8_t { automatic, packed, widened };

// Bytes of workspace the blocked kernels need when run on `threads` OpenMP threads (each thread
// gets its own slice), for sequences up to s.seq long.
size_t attention_workspace_bytes(const AttentionShape& s, AttentionMatmul precision, int threads,
                                 Bf16Operands operands = Bf16Operands::automatic);

// workspace: at least attention_workspace_bytes(s, precision, keel::max_threads()) bytes,
// 64-byte aligned. Same layouts and results as attention_forward/backward<float>, up to
// rounding (and the bf16 rounding of the inputs with BF16). The backward pass reads no forward
// output: it sums each row's D from the row itself (attention_blocked.cpp says why).
void attention_forward_blocked(const AttentionShape& s, AttentionMatmul precision, const float* q, const float* k,
                               const float* v, const int32_t* segments, float* out, float* lse, void* workspace,
                               size_t workspace_bytes, Bf16Operands operands = Bf16Operands::automatic);
void attention_backward_blocked(const AttentionShape& s, AttentionMatmul precision, const float* q, const float* k,
                                const float* v, const int32_t* segments, const float* lse, const float* dout, float* dq,
                                float* dk, float* dv, void* workspace, size_t workspace_bytes,
                                Bf16Operands operands = Bf16Operands::automatic);

// Builds, on every thread, the GEMM plans the blocked kernels can meet for sequences of exactly
// s.seq (s.batch does not matter): with packed documents a query block starts at the key block of
// its document, so the products' shapes change from batch to batch and from thread to thread. A
// decoder calls this once, so that no step builds (allocates) a plan.
void prepare_attention_blocked(const AttentionShape& s, AttentionMatmul precision,
                               Bf16Operands operands = Bf16Operands::automatic);

}  // namespace keel::kernels
