// The decoder-only transformer shared by the Llama, Qwen2 and GLM-4 families:
//   x = embed(ids); for each layer: x += o(attn(rope(qkv(rmsnorm(x))))); x += down(swiglu(gate_up(rmsnorm(x))))
//   loss = cross_entropy(lm_head(rmsnorm(x)), next-token labels)
// with hand-written forward and backward passes. Internally q/k/v and gate/up are always fused
// (one GEMM each); family-specific tensor names and fusions are handled by hf_weights.h.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "keel/kernels/rope.h"
#include "keel/model/config.h"
#include "keel/model/params.h"

namespace keel::model {

enum class Precision : uint8_t {
  F32,   // everything in fp32: exact, for tests
  BF16,  // fp32 master weights/grads/optimizer state; bf16 weight copies and GEMM inputs, fp32 accumulation
};

struct LayerParamIds {
  int input_norm = -1, qkv_weight = -1, qkv_bias = -1, o_weight = -1;
  int post_norm = -1, gate_up_weight = -1, down_weight = -1;
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
};

class Decoder {
 public:
  // max_batch x max_seq bounds every micro-batch; all activation buffers are sized from it now,
  // so the training step itself allocates nothing.
  Decoder(const ModelConfig& config, Precision precision, int64_t max_batch, int64_t max_seq);
  ~Decoder();

  const ModelConfig& config() const { return config_; }
  Precision precision() const { return precision_; }
  ParamStore& params() { return params_; }
  const ParamStore& params() const { return params_; }
  const DecoderParamIds& ids() const { return ids_; }

  // Initialises weights as transformers does for a new model: normal(0, std) matrices, zero biases,
  // unit norm weights. Deterministic in `seed`.
  void init_random(uint64_t seed, double std = 0.02);

  // Forward and backward of one micro-batch. Gradients are ADDED to params().grads(), scaled by
  // grad_scale (1 / target tokens of the whole optimizer step, so micro-batches sum to the mean).
  // Returns the sum of the token losses of this micro-batch.
  double forward_backward(const MicroBatch& batch, double grad_scale);
  // Forward only: the sum of the token losses (for evaluation).
  double forward_loss(const MicroBatch& batch);

  // Forward only; writes the logits at flat token index rows[i] (b * seq + t) into out[i * vocab].
  // Used by evaluation and greedy decoding.
  void logits_at(const MicroBatch& batch, const int64_t* rows, int64_t count, float* out);

  // Activation memory this decoder holds (bytes), for reporting.
  size_t activation_bytes() const;

 private:
  struct Buffers;
  void forward(const MicroBatch& batch);
  double lm_head_loss(const MicroBatch& batch, double grad_scale, bool backward);
  void backward(const MicroBatch& batch);
  void validate(const MicroBatch& batch) const;

  ModelConfig config_;
  Precision precision_;
  int64_t max_batch_, max_seq_;
  ParamStore params_;
  DecoderParamIds ids_;
  kernels::RopeTable rope_;
  std::unique_ptr<Buffers> buf_;
};

}  // namespace keel::model
