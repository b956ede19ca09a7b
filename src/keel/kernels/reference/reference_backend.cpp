#include "keel/kernels/reference/reference_backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "keel/core/dropout_mask.h"
#include "keel/core/error.h"
#include "keel/core/four_bit.h"
#include "keel/kernels/host_memory.h"
#include "keel/kernels/reference/attention.h"
#include "keel/kernels/reference/cached_attention.h"
#include "keel/kernels/reference/gemm.h"
#include "keel/kernels/reference/rmsnorm.h"

namespace keel::kernels {
namespace {

using Doubles = std::vector<double>;

// Elements a strided [rows, cols] view spans: (rows - 1) * ld + cols.
int64_t span(int64_t rows, int64_t cols, int64_t ld) { return rows <= 0 ? 0 : (rows - 1) * ld + cols; }

template <typename T>
Doubles widen(const T* x, int64_t n) {
  Doubles d(size_t(std::max<int64_t>(n, 0)));
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, bf16>)
      d[i] = bf16_to_float(x[i]);
    else
      d[i] = double(x[i]);
  }
  return d;
}

void narrow(const Doubles& d, float* x) {
  for (size_t i = 0; i < d.size(); ++i) x[i] = float(d[i]);
}

// Writes back only the [rows, cols] elements of a strided view: views of one fused buffer
// (q, k and v of the qkv projection) interleave, and each must leave the others' columns alone.
// A gated MLP's activation and its derivative at g, in double:
//   SwiGLU: silu(g) = g / (1 + exp(-g)), silu' = s (1 + g (1 - s)), s = sigmoid(g);
//   GeGLU: gelu(g) = 0.5 g (1 + t), t = tanh(k (g + 0.044715 g^3)), k = sqrt(2 / pi),
//          gelu' = 0.5 (1 + t) + 0.5 g (1 - t^2) k (1 + 3 * 0.044715 g^2).
struct Activation {
  double value, derivative;
};
Activation activation(GluActivation act, double g) {
  if (act == GluActivation::GeluTanh) {
    const double k = std::sqrt(2.0 / M_PI), kappa = 0.044715;
    const double t = std::tanh(k * (g + kappa * g * g * g));
    return {0.5 * g * (1 + t), 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * k * (1 + 3 * kappa * g * g)};
  }
  const double s = 1 / (1 + std::exp(-g));
  return {g * s, s * (1 + g * (1 - s))};
}

// RoPE on the first rotary_dim channels of each head, in place, rotating each pair (a, b) by
// sign * the angle of the token's position: a' = a cos - b sin, b' = a sin + b cos (pairs (2i, 2i+1)
// interleaved, (i, i + rotary_dim / 2) otherwise); cos and sin are the table's float values.
void rotate(float* x, int64_t ld, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
            const RopeTable& table, double sign) {
  const int64_t pairs = table.rotary_dim / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t pos = positions[t];
    require(pos >= 0 && pos < table.max_positions, "rope: position {} outside the table's {}", pos,
            table.max_positions);
    for (int64_t h = 0; h < heads; ++h) {
      float* head = x + t * ld + h * head_dim;
      for (int64_t i = 0; i < pairs; ++i) {
        const int64_t ia = table.interleaved ? 2 * i : i, ib = table.interleaved ? 2 * i + 1 : i + pairs;
        const double c = table.cos[size_t(pos * pairs + i)], s = sign * double(table.sin[size_t(pos * pairs + i)]);
        const double a = head[ia], b = head[ib];
        head[ia] = float(a * c - b * s);
        head[ib] = float(a * s + b * c);
      }
    }
  }
}

void narrow_view(const Doubles& d, int64_t rows, int64_t cols, int64_t ld, float* x) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) x[r * ld + c] = float(d[size_t(r * ld + c)]);
}

double round_to_bf16(double x) { return bf16_to_float(float_to_bf16(float(x))); }

class ReferenceBackend final : public HostMemoryBackend {
 public:
  std::string_view name() const override { return "reference"; }
  std::string description(bool bf16) const override {
    return std::string(
               "reference backend: every operation in double precision on scalar loops (slow; for tests "
               "and for checking other backends)") +
           (bf16 ? ", GEMM and attention inputs rounded to bf16" : "");
  }

  void gemm(const GemmShape& s, const float* a, const float* b, float* c, float beta) override {
    product(s, widen(a, a_span(s)), widen(b, b_span(s)), c, beta);
  }
  void gemm_bf16(const GemmShape& s, const bf16* a, const bf16* b, float* c, float beta) override {
    product(s, widen(a, a_span(s)), widen(b, b_span(s)), c, beta);
  }
  ProductShares bf16_product_shares(const GemmShape&) override { return {}; }  // each product whole
  void prepare_gemm(const GemmShape&, bool, float) override {}
  size_t gemm_scratch_bytes(bool) override { return 0; }
  void gemv_bf16(const float* x, const bf16* w, int64_t rows, int64_t in, float* y, float beta) override {
    for (int64_t r = 0; r < rows; ++r) {
      double sum = beta == 0.0f ? 0.0 : double(beta) * double(y[r]);
      for (int64_t i = 0; i < in; ++i) sum += double(x[i]) * double(bf16_to_float(w[r * in + i]));
      y[r] = float(sum);
    }
  }
  // A triple loop, the same for bf16 inputs: a small product says as much.
  double matmul_peak_flops(bool) override {
    const int64_t size = 128, repeats = 3;
    const auto s = packed_gemm(Trans::N, Trans::N, size, size, size);
    std::vector<float> a(size_t(size * size), 0.5f), b(a.size(), 0.25f), c(a.size());
    double best = 1e30;
    for (int r = 0; r < repeats; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      gemm(s, a.data(), b.data(), c.data(), 0.0f);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return 2.0 * double(size) * double(size) * double(size) / best;
  }

  void cast_to_bf16(const float* src, bf16* dst, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
  }
  void cast_to_f32(const bf16* src, float* dst, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
  }
  void add(float* dst, const float* a, const float* b, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) dst[i] = float(double(a[i]) + double(b[i]));
  }
  void add_bias_rows(float* y, const float* bias, int64_t rows, int64_t cols) override {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) y[r * cols + c] = float(double(y[r * cols + c]) + double(bias[c]));
  }
  void accumulate_bias_grad(const float* dy, int64_t rows, int64_t cols, float* db) override {
    for (int64_t c = 0; c < cols; ++c) {
      double sum = db[c];
      for (int64_t r = 0; r < rows; ++r) sum += dy[r * cols + c];
      db[c] = float(sum);
    }
  }

  void rmsnorm_forward(const RmsNormShape& s, const float* x, const float* w, float* y, float* rstd,
                       bf16* y_bf16) override {
    reference::rmsnorm_forward(s, x, w, y, rstd);
    if (y_bf16)
      for (int64_t r = 0; r < s.rows; ++r) cast_to_bf16(y + r * s.ldy, y_bf16 + r * s.ldy, s.heads * s.dim);
  }
  void rmsnorm_backward(const RmsNormShape& s, const float* x, const float* w, const float* rstd, const float* dy,
                        float* dx, float* dw, const float* residual, bf16* dx_bf16) override {
    reference::rmsnorm_backward(s, x, w, rstd, dy, dx, dw, residual);
    if (dx_bf16)
      for (int64_t r = 0; r < s.rows; ++r) cast_to_bf16(dx + r * s.lddx, dx_bf16 + r * s.lddx, s.heads * s.dim);
  }
  void rope_forward(float* x, int64_t ld, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
                    const RopeTable& table) override {
    rotate(x, ld, positions, tokens, heads, head_dim, table, 1.0);
  }
  // The gradient of a rotation is the rotation by the negative angle.
  void rope_backward(float* dx, int64_t ld, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
                     const RopeTable& table) override {
    rotate(dx, ld, positions, tokens, heads, head_dim, table, -1.0);
  }
  // In float, as transformers computes it (logits / cap, tanh, * cap), not in double: saturated
  // logits then equal cap exactly and tie as they do there, which greedy decoding's argmax sees.
  void soft_cap(float* x, int64_t n, double cap) override {
    const auto c = float(cap);
    for (int64_t i = 0; i < n; ++i) x[i] = std::tanh(x[i] / c) * c;
  }
  // out = act(gate) * up for gate_up rows [gate | up], in double, rounded once.
  void glu_forward(GluActivation act, const float* gate_up, int64_t rows, int64_t inter, float* out,
                   bf16* out_bf16) override {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < inter; ++c) {
        const double g = gate_up[r * 2 * inter + c], u = gate_up[r * 2 * inter + inter + c];
        out[r * inter + c] = float(activation(act, g).value * u);
      }
    if (out_bf16) cast_to_bf16(out, out_bf16, rows * inter);
  }
  // d/d gate = dout * up * act'(gate), d/d up = dout * act(gate).
  void glu_backward(GluActivation act, const float* gate_up, const float* dout, int64_t rows, int64_t inter,
                    float* dgate_up, bf16* dgate_up_bf16) override {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < inter; ++c) {
        const double g = gate_up[r * 2 * inter + c], u = gate_up[r * 2 * inter + inter + c];
        const double dy = dout[r * inter + c];
        const Activation a = activation(act, g);
        dgate_up[r * 2 * inter + c] = float(dy * u * a.derivative);
        dgate_up[r * 2 * inter + inter + c] = float(dy * a.value);
      }
    if (dgate_up_bf16) cast_to_bf16(dgate_up, dgate_up_bf16, rows * 2 * inter);
  }
  void embedding_forward(const int32_t* ids, int64_t n, const float* table, int64_t hidden, float* out) override {
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(out + i * hidden, table + int64_t(ids[i]) * hidden, sizeof(float) * hidden);
  }
  void dequantize_4bit(FourBitType type, const uint8_t* packed, const float* absmax, int64_t n, float* out) override {
    four_bit_dequantize(type, packed, absmax, n, out);
  }
  void dequantize_4bit_bf16(FourBitType type, const uint8_t* packed, const float* absmax, int64_t n,
                            bf16* out) override {
    std::vector<float> wide(size_t(std::max<int64_t>(n, 0)));
    four_bit_dequantize(type, packed, absmax, n, wide.data());
    for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(wide[size_t(i)]);
  }
  void dropout(const float* x, float* y, int64_t n, double p, uint64_t key) override {
    const uint64_t threshold = dropout_keep_threshold(p);
    for (int64_t i = 0; i < n; ++i) y[i] = dropout_keeps(key, uint64_t(i), threshold) ? float(double(x[i]) / (1.0 - p)) : 0.0f;
  }
  void dropout_bf16(const bf16* x, bf16* y, int64_t n, double p, uint64_t key) override {
    const uint64_t threshold = dropout_keep_threshold(p);
    for (int64_t i = 0; i < n; ++i)
      y[i] = float_to_bf16(dropout_keeps(key, uint64_t(i), threshold) ? float(double(bf16_to_float(x[i])) / (1.0 - p)) : 0.0f);
  }
  void embedding_forward_bf16(const int32_t* ids, int64_t n, const bf16* table, int64_t hidden, float* out) override {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < hidden; ++c) out[i * hidden + c] = bf16_to_float(table[int64_t(ids[i]) * hidden + c]);
  }
  // dtable[ids[i]] += dout[i] but for padding_idx's lookups: each used row summed in double from
  // what it held, in token order, then rounded once.
  void embedding_backward(const int32_t* ids, int64_t n, const float* dout, int64_t hidden, int64_t vocab,
                          int64_t padding_idx, float* dtable) override {
    for (int64_t i = 0; i < n; ++i)
      require(ids[i] >= 0 && ids[i] < vocab, "embedding_backward: token {} has id {}, expected an id in [0, {})", i,
              ids[i], vocab);
    Doubles dd = widen(dtable, vocab * hidden);
    for (int64_t i = 0; i < n; ++i) {
      if (ids[i] == padding_idx) continue;
      const int64_t row = int64_t(ids[i]) * hidden;
      for (int64_t h = 0; h < hidden; ++h) dd[size_t(row + h)] += double(dout[i * hidden + h]);
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = int64_t(ids[i]) * hidden;
      for (int64_t h = 0; h < hidden; ++h) dtable[row + h] = float(dd[size_t(row + h)]);
    }
  }
  double cross_entropy_forward_backward(float* logits, int64_t ld, const int32_t* labels, int64_t rows, int64_t vocab,
                                        double grad_scale, double softcap, bf16* grad_bf16,
                                        const LossRows& per_row) override {
    // Per row, in double: z = softcap * tanh(x / softcap) (or x), loss = logsumexp(z) - z[label],
    // d loss / d x_j = (softmax(z)_j - [j = label]) * dz_j/dx_j, times the row's gradient scale;
    // an ignored row's loss and gradient are 0. Rounded once into the row. (Not the CPU kernel's
    // template: a change to that must not change the yardstick it is measured against.)
    for (int64_t r = 0; r < rows; ++r)
      require(labels[r] == kIgnoreIndex || (labels[r] >= 0 && labels[r] < vocab),
              "cross_entropy: row {} has label {}, expected {} or a token id in [0, {})", r, labels[r], kIgnoreIndex,
              vocab);
    double loss = 0;
    Doubles z(static_cast<size_t>(vocab)), slope(static_cast<size_t>(vocab), 1.0);
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t label = labels[r];
      float* x = logits + r * ld;
      double mean = 0;
      for (int64_t j = 0; j < vocab; ++j) {
        const double t = softcap > 0 ? std::tanh(double(x[j]) / softcap) : 0.0;
        z[size_t(j)] = softcap > 0 ? softcap * t : double(x[j]);
        if (softcap > 0) slope[size_t(j)] = 1.0 - t * t;
        mean += z[size_t(j)];
      }
      if (per_row.mean_logit) per_row.mean_logit[r] = mean / double(vocab);
      double row_loss = 0;
      if (label == kIgnoreIndex) {
        std::fill_n(x, vocab, 0.0f);
      } else {
        const double top = *std::max_element(z.begin(), z.end());
        double sum = 0;
        for (int64_t j = 0; j < vocab; ++j) sum += std::exp(z[size_t(j)] - top);
        row_loss = top + std::log(sum) - z[size_t(label)];
        const double scale = grad_scale * (per_row.grad_scale ? double(per_row.grad_scale[r]) : 1.0);
        for (int64_t j = 0; j < vocab; ++j)
          x[j] = float((std::exp(z[size_t(j)] - top) / sum - (j == label ? 1.0 : 0.0)) * slope[size_t(j)] * scale);
      }
      if (per_row.loss) per_row.loss[r] = row_loss;
      loss += row_loss;
    }
    if (grad_bf16)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < vocab; ++j) grad_bf16[r * ld + j] = float_to_bf16(logits[r * ld + j]);
    return loss;
  }

  size_t attention_workspace_bytes(const AttentionShape&, AttentionMatmul) override { return 0; }
  void prepare_attention(const AttentionShape&, AttentionMatmul) override {}
  void attention_forward(const AttentionShape& s, AttentionMatmul precision, const float* q, const float* k,
                         const float* v, const int32_t* segments, float* out, float* lse, void*, size_t) override {
    const int64_t N = s.batch * s.seq, Q = s.q_heads * s.head_dim;
    Doubles qd = input(q, N, Q, s.ldq, precision), kd = input(k, N, s.kv_heads * s.head_dim, s.ldk, precision),
            vd = input(v, N, s.kv_heads * s.head_dim, s.ldv, precision);
    Doubles od(size_t(span(N, Q, s.ldo))), lsed(size_t(s.batch * s.q_heads * s.seq));
    kernels::attention_forward(s, qd.data(), kd.data(), vd.data(), segments, od.data(), lsed.data());
    narrow_view(od, N, Q, s.ldo, out);
    narrow(lsed, lse);
  }
  void attention_backward(const AttentionShape& s, AttentionMatmul precision, const float* q, const float* k,
                          const float* v, const int32_t* segments, const float* out, const float* lse,
                          const float* dout, float* dq, float* dk, float* dv, void*, size_t) override {
    const int64_t N = s.batch * s.seq, Q = s.q_heads * s.head_dim, KV = s.kv_heads * s.head_dim;
    Doubles qd = input(q, N, Q, s.ldq, precision), kd = input(k, N, KV, s.ldk, precision),
            vd = input(v, N, KV, s.ldv, precision);
    Doubles dqd(qd.size()), dkd(kd.size()), dvd(vd.size());
    kernels::attention_backward(s, qd.data(), kd.data(), vd.data(), segments, widen(out, span(N, Q, s.ldo)).data(),
                                widen(lse, s.batch * s.q_heads * s.seq).data(),
                                input(dout, N, Q, s.ldo, precision).data(), dqd.data(), dkd.data(), dvd.data());
    narrow_view(dqd, N, Q, s.ldq, dq);
    narrow_view(dkd, N, KV, s.ldk, dk);
    narrow_view(dvd, N, KV, s.ldv, dv);
  }
  void cached_attention(const AttentionShape& s, const float* q, int64_t tokens, int64_t first_position,
                        const float* k_cache, const float* v_cache, float* out) override {
    reference::cached_attention(s, q, tokens, first_position, k_cache, v_cache, out);
  }

  // torch.optim.AdamW's update formed in double from the fp32 state, each result rounded once.
  void adamw_update(float* w, const float* g, float* m, float* v, int64_t n, const AdamWStep& s, double weight_decay,
                    bf16* w_bf16) override {
    const double bias1 = 1.0 - std::pow(s.beta1, double(s.step));
    const double bias2_sqrt = std::sqrt(1.0 - std::pow(s.beta2, double(s.step)));
    for (int64_t i = 0; i < n; ++i) {
      const double gi = g[i] * float(s.grad_scale);  // clipped as torch clips: rounded to fp32 first
      const double mi = s.beta1 * m[i] + (1.0 - s.beta1) * gi;
      const double vi = s.beta2 * v[i] + (1.0 - s.beta2) * gi * gi;
      const double wi =
          double(w[i]) * (1.0 - s.lr * weight_decay) - s.lr / bias1 * mi / (std::sqrt(vi) / bias2_sqrt + s.eps);
      m[i] = float(mi), v[i] = float(vi), w[i] = float(wi);
      if (w_bf16) w_bf16[i] = float_to_bf16(w[i]);
    }
  }
  double sum_of_squares(const float* x, int64_t n) override {
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += double(x[i]) * double(x[i]);
    return sum;
  }
  void scale_in_place(float* x, int64_t n, float factor) override {
    for (int64_t i = 0; i < n; ++i) x[i] = float(double(x[i]) * double(factor));
  }

 private:
  static int64_t a_span(const GemmShape& s) {
    return s.trans_a == Trans::N ? span(s.m, s.k, s.lda) : span(s.k, s.m, s.lda);
  }
  static int64_t b_span(const GemmShape& s) {
    return s.trans_b == Trans::N ? span(s.k, s.n, s.ldb) : span(s.n, s.k, s.ldb);
  }
  static void product(const GemmShape& s, const Doubles& a, const Doubles& b, float* c, float beta) {
    Doubles cd = beta == 0.0f ? Doubles(size_t(span(s.m, s.n, s.ldc))) : widen(c, span(s.m, s.n, s.ldc));
    gemm_reference(s, a.data(), b.data(), cd.data(), beta);
    narrow_view(cd, s.m, s.n, s.ldc, c);
  }
  // Attention's inputs in double; with BF16 products rounded to bf16 first, as the CPU backend's
  // products and bf16 autocast see them.
  static Doubles input(const float* x, int64_t rows, int64_t cols, int64_t ld, AttentionMatmul precision) {
    Doubles d = widen(x, span(rows, cols, ld));
    if (precision == AttentionMatmul::BF16)
      for (double& e : d) e = round_to_bf16(e);
    return d;
  }
};

}  // namespace

Backend& reference_backend() {
  static ReferenceBackend backend;
  return backend;
}

}  // namespace keel::kernels
