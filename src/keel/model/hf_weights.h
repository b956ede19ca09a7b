// Hugging Face tensor names of each family, mapped onto keel's internal (fused) parameters.
// A checkpoint tensor is a block of consecutive rows of one internal parameter: Llama's q_proj,
// k_proj and v_proj are the three row blocks of keel's fused qkv weight, GLM's gate_up_proj is
// keel's gate_up weight as it is, ChatGLM's query_key_value is keel's qkv as it is. Loading copies
// each tensor into its rows; exporting writes each block back under its own name.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "keel/model/decoder.h"
#include "keel/formats/safetensors.h"

namespace keel::model {

struct HfTensor {
  std::string name;                           // as in the checkpoint, e.g. "model.layers.0.self_attn.q_proj.weight"
  int param = -1;                             // internal parameter index
  int64_t row_begin = 0, rows = 0, cols = 0;  // cols == 0 for vectors (norm weights, biases)
  // > 0: stored as [stacked, rows / stacked, cols] (transformers 5's fused experts, one matrix per expert).
  int64_t stacked = 0;
  std::vector<int64_t> shape() const {
    if (stacked > 0) return {stacked, rows / stacked, cols};
    return cols ? std::vector<int64_t>{rows, cols} : std::vector<int64_t>{rows};
  }
};

// How a mixture-of-experts checkpoint holds its experts: one tensor per expert and projection
// (mlp.experts.N.gate_proj.weight, up_proj, down_proj: the published checkpoints, and what
// transformers' save_pretrained writes back), or fused as transformers 5 holds them in memory
// (mlp.experts.gate_up_proj [experts, 2 inter, hidden], mlp.experts.down_proj [experts, hidden, inter]).
enum class ExpertLayout : uint8_t { PerExpert, Fused };

// A published checkpoint's per-expert names, block.experts.N.{gate,up,down}: Qwen3-MoE's and
// GLM-4.5's mlp.experts.N.gate_proj.weight, ..., Mixtral's block_sparse_moe.experts.N.w1 (gate), w3
// (up), w2 (down). One table for reading checkpoints (hf_tensors) and for stacking them into GGUF.
struct PublishedExpertNames {
  std::string_view block, gate, up, down;
};
inline PublishedExpertNames published_expert_names(Family family) {
  if (family == Family::Mixtral) return {"block_sparse_moe.", "w1.weight", "w3.weight", "w2.weight"};
  return {"mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight"};
}

// A mixture's expert tensor by name: its layer, its expert (-1: transformers 5's fused tensor of all
// of them, mlp.experts.gate_up_proj or down_proj) and its projection, from the published names
// above or the fused ones; nullopt for any other tensor. Shared by the GGUF stacking (export) and
// slicing (input).
enum class ExpertProjection : uint8_t { Gate, Up, Down, GateUp };
struct ExpertTensorName {
  int64_t layer = -1, expert = -1;
  ExpertProjection projection = ExpertProjection::Gate;
};
std::optional<ExpertTensorName> parse_expert_tensor_name(Family family, std::string_view name);

// The layout a checkpoint holds its experts in: fused where its first sparse layer's experts are
// (PerExpert for a dense model).
ExpertLayout checkpoint_expert_layout(const formats::CheckpointReader& reader, const ModelConfig& config);

// Every tensor of the family's checkpoint format, in the order transformers writes them.
std::vector<HfTensor> hf_tensors(const ModelConfig& config, const DecoderParamIds& ids,
                                 ExpertLayout experts = ExpertLayout::PerExpert);

// Loads all weights of `decoder` from a model directory (single or sharded safetensors). Missing or
// mis-shaped tensors are errors naming the tensor and file; tensors the family does not use are
// reported in the returned list (e.g. cached rotary buffers) rather than silently dropped.
// progress, if given, shows the weights read (and quantized, with QLoRA).
std::vector<std::string> load_hf_weights(Decoder& decoder, const std::string& dir, WorkProgress* progress = nullptr);

// The model's fp32 weights under the family's checkpoint names, in hf_tensors' order, as views into
// the decoder's parameters (valid while it lives): what save_hf_model writes, for writers of other
// formats (checkpoint/gguf_export.h). An error if the matrices are held in bf16 or 4 bits only.
std::vector<formats::TensorToWrite> hf_weight_tensors(const Decoder& decoder);

// Writes config.json and the weights (sharded above max_shard_bytes) in the family's format;
// progress, if given, shows the bytes written.
void save_hf_model(const Decoder& decoder, const std::string& dir, DType dtype, uint64_t max_shard_bytes = 5ull << 30,
                   WorkProgress* progress = nullptr);

// The fp32 weights as a stream over the flat parameter buffer: elements [begin, begin + *n) of it,
// 0 < *n <= max_count, valid until the next call; `begin` only increases from one call to the next.
using FlatWeightStream = std::function<const float*(int64_t begin, int64_t max_count, int64_t* n)>;

// save_hf_model for a decoder that does not hold its weights (ZeRO-3: each rank holds a shard):
// the weights are read from `weights`, front to back, one chunk at a time, so no whole copy of the
// model is ever in memory. The tensors are written in the order of the flat buffer.
void save_hf_model_streamed(const Decoder& decoder, const std::string& dir, DType dtype,
                            const FlatWeightStream& weights, uint64_t max_shard_bytes = 5ull << 30);

}  // namespace keel::model
