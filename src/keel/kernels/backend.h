// The device seam: every operation a training step computes, as one interface. model/ and train/
// reach compute only through a Backend; what runs behind it (oneDNN and AVX-512 row kernels, a
// scalar double-precision reference, later CUDA or Ascend) is private to kernels/.
//
// The operations are coarse, one per step of the decoder (a GEMM, a norm, attention, the fused LM
// head loss, the optimizer update), so a device backend can launch one kernel per call. Pointers
// are the backend's memory: what allocate() returns (for the CPU backends, host memory). Calls are
// ordered as issued; a backend that runs them asynchronously makes record_event/wait_event and
// synchronize mean what they say (the CPU backends finish each call before returning, so their
// events are complete when recorded). What only one kind of device has (the CPU's bf16 products
// widened to fp32) is an optional interface beside this one (bf16_widening.h) that callers ask
// for, so that a second device implements what it computes and nothing of another's policy.
//
// Two implementations: "cpu" (the training path) and "reference" (every operation computed in
// double from the same float inputs and rounded once at the end: slow, exact to fp32, the one
// every other backend is tested against). backend_named() picks one; the recipe's `backend` key
// and the tests choose by name.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/compute_event.h"
#include "keel/core/dtype.h"
#include "keel/core/four_bit.h"
#include "keel/core/memory_plan.h"
#include "keel/kernels/shapes.h"

namespace keel::kernels {

using keel::ComputeEvent;  // core/compute_event.h

class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu", "reference": the name the recipe's `backend` key takes.
  virtual std::string_view name() const = 0;
  // One line for the run's log: the instruction set, the GEMM library, bf16 support.
  virtual std::string description(bool bf16) const = 0;

  // ---- memory and ordering
  // `bytes` of device memory in one block (the memory plan's arena), 64-byte aligned, zeroed.
  virtual Arena allocate(size_t bytes) = 0;
  virtual void copy_to_device(void* device_dst, const void* host_src, size_t bytes) = 0;
  virtual void copy_to_host(void* host_dst, const void* device_src, size_t bytes) = 0;
  virtual void copy_on_device(void* dst, const void* src, size_t bytes) = 0;
  virtual ComputeEvent record_event() = 0;
  // Blocks the host until everything issued before `event` has finished.
  virtual void wait_event(const ComputeEvent& event) = 0;
  virtual void synchronize() = 0;

  // ---- GEMM: c = op(a) op(b) + beta c, beta 0 (overwrite) or 1 (accumulate, as for gradients).
  virtual void gemm(const GemmShape& s, const float* a, const float* b, float* c, float beta) = 0;
  // bf16 inputs, fp32 accumulation and output.
  virtual void gemm_bf16(const GemmShape& s, const bf16* a, const bf16* b, float* c, float beta) = 0;
  // y[r] = beta y[r] + sum_i x[i] float(w[r, i]) for r < rows: one token through a bf16 weight
  // [rows, in] held as stored. Decoding reads each weight once per token, so it is bound by the
  // weight's bytes, and a GEMM would first pack (or widen) the whole weight for one row.
  virtual void gemv_bf16(const float* x, const bf16* w, int64_t rows, int64_t in, float* y, float beta) = 0;
  // How the backend cuts a bf16 product over its threads (one part: it does not). A caller with
  // many independent products (the experts') may run their parts as its own tasks: gemm_bf16 on a
  // part from inside a parallel region runs it on the calling thread, and where a backend cuts
  // products at all, prepare_gemm prepares every part (or an uncut product) for every thread.
  virtual ProductShares bf16_product_shares(const GemmShape& s) = 0;
  // Prepares whatever the backend builds for a product on first use, so that a step loop meeting
  // the shape later allocates nothing.
  virtual void prepare_gemm(const GemmShape& s, bool bf16_inputs, float beta) = 0;
  // Bytes the products of a run (bf16 inputs or not) hold outside the caller's buffers for the
  // whole run, for the memory plan (the CPU's fp32 tiles of bf16 operands where it widens them,
  // kernels/bf16_widening.h), else 0.
  virtual size_t gemm_scratch_bytes(bool bf16_inputs) = 0;
  // This device's matmul throughput in FLOP/s, with bf16 inputs or fp32 (MFU's denominator),
  // measured as the backend sees fit (the CPU: a 1024^3 product, best of 3).
  virtual double matmul_peak_flops(bool bf16) = 0;

  // ---- elementwise and row operations on [rows, cols] row-major buffers
  // dst = bf16(src): the compute copy of weights and GEMM inputs.
  virtual void cast_to_bf16(const float* src, bf16* dst, int64_t n) = 0;
  // dst = float(src), exact: a saved bf16 activation where an fp32 kernel reads it.
  virtual void cast_to_f32(const bf16* src, float* dst, int64_t n) = 0;
  virtual void add(float* dst, const float* a, const float* b, int64_t n) = 0;              // dst = a + b
  // Soft-capping in place, x = cap * tanh(x / cap) (Gemma 2's final logits outside the fused loss:
  // evaluation's and generation's logits).
  virtual void soft_cap(float* x, int64_t n, double cap) = 0;
  // Dropout with core/dropout_mask.h's mask for `key`: y[i] = x[i] / (1 - p) where kept, else 0
  // (y may be x). The bf16 form scales in fp32 and rounds once.
  virtual void dropout(const float* x, float* y, int64_t n, double p, uint64_t key) = 0;
  virtual void dropout_bf16(const bf16* x, bf16* y, int64_t n, double p, uint64_t key) = 0;
  virtual void add_bias_rows(float* y, const float* bias, int64_t rows, int64_t cols) = 0;  // y[r] += bias
  // db[c] += sum over rows of dy[r, c] (ACCUMULATES), summed in row order.
  virtual void accumulate_bias_grad(const float* dy, int64_t rows, int64_t cols, float* db) = 0;

  // ---- the decoder's layers (contracts as in HF transformers' modules)
  // RMSNorm (LlamaRMSNorm) on each vector of s (shapes.h: a block's rows, or Qwen3's q/k heads
  // inside a fused row): y = x / sqrt(mean(x^2) + eps) * (weight_offset + w), the offset 0, or 1
  // for Gemma's (1 + w); y may be x; rstd [rows * heads] saved for backward. y_bf16 (may be null;
  // laid out as y): bf16(y) as well, the next GEMM's input copy made in the same pass (what
  // cast_to_bf16(y) would give).
  virtual void rmsnorm_forward(const RmsNormShape& s, const float* x, const float* w, float* y, float* rstd,
                               bf16* y_bf16) = 0;
  // dx overwritten; dw ACCUMULATES (null: a frozen weight, no gradient). residual (may be null;
  // laid out as dx): added to dx in the same pass — the residual stream's gradient, which reaches
  // the norm's input past the norm — as add(dx, dx, residual) would. dx_bf16 (may be null; laid
  // out as dx): bf16(dx) as well, for the projection whose backward reads dx next.
  virtual void rmsnorm_backward(const RmsNormShape& s, const float* x, const float* w, const float* rstd,
                                const float* dy, float* dx, float* dw, const float* residual, bf16* dx_bf16) = 0;
  // x: [tokens, heads, head_dim] with row stride ld; rotates in place (backward: by -angle).
  virtual void rope_forward(float* x, int64_t ld, const int32_t* positions, int64_t tokens, int64_t heads,
                            int64_t head_dim, const RopeTable& table) = 0;
  virtual void rope_backward(float* dx, int64_t ld, const int32_t* positions, int64_t tokens, int64_t heads,
                             int64_t head_dim, const RopeTable& table) = 0;
  // The gated MLP activation (glu.h): out = act(gate) * up with gate_up[r] = [gate (inter) | up
  // (inter)]; SwiGLU (silu) or GeGLU (tanh-approximated GELU). out_bf16 / dgate_up_bf16 (may be
  // null): the result in bf16 as well, made in the same pass, as cast_to_bf16 of it would be.
  virtual void glu_forward(GluActivation act, const float* gate_up, int64_t rows, int64_t inter, float* out,
                           bf16* out_bf16) = 0;
  virtual void glu_backward(GluActivation act, const float* gate_up, const float* dout, int64_t rows, int64_t inter,
                            float* dgate_up, bf16* dgate_up_bf16) = 0;
  // out[i] = table[ids[i]]; backward ACCUMULATES dtable[ids[i]] += dout[i], deterministically.
  virtual void embedding_forward(const int32_t* ids, int64_t n, const float* table, int64_t hidden, float* out) = 0;
  // NF4 or FP4 (core/four_bit.h) to fp32 or bf16: out[i] = four_bit_values(type)[code i] *
  // absmax[i / 64] for n elements (n a multiple of 64), rounded to bf16 for the bf16 form. QLoRA's
  // GEMMs read their weights so, a tile of rows at a time.
  virtual void dequantize_4bit(FourBitType type, const uint8_t* packed, const float* absmax, int64_t n, float* out) = 0;
  virtual void dequantize_4bit_bf16(FourBitType type, const uint8_t* packed, const float* absmax, int64_t n,
                                    bf16* out) = 0;
  // The same from a bf16 table (a frozen embedding held only as bf16), widened exactly to fp32.
  virtual void embedding_forward_bf16(const int32_t* ids, int64_t n, const bf16* table, int64_t hidden,
                                      float* out) = 0;
  // padding_idx: the row torch's nn.Embedding(padding_idx=...) keeps out of the lookups' gradient
  // (-1: none); the model decides which (ModelConfig::embedding_padding_idx).
  virtual void embedding_backward(const int32_t* ids, int64_t n, const float* dout, int64_t hidden, int64_t vocab,
                                  int64_t padding_idx, float* dtable) = 0;
  // Softmax cross-entropy over a block of logits [rows, vocab] (row stride ld), fused with its
  // gradient: logits are overwritten by (softmax - onehot) * grad_scale (zeros for kIgnoreIndex
  // rows). Returns the SUM of -log softmax(logits)[label] over non-ignored rows. softcap > 0: of
  // softcap * tanh(logits / softcap) (Gemma 2's final-logit soft-capping), 0: none. With
  // grad_bf16 (same layout) the gradient goes there in bf16 instead (what bf16 products read; the
  // logits are then scratch): the same bits as converting the fp32 gradient, one pass fewer.
  // per_row (shapes.h, LossRows): a gradient scale per row, each row's loss and mean logit out.
  virtual double cross_entropy_forward_backward(float* logits, int64_t ld, const int32_t* labels, int64_t rows,
                                                int64_t vocab, double grad_scale, double softcap,
                                                bf16* grad_bf16 = nullptr, const LossRows& per_row = {}) = 0;

  // ---- causal grouped-query attention (layouts in shapes.h)
  // segments: optional [batch*seq] document ids (a query attends to earlier keys of its own
  // document); lse [batch, q_heads, seq] saved for the backward pass, which overwrites dq/dk/dv.
  // workspace: attention_workspace_bytes(s, precision) bytes the caller plans, 64-byte aligned.
  virtual size_t attention_workspace_bytes(const AttentionShape& s, AttentionMatmul precision) = 0;
  // Called once per decoder with the longest sequence: builds what any later call can need.
  virtual void prepare_attention(const AttentionShape& s, AttentionMatmul precision) = 0;
  virtual void attention_forward(const AttentionShape& s, AttentionMatmul precision, const float* q, const float* k,
                                 const float* v, const int32_t* segments, float* out, float* lse, void* workspace,
                                 size_t workspace_bytes) = 0;
  virtual void attention_backward(const AttentionShape& s, AttentionMatmul precision, const float* q, const float* k,
                                  const float* v, const int32_t* segments, const float* out, const float* lse,
                                  const float* dout, float* dq, float* dk, float* dv, void* workspace,
                                  size_t workspace_bytes) = 0;
  // Generation: `tokens` new queries (q [tokens, q_heads*head_dim], row stride s.ldq) at positions
  // first_position.. over a KV cache holding keys/values of positions 0..first_position+tokens-1
  // ([positions, kv_heads*head_dim] each); causal, with s's heads, scale, sliding window and soft
  // cap (its batch and seq are not used); out [tokens, q_heads*head_dim].
  virtual void cached_attention(const AttentionShape& s, const float* q, int64_t tokens, int64_t first_position,
                                const float* k_cache, const float* v_cache, float* out) = 0;

  // ---- optimizer
  // AdamW on n parameters in place (shapes.h), the gradients scaled by s.grad_scale as they are
  // read (clipping; g itself is left as it was); w_bf16, if not null, receives bf16(w) after.
  virtual void adamw_update(float* w, const float* g, float* m, float* v, int64_t n, const AdamWStep& s,
                            double weight_decay, bf16* w_bf16) = 0;
  // Sum of squares in double (the global gradient norm of clip_grad_norm_).
  virtual double sum_of_squares(const float* x, int64_t n) = 0;
  virtual void scale_in_place(float* x, int64_t n, float factor) = 0;
};

// The backend of that name ("cpu", "reference"); keel::Error naming the known ones otherwise.
// Backends are process-wide and live until exit.
Backend& backend_named(std::string_view name);
std::vector<std::string> backend_names();
// The training path's default: "cpu".
Backend& default_backend();

}  // namespace keel::kernels
