// Causal self-attention with grouped-query heads. Two implementations of the same contract:
// - attention_forward/backward<T>: flash-style (Dao et al. 2022), tiles of keys/values visited
//   with an online softmax, scalar loops; templated so the tests run it in double against finite
//   differences. The reference.
// - attention_forward/backward_blocked: the training path. Blocks of query rows, each block's
//   products (scores, probabilities x values, and the four products of the backward pass) as
//   GEMMs on oneDNN, in fp32 or with bf16 inputs and fp32 accumulation, softmax in fp32. It holds
//   one [block, seq] row of scores per thread, never [seq, seq], in a workspace the caller plans.
// Both recompute the probabilities in the backward pass from the saved log-sum-exp.
#pragma once
#include <cstddef>
#include <cstdint>

namespace keel::kernels {

struct AttentionShape {
  int64_t batch, seq;            // sequences in the micro-batch and their (padded) length
  int64_t q_heads, kv_heads;     // q_heads % kv_heads == 0; q head h reads kv head h / (q_heads/kv_heads)
  int64_t head_dim;
  int64_t ldq, ldk, ldv, ldo;    // row strides (elements between consecutive tokens)
  double scale;                  // usually 1/sqrt(head_dim)
};

// q: token t of sequence b at q + (b*seq + t)*ldq + h*head_dim; same layout for k, v, out.
// segments: optional [batch*seq] document ids; a query attends only to keys at earlier or equal
//   positions with the same id (block-diagonal causal mask for packed sequences). nullptr = one
//   document per sequence.
// lse: [batch, q_heads, seq] log-sum-exp of the scaled scores, saved for the backward pass.
template <typename T>
void attention_forward(const AttentionShape& s, const T* q, const T* k, const T* v,
                       const int32_t* segments, T* out, T* lse);

// dout has out's layout (row stride ldo). dq, dk, dv are overwritten (same layouts as q, k, v,
// with the same strides).
template <typename T>
void attention_backward(const AttentionShape& s, const T* q, const T* k, const T* v,
                        const int32_t* segments, const T* out, const T* lse, const T* dout, T* dq,
                        T* dk, T* dv);

// Element type of the blocked kernel's GEMM inputs. BF16 rounds q, k, v, the probabilities and
// the incoming gradients to bf16 before each product (accumulating in fp32), as bf16 autocast
// does in PyTorch; F32 keeps everything in fp32.
enum class AttentionMatmul : uint8_t { F32, BF16 };

// Bytes of workspace the blocked kernels need when run on `threads` OpenMP threads (each thread
// gets its own slice), for sequences up to s.seq long.
size_t attention_workspace_bytes(const AttentionShape& s, AttentionMatmul precision, int threads);

// workspace: at least attention_workspace_bytes(s, precision, keel::max_threads()) bytes,
// 64-byte aligned. Same layouts and results as attention_forward/backward<float>, up to
// rounding (and the bf16 rounding of the inputs with BF16).
void attention_forward_blocked(const AttentionShape& s, AttentionMatmul precision, const float* q,
                               const float* k, const float* v, const int32_t* segments, float* out,
                               float* lse, void* workspace, size_t workspace_bytes);
void attention_backward_blocked(const AttentionShape& s, AttentionMatmul precision, const float* q,
                                const float* k, const float* v, const int32_t* segments,
                                const float* out, const float* lse, const float* dout, float* dq,
                                float* dk, float* dv, void* workspace, size_t workspace_bytes);

// Builds, on every thread, the GEMM plans the blocked kernels can meet for sequences of exactly
// s.seq (s.batch does not matter): with packed documents a query block starts at the key block of
// its document, so the products' shapes change from batch to batch and from thread to thread. A
// decoder calls this once, so that no step builds (allocates) a plan.
void prepare_attention_blocked(const AttentionShape& s, AttentionMatmul precision);

}  // namespace keel::kernels
