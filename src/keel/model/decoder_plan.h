// What the decoder decides before step 1, private to model/ (decoder.cpp and decoder_plan.cpp):
// its parameters and adapter, ZeRO's gradient groups and weight gathers, and every buffer of the
// step with its lifetime (describe_memory). The one description drives both `keel plan`
// (decoder_memory_plan, decoder.h) and the arena the Decoder's constructor lays out, so the plan
// is exact by construction.
#pragma once
#include <cstdint>
#include <vector>

#include "keel/core/memory_plan.h"
#include "keel/kernels/shapes.h"
#include "keel/model/decoder.h"
#include "keel/model/lora.h"
#include "keel/model/params.h"

namespace keel::model {

// Rows of the fused LM head + loss chunk (Decoder::lm_head_loss): `requested` when set (the
// recipe's lm_head_chunk_tokens), else at least 512 rows, or more for a small vocabulary up to a
// 32 MiB fp32 logits chunk. Below ~512 rows the head's three products run well under the GEMM's
// speed and each chunk re-reads the whole [vocab, hidden] weight and its fp32 gradient (bench
// model, vocabulary 32000: 262 rows ran the step at 987 tokens/s, 512 rows at 1096; peak RSS
// +32 MiB, the logits sharing bytes with the backward pass's scratch).
// The chunks are made equal, so none is a small remainder.
int64_t lm_head_chunk_rows(int64_t vocab, int64_t tokens, int64_t requested);

// How the frozen matrices are held: the embedding and LM head, and the blocks' projections. Norms
// and biases always keep fp32 masters (the kernels read them in fp32).
struct BaseStorage {
  ParamStorage head = ParamStorage::Master, blocks = ParamStorage::Master;
};

// LoRA in bf16 keeps the frozen matrices in bf16 only (their fp32 masters would never be read);
// QLoRA stores the blocks' projections in 4 bits (bitsandbytes leaves the embedding and LM head be).
BaseStorage base_storage(const DecoderOptions& options, Precision precision);

// Declares the parameters in the order of the flat buffers (HF module order). Shared by the
// constructor and decoder_memory_plan so the plan sees exactly the store the decoder builds.
void declare_params(const ModelConfig& c, ParamStore& params, DecoderParamIds& ids, BaseStorage storage = {});

// QLoRA dequantizes whole rows, as many as fit in `budget` weights (at least one).
int64_t four_bit_tile_rows(int64_t rows, int64_t cols, int64_t budget);

// LoRA: the targeted modules and their A/B matrices in `adapter` (nothing without LoRA), and the
// trained copies of modules_to_save: the embedding first and the LM head last, so that the
// adapter's parameters, like the model's, become final in reverse order in the backward pass.
struct AdapterLayout {
  std::vector<LoraModule> modules;
  SavedModules saved;
  int embed = -1, lm_head = -1;
};
AdapterLayout declare_adapter(const ModelConfig& c, const DecoderParamIds& ids, const LoraSpec& spec,
                              ParamStore& adapter);

// ZeRO-2's gradient groups of the trainable store (GradGroup): each tensor's positions of the
// StepTimeline where the backward pass writes its gradient, runs of equal positions grouped. The
// model's tensors: the head's at the head, a block's in its backward, the embedding at the end
// (and at the head too when the LM head is the embedding). LoRA's: a module's A and B in its
// block's backward, the trained copies of the embedding and LM head where the originals' are.
std::vector<GradGroup> gradient_groups(const ModelConfig& c, const DecoderParamIds& ids, const ParamStore& trained,
                                       const AdapterLayout& adapter);

// ZeRO-3's gathers (WeightGather), sorted by position: the flat buffer holds the embedding, then
// each block's tensors, then the final norm and LM head, so each group is one contiguous span.
// bf16_copies: bf16 precision with trained masters (full fine-tuning), whose GEMMs read bf16 copies.
// local (ZeRO-3 with one rank, DecoderOptions::cast_per_position): the masters are whole and read
// where they are, so a gather carries only its bf16 casts, and a position without any has none.
std::vector<WeightGather> plan_weight_gathers(const ModelConfig& c, const DecoderParamIds& ids,
                                              const ParamStore& params, bool bf16_copies, bool resident,
                                              bool local = false);

// The weight gathers the options ask for: ZeRO-3's, one per position that reads weights; the
// resident ones of sharded masters (ZeRO-1/2 in bf16), one per position that reads weights first
// (the tied embedding twice: looked up in fp32, read by the LM head in bf16); or none.
std::vector<WeightGather> weight_gathers_for(const ModelConfig& c, const DecoderParamIds& ids, const ParamStore& params,
                                             Precision precision, const DecoderOptions& options);

// What the plan and the constructor both refuse, before anything is laid out.
void check_arguments(const ModelConfig& config, int64_t max_batch, int64_t max_seq, const DecoderOptions& options);

kernels::AttentionMatmul attention_matmul(Precision p);

// Plan ids of one block's intermediates (-1: not planned, e.g. bf16 copies in fp32 mode).
// Each block's buffers, declared once as (name, element type): BlockIds holds their plan ids
// (describe_memory plans each, -1 where the model has none), the decoder's BlockActivations their
// addresses, and binding one to the other follows from this list, so a buffer added to a block is
// one line here and its planning there.
//   xn1 rstd1 / xn2 rstd2: the normalised inputs of attention / the MLP and each row's rstd;
//   qk rstd_qk: q/k norms (the normalised, rotated q | k, and each head's rstd);
//   ao rstd_ao mo rstd_mo: sandwich norms (the attention's / MLP's output and rstd);
//   *_b: the bf16 copies the GEMMs read in bf16 mode;
//   lora_u: LoRA's scaling * x A^T of each of the block's modules;
//   experts_lora_u: LoRA on a sparse layer's experts, scaling * x A_e^T of each routed row, per module;
//   router_probs ... routed_out: a sparse layer's routing and routed rows (experts.h, RoutedActivations),
//     in place of gate_up and act.
#define KEEL_BLOCK_BUFFERS(X)                                                                                \
  X(xn1, float) X(rstd1, float) X(qkv, float) X(attn, float) X(lse, float) X(xmid, float) X(xn2, float)        \
  X(rstd2, float) X(gate_up, float) X(act, float) X(qk, float) X(rstd_qk, float) X(ao, float) X(rstd_ao, float) \
  X(mo, float) X(rstd_mo, float) X(xn1_b, bf16) X(attn_b, bf16) X(xn2_b, bf16) X(act_b, bf16) X(lora_u, float) \
  X(lora_u_b, bf16) X(router_probs, float) X(route_choice, int32_t) X(route_weight, float)                    \
  X(expert_rows, int32_t) X(row_slot, int32_t) X(token_rows, int32_t) X(routed_in, float)                      \
  X(routed_gate_up, float) X(routed_act, float) X(routed_out, float) X(routed_in_b, bf16) X(routed_act_b, bf16) \
  X(experts_lora_u, float)

struct BlockIds {
#define KEEL_BLOCK_ID(name, type) int name = -1;
  KEEL_BLOCK_BUFFERS(KEEL_BLOCK_ID)
#undef KEEL_BLOCK_ID
};

// What the plan needs to know of the adapter: its size, each block's module count, the widest
// module input (LoRA dropout's scratch), and every module's input and output width and its
// projection's (the widened copies of the products' operands).
struct AdapterShape {
  int64_t elements = 0, rank = 0, widest_input = 0;
  std::vector<int64_t> inputs, outputs, projection_outputs;
  bool dropout = false;
  std::vector<int64_t> modules_per_layer;
  std::vector<int64_t> expert_modules_per_layer;  // LoRA on the experts: 0, 1 or 2 per layer
  bool enabled() const { return rank > 0; }
  bool on_experts() const {
    for (int64_t n : expert_modules_per_layer)
      if (n > 0) return true;
    return false;
  }
};
AdapterShape adapter_shape(const ModelConfig& c, const std::vector<LoraModule>& modules, const ParamStore& adapter,
                           const LoraSpec& spec);

// Plan ids of every decoder buffer.
struct DecoderLayout {
  int weights = -1, grads = -1, weights_bf16 = -1, adam_m = -1, adam_v = -1;
  int lora_weights = -1, lora_grads = -1, lora_weights_bf16 = -1, lora_du = -1, lora_du_b = -1;
  int four_bit_packed = -1, four_bit_absmax = -1, four_bit_tile = -1, four_bit_tile_b = -1;
  int lora_dropped = -1, lora_dropped_b = -1, lora_dx = -1;
  int lora_held_input = -1, held_grad = -1;              // bf16 where products widen: hold_widened's copies
  int grad_shard = -1;                                   // ZeRO-2: this rank's summed gradients
  std::vector<int> grad_staging;                         // ZeRO-2: one per GradGroup
  std::vector<int> gathered, gathered_b;                 // ZeRO-3: one per WeightGather (fp32, and bf16 copies)
  std::vector<int> gathered_c;                           // ZeRO-3 under LoRA: the frozen bf16 matrices gathered
  std::vector<int> gathered_4bit, gathered_4bit_absmax;  // and QLoRA's 4-bit codes and absmax values
  int compute_only_shard = -1;                           // ZeRO-3 under LoRA: this rank's shard of them
  std::vector<int> x;                                    // [layers + 1] block inputs; x[layers] feeds the final norm
  std::vector<BlockIds> forward, backward;               // the same ids unless checkpointing
  int xn_final = -1, rstd_final = -1, xn_final_b = -1;
  int dx = -1, dh = -1, dnorm = -1, dtmp = -1, d_act = -1, d_gate_up = -1, d_attn = -1, d_qkv = -1, dy_b = -1;
  int d_qk = -1;  // q/k norms: the gradient of the normalised q | k
  int logits = -1, logits_b = -1;
  int attention_workspace = -1;
  // Mixture of experts: the backward pass's scratch (experts.h, ExpertsScratch; its act and
  // gate_up gradients are d_act and d_gate_up, planned wide enough for the routed rows), each
  // token's mask (1: not padding) for the load-balancing loss, its sums (RouterBalance: three
  // [experts] doubles) and the tokens each sparse layer sent each expert over a step ([sparse
  // layers, experts] doubles).
  int d_routed = -1, d_router = -1, d_slot = -1, token_mask = -1, router_balance = -1, expert_load = -1;
  int d_routed_b = -1, d_routed_gate_up_b = -1, d_router_b = -1;  // bf16: the products' copies
  int d_experts_lora = -1, d_experts_lora_b = -1;  // LoRA on the experts: du [routed, rank] (ExpertsScratch)
};

// Every buffer of a training step with its lifetime on the StepTimeline. This one description
// drives both `keel plan` (decoder_memory_plan) and the real arena (the constructor).
//
// Lifetimes: parameters, gradients and optimizer state live across steps. Block l's input lives
// from the forward of the block that writes it to block l's backward. Without checkpointing a
// block's intermediates live from its forward to its backward, so all blocks' are alive at the
// LM head; with checkpointing they are scratch of one position (the forward, then the
// recomputation in the backward), so every block that recomputes shares the same bytes (the
// others, past checkpointing_layers, keep theirs as without checkpointing). Gradient scratch lives
// through the backward pass and shares its bytes with the LM head's logits chunk, which is dead
// by then.
DecoderLayout describe_memory(const ModelConfig& c, const ParamStore& params, const AdapterShape& adapter,
                              const std::vector<GradGroup>& grad_groups, const std::vector<WeightGather>& gathers,
                              Precision precision, int64_t max_batch, int64_t max_seq, const DecoderOptions& options,
                              MemoryPlan& plan);

}  // namespace keel::model
