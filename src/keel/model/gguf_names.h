// llama.cpp's view of keel's families, as its converter (convert_hf_to_gguf.py with gguf-py's
// tensor map) writes them: the GGUF architecture of each family, each Hugging Face tensor's GGUF
// name, the row permutation it applies to Llama-style query and key projections, and the type each
// tensor is stored in for a given --outtype. The file format itself is formats/gguf_writer.h.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "keel/formats/gguf_quants.h"
#include "keel/model/config.h"

namespace keel::model {

inline constexpr uint32_t kGgmlQuantizationVersion = 2;  // GGML_QNT_VERSION: general.quantization_version

// The GGUF architecture (`general.architecture`) of a family: "llama" for Llama, Mistral and Mixtral,
// "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "chatglm" for GLM-4 in the glm format
// (GlmForCausalLM, which the converter writes with its ChatGLMModel; glm_original checkpoints are
// not written) and "glm4moe" for GLM-4.5. Families keel does not write are a keel::Error naming the
// family.
std::string gguf_architecture(const ModelConfig& config);

// "model.layers.3.self_attn.q_proj.weight" -> "blk.3.attn_q.weight", ... (Gemma's sandwich norms
// by its own names); a keel::Error naming the tensor for one llama.cpp has no name for.
std::string gguf_tensor_name(const ModelConfig& config, const std::string& hf_name);

// A mixture's expert in a published checkpoint's per-expert names
// ("model.layers.3.mlp.experts.5.gate_proj.weight"; Mixtral's block_sparse_moe.experts.5.w1) as the
// slice of the GGUF stack holding it: {"blk.3.ffn_gate_exps.weight", 5}. nullopt for other tensors.
struct GgufExpertSlice {
  std::string stack;
  int64_t expert = 0;
};
std::optional<GgufExpertSlice> gguf_expert_slice(const ModelConfig& config, const std::string& hf_name);

// Gemma 2 and 3: llama.cpp's RMSNorm multiplies by w, transformers' Gemma RMSNorms by (1 + w), so
// the converter stores every norm weight plus one (Gemma2Model.modify_tensors,
// Gemma3Model.norm_shift). 0 for other tensors.
float gguf_norm_shift(const ModelConfig& config, const std::string& hf_name);

// Llama and Mistral: the converter's LlamaModel.permute on q_proj and k_proj (weights and biases):
// within each head, rows (i, i + head_dim/2) -- the rotate_half pairs -- become rows (2i, 2i + 1),
// the adjacent pairs ggml's RoPE rotates. 0 when the tensor is not permuted.
int64_t gguf_permuted_heads(const ModelConfig& config, const std::string& hf_name);
// rows x cols values of `heads` heads, src -> dst (cols 1 for a bias). `undo`: the inverse, from
// the file's order back to transformers' (reading a GGUF file, as transformers' GGUF loader does).
void permute_rows_for_gguf(const float* src, float* dst, int64_t heads, int64_t rows, int64_t cols, bool undo = false);
// Values [begin, begin + count) of permute_rows_for_gguf's output (whole rows) into dst, the input
// read through read(first, n, buffer) -- its values [first, first + n) -- a head at a time: a head's
// rows move only within it, so a tensor written a piece at a time holds a head, not the matrix.
void permute_rows_for_gguf_part(const std::function<void(int64_t first, int64_t n, float* buffer)>& read,
                                int64_t heads, int64_t rows, int64_t cols, int64_t begin, int64_t count, float* dst);

// The --outtype values (the converter's names, and llama-quantize's q4_k_m) and the file type each
// gives (general.file_type, llama_ftype: 0 all f32, 1 mostly f16, 2 mostly q4_0, 7 mostly q8_0,
// 15 mostly Q4_K_M, 32 mostly bf16). q4_k_m is GgmlType::Q4_K, the mix's base type: the per-tensor
// types are gguf_q4_k_m.h's.
formats::GgmlType gguf_outtype_from_name(const std::string& name);
uint32_t gguf_file_type(formats::GgmlType outtype);
// The --outtype name of an outtype ("f16", ..., "q4_k_m").
std::string gguf_outtype_name(formats::GgmlType outtype);

// The type a tensor is stored in (prepare_tensors): vectors, norms, a mixture's router (ffn_gate_inp)
// and anything not named ".weight" (or an adapter's ".lora_a" / ".lora_b") in F32; a matrix in
// `outtype`, or F16 where its rows are not whole blocks of a block type (the converter's fallback on
// gguf-py's QuantError). `fallback` tells the caller it happened.
formats::GgmlType gguf_tensor_type(const std::string& gguf_name, const std::vector<int64_t>& shape,
                                   formats::GgmlType outtype, bool* fallback = nullptr);

}  // namespace keel::model
