// The decoder's mixture-of-experts layers (experts.h does the routing and the products): the
// weights, activations and scratch of a sparse layer handed over from the decoder's buffers, the
// padding mask the load-balancing loss leaves out, and the expert load reported per step.
#include <algorithm>

#include "keel/model/decoder.h"
#include "keel/model/decoder_buffers.h"
#include "keel/model/experts.h"

namespace keel::model {

namespace {

// bf16 precision: the products read the weights' bf16 copies (under LoRA the frozen experts are
// held in bf16 only, and weight() is null: the bf16 products never read it). QLoRA: the experts
// are 4-bit, dequantized an expert at a time into the decoder's 4-bit tile (experts.h).
ExpertsWeights experts_weights(const ParamStore& P, const LayerParamIds& p, bool bf, const auto& buffers) {
  ExpertsWeights w{P.weight(p.router), P.weight(p.experts_gate_up), P.weight(p.experts_down)};
  if (p.router_bias >= 0) w.router_bias = P.weight(p.router_bias);
  if (bf) {
    w.router_b = P.weight_bf16(p.router);
    w.gate_up_b = P.weight_bf16(p.experts_gate_up);
    w.down_b = P.weight_bf16(p.experts_down);
  }
  w.gate_up_4bit = P.four_bit(p.experts_gate_up);
  w.down_4bit = P.four_bit(p.experts_down);
  w.tile = buffers.four_bit_tile;
  w.tile_b = buffers.four_bit_tile_b;
  return w;
}

RoutedActivations routed_activations(const auto& a) {
  return {a.router_probs, a.route_choice,   a.route_weight, a.expert_rows, a.row_slot,   a.token_rows,
          a.routed_in,    a.routed_gate_up, a.routed_act,   a.routed_out,  a.routed_in_b, a.routed_act_b};
}

}  // namespace

const LoraModule* Decoder::experts_adapter(int64_t layer, LinearSlot slot) const {
  if (lora_.empty()) return nullptr;
  const auto& modules = lora_by_slot_[size_t(layer)][size_t(slot)];
  return modules.empty() ? nullptr : &lora_[size_t(modules.front())];
}

// LoRA on the layer's experts (experts.h: ExpertsLora), when lora_target names them: the adapter's
// matrices into the weights, each module's u (the block's experts_lora_u, [routed, rank] per
// module) into the routed activations.
void Decoder::attach_experts_adapters(int64_t layer, int64_t tokens, const BlockActivations& a, ExpertsWeights& w,
                                      RoutedActivations& routed) const {
  const int64_t r = options_.lora.rank, R = tokens * config_.moe.experts_per_token;
  const bool bf = precision_ == Precision::BF16;
  for (LinearSlot slot : {LinearSlot::ExpertsGateUp, LinearSlot::ExpertsDown}) {
    const LoraModule* m = experts_adapter(layer, slot);
    if (!m) continue;
    const ExpertsLora lora{adapter_.weight(m->a), adapter_.weight(m->b), bf ? adapter_.weight_bf16(m->a) : nullptr};
    float* u = a.experts_lora_u + m->index_in_layer * R * r;
    if (slot == LinearSlot::ExpertsGateUp) {
      w.gate_up_lora = lora;
      routed.lora_u_gate_up = u;
    } else {
      w.down_lora = lora;
      routed.lora_u_down = u;
    }
    w.lora_rank = r;
    w.lora_scaling = float(options_.lora.scaling());
  }
}

void Decoder::token_mask(const MicroBatch& mb) {
  float* mask = buf_->token_mask;
  for (int64_t r = 0; r < mb.batch; ++r) {
    const int32_t* doc = mb.documents ? mb.documents + r * mb.seq : nullptr;
    bool padding = false;
    for (int64_t t = 0; t < mb.seq; ++t) {
      // The loaders give padding the id one past the next document's (data/shard_loader.cpp):
      // a row's tokens start at document 0 and step by at most one.
      if (doc && !padding) padding = t == 0 ? doc[0] != 0 : doc[t] - doc[t - 1] >= 2;
      mask[r * mb.seq + t] = padding ? 0.0f : 1.0f;
    }
  }
}

void Decoder::experts_forward(const MicroBatch& mb, int64_t l, const BlockActivations& a, float* x_out) {
  auto& b = *buf_;
  const int64_t N = mb.batch * mb.seq;
  // The load-balancing sums and the expert load count the forward pass once (not its recomputation).
  RouterBalance balance = RouterBalance::over(b.router_balance, config_.moe.experts);
  RoutedActivations routed = routed_activations(a);
  const bool bf = precision_ == Precision::BF16;
  ExpertsWeights w = experts_weights(params_, ids_.layers[size_t(l)], bf, b);
  attach_experts_adapters(l, N, a, w, routed);
  model::experts_forward(backend_, experts_shape(config_, N), a.xn2, a.xn2_b, w, routed, a.xmid, x_out, b.token_mask,
                         x_out && config_.has_aux_loss() ? &balance : nullptr);
  if (!x_out) return;
  int64_t sparse = 0;  // this layer's row of the expert load
  for (int64_t i = 0; i < l; ++i) sparse += config_.sparse_layer(i);
  double* load = b.expert_load + sparse * config_.moe.experts;
  for (int64_t e = 0; e < config_.moe.experts; ++e) load[e] += double(expert_tokens(routed, e));
}

void Decoder::experts_backward(const MicroBatch& mb, int64_t l, const BlockActivations& a, const float* dy,
                               float* dx, bool add_to_dx) {
  auto& b = *buf_;
  auto& P = params_;
  const LayerParamIds& p = ids_.layers[size_t(l)];
  ExpertsGrads g;
  if (!P.frozen()) {
    g.router = P.grad(p.router);
    g.gate_up = P.grad(p.experts_gate_up);
    g.down = P.grad(p.experts_down);
    g.down_beta = P.first_gradient_write(p.experts_down) ? 0.0f : 1.0f;
    g.gate_up_beta = P.first_gradient_write(p.experts_gate_up) ? 0.0f : 1.0f;
    g.router_beta = P.first_gradient_write(p.router) ? 0.0f : 1.0f;
  }
  const LoraModule* gate_up = experts_adapter(l, LinearSlot::ExpertsGateUp);
  const LoraModule* down = experts_adapter(l, LinearSlot::ExpertsDown);
  if (gate_up) g.gate_up_a = adapter_.grad(gate_up->a), g.gate_up_b = adapter_.grad(gate_up->b);
  if (down) g.down_a = adapter_.grad(down->a), g.down_b = adapter_.grad(down->b);
  const RouterBalance balance = RouterBalance::over(b.router_balance, config_.moe.experts);
  const ExpertsScratch scratch{b.d_routed, b.d_act,      b.d_gate_up,          b.d_router,       b.d_slot,
                               b.d_routed_b, b.d_routed_gate_up_b, b.d_router_b, b.d_experts_lora, b.d_experts_lora_b};
  const int64_t N = mb.batch * mb.seq;
  ExpertsWeights w = experts_weights(P, p, precision_ == Precision::BF16, b);
  RoutedActivations routed = routed_activations(a);
  attach_experts_adapters(l, N, a, w, routed);
  // In bf16 a.xn2 holds another block's data by now: the products read a.xn2_b.
  model::experts_backward(backend_, experts_shape(config_, N), a.xn2, a.xn2_b, w, routed, dy, scratch,
                          config_.has_aux_loss() ? &balance : nullptr, b.token_mask, g, dx, add_to_dx);
  // The adapters' gradients are final, in reverse parameter order (GradReadyHook).
  for (const LoraModule* m : {down, gate_up})
    if (m) grad_ready(m->b), grad_ready(m->a);
}

std::span<const double> Decoder::expert_load() const {
  if (!buf_->expert_load) return {};
  int64_t sparse = 0;
  for (int64_t l = 0; l < config_.num_layers; ++l) sparse += config_.sparse_layer(l);
  return {buf_->expert_load, size_t(sparse * config_.moe.experts)};
}

void Decoder::clear_expert_load() {
  const auto load = expert_load();
  std::fill_n(buf_->expert_load, load.size(), 0.0);
}

}  // namespace keel::model
