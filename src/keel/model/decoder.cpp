#include "keel/model/decoder.h"

#include <algorithm>
#include <cstring>
#include <random>

#include "keel/core/error.h"
#include "keel/kernels/attention.h"
#include "keel/kernels/cross_entropy.h"
#include "keel/kernels/embedding.h"
#include "keel/kernels/gemm.h"
#include "keel/kernels/rmsnorm.h"
#include "keel/kernels/swiglu.h"

namespace keel::model {

using kernels::Trans;

namespace {

// Rows of logits computed at once by the fused LM head + cross-entropy: bounded so that
// [rows, vocab] fp32 logits stay near 32 MiB whatever the vocabulary.
int64_t lm_head_chunk_rows(int64_t vocab, int64_t tokens) {
  int64_t rows = (int64_t(8) << 20) / std::max<int64_t>(vocab, 1);
  return std::clamp<int64_t>(rows, 16, std::max<int64_t>(tokens, 1));
}

template <typename T>
std::vector<T> sized(int64_t n) {
  return std::vector<T>(size_t(n));
}

void add_bias_rows(float* y, const float* bias, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) y[r * cols + c] += bias[c];
}

// db[c] += sum over rows of dy[r, c]; columns are split across threads so sums stay in row order.
void accumulate_bias_grad(const float* dy, int64_t rows, int64_t cols, float* db) {
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < cols; ++c) {
    float sum = 0.0f;
    for (int64_t r = 0; r < rows; ++r) sum += dy[r * cols + c];
    db[c] += sum;
  }
}

void add_into(float* dst, const float* a, const float* b, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] = a[i] + b[i];
}

}  // namespace

struct LayerActivations {
  std::vector<float> x, xn1, rstd1, qkv, attn, lse, xmid, xn2, rstd2, gate_up, act;
  std::vector<bf16> xn1_b, attn_b, xn2_b, act_b;  // GEMM inputs in bf16 mode (empty in fp32)
};

struct Decoder::Buffers {
  std::vector<LayerActivations> layers;
  std::vector<float> x_final, xn_final, rstd_final;
  std::vector<bf16> xn_final_b;
  // Gradient scratch, reused by every layer in turn.
  std::vector<float> dx, dh, dnorm, dtmp, d_act, d_gate_up, d_attn, d_qkv, logits;
  std::vector<bf16> dy_b, logits_b;
};

Decoder::Decoder(const ModelConfig& config, Precision precision, int64_t max_batch, int64_t max_seq)
    : config_(config), precision_(precision), max_batch_(max_batch), max_seq_(max_seq) {
  model::validate(config_, "model");
  require(max_batch > 0 && max_seq > 1, "decoder: batch {} and sequence length {} must be positive (seq >= 2)",
          max_batch, max_seq);
  const auto& c = config_;
  const int64_t H = c.hidden_size, qkv_rows = c.q_size() + 2 * c.kv_size();
  ids_.embed = params_.add("embed", {c.vocab_size, H}, true);
  ids_.layers.resize(c.num_layers);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    auto& p = ids_.layers[l];
    std::string prefix = "layers." + std::to_string(l) + ".";
    p.input_norm = params_.add(prefix + "input_norm", {H}, false);
    p.qkv_weight = params_.add(prefix + "qkv.weight", {qkv_rows, H}, true);
    if (c.qkv_bias) p.qkv_bias = params_.add(prefix + "qkv.bias", {qkv_rows}, false);
    p.o_weight = params_.add(prefix + "o.weight", {H, c.q_size()}, true);
    p.post_norm = params_.add(prefix + "post_attention_norm", {H}, false);
    p.gate_up_weight = params_.add(prefix + "gate_up.weight", {2 * c.intermediate_size, H}, true);
    p.down_weight = params_.add(prefix + "down.weight", {H, c.intermediate_size}, true);
  }
  ids_.final_norm = params_.add("final_norm", {H}, false);
  ids_.lm_head = c.tie_word_embeddings ? ids_.embed : params_.add("lm_head", {c.vocab_size, H}, true);
  params_.allocate(precision_ == Precision::BF16);

  rope_ = kernels::RopeTable::build(c.rotary_dim, c.rope_interleaved, c.rope_theta, max_seq_);

  const int64_t N = max_batch_ * max_seq_, I = c.intermediate_size, Q = c.q_size();
  const bool bf = precision_ == Precision::BF16;
  buf_ = std::make_unique<Buffers>();
  auto& b = *buf_;
  b.layers.resize(c.num_layers);
  for (auto& a : b.layers) {
    a.x = sized<float>(N * H);
    a.xn1 = sized<float>(N * H);
    a.rstd1 = sized<float>(N);
    a.qkv = sized<float>(N * qkv_rows);
    a.attn = sized<float>(N * Q);
    a.lse = sized<float>(N * c.num_heads);
    a.xmid = sized<float>(N * H);
    a.xn2 = sized<float>(N * H);
    a.rstd2 = sized<float>(N);
    a.gate_up = sized<float>(N * 2 * I);
    a.act = sized<float>(N * I);
    if (bf) {
      a.xn1_b = sized<bf16>(N * H);
      a.attn_b = sized<bf16>(N * Q);
      a.xn2_b = sized<bf16>(N * H);
      a.act_b = sized<bf16>(N * I);
    }
  }
  b.x_final = sized<float>(N * H);
  b.xn_final = sized<float>(N * H);
  b.rstd_final = sized<float>(N);
  if (bf) b.xn_final_b = sized<bf16>(N * H);
  for (auto* v : {&b.dx, &b.dh, &b.dnorm, &b.dtmp}) *v = sized<float>(N * H);
  b.d_act = sized<float>(N * I);
  b.d_gate_up = sized<float>(N * 2 * I);
  b.d_attn = sized<float>(N * Q);
  b.d_qkv = sized<float>(N * qkv_rows);
  const int64_t chunk = lm_head_chunk_rows(c.vocab_size, N);
  b.logits = sized<float>(chunk * c.vocab_size);
  if (bf) {
    b.dy_b = sized<bf16>(N * std::max({H, 2 * I, qkv_rows}));
    b.logits_b = sized<bf16>(chunk * c.vocab_size);
  }
}

Decoder::~Decoder() = default;

size_t Decoder::activation_bytes() const {
  size_t total = 0;
  auto add = [&](const auto& v) { total += v.size() * sizeof(v[0]); };
  for (const auto& a : buf_->layers) {
    for (const auto* v : {&a.x, &a.xn1, &a.rstd1, &a.qkv, &a.attn, &a.lse, &a.xmid, &a.xn2, &a.rstd2,
                          &a.gate_up, &a.act})
      add(*v);
    for (const auto* v : {&a.xn1_b, &a.attn_b, &a.xn2_b, &a.act_b}) add(*v);
  }
  const auto& b = *buf_;
  for (const auto* v : {&b.x_final, &b.xn_final, &b.rstd_final, &b.dx, &b.dh, &b.dnorm, &b.dtmp, &b.d_act,
                        &b.d_gate_up, &b.d_attn, &b.d_qkv, &b.logits})
    add(*v);
  for (const auto* v : {&b.xn_final_b, &b.dy_b, &b.logits_b}) add(*v);
  return total;
}

void Decoder::init_random(uint64_t seed, double std) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, float(std));
  for (const auto& p : params_.params()) {
    float* w = params_.weight(&p - params_.params().data());
    bool is_norm = p.name.find("norm") != std::string::npos;
    bool is_bias = p.name.find(".bias") != std::string::npos;
    for (int64_t i = 0; i < p.numel; ++i) w[i] = is_norm ? 1.0f : is_bias ? 0.0f : normal(rng);
  }
  params_.refresh_bf16_copy();
}

void Decoder::validate(const MicroBatch& mb) const {
  require(mb.batch > 0 && mb.batch <= max_batch_ && mb.seq > 0 && mb.seq <= max_seq_,
          "micro-batch {}x{} exceeds the planned {}x{}", mb.batch, mb.seq, max_batch_, max_seq_);
  const int64_t n = mb.batch * mb.seq;
  for (int64_t i = 0; i < n; ++i) {
    require(mb.input_ids[i] >= 0 && mb.input_ids[i] < config_.vocab_size,
            "token id {} at position {} is outside the vocabulary (size {})", mb.input_ids[i], i,
            config_.vocab_size);
    require(mb.targets[i] == kernels::kIgnoreIndex || (mb.targets[i] >= 0 && mb.targets[i] < config_.vocab_size),
            "label {} at position {} is outside the vocabulary (size {}) and is not -100", mb.targets[i], i,
            config_.vocab_size);
    require(mb.positions[i] >= 0 && mb.positions[i] < max_seq_, "position id {} at {} is out of range [0, {})",
            mb.positions[i], i, max_seq_);
  }
}

// ---- linear layers: y = x W^T, in fp32 or with bf16 inputs and fp32 accumulation ----
namespace {

struct Linear {
  bool bf;
  int64_t rows;  // tokens
  // y[rows, out] (+)= x[rows, in] W[out, in]^T
  void forward(const float* x, const bf16* xb, const float* w, const bf16* wb, int64_t in, int64_t out, float* y,
               float beta) const {
    auto s = kernels::packed_gemm(Trans::N, Trans::T, rows, out, in);
    if (bf)
      kernels::gemm_bf16(s, xb, wb, y, beta);
    else
      kernels::gemm_f32(s, x, w, y, beta);
  }
  // dx[rows, in] = dy[rows, out] W[out, in]
  void backward_input(const float* dy, const bf16* dyb, const float* w, const bf16* wb, int64_t in, int64_t out,
                      float* dx) const {
    auto s = kernels::packed_gemm(Trans::N, Trans::N, rows, in, out);
    if (bf)
      kernels::gemm_bf16(s, dyb, wb, dx, 0.0f);
    else
      kernels::gemm_f32(s, dy, w, dx, 0.0f);
  }
  // dW[out, in] += dy[rows, out]^T x[rows, in]
  void backward_weight(const float* dy, const bf16* dyb, const float* x, const bf16* xb, int64_t in, int64_t out,
                       float* dw) const {
    auto s = kernels::packed_gemm(Trans::T, Trans::N, out, in, rows);
    if (bf)
      kernels::gemm_bf16(s, dyb, xb, dw, 1.0f);
    else
      kernels::gemm_f32(s, dy, x, dw, 1.0f);
  }
};

void to_bf16(const float* src, bf16* dst, int64_t n) {
  if (dst) convert_f32_to_bf16(src, dst, size_t(n));
}

}  // namespace

void Decoder::forward(const MicroBatch& mb) {
  const auto& c = config_;
  auto& b = *buf_;
  const int64_t N = mb.batch * mb.seq, H = c.hidden_size, I = c.intermediate_size;
  const int64_t Q = c.q_size(), KV = c.kv_size(), QKV = Q + 2 * KV;
  const bool bf = precision_ == Precision::BF16;
  Linear lin{bf, N};
  auto& P = params_;

  kernels::embedding_forward(mb.input_ids, N, P.weight(ids_.embed), H, b.layers.empty() ? b.x_final.data()
                                                                                          : b.layers[0].x.data());
  kernels::AttentionShape as{mb.batch, mb.seq, c.num_heads, c.num_kv_heads, c.head_dim, QKV, QKV, QKV, Q,
                             1.0 / std::sqrt(double(c.head_dim))};
  for (int64_t l = 0; l < c.num_layers; ++l) {
    auto& a = b.layers[l];
    const auto& p = ids_.layers[l];
    float* x_next = l + 1 < c.num_layers ? b.layers[l + 1].x.data() : b.x_final.data();

    kernels::rmsnorm_forward(a.x.data(), P.weight(p.input_norm), N, H, c.rms_norm_eps, a.xn1.data(), a.rstd1.data());
    to_bf16(a.xn1.data(), bf ? a.xn1_b.data() : nullptr, N * H);
    lin.forward(a.xn1.data(), a.xn1_b.data(), P.weight(p.qkv_weight), P.weight_bf16(p.qkv_weight), H, QKV,
                a.qkv.data(), 0.0f);
    if (p.qkv_bias >= 0) add_bias_rows(a.qkv.data(), P.weight(p.qkv_bias), N, QKV);
    kernels::rope_forward(a.qkv.data(), QKV, mb.positions, N, c.num_heads, c.head_dim, rope_);
    kernels::rope_forward(a.qkv.data() + Q, QKV, mb.positions, N, c.num_kv_heads, c.head_dim, rope_);
    kernels::attention_forward(as, a.qkv.data(), a.qkv.data() + Q, a.qkv.data() + Q + KV, mb.segments,
                               a.attn.data(), a.lse.data());
    to_bf16(a.attn.data(), bf ? a.attn_b.data() : nullptr, N * Q);
    std::memcpy(a.xmid.data(), a.x.data(), sizeof(float) * N * H);
    lin.forward(a.attn.data(), a.attn_b.data(), P.weight(p.o_weight), P.weight_bf16(p.o_weight), Q, H,
                a.xmid.data(), 1.0f);

    kernels::rmsnorm_forward(a.xmid.data(), P.weight(p.post_norm), N, H, c.rms_norm_eps, a.xn2.data(),
                             a.rstd2.data());
    to_bf16(a.xn2.data(), bf ? a.xn2_b.data() : nullptr, N * H);
    lin.forward(a.xn2.data(), a.xn2_b.data(), P.weight(p.gate_up_weight), P.weight_bf16(p.gate_up_weight), H, 2 * I,
                a.gate_up.data(), 0.0f);
    kernels::swiglu_forward(a.gate_up.data(), N, I, a.act.data());
    to_bf16(a.act.data(), bf ? a.act_b.data() : nullptr, N * I);
    std::memcpy(x_next, a.xmid.data(), sizeof(float) * N * H);
    lin.forward(a.act.data(), a.act_b.data(), P.weight(p.down_weight), P.weight_bf16(p.down_weight), I, H, x_next,
                1.0f);
  }
  kernels::rmsnorm_forward(b.x_final.data(), P.weight(ids_.final_norm), N, H, c.rms_norm_eps, b.xn_final.data(),
                           b.rstd_final.data());
  to_bf16(b.xn_final.data(), bf ? b.xn_final_b.data() : nullptr, N * H);
}

// Fused LM head + cross-entropy over row chunks: logits for `chunk` tokens at a time, turned into
// dlogits in place, then immediately pushed back through the head. Writes d(xn_final) to b.dnorm.
double Decoder::lm_head_loss(const MicroBatch& mb, double grad_scale, bool backward) {
  const auto& c = config_;
  auto& b = *buf_;
  auto& P = params_;
  const int64_t N = mb.batch * mb.seq, H = c.hidden_size, V = c.vocab_size;
  const bool bf = precision_ == Precision::BF16;
  const int64_t chunk = lm_head_chunk_rows(V, max_batch_ * max_seq_);
  double loss = 0.0;
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t rows = std::min(chunk, N - r0);
    Linear lin{bf, rows};
    const float* xn = b.xn_final.data() + r0 * H;
    const bf16* xnb = bf ? b.xn_final_b.data() + r0 * H : nullptr;
    lin.forward(xn, xnb, P.weight(ids_.lm_head), P.weight_bf16(ids_.lm_head), H, V, b.logits.data(), 0.0f);
    loss += kernels::cross_entropy_forward_backward(b.logits.data(), V, mb.targets + r0, rows, V, grad_scale);
    if (!backward) continue;
    to_bf16(b.logits.data(), bf ? b.logits_b.data() : nullptr, rows * V);
    lin.backward_input(b.logits.data(), b.logits_b.data(), P.weight(ids_.lm_head), P.weight_bf16(ids_.lm_head), H, V,
                       b.dnorm.data() + r0 * H);
    lin.backward_weight(b.logits.data(), b.logits_b.data(), xn, xnb, H, V, P.grad(ids_.lm_head));
  }
  return loss;
}

void Decoder::backward(const MicroBatch& mb) {
  const auto& c = config_;
  auto& b = *buf_;
  auto& P = params_;
  const int64_t N = mb.batch * mb.seq, H = c.hidden_size, I = c.intermediate_size;
  const int64_t Q = c.q_size(), KV = c.kv_size(), QKV = Q + 2 * KV;
  const bool bf = precision_ == Precision::BF16;
  Linear lin{bf, N};
  bf16* dyb = bf ? b.dy_b.data() : nullptr;

  kernels::rmsnorm_backward(b.x_final.data(), P.weight(ids_.final_norm), b.rstd_final.data(), b.dnorm.data(), N, H,
                            b.dx.data(), P.grad(ids_.final_norm));
  kernels::AttentionShape as{mb.batch, mb.seq, c.num_heads, c.num_kv_heads, c.head_dim, QKV, QKV, QKV, Q,
                             1.0 / std::sqrt(double(c.head_dim))};
  for (int64_t l = c.num_layers - 1; l >= 0; --l) {
    auto& a = b.layers[l];
    const auto& p = ids_.layers[l];
    // MLP: x_next = xmid + down(swiglu(gate_up(rmsnorm(xmid))))
    to_bf16(b.dx.data(), dyb, N * H);
    lin.backward_input(b.dx.data(), dyb, P.weight(p.down_weight), P.weight_bf16(p.down_weight), I, H, b.d_act.data());
    lin.backward_weight(b.dx.data(), dyb, a.act.data(), a.act_b.data(), I, H, P.grad(p.down_weight));
    kernels::swiglu_backward(a.gate_up.data(), b.d_act.data(), N, I, b.d_gate_up.data());
    to_bf16(b.d_gate_up.data(), dyb, N * 2 * I);
    lin.backward_input(b.d_gate_up.data(), dyb, P.weight(p.gate_up_weight), P.weight_bf16(p.gate_up_weight), H, 2 * I,
                       b.dnorm.data());
    lin.backward_weight(b.d_gate_up.data(), dyb, a.xn2.data(), a.xn2_b.data(), H, 2 * I, P.grad(p.gate_up_weight));
    kernels::rmsnorm_backward(a.xmid.data(), P.weight(p.post_norm), a.rstd2.data(), b.dnorm.data(), N, H,
                              b.dtmp.data(), P.grad(p.post_norm));
    add_into(b.dh.data(), b.dx.data(), b.dtmp.data(), N * H);

    // Attention: xmid = x + o(attn(rope(qkv(rmsnorm(x)))))
    to_bf16(b.dh.data(), dyb, N * H);
    lin.backward_input(b.dh.data(), dyb, P.weight(p.o_weight), P.weight_bf16(p.o_weight), Q, H, b.d_attn.data());
    lin.backward_weight(b.dh.data(), dyb, a.attn.data(), a.attn_b.data(), Q, H, P.grad(p.o_weight));
    float* dq = b.d_qkv.data();
    kernels::attention_backward(as, a.qkv.data(), a.qkv.data() + Q, a.qkv.data() + Q + KV, mb.segments,
                                a.attn.data(), a.lse.data(), b.d_attn.data(), dq, dq + Q, dq + Q + KV);
    kernels::rope_backward(dq, QKV, mb.positions, N, c.num_heads, c.head_dim, rope_);
    kernels::rope_backward(dq + Q, QKV, mb.positions, N, c.num_kv_heads, c.head_dim, rope_);
    if (p.qkv_bias >= 0) accumulate_bias_grad(b.d_qkv.data(), N, QKV, P.grad(p.qkv_bias));
    to_bf16(b.d_qkv.data(), dyb, N * QKV);
    lin.backward_input(b.d_qkv.data(), dyb, P.weight(p.qkv_weight), P.weight_bf16(p.qkv_weight), H, QKV,
                       b.dnorm.data());
    lin.backward_weight(b.d_qkv.data(), dyb, a.xn1.data(), a.xn1_b.data(), H, QKV, P.grad(p.qkv_weight));
    kernels::rmsnorm_backward(a.x.data(), P.weight(p.input_norm), a.rstd1.data(), b.dnorm.data(), N, H,
                              b.dtmp.data(), P.grad(p.input_norm));
    add_into(b.dx.data(), b.dh.data(), b.dtmp.data(), N * H);
  }
  kernels::embedding_backward(mb.input_ids, N, b.dx.data(), H, c.vocab_size, P.grad(ids_.embed));
}

double Decoder::forward_backward(const MicroBatch& mb, double grad_scale) {
  validate(mb);
  forward(mb);
  double loss = lm_head_loss(mb, grad_scale, true);
  backward(mb);
  return loss;
}

double Decoder::forward_loss(const MicroBatch& mb) {
  validate(mb);
  forward(mb);
  return lm_head_loss(mb, 0.0, false);
}

void Decoder::logits_at(const MicroBatch& mb, const int64_t* rows, int64_t count, float* out) {
  validate(mb);
  forward(mb);
  const int64_t H = config_.hidden_size, V = config_.vocab_size;
  const bool bf = precision_ == Precision::BF16;
  Linear lin{bf, 1};
  for (int64_t i = 0; i < count; ++i) {
    require(rows[i] >= 0 && rows[i] < mb.batch * mb.seq, "logits_at: row {} out of range", rows[i]);
    lin.forward(buf_->xn_final.data() + rows[i] * H, bf ? buf_->xn_final_b.data() + rows[i] * H : nullptr,
                params_.weight(ids_.lm_head), params_.weight_bf16(ids_.lm_head), H, V, out + i * V, 0.0f);
  }
}

}  // namespace keel::model
