// The decoder's buffers as its implementation files see them (decoder.cpp, decoder_experts.cpp):
// one block's activations (KEEL_BLOCK_BUFFERS) and the step's buffers, pointers into the arena the
// memory plan (decoder_plan.h) lays out. Private to model/: nothing outside includes it.
#pragma once
#include <vector>

#include "keel/model/decoder.h"
#include "keel/model/decoder_plan.h"

namespace keel::model {

// A block's buffers (KEEL_BLOCK_BUFFERS, decoder_plan.h): null where the model or the precision
// has none (q/k norms, sandwich norms, bf16 copies, LoRA's [modules of the block][tokens, rank]).
struct Decoder::BlockActivations {
#define KEEL_BLOCK_POINTER(name, type) type* name = nullptr;
  KEEL_BLOCK_BUFFERS(KEEL_BLOCK_POINTER)
#undef KEEL_BLOCK_POINTER
};

struct Decoder::Buffers {
  std::vector<float*> x;  // block inputs; x[layers] is the final norm's input
  std::vector<BlockActivations> forward, backward;
  float *xn_final, *rstd_final;
  bf16* xn_final_b;
  // Gradient scratch, reused by every layer in turn.
  float *dx, *dh, *dnorm, *dtmp, *d_act, *d_gate_up, *d_attn, *d_qkv, *d_qk, *logits;
  bf16 *dy_b, *logits_b;
  float* lora_du;  // LoRA: scaling * dy B of one module [tokens, rank]
  bf16* lora_du_b;
  float *lora_dropped, *lora_dx;  // LoRA dropout: a module's dropped-out input; its input gradient before the mask
  bf16* lora_dropped_b;
  float *lora_held_input, *held_grad;  // bf16 where products widen (null otherwise)
  int64_t lora_held_input_elements, held_grad_elements;
  float* four_bit_tile;  // QLoRA: dequantized rows of a 4-bit weight (fp32 or bf16, by precision)
  bf16* four_bit_tile_b;
  int64_t four_bit_tile_elements;
  void* attention_workspace;
  size_t attention_workspace_bytes;
  // Mixture of experts (DecoderLayout says what each holds).
  float *d_routed, *d_router, *d_slot, *token_mask;
  bf16 *d_routed_b, *d_routed_gate_up_b, *d_router_b;
  float* d_experts_lora;  // LoRA on the experts: du of the routed rows (ExpertsScratch::lora_du)
  bf16* d_experts_lora_b;
  double *router_balance, *expert_load;

  DecoderLayout layout;
  // MemoryPlanning::PerTensor: the plan ids of the buffers allocated per call, and where each
  // plan id lives while a call runs (null outside one).
  std::vector<int> transient_ids;
  std::vector<std::byte*> at;

  // Points every activation and scratch pointer at at[plan id] (null for -1 ids).
  void bind(const MemoryPlan& plan) {
    const DecoderLayout& d = layout;
    auto f32 = [&](int id) { return id < 0 ? nullptr : reinterpret_cast<float*>(at[size_t(id)]); };
    auto b16 = [&](int id) { return id < 0 ? nullptr : reinterpret_cast<bf16*>(at[size_t(id)]); };
    auto block = [&](const BlockIds& ids) {
      BlockActivations a;
#define KEEL_BLOCK_BIND(name, type) a.name = ids.name < 0 ? nullptr : reinterpret_cast<type*>(at[size_t(ids.name)]);
      KEEL_BLOCK_BUFFERS(KEEL_BLOCK_BIND)
#undef KEEL_BLOCK_BIND
      return a;
    };
    x.resize(d.x.size());
    forward.resize(d.forward.size());
    backward.resize(d.backward.size());
    for (size_t i = 0; i < d.x.size(); ++i) x[i] = f32(d.x[i]);
    for (size_t i = 0; i < d.forward.size(); ++i) forward[i] = block(d.forward[i]);
    for (size_t i = 0; i < d.backward.size(); ++i) backward[i] = block(d.backward[i]);
    xn_final = f32(d.xn_final);
    rstd_final = f32(d.rstd_final);
    xn_final_b = b16(d.xn_final_b);
    dx = f32(d.dx);
    dh = f32(d.dh);
    dnorm = f32(d.dnorm);
    dtmp = f32(d.dtmp);
    d_act = f32(d.d_act);
    d_gate_up = f32(d.d_gate_up);
    d_attn = f32(d.d_attn);
    d_qkv = f32(d.d_qkv);
    d_qk = f32(d.d_qk);
    dy_b = b16(d.dy_b);
    lora_du = f32(d.lora_du);
    lora_du_b = b16(d.lora_du_b);
    lora_dropped = f32(d.lora_dropped);
    lora_dropped_b = b16(d.lora_dropped_b);
    lora_dx = f32(d.lora_dx);
    lora_held_input = f32(d.lora_held_input);
    held_grad = f32(d.held_grad);
    auto elements = [&](int id) { return id < 0 ? int64_t(0) : int64_t(plan.buffer(id).bytes / sizeof(float)); };
    lora_held_input_elements = elements(d.lora_held_input);
    held_grad_elements = elements(d.held_grad);
    four_bit_tile = f32(d.four_bit_tile);
    four_bit_tile_b = b16(d.four_bit_tile_b);
    const int tile = d.four_bit_tile >= 0 ? d.four_bit_tile : d.four_bit_tile_b;
    four_bit_tile_elements =
        tile < 0 ? 0 : int64_t(plan.buffer(tile).bytes / (d.four_bit_tile >= 0 ? sizeof(float) : sizeof(bf16)));
    attention_workspace = at[size_t(d.attention_workspace)];
    attention_workspace_bytes = plan.buffer(d.attention_workspace).bytes;
    logits = f32(d.logits);
    logits_b = b16(d.logits_b);
    d_routed = f32(d.d_routed);
    d_router = f32(d.d_router);
    d_slot = f32(d.d_slot);
    d_routed_b = b16(d.d_routed_b);
    d_routed_gate_up_b = b16(d.d_routed_gate_up_b);
    d_router_b = b16(d.d_router_b);
    d_experts_lora = f32(d.d_experts_lora);
    d_experts_lora_b = b16(d.d_experts_lora_b);
    token_mask = f32(d.token_mask);
    auto f64 = [&](int id) { return id < 0 ? nullptr : reinterpret_cast<double*>(at[size_t(id)]); };
    router_balance = f64(d.router_balance);
    expert_load = f64(d.expert_load);
  }
};

}  // namespace keel::model
