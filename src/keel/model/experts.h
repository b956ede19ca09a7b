// The mixture-of-experts MLP of a sparse layer (Qwen3-MoE; Shazeer et al. 2017, "Outrageously
// Large Neural Networks"; Fedus et al. 2021, "Switch Transformers"), as transformers computes it:
//   p[t] = softmax(x[t] W_r^T)                          router probabilities over the experts
//   S(t) = the top_k experts of p[t]                      (descending, as torch.topk)
//   w[t, j] = p[t, S_j]            (/ sum_j p[t, S_j] with norm_topk_prob)
//   y[t] = residual[t] + sum_j w[t, j] down_e(silu(gate_e x[t]) * up_e x[t]),   e = S_j(t)
// run as grouped products: a token's top_k (token, expert) pairs are its routed rows, and the rows
// of all tokens are sorted by expert (counting sort, by token within an expert), so each expert's
// rows are one contiguous block, and its gate/up and its down projections run over the block
// through the kernels Backend. There is no loop over tokens around a product, and an expert no
// token chose runs nothing. The routed rows of a micro-batch always number tokens x top_k, however
// routing falls, so each buffer below is planned once at that size (decoder_plan.cpp).
//
// A block of n rows runs as one product per set bit of n (its power-of-two pieces, largest first):
// the backend builds a plan per product shape on first use, which allocates (oneDNN primitives),
// and an expert's row count changes every step; powers of two bound the shapes to log2(tokens x
// top_k) + 1 per product, all prepared with the decoder (prepare_experts), so the steady step
// allocates nothing. Each piece is a full-speed GEMM on its rows; the weight gradients sum the
// pieces (beta 1 after the first).
//
// GLM-4.5 (ExpertsShape::sigmoid; Glm4MoeTopkRouter, DeepSeek-V3's "noaux_tc" routing) in place of
// the softmax top-k:
//   s[t] = sigmoid(x[t] W_r^T)                            the scores (kept in probs)
//   c[t, e] = s[t, e] + b[e]                              b: e_score_correction_bias, chooses only
//   G(t) = the topk_groups of the `groups` equal runs of experts whose two best c sum highest
//   S(t) = the top_k experts of c[t] among G(t)'s          (lower index first among equals)
//   w[t, j] = rsf * s[t, S_j] (/ (sum_j s[t, S_j] + 1e-20) with norm_topk_prob),  rsf: routed_scaling_factor
// b gets no gradient (the choice is not differentiable); d s flows through the weights alone, then
// d logit = d s * s (1 - s).
//
// The load-balancing loss (transformers' load_balancing_loss_func) over a micro-batch's sparse
// layers, counting only tokens that are not padding (its attention_mask):
//   f_e = (sum over layers and tokens of [e in S(t)]) / T,  P_e = (sum over layers and tokens of p[t, e]) / T
//   aux = experts * sum_e f_e P_e,   T = sparse layers x tokens
// Only P carries a gradient (top-k is not differentiable): d aux / d p[t, e] = experts f_e / T.
#pragma once
#include <cstdint>

#include "keel/kernels/backend.h"
#include "keel/model/config.h"
#include "keel/model/params.h"

namespace keel::model {

struct ExpertsShape {
  int64_t tokens = 0, hidden = 0, experts = 0, top_k = 0, inter = 0;  // inter: moe_intermediate_size
  bool norm_topk_prob = false;
  bool sigmoid = false;  // GLM-4.5's router (above); the three below only with it
  int64_t groups = 1, topk_groups = 1;
  float routed_scaling_factor = 1.0f;
  int64_t routed() const { return tokens * top_k; }  // rows through the experts
};
ExpertsShape experts_shape(const ModelConfig& c, int64_t tokens);

// A sparse layer's weights, as keel stores them: the router [experts, hidden], every expert's
// fused gate/up [experts * 2 inter, hidden] (expert e's gate rows, then its up rows: transformers'
// in-memory gate_up_proj [experts, 2 inter, hidden]) and down [experts * hidden, inter].
// In bf16 precision their bf16 copies are what the products read (null in fp32).
//
// QLoRA: the experts' two tensors may be 4-bit instead (gate_up_4bit / down_4bit; gate_up, down
// and their bf16 copies null), frozen. Each expert's slice is a whole number of 64-element blocks
// (hidden is a multiple of 64), and before each of that expert's products (forward, backward to the
// input, checkpointing's recomputation) it is dequantized whole into `tile` (fp32) or `tile_b`
// (bf16), which holds one expert's gate/up (2 inter x hidden elements, the larger of the two):
//   W_e[i] = four_bit_values(type)[code of element e * slice + i] * absmax[(e * slice + i) / 64]
// An expert no row reached is not dequantized. The router is never 4-bit.
//
// LoRA on the experts (lora.h; PEFT's target_parameters): gate_up and/or down may carry an adapter
// pair per expert, A [experts * rank, in] and B [experts * out, rank] (expert e's A_e and B_e one
// after another), and a product over expert e's rows x then adds, with u = scaling * x A_e^T,
//   y_e = x W_e^T + u B_e^T        (= x (W_e + scaling B_e A_e)^T, PEFT's folded weight),
// computed on the same row blocks, each a GEMM over the expert's rows (no loop over tokens): u for
// every row first (one scale over all routed rows), then each expert's u B_e^T added.
// 4-bit experts (QLoRA) take it alike: the adapter never touches the dequantized tile.
// In bf16 precision the adapter's products read fp32 operands wherever both exist in fp32 (u, B,
// the output gradients, du, A, the experts' act), and bf16 only with the routed input x, held in
// bf16 alone (u = x A_e^T and gate_up's dA = du^T x). Why: PEFT folds scaling B_e A_e into the
// expert's weight in fp32 and rounds the sum once for the product (its ParamWrapper, under
// autocast), so its adapter path sees no bf16 rounding of u, B or du; rounding them all, as
// keel's LoRA on a linear layer does (as PEFT's lora.Linear does), put keel's expert adapters at
// 7.8x torch bf16's own distance from fp32 (moe_reference.py --lora-experts, KEEL_MOE_SEED=2),
// against 1.5x so.
struct ExpertsLora {
  const float *a = nullptr, *b = nullptr;
  const bf16* a_b = nullptr;  // bf16: A's copy, for u = x A_e^T on the bf16 routed input (below)
  explicit operator bool() const { return a != nullptr; }
};
struct ExpertsWeights {
  const float *router = nullptr, *gate_up = nullptr, *down = nullptr;
  const float* router_bias = nullptr;  // sigmoid routing: e_score_correction_bias [experts], fp32
  const bf16 *router_b = nullptr, *gate_up_b = nullptr, *down_b = nullptr;
  FourBitWeight gate_up_4bit, down_4bit;
  float* tile = nullptr;
  bf16* tile_b = nullptr;
  ExpertsLora gate_up_lora, down_lora;
  int64_t lora_rank = 0;
  float lora_scaling = 0;
  bool in_bf16() const { return router_b != nullptr; }
};
// The elements of the dequantized-expert tile 4-bit experts need (one expert's gate/up).
inline int64_t experts_tile_elements(const ModelConfig& c) { return 2 * c.moe.intermediate_size * c.hidden_size; }
// Their gradients, each overwritten (beta 0: the step's first write) or added to (beta 1). The
// adapters' (A and B of gate_up's and down's, as ExpertsLora lays them out) are always added to:
// LoRA's gradients are zeroed once a step (design.md).
struct ExpertsGrads {
  float *router = nullptr, *gate_up = nullptr, *down = nullptr;
  float router_beta = 1, gate_up_beta = 1, down_beta = 1;
  float *gate_up_a = nullptr, *gate_up_b = nullptr, *down_a = nullptr, *down_b = nullptr;
};

// What the forward pass keeps for the backward pass (plan sizes in experts_buffer_elements).
struct RoutedActivations {
  float* probs = nullptr;          // [tokens, experts] the router's softmax (sigmoid: its scores)
  int32_t* choice = nullptr;       // [tokens, top_k] each slot's expert, by descending probability
  float* weight = nullptr;         // [tokens, top_k] each slot's weight w
  int32_t* expert_rows = nullptr;  // [experts + 1] expert e's routed rows are [expert_rows[e], expert_rows[e + 1])
  int32_t* row_slot = nullptr;     // [routed] the slot (t * top_k + j) each routed row serves
  int32_t* token_rows = nullptr;   // [routed] token t's rows at [t * top_k, (t + 1) * top_k), ascending (expert order)
  float* in = nullptr;             // [routed, hidden] each row's input x[t] (fp32 precision only)
  float* gate_up = nullptr;        // [routed, 2 inter]
  float* act = nullptr;            // [routed, inter]
  float* out = nullptr;            // [routed, hidden] each row's expert output, before its weight
  bf16* in_b = nullptr;            // bf16: the copies the products read (null in fp32)
  bf16* act_b = nullptr;
  float* lora_u_gate_up = nullptr;  // [routed, rank] LoRA on the experts: u = scaling x A_e^T of each row
  float* lora_u_down = nullptr;
};

// The backward pass's scratch, shared by every sparse layer.
struct ExpertsScratch {
  float* rows = nullptr;      // [routed, hidden] the rows' output gradients, then their input gradients
  float* act = nullptr;       // [routed, inter]
  float* gate_up = nullptr;   // [routed, 2 inter]
  float* logits = nullptr;    // [tokens, experts] the router's probability, then logit, gradients
  float* slot_grad = nullptr; // [tokens, top_k] d loss / d w
  bf16* rows_b = nullptr;     // bf16: rows', gate_up's and logits' gradients as the products read them
  bf16* gate_up_b = nullptr;
  bf16* logits_b = nullptr;
  float* lora_du = nullptr;   // [routed, rank] LoRA on the experts: scaling * d y_e B_e of each row
  bf16* lora_du_b = nullptr;  // bf16: its copy, for the products with the routed input (held in bf16 alone)
};

// The micro-batch's load-balancing sums over its sparse layers (counted where mask is 1), and the
// gradient coefficients they give each expert. Buffers of `experts` doubles each, planned.
struct RouterBalance {
  double* tokens = nullptr;  // sum of [e in S(t)]
  double* probs = nullptr;   // sum of p[t, e]
  double* grad = nullptr;    // d (weight * aux) / d p[t, e] for a token not masked out
  double rows = 0;           // T: the masked tokens once per sparse layer (set by the caller)
  void clear(int64_t experts);
  // aux, and `grad` for a loss that adds weight * aux (weight 0: no gradient).
  double finish(int64_t experts, double weight);
  // The three sums laid out one after another in `sums` (3 x experts doubles: the plan's buffer).
  static RouterBalance over(double* sums, int64_t experts) { return {sums, sums + experts, sums + 2 * experts}; }
};

// Routes x [tokens, hidden] and runs the experts: y[t] = residual[t] + the weighted sum of its
// experts' outputs (summed in ascending expert order, as transformers' index_add_ loop adds them).
// y null: only the intermediates (gradient checkpointing's recomputation). balance (may be null)
// gathers the layer's load-balancing sums over the tokens whose mask is 1 (null mask: all).
// In bf16 (w.in_bf16()) x_b is x's bf16 copy, which the products read, as every GEMM input in bf16
// precision: bf16 operands, fp32 accumulation and outputs; softmax, top-k and weights in fp32.
void experts_forward(kernels::Backend& backend, const ExpertsShape& s, const float* x, const bf16* x_b,
                     const ExpertsWeights& w, const RoutedActivations& a, const float* residual, float* y,
                     const float* mask, RouterBalance* balance);

// From dy [tokens, hidden] (the gradient of y): dx [tokens, hidden] (overwritten, or added to with
// add_to_dx: GLM-4.5's shared experts wrote theirs first) and the weights' gradients, the router's
// included, with the load-balancing loss's part (balance->grad, weighted by mask; balance null:
// none). In bf16 only x_b is read of the input (x may be stale).
void experts_backward(kernels::Backend& backend, const ExpertsShape& s, const float* x, const bf16* x_b,
                      const ExpertsWeights& w, const RoutedActivations& a, const float* dy,
                      const ExpertsScratch& scratch, const RouterBalance* balance, const float* mask,
                      const ExpertsGrads& g, float* dx, bool add_to_dx = false);

// Sigmoid routing's expert groups are chosen with a set on the stack: n_group is at most this.
constexpr int64_t kMaxExpertGroups = 1024;

// Builds the backend's plans of every product shape experts_forward and experts_backward can meet
// for micro-batches of up to `tokens` tokens (lora_rank > 0: the adapters' products too).
void prepare_experts(kernels::Backend& backend, const ExpertsShape& s, bool bf16_inputs, int64_t lora_rank = 0);

// Tokens routed to each expert in a routed layer (expert_rows' differences): for the load report.
inline int64_t expert_tokens(const RoutedActivations& a, int64_t expert) {
  return int64_t(a.expert_rows[expert + 1]) - a.expert_rows[expert];
}

}  // namespace keel::model
