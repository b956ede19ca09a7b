#include "keel/model/gguf_names.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <string_view>
#include <utility>

#include "keel/core/error.h"
#include "keel/model/gguf_q4_k_m.h"
#include "keel/model/hf_weights.h"

namespace keel::model {
namespace {

using formats::GgmlType;

// gguf-py's tensor map for the block tensors of the families keel writes (HF suffix -> GGUF).
constexpr std::pair<std::string_view, std::string_view> kBlockTensors[] = {
    {"input_layernorm.weight", "attn_norm.weight"},
    {"self_attn.q_proj.weight", "attn_q.weight"},
    {"self_attn.q_proj.bias", "attn_q.bias"},
    {"self_attn.k_proj.weight", "attn_k.weight"},
    {"self_attn.k_proj.bias", "attn_k.bias"},
    {"self_attn.v_proj.weight", "attn_v.weight"},
    {"self_attn.v_proj.bias", "attn_v.bias"},
    {"self_attn.o_proj.weight", "attn_output.weight"},
    {"self_attn.q_norm.weight", "attn_q_norm.weight"},
    {"self_attn.k_norm.weight", "attn_k_norm.weight"},
    {"post_attention_layernorm.weight", "ffn_norm.weight"},
    {"mlp.gate_proj.weight", "ffn_gate.weight"},
    {"mlp.up_proj.weight", "ffn_up.weight"},
    {"mlp.down_proj.weight", "ffn_down.weight"},
    // A mixture of experts: the router (Qwen3-MoE's and transformers 5's mlp.gate, Mixtral's
    // block_sparse_moe.gate), and each projection of the layer's experts stacked into one 3-D
    // tensor under the name the converter gives the stack (Qwen2MoeModel's merged_name; keel's
    // stacking, checkpoint/gguf_experts.h, names Mixtral's w1, w3, w2 stacks alike).
    {"mlp.gate.weight", "ffn_gate_inp.weight"},
    {"block_sparse_moe.gate.weight", "ffn_gate_inp.weight"},
    {"mlp.experts.gate_proj.weight", "ffn_gate_exps.weight"},
    {"mlp.experts.up_proj.weight", "ffn_up_exps.weight"},
    {"mlp.experts.down_proj.weight", "ffn_down_exps.weight"},
};

// GLM-4 (GlmForCausalLM): gate and up in one matrix, gate rows first; llama.cpp's chatglm reads it
// as ffn_up of 2 x n_ff rows and splits it the same way (LLM_FFN_SWIGLU).
constexpr std::string_view kGlmGateUp = "mlp.gate_up_proj.weight";

// Gemma's sandwich norms: its post_attention_layernorm is on the attention's output, and the norm
// before the MLP is pre_feedforward_layernorm (gguf-py's GEMMA3 tensor list).
constexpr std::pair<std::string_view, std::string_view> kGemmaBlockTensors[] = {
    {"post_attention_layernorm.weight", "post_attention_norm.weight"},
    {"pre_feedforward_layernorm.weight", "ffn_norm.weight"},
    {"post_feedforward_layernorm.weight", "post_ffw_norm.weight"},
};

// GLM-4.5 (gguf-py's GLM4_MOE tensor list): its norm before the MLP is ATTN_POST_NORM (the list has
// no FFN_NORM), the router's correction bias is FFN_EXP_PROBS_B, and the shared experts are the
// *_shexp projections.
constexpr std::pair<std::string_view, std::string_view> kGlm4MoeBlockTensors[] = {
    {"post_attention_layernorm.weight", "post_attention_norm.weight"},
    {"mlp.gate.e_score_correction_bias", "exp_probs_b.bias"},
    {"mlp.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight"},
    {"mlp.shared_experts.up_proj.weight", "ffn_up_shexp.weight"},
    {"mlp.shared_experts.down_proj.weight", "ffn_down_shexp.weight"},
};

constexpr std::pair<std::string_view, std::string_view> kModelTensors[] = {
    {"model.embed_tokens.weight", "token_embd.weight"},
    {"model.norm.weight", "output_norm.weight"},
    {"lm_head.weight", "output.weight"},
};

// The families the converter writes through LlamaModel, which permutes q_proj and k_proj (Mixtral too).
bool llama_style(Family f) { return f == Family::Llama || f == Family::Mistral || f == Family::Mixtral; }

}  // namespace

std::string gguf_architecture(const ModelConfig& config) {
  switch (config.family) {
    case Family::Llama:
    case Family::Mistral:  // the converter's LlamaModel takes MistralForCausalLM and MixtralForCausalLM too
    case Family::Mixtral: return "llama";
    case Family::Qwen2: return "qwen2";
    case Family::Qwen3: return "qwen3";
    case Family::Qwen3Moe: return "qwen3moe";
    case Family::Gemma2: return "gemma2";
    case Family::Gemma3: return "gemma3";
    case Family::Glm: return "chatglm";  // the converter's ChatGLMModel takes GlmForCausalLM
    case Family::Glm4Moe: return "glm4moe";
    default: break;
  }
  require(config.family != Family::GlmOriginal,
          "ChatGLM-format GLM-4 ({}): keel's GGUF export writes GLM-4 in the glm format (GlmForCausalLM); export it "
          "--format hf first (which writes the glm format), then that directory --format gguf",
          config.architecture);
  fail("{} ({}): keel's GGUF export does not write this family yet (it writes Llama, Mistral, Qwen2, Qwen3, "
       "Gemma 2, Gemma 3, GLM-4 in the glm format, Qwen3-MoE, Mixtral and GLM-4.5); "
       "export a Hugging Face directory (--format hf) and convert it with llama.cpp's convert_hf_to_gguf.py",
       family_display_name(config.family), config.architecture);
}

std::string gguf_tensor_name(const ModelConfig& config, const std::string& hf_name) {
  for (const auto& [hf, gguf] : kModelTensors)
    if (hf_name == hf) return std::string(gguf);
  constexpr std::string_view kLayers = "model.layers.";
  if (hf_name.starts_with(kLayers)) {
    const std::string_view rest = std::string_view(hf_name).substr(kLayers.size());
    int64_t block = -1;
    const auto [end, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), block);
    if (ec == std::errc() && end < rest.data() + rest.size() && *end == '.') {
      const std::string_view suffix(end + 1, size_t(rest.data() + rest.size() - end - 1));
      if (config.family == Family::Glm && suffix == kGlmGateUp) return "blk." + std::to_string(block) + ".ffn_up.weight";
      if (config.family == Family::Glm4Moe)
        for (const auto& [hf, gguf] : kGlm4MoeBlockTensors)
          if (suffix == hf) return "blk." + std::to_string(block) + "." + std::string(gguf);
      if (config.gemma())
        for (const auto& [hf, gguf] : kGemmaBlockTensors)
          if (suffix == hf) return "blk." + std::to_string(block) + "." + std::string(gguf);
      for (const auto& [hf, gguf] : kBlockTensors)
        if (suffix == hf) return "blk." + std::to_string(block) + "." + std::string(gguf);
    }
  }
  fail("tensor '{}': llama.cpp's GGUF tensor map has no name for it (keel's GGUF export knows the tensors of "
       "Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, GLM-4, Qwen3-MoE, Mixtral and GLM-4.5 checkpoints; a "
       "mixture's experts as the stacks checkpoint/gguf_experts.h makes of them)",
       hf_name);
}

std::optional<GgufExpertSlice> gguf_expert_slice(const ModelConfig& config, const std::string& hf_name) {
  if (!config.has_experts()) return std::nullopt;
  const auto e = parse_expert_tensor_name(config.family, hf_name);
  if (!e || e->expert < 0) return std::nullopt;  // transformers 5's fused tensors are not one expert's
  constexpr std::string_view kStacks[] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};  // Gate, Up, Down
  return GgufExpertSlice{fmt::format("blk.{}.{}.weight", e->layer, kStacks[size_t(e->projection)]), e->expert};
}

float gguf_norm_shift(const ModelConfig& config, const std::string& hf_name) {
  return config.gemma() && std::string_view(hf_name).ends_with("norm.weight") ? 1.0f : 0.0f;
}

int64_t gguf_permuted_heads(const ModelConfig& config, const std::string& hf_name) {
  if (!llama_style(config.family)) return 0;
  auto ends = [&](std::string_view s) { return std::string_view(hf_name).ends_with(s); };
  if (ends("q_proj.weight") || ends("q_proj.bias")) return config.num_heads;
  if (ends("k_proj.weight") || ends("k_proj.bias")) return config.num_kv_heads;
  return 0;
}

// weights.reshape(heads, 2, rows / heads / 2, cols).swapaxes(1, 2): output row (h, i, j) is input
// row (h, j, i); undone, output row (h, j, i) is input row (h, i, j).
void permute_rows_for_gguf(const float* src, float* dst, int64_t heads, int64_t rows, int64_t cols, bool undo) {
  require(heads > 0 && rows % (2 * heads) == 0, "GGUF permutation: {} rows do not split into {} heads of pairs", rows,
          heads);
  const int64_t half = rows / heads / 2;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < half; ++i)
      for (int64_t j = 0; j < 2; ++j) {
        const int64_t hf_row = (h * 2 + j) * half + i, gguf_row = (h * half + i) * 2 + j;
        const float* from = src + (undo ? gguf_row : hf_row) * cols;
        std::copy(from, from + cols, dst + (undo ? hf_row : gguf_row) * cols);
      }
}

void permute_rows_for_gguf_part(const std::function<void(int64_t first, int64_t n, float* buffer)>& read,
                                int64_t heads, int64_t rows, int64_t cols, int64_t begin, int64_t count, float* dst) {
  require(heads > 0 && rows % (2 * heads) == 0, "GGUF permutation: {} rows do not split into {} heads of pairs", rows,
          heads);
  require(begin >= 0 && count >= 0 && begin % cols == 0 && count % cols == 0 && begin + count <= rows * cols,
          "GGUF permutation: values [{}, {}) are not whole rows of {} x {}", begin, begin + count, rows, cols);
  const int64_t head_rows = rows / heads, head_values = head_rows * cols;
  const int64_t first_row = begin / cols, end_row = (begin + count) / cols;
  std::vector<float> input(static_cast<size_t>(head_values)), output(input.size());
  for (int64_t h = first_row / head_rows; h * head_rows < end_row; ++h) {
    read(h * head_values, head_values, input.data());
    permute_rows_for_gguf(input.data(), output.data(), 1, head_rows, cols);
    // The head's rows that fall in [first_row, end_row): all but at the piece's two ends.
    const int64_t from = std::max(first_row, h * head_rows), to = std::min(end_row, (h + 1) * head_rows);
    std::copy(output.begin() + (from - h * head_rows) * cols, output.begin() + (to - h * head_rows) * cols,
              dst + (from - first_row) * cols);
  }
}

GgmlType gguf_outtype_from_name(const std::string& name) {
  if (name == "f32") return GgmlType::F32;
  if (name == "f16") return GgmlType::F16;
  if (name == "bf16") return GgmlType::BF16;
  if (name == "q8_0") return GgmlType::Q8_0;
  if (name == "q4_0") return GgmlType::Q4_0;
  if (name == "q4_k_m") return GgmlType::Q4_K;
  fail("--outtype: expected f32, f16, bf16, q8_0, q4_0 or q4_k_m, found '{}'", name);
}

std::string gguf_outtype_name(GgmlType outtype) {
  if (outtype == GgmlType::Q4_K) return "q4_k_m";
  std::string name(formats::ggml_type_name(outtype));
  for (char& ch : name) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  return name;
}

uint32_t gguf_file_type(GgmlType outtype) {
  switch (outtype) {
    case GgmlType::F32: return 0;
    case GgmlType::F16: return 1;
    case GgmlType::Q4_0: return 2;
    case GgmlType::Q8_0: return 7;
    case GgmlType::Q4_K: return kGgufFileTypeQ4_K_M;
    case GgmlType::BF16: return 32;
    case GgmlType::Q5_0:
    case GgmlType::Q6_K: break;  // types within the Q4_K_M mix, not outtypes
  }
  return 0;
}

GgmlType gguf_tensor_type(const std::string& gguf_name, const std::vector<int64_t>& shape, GgmlType outtype,
                          bool* fallback) {
  if (fallback) *fallback = false;
  const std::string_view name(gguf_name);
  const bool matrix_name = name.ends_with(".weight") || name.ends_with(".lora_a") || name.ends_with(".lora_b");
  // The router (FFN_GATE_INP) is among the tensors the converter always keeps in F32, as llama-quantize does.
  if (shape.size() <= 1 || name.ends_with("_norm.weight") || name.ends_with("ffn_gate_inp.weight") || !matrix_name)
    return GgmlType::F32;
  if (!formats::ggml_row_fits(outtype, shape.back())) {
    if (fallback) *fallback = true;
    return GgmlType::F16;
  }
  return outtype;
}

}  // namespace keel::model
