#include "keel/model/generator.h"

#include "keel/model/experts.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "keel/core/error.h"

namespace keel::model {

void Generator::linear(const float* x, int weight, int64_t rows, int64_t in, int64_t out, float* y, float beta) {
  const auto shape = kernels::packed_gemm(kernels::Trans::N, kernels::Trans::T, rows, out, in);
  if (weights_ == GenerationWeights::F32) {
    backend_.gemm(shape, x, decoder_.params().weight(weight), y, beta);
    return;
  }
  const bf16* w = bf16_weights_[size_t(weight)];
  if (rows == 1) {  // a generated token: each weight read once, as stored
    backend_.gemv_bf16(x, w, out, in, y, beta);
    return;
  }
  // The prompt: the weight widened once (exactly) for all its rows, then an fp32 GEMM.
  backend_.cast_to_f32(w, widened_.data(), out * in);
  backend_.gemm(shape, x, widened_.data(), y, beta);
}

Generator::Generator(const Decoder& decoder, int64_t max_length, GenerationWeights weights)
    : decoder_(decoder), backend_(decoder.backend()), c_(decoder.config()), max_length_(max_length), weights_(weights) {
  require(max_length > 0, "generation: max_length must be positive");
  require(!c_.has_experts() || weights == GenerationWeights::F32,
          "generation: {} ({}) is a mixture-of-experts model, whose experts keel's generator runs on the fp32 "
          "weights only in this version (--weights f32)",
          family_display_name(c_.family), c_.architecture);
  require(
      decoder.params().compute_only_total() == 0 && decoder.params().four_bit_total() == 0 && !decoder.has_adapter(),
      "generation: needs the model's fp32 weights without an adapter of its own (merge an adapter first)");
  rope_ = kernels::RopeTable::build(c_.rotary_dim, c_.rope_interleaved, c_.rope_theta, max_length);
  if (c_.rope_local_theta > 0)
    rope_local_ = kernels::RopeTable::build(c_.rotary_dim, c_.rope_interleaved, c_.rope_local_theta, max_length);
  k_cache_.assign(c_.num_layers, std::vector<float>(size_t(max_length * c_.kv_size())));
  v_cache_.assign(c_.num_layers, std::vector<float>(size_t(max_length * c_.kv_size())));
  if (weights_ == GenerationWeights::Bf16) {
    const auto& P = decoder.params();
    const auto& I = decoder.ids();
    std::vector<int> projections{I.lm_head};
    for (const auto& p : I.layers)
      projections.insert(projections.end(), {p.qkv_weight, p.o_weight, p.gate_up_weight, p.down_weight});
    std::sort(projections.begin(), projections.end());
    projections.erase(std::unique(projections.begin(), projections.end()), projections.end());
    auto aligned = [](int64_t n) { return (size_t(n) * sizeof(bf16) + 63) / 64 * 64; };
    size_t bytes = 0;
    int64_t largest = 0;
    for (int id : projections) bytes += aligned(P.param(id).numel);
    bf16_arena_ = Arena(bytes);
    bf16_weights_.assign(P.params().size(), nullptr);
    size_t offset = 0;
    for (int id : projections) {
      const int64_t n = P.param(id).numel;
      bf16* w = bf16_arena_.at<bf16>(offset);
      backend_.cast_to_bf16(P.weight(id), w, n);
      bf16_weights_[size_t(id)] = w;
      offset += aligned(n);
      largest = std::max(largest, n);
    }
    widened_.resize(size_t(largest));
  }
}

// The decoder's forward pass (decoder.cpp: forward_block) for n new tokens over the cache, in fp32.
const std::vector<float>& Generator::feed(const int32_t* ids, int64_t n, int64_t position) {
  require(position + n <= max_length_, "generation: {} tokens exceed the maximum length {}", position + n, max_length_);
  const auto& P = decoder_.params();
  const auto& I = decoder_.ids();
  const int64_t H = c_.hidden_size, Q = c_.q_size(), KV = c_.kv_size(), QKV = Q + 2 * KV, D = c_.head_dim;
  int64_t widest = c_.intermediate_size;  // the dense MLPs' and GLM-4.5's shared experts' widths
  for (int64_t l = 0; l < c_.num_layers; ++l) widest = std::max(widest, c_.mlp_width(l));
  const kernels::RmsNormShape hidden = hidden_norm_shape(c_, n);
  const kernels::RmsNormShape q_norm = head_norm_shape(c_, n, c_.num_heads, QKV, QKV),
                              k_norm = head_norm_shape(c_, n, c_.num_kv_heads, QKV, QKV);
  for (int64_t i = 0; i < n; ++i)
    require(ids[i] >= 0 && ids[i] < c_.vocab_size, "generation: token id {} is outside the vocabulary", ids[i]);
  x_.resize(n * H), xn_.resize(n * H), qkv_.resize(n * QKV), attn_.resize(n * Q), h_.resize(n * H);
  gate_up_.resize(n * 2 * widest), act_.resize(n * widest);
  if (c_.sandwich_norms) branch_.resize(n * H);
  std::vector<float> rstd(n);
  std::vector<int32_t> positions(n);
  std::iota(positions.begin(), positions.end(), int32_t(position));
  backend_.embedding_forward(ids, n, P.weight(I.embed), H, x_.data());
  if (c_.scale_embeddings) backend_.scale_in_place(x_.data(), n * H, embedding_scale(c_));
  // Sandwich norms: residual += norm(branch), the branch normalised in place.
  auto add_normed_branch = [&](float* residual, float* branch, int norm_id) {
    backend_.rmsnorm_forward(hidden, branch, P.weight(norm_id), branch, rstd.data(), nullptr);
    backend_.add(residual, residual, branch, n * H);
  };
  for (int64_t l = 0; l < c_.num_layers; ++l) {
    const auto& p = I.layers[l];
    const kernels::RopeTable& rope = c_.rope_local_theta > 0 && c_.window_of(l) > 0 ? rope_local_ : rope_;
    kernels::AttentionShape as = attention_shape(c_, l, 1, n);
    as.ldq = as.ldk = as.ldv = QKV;  // q, k and v stay in the projection's output here
    backend_.rmsnorm_forward(hidden, x_.data(), P.weight(p.input_norm), xn_.data(), rstd.data(), nullptr);
    linear(xn_.data(), p.qkv_weight, n, H, QKV, qkv_.data(), 0.0f);
    if (p.qkv_bias >= 0) backend_.add_bias_rows(qkv_.data(), P.weight(p.qkv_bias), n, QKV);
    if (c_.qk_norm) {  // Qwen3, Gemma 3: each query and key head normalised before RoPE, in place
      qk_rstd_.resize(size_t(n * (c_.num_heads + c_.num_kv_heads)));
      backend_.rmsnorm_forward(q_norm, qkv_.data(), P.weight(p.q_norm), qkv_.data(), qk_rstd_.data(), nullptr);
      backend_.rmsnorm_forward(k_norm, qkv_.data() + Q, P.weight(p.k_norm), qkv_.data() + Q,
                               qk_rstd_.data() + n * c_.num_heads, nullptr);
    }
    backend_.rope_forward(qkv_.data(), QKV, positions.data(), n, c_.num_heads, D, rope);
    backend_.rope_forward(qkv_.data() + Q, QKV, positions.data(), n, c_.num_kv_heads, D, rope);
    float* kc = k_cache_[l].data();
    float* vc = v_cache_[l].data();
    for (int64_t t = 0; t < n; ++t) {
      std::memcpy(kc + (position + t) * KV, qkv_.data() + t * QKV + Q, sizeof(float) * KV);
      std::memcpy(vc + (position + t) * KV, qkv_.data() + t * QKV + Q + KV, sizeof(float) * KV);
    }
    backend_.cached_attention(as, qkv_.data(), n, position, kc, vc, attn_.data());
    std::memcpy(h_.data(), x_.data(), sizeof(float) * n * H);
    if (c_.sandwich_norms) {
      linear(attn_.data(), p.o_weight, n, Q, H, branch_.data(), 0.0f);
      add_normed_branch(h_.data(), branch_.data(), p.attn_out_norm);
    } else {
      linear(attn_.data(), p.o_weight, n, Q, H, h_.data(), 1.0f);
    }
    backend_.rmsnorm_forward(hidden, h_.data(), P.weight(p.post_norm), xn_.data(), rstd.data(), nullptr);
    const int64_t inter = c_.mlp_width(l);
    if (c_.sparse_layer(l)) {  // x = h + the experts' weighted outputs (experts.h), as in training
      routed_experts(l, n);
      if (inter == 0) continue;
    }
    // The dense MLP, or (GLM-4.5) the shared experts added to the routed ones' output.
    linear(xn_.data(), p.gate_up_weight, n, H, 2 * inter, gate_up_.data(), 0.0f);
    backend_.glu_forward(c_.mlp_activation, gate_up_.data(), n, inter, act_.data(), nullptr);
    if (!c_.sparse_layer(l)) std::memcpy(x_.data(), h_.data(), sizeof(float) * n * H);
    if (c_.sandwich_norms) {
      linear(act_.data(), p.down_weight, n, inter, H, branch_.data(), 0.0f);
      add_normed_branch(x_.data(), branch_.data(), p.mlp_out_norm);
    } else {
      linear(act_.data(), p.down_weight, n, inter, H, x_.data(), 1.0f);
    }
  }
  // Only the last position's logits are needed to continue.
  const float* last = x_.data() + (n - 1) * H;
  backend_.rmsnorm_forward(hidden_norm_shape(c_, 1), last, P.weight(I.final_norm), xn_.data(), rstd.data(), nullptr);
  logits_.resize(c_.vocab_size);
  linear(xn_.data(), I.lm_head, 1, H, c_.vocab_size, logits_.data(), 0.0f);
  if (c_.final_logit_softcap > 0) backend_.soft_cap(logits_.data(), c_.vocab_size, c_.final_logit_softcap);
  return logits_;
}

void Generator::routed_experts(int64_t layer, int64_t n) {
  const ExpertsShape s = experts_shape(c_, n);
  const int64_t R = s.routed(), H = s.hidden, I = s.inter;
  routed_f_.resize(size_t(n * s.experts + R + R * (H + 2 * I + I + H)));
  routed_i_.resize(size_t(R + s.experts + 1 + 2 * R));
  float* f = routed_f_.data();
  int32_t* i = routed_i_.data();
  RoutedActivations a;
  a.probs = f, f += n * s.experts;
  a.weight = f, f += R;
  a.in = f, f += R * H;
  a.gate_up = f, f += R * 2 * I;
  a.act = f, f += R * I;
  a.out = f;
  a.choice = i, i += R;
  a.expert_rows = i, i += s.experts + 1;
  a.row_slot = i, i += R;
  a.token_rows = i;
  const auto& P = decoder_.params();
  const auto& p = decoder_.ids().layers[size_t(layer)];
  ExpertsWeights w{P.weight(p.router), P.weight(p.experts_gate_up), P.weight(p.experts_down)};
  if (p.router_bias >= 0) w.router_bias = P.weight(p.router_bias);
  experts_forward(backend_, s, xn_.data(), nullptr, w, a, h_.data(), x_.data(), nullptr, nullptr);
}

int32_t Generator::sample(const SamplingOptions& o) {
  const int64_t V = int64_t(logits_.size());
  if (o.temperature <= 0.0) return int32_t(std::max_element(logits_.begin(), logits_.end()) - logits_.begin());
  std::vector<int32_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  // Equal logits (soft-capped ones saturate in float) keep id order, so top_k = 1 is greedy's argmax.
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits_[a] > logits_[b]; });
  int64_t keep = o.top_k > 0 ? std::min<int64_t>(o.top_k, V) : V;
  std::vector<double> probs(keep);
  const double top = logits_[order[0]];
  double sum = 0;
  for (int64_t i = 0; i < keep; ++i) sum += probs[i] = std::exp((logits_[order[i]] - top) / o.temperature);
  if (o.top_p < 1.0) {  // smallest prefix whose probability reaches top_p
    double cumulative = 0;
    for (int64_t i = 0; i < keep; ++i) {
      cumulative += probs[i] / sum;
      if (cumulative >= o.top_p) {
        keep = i + 1;
        break;
      }
    }
    probs.resize(keep);
  }
  std::discrete_distribution<int64_t> pick(probs.begin(), probs.end());
  return order[pick(rng_)];
}

std::vector<int32_t> Generator::generate(const std::vector<int32_t>& prompt, const SamplingOptions& o,
                                         const std::function<void(int32_t)>& on_token) {
  require(!prompt.empty(), "generation: the prompt is empty");
  rng_.seed(o.seed);
  std::vector<int32_t> out;
  feed(prompt.data(), int64_t(prompt.size()), 0);
  int64_t position = int64_t(prompt.size());
  for (int64_t i = 0; i < o.max_new_tokens && position < max_length_; ++i) {
    if (i < o.min_new_tokens)
      for (int64_t stop : o.stop_ids)
        if (stop >= 0 && stop < int64_t(logits_.size()))
          logits_[size_t(stop)] = -std::numeric_limits<float>::infinity();
    const int32_t next = sample(o);
    out.push_back(next);
    if (on_token) on_token(next);
    if (std::find(o.stop_ids.begin(), o.stop_ids.end(), next) != o.stop_ids.end()) break;
    if (position + 1 >= max_length_) break;
    feed(&next, 1, position);
    ++position;
  }
  return out;
}

}  // namespace keel::model
