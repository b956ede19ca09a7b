// --outtype q4_k_m: llama-quantize's Q4_K_M mix (LLAMA_FTYPE_MOSTLY_Q4_K_M, llama_tensor_get_type
// in llama.cpp's src/llama-quant.cpp, without an importance matrix or overrides) for the families
// keel writes. Most matrices Q4_K; Q6_K where llama.cpp spends more bits: the output (or a tied
// token_embd, which is the output), and attn_v and ffn_down in the layers use_more_bits picks
// (the first and last eighth, and every third between); a matrix whose rows are not whole blocks
// falls back as llama.cpp does (Q4_K -> Q5_0, Q6_K -> Q8_0, then F16). Norms, biases, anything not
// a ".weight" matrix keep their F32. The file's tensors are in llama-quantize's order
// (llama_model_loader's weights_map: the tensors outside layers, then layer by layer, by name).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "keel/formats/gguf_quants.h"
#include "keel/model/config.h"

namespace keel::model {

inline constexpr uint32_t kGgufFileTypeQ4_K_M = 15;  // LLAMA_FTYPE_MOSTLY_Q4_K_M: general.file_type

struct Q4KMChoice {
  formats::GgmlType type = formats::GgmlType::F32;
  std::string reason;  // why not Q4_K ("" for Q4_K and for tensors kept F32)
};

// llama_model_loader's weights_map order: a before b.
bool llama_quantize_order(const std::string& a, const std::string& b);

// The types of `names` (GGUF names, in llama_quantize_order) with `shapes` (outermost first, as
// keel's tensors: rows, then the row's length) under Q4_K_M. llama.cpp's choices that need what
// keel does not write (Q5_K: a 70B-type model's attn_v, fused attn_qkv; mixture-of-experts
// rules) are a keel::Error naming the case.
std::vector<Q4KMChoice> q4_k_m_tensor_types(const ModelConfig& config, const std::string& arch,
                                            const std::vector<std::string>& names,
                                            const std::vector<std::vector<int64_t>>& shapes);

}  // namespace keel::model
