// The decoder-only transformer shared by the Llama, Qwen2, Qwen3, Mistral, Gemma 2/3 and GLM-4
// families (docs/models.md):
//   x = embed(ids); for each layer: x += o(attn(rope(qkv(rmsnorm(x))))); x += down(glu(gate_up(rmsnorm(x))))
//   loss = cross_entropy(lm_head(rmsnorm(x)), next-token labels)
// with hand-written forward and backward passes. Internally q/k/v and gate/up are always fused
// (one GEMM each); family-specific tensor names and fusions are handled by hf_weights.h. Qwen3
// normalises each query and key head before RoPE (q_norm, k_norm); Mistral's layers attend
// through a sliding window; Gemma adds a norm on each residual branch's output ("sandwich"),
// scales embeddings by sqrt(hidden), uses GeGLU, (1 + w) norms, and soft-caps scores and logits.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "keel/core/memory_plan.h"
#include "keel/kernels/backend.h"
#include "keel/model/config.h"
#include "keel/model/lora.h"
#include "keel/model/params.h"

namespace keel::model {

enum class Precision : uint8_t {
  F32,   // everything in fp32: exact, for tests
  BF16,  // fp32 master weights/grads/optimizer state; bf16 weight copies and GEMM inputs, fp32 accumulation
};

struct LayerParamIds {
  int input_norm = -1, qkv_weight = -1, qkv_bias = -1, q_norm = -1, k_norm = -1, o_weight = -1;
  int attn_out_norm = -1;  // sandwich norms (Gemma): on the attention's output
  int post_norm = -1, gate_up_weight = -1, down_weight = -1;  // post_norm: the MLP's input norm
  int mlp_out_norm = -1;   // sandwich norms: on the MLP's output
  // A sparse layer (mixture of experts, model/experts.h) has these in place of gate_up and down:
  // the router [experts, hidden] and every expert's gate/up [experts * 2 inter, hidden] and down
  // [experts * hidden, inter].
  int router = -1, experts_gate_up = -1, experts_down = -1;
  // GLM-4.5: the router's e_score_correction_bias [experts] (a buffer transformers never trains: it
  // gets no gradient, and AdamW without weight decay leaves it as loaded), and the shared experts,
  // which are gate_up and down above at width moe.shared_intermediate_size (ModelConfig::mlp_width).
  int router_bias = -1;
};

struct DecoderParamIds {
  int embed = -1, final_norm = -1, lm_head = -1;  // lm_head == embed when embeddings are tied
  std::vector<LayerParamIds> layers;
};

// One micro-batch laid out as [batch, seq] rows.
struct MicroBatch {
  int64_t batch = 0, seq = 0;
  const int32_t* input_ids = nullptr;  // [batch*seq], each < vocab_size
  const int32_t* targets = nullptr;    // [batch*seq] id of the NEXT token to predict, or -100
  const int32_t* positions = nullptr;  // [batch*seq] rotary positions, each < seq
  const int32_t* segments = nullptr;   // [batch*seq] document ids for packed rows, or nullptr
  // LoRA dropout's masks are drawn from this key (core/dropout_mask.h), a function of the step and
  // the micro-batch's place in it, so resumes and recomputations draw the same; 0: no dropout
  // (evaluation, generation).
  uint64_t dropout_key = 0;
  // [batch*seq] each token's document id as the data loaders write it (data/shard_loader.h), packed
  // or not: padding follows a jump of two in them. Mixture-of-experts models leave padding out of
  // the load-balancing loss, as transformers' attention_mask does; null: every token counts.
  const int32_t* documents = nullptr;
};

// Where the buffers of a forward/backward pass live.
enum class MemoryPlanning : uint8_t {
  // Every buffer in one arena laid out before step 1, buffers of disjoint lifetimes sharing bytes.
  Planned,
  // The baseline a general-purpose allocator gives: only what lives across steps (weights, their
  // bf16 copies, gradients, optimizer state) in the arena; every activation and scratch buffer is
  // malloc'ed at the start of each forward_backward / forward_loss / logits_at call and freed at
  // its end, none sharing bytes with another. Same results bit for bit.
  PerTensor,
};

struct DecoderOptions {
  // Keep only each block's input in the forward pass and recompute the block inside the backward
  // pass (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"): activation memory
  // drops from every block's intermediates to one block's, for one more forward pass per step.
  bool gradient_checkpointing = false;
  // Plan AdamW's first and second moments in the arena (a decoder that will be trained);
  // evaluation-only decoders leave them out.
  bool optimizer_state = false;
  // The largest arena allowed in bytes (the recipe's memory_pool_size); 0 = no cap. A plan above
  // it fails at construction with the breakdown, before anything is allocated.
  size_t memory_cap_bytes = 0;
  MemoryPlanning memory_planning = MemoryPlanning::Planned;
  // ZeRO-1 (Rajbhandari et al. 2020, stage 1): the optimizer state is split over
  // `optimizer_shards` data-parallel ranks (keel::shard_ranges of the flat parameter buffer) and
  // this decoder plans and holds shard `optimizer_shard` of it.
  int optimizer_shards = 1, optimizer_shard = 0;
  // ZeRO-2 (stage 2): the gradients are sharded too. No whole gradient buffer is planned: the
  // backward pass writes each group of gradients it finishes together (GradGroup) into a staging
  // buffer that lives only until that group has been reduce-scattered, and this decoder keeps the
  // summed gradients of its optimizer shard. Needs optimizer_shards > 1.
  bool shard_gradients = false;
  // ZeRO-3 (stage 3): the weights are sharded too. This decoder holds the fp32 masters of its
  // optimizer shard only; each position of the step reads weights gathered from every rank into a
  // buffer planned for that position (WeightGather), through hooks a communicator drives
  // (set_weight_gather_hooks). Needs shard_gradients. Under LoRA the frozen base weights are the
  // ones sharded and gathered (WeightGather), 4-bit ones (QLoRA) too.
  bool shard_weights = false;
  // ZeRO-1/2 in bf16 full fine-tuning, as DeepSpeed runs them (and the ZeRO paper counts them: the
  // fp32 master is optimizer state): this decoder holds the fp32 masters of its optimizer shard
  // only, and what the step reads (the GEMMs' bf16 matrices; norms, biases and the embedding's
  // lookup copy in fp32) is whole and resident, gathered from every rank's shard after each
  // optimizer step (refresh_resident_weights; WeightGather, one per position that first reads
  // them). In fp32 the masters are the compute weights and stay whole. Needs optimizer_shards > 1,
  // bf16, no LoRA; not with shard_weights.
  bool shard_masters = false;
  // Where the step computes and its arena lives; nullptr: kernels::default_backend() (the CPU).
  kernels::Backend* backend = nullptr;
  // LoRA (lora.h): the base weights are frozen (no gradients, no optimizer state, no weight-gradient
  // GEMMs) and the adapter's matrices are what trains. rank 0: full fine-tuning.
  LoraSpec lora;
  // QLoRA (Dettmers et al. 2023): the blocks' frozen matrices stored in 4 bits, NF4 or FP4
  // (core/four_bit.h), and dequantized a tile of rows at a time inside their GEMMs, in the
  // precision's compute type; double quantization rounds each HF tensor's absmax values through
  // bitsandbytes' 8-bit scheme (kept dequantized: the same numbers, 0.05 byte per weight more).
  // A checkpoint saved in 4 bits by bitsandbytes (ModelConfig::saved_four_bit) is read as it is.
  // Needs LoRA.
  bool four_bit_base = false;
  FourBitType four_bit_type = FourBitType::Nf4;
  bool double_quantization = true;
  // The most 4-bit weights dequantized at once (a tile of whole rows, planned as scratch); 8 MiB of
  // bf16 by default, small in tests to run the tiling.
  int64_t four_bit_tile_elements = int64_t(1) << 22;
  // Tokens per chunk of the fused LM head and loss: the logits of that many tokens ([chunk, vocab]
  // in fp32, and bf16) are the step's largest scratch buffer. 0: keel's choice
  // (lm_head_chunk_rows in decoder_plan.cpp: at least 512, for the head's GEMMs to run at speed).
  int64_t lm_head_chunk_tokens = 0;
  // (Kept after the fields tests set in order.) With gradient_checkpointing, how many blocks
  // recompute, from the first (Megatron-LM's --recompute-num-layers); the others keep their
  // intermediates as without checkpointing. Memory the plan has to spare buys fewer recomputed
  // forward passes. 0: keel's choice (resolve_checkpointing_layers): every block, or every block
  // but the last where keeping the last one's intermediates takes no more memory.
  int64_t checkpointing_layers = 0;
  // ZeRO-3 with one rank (bf16 full fine-tuning): nothing to shard, but no whole bf16 copy of the
  // weights either. Each position's GEMM matrices are cast from the masters into a buffer planned
  // for that position just before it reads them (ZeRO-3's gather buffers, filled locally: no
  // hooks), so the bf16 weights cost two positions' worth instead of the model's, for one cast
  // pass per position per step. The masters, gradients and moments stay whole.
  bool cast_per_position = false;
  bool recomputes(int64_t layer) const {
    return gradient_checkpointing && (checkpointing_layers == 0 || layer < checkpointing_layers);
  }
};

inline kernels::Backend& backend_of(const DecoderOptions& options) {
  return options.backend ? *options.backend : kernels::default_backend();
}

// Positions on the abstract timeline of one training step that the decoder's memory plan uses:
// 0 holds what lives across steps, then one position per block forward, the LM head (final norm,
// logits and loss, and the final norm's backward), one per block backward (last block first), and
// the optimizer step. Callers adding their own buffers (gradient buckets) use the same positions.
struct StepTimeline {
  int32_t layers = 0;
  int32_t forward(int64_t layer) const { return int32_t(1 + layer); }
  int32_t head() const { return 1 + layers; }
  int32_t backward(int64_t layer) const { return int32_t(head() + layers - layer); }
  int32_t optimizer() const { return head() + layers + 1; }
  int32_t last() const { return optimizer(); }
};

// ZeRO-2: trainable tensors whose gradients the backward pass writes at the same positions of the
// StepTimeline, contiguous in the flat buffer: the LM head and final norm (at the head), one block
// (its backward), the embedding (the end of the backward pass; from the head on when tied to the
// LM head). Their staging buffer lives from first_written to last_written + 1: the reduction of a
// group may run during the next position and must be complete before the one after.
struct GradGroup {
  int first_param = 0, last_param = 0;  // [first, last] of Decoder::trainable()
  FlatRange range;                      // their span of the flat buffer (the staging's layout)
  int32_t first_written = 0, last_written = 0;
  float* staging = nullptr;  // range.size() floats (set by the decoder; null in a plan)
};

// ZeRO-3: weights one position of the step reads, gathered from every rank's shard of the masters
// into a buffer planned for that position and the one before it: the gather starts as the step
// enters the previous position, so it runs while that position computes (the first position's
// gathers start and are waited for at once). The groups are the embedding, each block, and the
// final norm with the LM head. A block is gathered twice, for its forward and for its backward:
// keeping its weights in between would hold every block's at the head, the replicated footprint
// (with gradient checkpointing the backward's gather also serves the recomputation). The head's
// are gathered once (its forward and backward run at one position), the embedding for the first
// position (and again at the head when the LM head is the embedding); its backward (a scatter into
// the gradient) reads no weights.
//
// Under LoRA the frozen base is what is sharded (the adapter is small and stays whole: its
// gradients and moments are sharded as in ZeRO-2). Its matrices are compute-only tensors
// (ParamStore): bf16 ones in bf16 precision, gathered as bf16, half the bytes of fp32, into a
// buffer of their own; under QLoRA the blocks' projections as their 4-bit codes and absmax values
// (about an eighth of fp32's bytes). The fp32 span holds the norms and biases.
//
// What travels is what the position reads: in fp32 precision every master in fp32; in bf16 (full
// fine-tuning) the GEMMs' matrices as bf16 only, each rank casting its part of the masters before
// the gather (the same bits as casting after it, half the traffic and the buffer), and only the
// tensors read in fp32 (norms, biases, the embedding at its lookup) in fp32.
//
// Sharded masters (ZeRO-1/2 in bf16, DecoderOptions::shard_masters) use the same gathers less the
// backward pass's repeats, into buffers that stay: the whole weights the step reads, refreshed
// once per optimizer step, each gather waited for where a call first reads it.
struct WeightGather {
  int first_param = 0, last_param = 0;  // [first, last] of Decoder::params()
  FlatRange range;                      // their masters' span of the flat buffer
  int32_t position = 0;                 // where the step reads them
  // The masters read in fp32, in runs of consecutive tensors: each run's span of the flat buffer
  // and where it starts in `weights` (runs back to back, each on 16 elements).
  struct Run {
    FlatRange range;
    int64_t at = 0;
  };
  std::vector<Run> fp32_runs;
  int64_t fp32_elements = 0;
  float* weights = nullptr;  // fp32_elements floats (set by the decoder; null in a plan)
  // bf16 full fine-tuning: `range` up to whole 16-element units, as bf16 (a tensor at
  // Param::offset - range.begin); empty otherwise.
  FlatRange bf16_span;
  bf16* weights_bf16 = nullptr;
  // Their compute-only bf16 tensors' span (Param::offset of Bf16 tensors, up to the store's
  // alignment: every part a whole number of 4-byte words), gathered as they are; empty without.
  FlatRange compute_only;
  bf16* compute_only_weights = nullptr;
  // QLoRA: their 4-bit tensors' span (Param::offset of FourBit tensors, up to kFourBitShardAlign),
  // gathered as codes (span / 2 bytes) and absmax values (span / 64 floats); empty without.
  FlatRange four_bit;
  uint8_t* four_bit_packed = nullptr;
  float* four_bit_absmax = nullptr;
};

// The memory plan of a decoder with these settings: every buffer the constructor will take from
// its arena, with sizes and lifetimes, computed without allocating any of it (so `keel plan` can
// plan a 9B model on a laptop). The constructor allocates from exactly this description.
MemoryPlan decoder_memory_plan(const ModelConfig& config, Precision precision, int64_t max_batch, int64_t max_seq,
                               const DecoderOptions& options);

// `options` with checkpointing_layers decided when it is 0 and checkpointing is on: every block
// but the last where that plans no more memory than every block (the last block's backward comes
// first, right after the LM head; recomputing it there holds its fp32 GEMM inputs beside the
// gradient scratch, which its kept intermediates can cost less than), else every block.
DecoderOptions resolve_checkpointing_layers(const ModelConfig& config, Precision precision, int64_t max_batch,
                                            int64_t max_seq, DecoderOptions options);

// Layer `layer`'s attention for micro-batches of batch x seq, as the decoder runs it: heads, the
// scores' scale, its sliding window and soft cap; q/k/v row strides of the fused projection (q and
// k from their own [tokens, q | k] buffer with q/k norms).
kernels::AttentionShape attention_shape(const ModelConfig& config, int64_t layer, int64_t batch, int64_t seq);
// The model's RMSNorm (its eps, Gemma's weight offset) on `rows` rows of the hidden state.
kernels::RmsNormShape hidden_norm_shape(const ModelConfig& config, int64_t rows);
// Its q_norm or k_norm (Qwen3, Gemma 3) on `heads` heads of each of `tokens` rows: x read with row
// stride ldx (the fused projection's output, where dx is written too), y and dy with ldy.
kernels::RmsNormShape head_norm_shape(const ModelConfig& config, int64_t tokens, int64_t heads, int64_t ldx,
                                      int64_t ldy);
// Gemma: the factor the embedding's output is multiplied by, sqrt(hidden_size) rounded to float.
float embedding_scale(const ModelConfig& config);

// The model's parameters as the decoder declares them (fp32 masters, full fine-tuning), without
// memory: for what needs the tensor layout of a config (plans, tensor names) and no decoder.
void declare_model_params(const ModelConfig& config, ParamStore& params, DecoderParamIds& ids);

// A random initialisation's values drawn for a tensor that is not written in place go through a
// buffer of this many (Decoder::init_random): a whole-tensor buffer (a 150k vocabulary's embedding:
// 445 MiB in bf16, 890 MiB as ZeRO-3's fp32 draws; a 30B MoE's 4-bit experts, 1.6 GB each) would
// raise the setup's peak far above the step's.
inline constexpr int64_t kInitPieceElements = int64_t(1) << 20;

// QLoRA's setup scratch: the most weights held in fp32 at once while the 4-bit projections are
// filled — the largest HF tensor of a 4-bit matrix, loaded one by one, in the checkpoint's layout
// (fused_experts: transformers 5's, a layer's experts in one tensor, read whole), or a random
// initialisation's piece (kInitPieceElements; under ZeRO-3 its largest tensor).
// 0 without 4-bit weights, and for a checkpoint saved in 4 bits (copied as it is).
int64_t four_bit_setup_scratch_elements(const ModelConfig& config, const DecoderOptions& options, bool from_files,
                                        bool fused_experts = false);

struct ExpertsWeights;     // experts.h
struct RoutedActivations;

class Decoder {
 public:
  // max_batch x max_seq bounds every micro-batch. Every buffer (parameters, gradients, optimizer
  // state, activations, scratch) is planned from it and placed in one arena now, so the training
  // step itself allocates nothing.
  Decoder(const ModelConfig& config, Precision precision, int64_t max_batch, int64_t max_seq,
          const DecoderOptions& options = {});
  ~Decoder();

  const ModelConfig& config() const { return config_; }
  Precision precision() const { return precision_; }
  // The model's weights. Frozen (no gradients) under LoRA.
  ParamStore& params() { return params_; }
  const ParamStore& params() const { return params_; }
  const DecoderParamIds& ids() const { return ids_; }
  // What the optimizer updates: the model's weights, or under LoRA the adapter's matrices.
  ParamStore& trainable() { return lora_.empty() ? params_ : adapter_; }
  const ParamStore& trainable() const { return lora_.empty() ? params_ : adapter_; }
  bool has_adapter() const { return !lora_.empty(); }
  const ParamStore& adapter() const { return adapter_; }
  ParamStore& adapter() { return adapter_; }
  const std::vector<LoraModule>& lora_modules() const { return lora_; }
  // The adapter's trained copies of the embedding and the LM head (modules_to_save), -1 if none.
  int trained_embedding() const { return trained_embed_; }
  int trained_lm_head() const { return trained_lm_head_; }
  const SavedModules& saved_modules() const { return saved_; }

  // Initialises weights as transformers' _init_weights does for a new model: normal(0, std)
  // matrices (std: the config's initializer_range), zero biases, norm weights that scale by 1 (1
  // itself, or 0 where the norm scales by 1 + w: Gemma's). Deterministic in `seed`.
  void init_random(uint64_t seed) { init_random(seed, config_.initializer_range); }
  void init_random(uint64_t seed, double std);
  // The adapter's initialisation (lora.h: init_lora), deterministic in `seed`.
  void init_adapter(uint64_t seed);
  // modules_to_save: the adapter's trained copies := the model's embedding / LM head (PEFT's start).
  // Under ZeRO-3 no rank holds those whole: write_weights writes the copies as each whole tensor
  // passes through memory, and this only refreshes their bf16.
  void copy_saved_modules_from_model();
  // Loading and initialisation: elements [first, first + n) of base tensor `param` (an fp32 master,
  // or a compute-only bf16 one) := values; under ZeRO-3 this rank's part of them, and
  // modules_to_save's trained copy of the tensor too (no rank holds it whole afterwards).
  void write_weights(int param, int64_t first, const float* values, int64_t n);
  void write_weights(int param, int64_t first, const bf16* values, int64_t n);

  // Forward and backward of one micro-batch. Gradients are ADDED to params().grads() — or, for a
  // tensor's first write since ParamStore::begin_gradient_step, written over them — scaled by
  // grad_scale (1 / target tokens of the whole optimizer step, so micro-batches sum to the mean).
  // Returns the sum of the token losses of this micro-batch.
  double forward_backward(const MicroBatch& batch, double grad_scale);
  // Called with a parameter's index (into trainable().params()) as soon as the backward pass has
  // made its gradient final: in reverse parameter order, the LM head first and the embedding last
  // (a tied embedding only at the very end), with the backend's event after the write (a device
  // communicator waits for it). Data parallel uses it to start a gradient bucket's allreduce while
  // the backward pass goes on. An empty function turns it off.
  using GradReadyHook = std::function<void(int param, ComputeEvent written)>;
  void set_grad_ready_hook(GradReadyHook hook) { grad_ready_ = std::move(hook); }
  // ZeRO-2 (DecoderOptions::shard_gradients): the groups of gradients and their staging buffers,
  // in the order the backward pass finishes them; empty otherwise.
  const std::vector<GradGroup>& grad_groups() const { return grad_groups_; }
  // Called as a call enters each StepTimeline position (each block's forward, the head, each
  // block's backward), before it reads a weight or writes a gradient there: ZeRO-2 waits there for
  // the reductions whose staging the position may reuse, ZeRO-1/2 for the post-step gather of the
  // weights the position reads first (first_weight_reads). The decoder then zeroes the staging of
  // the groups that begin.
  using PositionHook = std::function<void(int32_t position)>;
  void set_position_hook(PositionHook hook) { position_hook_ = std::move(hook); }
  // The full model's weights by the position that reads them first in a step (the embedding and
  // block 0 at the first, each block at its forward, the final norm and LM head at the head): spans
  // of the flat buffer, in order, covering it. ZeRO-1/2 gather the updated shards span by span and
  // wait for each where it is first read, so the gather overlaps the next step's forward pass.
  std::vector<WeightGather> first_weight_reads() const;

  // ZeRO-3 (DecoderOptions::shard_weights): the gathers of the step in the order of their
  // positions; empty otherwise. The decoder copies this rank's part of a gather's masters into its
  // buffer, then calls start(g); before the position reads the weights it calls wait(g). Every
  // forward_backward, forward_loss and logits_at call makes the same calls in the same order on
  // every rank (its positions' gathers, one position ahead), so a collective can implement them.
  // Under shard_masters (resident gathers) the buffers stay: refresh_resident_weights() starts
  // every gather, and each is waited for where a call first reads it, or by settle_resident_weights().
  const std::vector<WeightGather>& weight_gathers() const { return weight_gathers_; }
  struct WeightGatherHooks {
    std::function<void(size_t gather)> start, wait;
  };
  void set_weight_gather_hooks(WeightGatherHooks hooks) { gather_hooks_ = std::move(hooks); }
  // shard_masters: the gathers' buffers are the weights the step reads, whole, between refreshes.
  bool resident_gathers() const { return options_.shard_masters; }
  // ZeRO-3 with one rank: the gathers are bf16 casts this decoder makes itself (no hooks).
  bool casts_per_position() const { return options_.cast_per_position && !weight_gathers_.empty(); }
  // shard_masters, after this rank's masters changed (the optimizer step, loading, initialisation):
  // copies this rank's part of the masters into every gather (the fp32 runs, and unless the
  // optimizer step wrote them already, the bf16 casts: `bf16_written`) and starts them all. Every
  // rank calls it at the same point. The next call waits for each where it is first read.
  void refresh_resident_weights(bool bf16_written);
  // Waits for the gathers refresh_resident_weights() started; nothing when none is pending.
  void settle_resident_weights();

  // Forward only: the sum of the token losses (for evaluation).
  double forward_loss(const MicroBatch& batch);

  // Objectives over whole sequences (preference losses, train/objective.h). The caller's buffers,
  // [batch * seq] each, indexed by flat token (b * seq + t): each token's -log p(target) (0 where
  // the target is -100) and the mean over the vocabulary of its (capped) logits.
  struct TokenScores {
    double* nll = nullptr;
    double* mean_logit = nullptr;
  };
  // Chooses each token's gradient weight from the micro-batch's scores (weight[i] multiplies the
  // gradient of nll[i]); called once per forward_backward_weighted, between its two head passes.
  class TokenWeighting {
   public:
    virtual ~TokenWeighting() = default;
    virtual void weigh(const double* nll, const double* mean_logit, float* weight) = 0;
  };
  // Forward only, scores out; returns their sum (the reference pass of DPO, evaluation).
  double forward_score(const MicroBatch& batch, TokenScores scores);
  // One forward pass, the scores, weigh(), then the gradient of sum_i weight[i] * nll[i] through
  // the head and every block, added to the gradients as forward_backward's are. The head's logits
  // are computed twice (to score, then for the gradient): the weights depend on every token of the
  // micro-batch, and holding all of its logits would cost [batch * seq, vocab] floats.
  void forward_backward_weighted(const MicroBatch& batch, TokenScores scores, float* weights,
                                 TokenWeighting& weighting);

  // Forward only; writes the logits at flat token index rows[i] (b * seq + t) into out[i * vocab].
  // Used by evaluation and greedy decoding.
  void logits_at(const MicroBatch& batch, const int64_t* rows, int64_t count, float* out);

  // Mixture of experts (experts.h): the load-balancing loss of the last forward pass (0 without
  // experts); the last forward_backward added config().aux_loss_weight() times it to its loss's
  // gradient (the loss it returns is the token losses' sum alone). The tokens each sparse layer
  // sent each expert since the last clear_expert_load(): [sparse layers][experts], row-major
  // (empty without experts).
  double aux_loss() const { return aux_loss_; }
  std::span<const double> expert_load() const;
  void clear_expert_load();

  // Activation and scratch memory this decoder holds at the plan's peak (bytes), for reporting.
  size_t activation_bytes() const;
  // The plan the arena was laid out from, and the arena's size (with MemoryPlanning::PerTensor
  // the arena holds only the plan's persistent buffers).
  const MemoryPlan& memory_plan() const { return plan_; }
  size_t arena_bytes() const { return arena_.size(); }
  const DecoderOptions& options() const { return options_; }
  // The blocks whose intermediates the backward pass recomputes (gradient checkpointing), from the
  // first: checkpointing_layers as resolve_checkpointing_layers decided it; 0 without checkpointing.
  int64_t recomputed_blocks() const { return options_.gradient_checkpointing ? options_.checkpointing_layers : 0; }
  // Tokens the fused LM head and loss take at once (DecoderOptions::lm_head_chunk_tokens, or
  // keel's choice when that is 0): the size of the step's logits buffer, [chunk, vocab].
  int64_t lm_head_chunk() const;
  kernels::Backend& backend() const { return backend_; }

 private:
  struct Buffers;
  struct BlockActivations;
  struct TransientScope;  // MemoryPlanning::PerTensor: the call's own allocations
  // aux_weight: what the load-balancing loss weighs in the loss whose gradient the backward pass
  // takes (0: none, or no backward pass).
  void forward(const MicroBatch& batch, double aux_weight = 0.0);
  // A sparse layer's MLP (experts.h) from the post-attention norm's output.
  void experts_forward(const MicroBatch& batch, int64_t layer, const BlockActivations& a, float* x_out);
  // dx is overwritten, or added to with add_to_dx (GLM-4.5's shared experts wrote theirs first).
  void experts_backward(const MicroBatch& batch, int64_t layer, const BlockActivations& a, const float* dy, float* dx,
                        bool add_to_dx);
  // LoRA on a sparse layer's experts (lora.h): the module adapting `slot` (ExpertsGateUp,
  // ExpertsDown) of `layer`, null if none; and the adapters handed to experts.h's products.
  const LoraModule* experts_adapter(int64_t layer, LinearSlot slot) const;
  void attach_experts_adapters(int64_t layer, int64_t tokens, const BlockActivations& a, ExpertsWeights& w,
                               RoutedActivations& routed) const;
  void token_mask(const MicroBatch& batch);
  // Block `layer` from its input x_in: fills `a` and, unless x_out is null (recomputation inside
  // the backward pass, which only needs the intermediates), writes the next block's input.
  void forward_block(const MicroBatch& batch, int64_t layer, const float* x_in, const BlockActivations& a,
                     float* x_out);
  // scores: each token's loss and mean logit out (null: none); token_weights: each token's gradient
  // scale times grad_scale (null: grad_scale alone).
  double lm_head_loss(const MicroBatch& batch, double grad_scale, bool backward, const TokenScores* scores = nullptr,
                      const float* token_weights = nullptr);
  // From the LM head's input gradient (b.dnorm) down: says the head's gradient is final, then
  // every block's backward pass and the embedding's.
  void backward(const MicroBatch& batch);
  void validate(const MicroBatch& batch) const;
  void to_bf16(const float* src, bf16* dst, int64_t n);  // a GEMM input's bf16 copy, if planned
  // LoRA on one linear layer of block `layer` (lora.h). Forward: u = scaling * x A^T for each of
  // its modules (kept for the backward pass), then, unless only u is wanted (recomputation of the
  // down projection), y[:, rows] += u B^T. Backward: dB += dy^T u, du = scaling * dy B,
  // dA += du^T x, dx += du A.
  void lora_forward(const MicroBatch& batch, int64_t layer, LinearSlot slot, const float* x, const bf16* xb,
                    float* y, int64_t ldy, const BlockActivations& a, bool apply);
  void lora_backward(const MicroBatch& batch, int64_t layer, LinearSlot slot, const float* dy, const bf16* dyb,
                     int64_t ldy, const float* x, const bf16* xb, float* dx, const BlockActivations& a);
  // xb [tokens, cols], when the products of `slot`'s projection and adapters should read it
  // widened once (bf16 LoRA where products widen bf16, its copy planned this large, the slot has
  // adapters, no dropout), else null.
  const bf16* held_lora_input(const MicroBatch& batch, int64_t layer, LinearSlot slot, const bf16* xb,
                              int64_t cols) const;
  // dyb [tokens, width], a projection's output gradient, when its products (input and weight
  // gradients, adapters) should read it widened once (bf16 where products widen, its copy planned
  // this large, and more than one product reads it), else null.
  const bf16* held_output_grad(const MicroBatch& batch, int64_t layer, LinearSlot slot, const bf16* dyb,
                               int64_t width) const;
  // LoRA dropout: module m's input, dropped out with its key into the planned scratch (fp32 or
  // bf16 by precision); the returned pointers replace x / xb. Unchanged without dropout.
  std::pair<const float*, const bf16*> lora_input(const MicroBatch& batch, int module, int64_t cols, const float* x,
                                                  const bf16* xb);

  ModelConfig config_;
  Precision precision_;
  int64_t max_batch_, max_seq_;
  DecoderOptions options_;
  kernels::Backend& backend_;
  MemoryPlan plan_;
  Arena arena_;
  ParamStore params_;
  DecoderParamIds ids_;
  ParamStore adapter_;                                                      // LoRA's A and B matrices
  std::vector<LoraModule> lora_;                                            // empty: full fine-tuning
  std::vector<std::array<std::vector<int>, kLinearSlots>> lora_by_slot_;  // [layer][slot] -> modules
  SavedModules saved_;                                                    // modules_to_save
  int trained_embed_ = -1, trained_lm_head_ = -1;                         // their copies in adapter_
  kernels::RopeTable rope_, rope_local_;  // rope_local_: Gemma 3's sliding layers (empty otherwise)
  const kernels::RopeTable& rope_of(int64_t layer) const {
    return config_.rope_local_theta > 0 && config_.window_of(layer) > 0 ? rope_local_ : rope_;
  }
  std::unique_ptr<Buffers> buf_;
  GradReadyHook grad_ready_;
  std::vector<GradGroup> grad_groups_;
  PositionHook position_hook_;
  std::vector<WeightGather> weight_gathers_;
  WeightGatherHooks gather_hooks_;
  int32_t last_position_ = 0;  // of the call in progress: the gathers started go no further
  double aux_loss_ = 0;        // mixture of experts: the last forward pass's load-balancing loss
  // shard_masters: the first resident gather not waited for since the last refresh (size(): none
  // pending), and whether the buffers were ever filled (a call before that reads garbage).
  size_t resident_wait_ = 0;
  bool resident_filled_ = false;
  // This rank's part of gather g's masters into its buffers (fp32 runs; bf16 casts if `cast`;
  // LoRA's compute-only and 4-bit parts), ready for the all-gather.
  void stage_gather(size_t g, bool cast);
  void point_at_gather(const WeightGather& g, bool keep);
  // Calls the position hook, waits for the weights the position reads (ZeRO-3) and starts the next
  // position's gathers, zeroes the gradient staging that begins (ZeRO-2).
  void enter_position(int32_t position);
  void start_gathers(int32_t position);
  // A call's positions begin (the last one it reaches) and end: under ZeRO-3 no gathered address
  // outlives the call.
  struct CallScope;
  // `param` of trainable(); base weights report only when they train (not under LoRA).
  void grad_ready(int param) const {
    if (grad_ready_ && param >= 0) grad_ready_(param, backend_.record_event());
  }
  // ZeRO-3 with modules_to_save: the trained copy (fp32, whole) of base tensor `param`; null
  // without one or when the base is whole.
  float* sharded_saved_copy(int param);
  void base_grad_ready(int param) const {
    if (lora_.empty()) grad_ready(param);
  }
};

}  // namespace keel::model
