#include "keel/kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "keel/core/threads.h"
#include "keel/kernels/adamw.h"
#include "keel/kernels/attention.h"
#include "keel/kernels/bf16_widening.h"
#include "keel/kernels/cpu/vector_ops.h"
#include "keel/kernels/cached_attention.h"
#include "keel/kernels/cross_entropy.h"
#include "keel/core/dropout_mask.h"
#include "keel/kernels/embedding.h"
#include "keel/kernels/four_bit_dequantize.h"
#include "keel/kernels/gemm.h"
#include "keel/kernels/host_memory.h"
#include "keel/kernels/rmsnorm.h"
#include "keel/kernels/rope.h"
#include "keel/kernels/glu.h"

namespace keel::kernels {
namespace {

// Below this many elements an elementwise pass runs on the calling thread alone.
constexpr int64_t kParallelMinElements = int64_t(1) << 15;

class CpuBackend final : public HostMemoryBackend, public Bf16Widening {
 public:
  std::string_view name() const override { return "cpu"; }
  std::string description(bool bf16) const override {
    const std::string gemms =
        !bf16 ? "fp32 GEMMs on oneDNN"
        : bf16_matmul_native()
            ? fmt::format("bf16 GEMMs on oneDNN ({}){}", bf16_products().reason,
                          bf16_products_split() ? "; the large ones split over the threads by keel, one product a "
                                                  "thread (KEEL_GEMM_SPLIT=0: oneDNN's threading)"
                                                : "")
            : fmt::format("bf16 GEMMs widened to fp32 ({}; docs/performance.md)", bf16_products().reason);
    return fmt::format("cpu backend: row kernels {}, {}", isa_name(vector_ops().isa), gemms);
  }

  void gemm(const GemmShape& s, const float* a, const float* b, float* c, float beta) override {
    gemm_f32(s, a, b, c, beta);
  }
  void gemm_bf16(const GemmShape& s, const bf16* a, const bf16* b, float* c, float beta) override {
    kernels::gemm_bf16(s, a, b, c, beta);
  }
  ProductShares bf16_product_shares(const GemmShape& s) override { return kernels::bf16_product_shares(s); }
  void prepare_gemm(const GemmShape& s, bool bf16_inputs, float beta) override { gemm_prepare(s, bf16_inputs, beta); }
  size_t gemm_scratch_bytes(bool bf16_inputs) override { return gemm_widened_operand_bytes(bf16_inputs); }
  void gemv_bf16(const float* x, const bf16* w, int64_t rows, int64_t in, float* y, float beta) override {
    const auto& ops = vector_ops();
    auto put = [&](int64_t r, float dot) { y[r] = (beta == 0.0f ? 0.0f : beta * y[r]) + dot; };
    const int64_t quads = rows / 4;  // four rows per task: see VectorOps::dot4_bf16
    parallel_for(quads, rows * in >= kParallelMinElements, [&](int64_t begin, int64_t end) {
      float dots[4];
      for (int64_t q = begin; q < end; ++q) {
        ops.dot4_bf16(x, w + 4 * q * in, in, in, dots);
        for (int k = 0; k < 4; ++k) put(4 * q + k, dots[k]);
      }
    });
    for (int64_t r = 4 * quads; r < rows; ++r) put(r, ops.dot_bf16(x, w + r * in, in));
  }
  // A 1024^3 product, best of 3 after a warm-up: long enough for oneDNN's rate, short beside the
  // run whose MFU it divides.
  double matmul_peak_flops(bool bf16) override { return measure_matmul_peak(bf16, 1024, 3); }

  // Bf16Widening: gemm_bf16 widens where oneDNN has no bf16 matmul or runs it slower (gemm.h).
  bool widens() override { return !bf16_matmul_native(); }
  bool keep(bool widened, const std::string& why) override {
    return keep_bf16_products(!widened, why).native != widened;
  }
  void hold(int slot, const bf16* x, int64_t rows, int64_t cols, int64_t ld, float* copy) override {
    gemm_hold_widened(slot, x, rows, cols, ld, copy);
  }
  void release(int slot) override { gemm_release_widened(slot); }

  // The GEMM inputs' bf16 copies, through the dispatched row kernel (AVX-512 where present).
  void cast_to_bf16(const float* src, bf16* dst, int64_t n) override {
    const auto& ops = vector_ops();
    parallel_for(n, n >= kParallelMinElements,
                 [&](int64_t begin, int64_t end) { ops.scale_to_bf16(src + begin, 1.0f, dst + begin, end - begin); });
  }
  // core/dtype's conversion, a parallel loop itself.
  void cast_to_f32(const bf16* src, float* dst, int64_t n) override { convert_bf16_to_f32(src, dst, size_t(n)); }
  void dropout(const float* x, float* y, int64_t n, double p, uint64_t key) override {
    const uint64_t threshold = dropout_keep_threshold(p);
    const auto scale = float(1.0 / (1.0 - p));
    parallel_for(n, n >= kParallelMinElements, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) y[i] = dropout_keeps(key, uint64_t(i), threshold) ? x[i] * scale : 0.0f;
    });
  }
  void dropout_bf16(const bf16* x, bf16* y, int64_t n, double p, uint64_t key) override {
    const uint64_t threshold = dropout_keep_threshold(p);
    const auto scale = float(1.0 / (1.0 - p));
    parallel_for(n, n >= kParallelMinElements, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        y[i] = float_to_bf16(dropout_keeps(key, uint64_t(i), threshold) ? bf16_to_float(x[i]) * scale : 0.0f);
    });
  }
  void add(float* dst, const float* a, const float* b, int64_t n) override {
    parallel_for(n, n >= kParallelMinElements, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) dst[i] = a[i] + b[i];
    });
  }
  void add_bias_rows(float* y, const float* bias, int64_t rows, int64_t cols) override {
    parallel_for(rows, rows * cols >= kParallelMinElements, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t c = 0; c < cols; ++c) y[r * cols + c] += bias[c];
    });
  }
  // Columns are split across threads so that each sum stays in row order.
  void accumulate_bias_grad(const float* dy, int64_t rows, int64_t cols, float* db) override {
    parallel_for(cols, rows * cols >= kParallelMinElements, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        float sum = 0.0f;
        for (int64_t r = 0; r < rows; ++r) sum += dy[r * cols + c];
        db[c] += sum;
      }
    });
  }

  void rmsnorm_forward(const RmsNormShape& s, const float* x, const float* w, float* y, float* rstd,
                       bf16* y_bf16) override {
    kernels::rmsnorm_forward(s, x, w, y, rstd, y_bf16);
  }
  void rmsnorm_backward(const RmsNormShape& s, const float* x, const float* w, const float* rstd, const float* dy,
                        float* dx, float* dw, const float* residual, bf16* dx_bf16) override {
    kernels::rmsnorm_backward(s, x, w, rstd, dy, dx, dw, residual, dx_bf16);
  }
  void rope_forward(float* x, int64_t ld, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
                    const RopeTable& table) override {
    kernels::rope_forward(x, ld, positions, tokens, heads, head_dim, table);
  }
  void rope_backward(float* dx, int64_t ld, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
                     const RopeTable& table) override {
    kernels::rope_backward(dx, ld, positions, tokens, heads, head_dim, table);
  }
  void soft_cap(float* x, int64_t n, double cap) override { vector_ops().soft_cap(x, n, 1.0f, float(cap), nullptr); }
  void glu_forward(GluActivation act, const float* gate_up, int64_t rows, int64_t inter, float* out,
                   bf16* out_bf16) override {
    kernels::glu_forward(act, gate_up, rows, inter, out, out_bf16);
  }
  void glu_backward(GluActivation act, const float* gate_up, const float* dout, int64_t rows, int64_t inter,
                    float* dgate_up, bf16* dgate_up_bf16) override {
    kernels::glu_backward(act, gate_up, dout, rows, inter, dgate_up, dgate_up_bf16);
  }
  void embedding_forward(const int32_t* ids, int64_t n, const float* table, int64_t hidden, float* out) override {
    kernels::embedding_forward(ids, n, table, hidden, out);
  }
  void dequantize_4bit(FourBitType type, const uint8_t* packed, const float* absmax, int64_t n, float* out) override {
    kernels::dequantize_4bit(type, packed, absmax, n, out);
  }
  void dequantize_4bit_bf16(FourBitType type, const uint8_t* packed, const float* absmax, int64_t n,
                            bf16* out) override {
    kernels::dequantize_4bit(type, packed, absmax, n, out);
  }
  void embedding_forward_bf16(const int32_t* ids, int64_t n, const bf16* table, int64_t hidden, float* out) override {
    kernels::embedding_forward_bf16(ids, n, table, hidden, out);
  }
  void embedding_backward(const int32_t* ids, int64_t n, const float* dout, int64_t hidden, int64_t vocab,
                          int64_t padding_idx, float* dtable) override {
    kernels::embedding_backward(ids, n, dout, hidden, vocab, padding_idx, dtable);
  }
  double cross_entropy_forward_backward(float* logits, int64_t ld, const int32_t* labels, int64_t rows, int64_t vocab,
                                        double grad_scale, double softcap, bf16* grad_bf16,
                                        const LossRows& per_row) override {
    return kernels::cross_entropy_forward_backward(logits, ld, labels, rows, vocab, grad_scale, softcap, grad_bf16,
                                                   per_row);
  }

  size_t attention_workspace_bytes(const AttentionShape& s, AttentionMatmul precision) override {
    return kernels::attention_workspace_bytes(s, precision, max_threads());
  }
  void prepare_attention(const AttentionShape& s, AttentionMatmul precision) override {
    prepare_attention_blocked(s, precision);
  }
  void attention_forward(const AttentionShape& s, AttentionMatmul precision, const float* q, const float* k,
                         const float* v, const int32_t* segments, float* out, float* lse, void* workspace,
                         size_t workspace_bytes) override {
    attention_forward_blocked(s, precision, q, k, v, segments, out, lse, workspace, workspace_bytes);
  }
  void attention_backward(const AttentionShape& s, AttentionMatmul precision, const float* q, const float* k,
                          const float* v, const int32_t* segments, const float* out, const float* lse,
                          const float* dout, float* dq, float* dk, float* dv, void* workspace,
                          size_t workspace_bytes) override {
    attention_backward_blocked(s, precision, q, k, v, segments, lse, dout, dq, dk, dv, workspace, workspace_bytes);
  }
  void cached_attention(const AttentionShape& s, const float* q, int64_t tokens, int64_t first_position,
                        const float* k_cache, const float* v_cache, float* out) override {
    kernels::cached_attention(s, q, tokens, first_position, k_cache, v_cache, out);
  }

  void adamw_update(float* w, const float* g, float* m, float* v, int64_t n, const AdamWStep& s, double weight_decay,
                    bf16* w_bf16) override {
    kernels::adamw_update(w, g, m, v, n, s, weight_decay, w_bf16);
  }
  double sum_of_squares(const float* x, int64_t n) override { return kernels::sum_of_squares(x, n); }
  void scale_in_place(float* x, int64_t n, float factor) override { kernels::scale_in_place(x, n, factor); }
};

}  // namespace

Backend& cpu_backend() {
  static CpuBackend backend;
  return backend;
}

}  // namespace keel::kernels
