#include "keel/model/gguf_q4_k_m.h"

#include <fmt/format.h>

#include <cstdio>

#include "keel/core/error.h"

namespace keel::model {
namespace {

using formats::GgmlType;

// weight_name_comparer's layer: N for "blk.N.*", -1 otherwise (sscanf's "blk.%d.").
int layer_of(const std::string& name) {
  int layer = -1;
  std::sscanf(name.c_str(), "blk.%d.", &layer);
  return layer;
}

bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

// tensor_allows_quantization for the tensors keel writes: matrices (2 or more dimensions of which
// the last is not 1, ggml_n_dims) named "...weight", not norms.
bool allows_quantization(const std::string& name, const std::vector<int64_t>& shape) {
  int dims = 1;
  for (size_t i = 0; i < shape.size(); ++i)  // keel's shapes are outermost first: ggml's ne reversed
    if (shape[i] != 1) {
      dims = int(shape.size() - i);
      break;
    }
  return dims >= 2 && name.ends_with("weight") && !contains(name, "_norm.weight");
}

// The layers llama.cpp gives more bits (Q4_K_M's attn_v and ffn_down): the first and last eighth,
// and every third layer between.
bool use_more_bits(int i_layer, int n_layers) {
  return i_layer < n_layers / 8 || i_layer >= 7 * n_layers / 8 || (i_layer - n_layers / 8) % 3 == 2;
}

// tensor_type_fallback: rows of `ncols` values that are not whole blocks of `type` take a type of
// 32-value blocks (Q4_K -> Q5_0, Q6_K -> Q8_0; Q8_0 stays), and F16 where those do not fit either.
GgmlType fallback(GgmlType type, int64_t ncols, std::string& reason) {
  if (ncols % formats::ggml_block_size(type) == 0) return type;
  GgmlType to = type == GgmlType::Q4_K ? GgmlType::Q5_0 : type == GgmlType::Q6_K ? GgmlType::Q8_0 : type;
  std::string why = fmt::format("rows of {} values are not whole blocks of {} for {}", ncols,
                                formats::ggml_block_size(type), formats::ggml_type_name(type));
  if (ncols % formats::ggml_block_size(to) != 0) {
    if (to != type) why += fmt::format(", nor of {} for {}", formats::ggml_block_size(to), formats::ggml_type_name(to));
    to = GgmlType::F16;
  }
  reason = fmt::format("{}{}, llama.cpp's fallback", reason.empty() ? "" : reason + "; ", why);
  return to;
}

}  // namespace

bool llama_quantize_order(const std::string& a, const std::string& b) {
  const int la = layer_of(a), lb = layer_of(b);
  if (la != lb) return la < lb;
  return a < b;
}

std::vector<Q4KMChoice> q4_k_m_tensor_types(const ModelConfig& config, const std::string& arch,
                                            const std::vector<std::string>& names,
                                            const std::vector<std::vector<int64_t>>& shapes) {
  // llama.cpp's model types that change Q4_K_M's choices: LLM_TYPE_70B (llama with 80 layers and
  // grouped KV heads, qwen2 with 80 layers) gives attn_v Q5_K, whose quantizer keel does not have.
  const bool type_70b = config.num_layers == 80 &&
                        ((arch == "llama" && config.num_heads != config.num_kv_heads) || arch == "qwen2");
  require(!type_70b,
          "--outtype q4_k_m: llama.cpp takes this {}-layer {} model for a 70B one and quantizes its attn_v matrices to "
          "Q5_K, which keel does not write; export --outtype f32 (or f16) and run llama-quantize on that file",
          config.num_layers, arch);
  int n_attention_wv = 0;
  bool tied = true;
  for (const auto& name : names) {
    if (contains(name, "attn_qkv.weight") || contains(name, "attn_kv_b.weight"))
      fail("--outtype q4_k_m: {} is a fused attention matrix, which llama.cpp quantizes to Q5_K under Q4_K_M and keel "
           "does not write; export --outtype f32 and run llama-quantize on that file",
           name);
    if (contains(name, "attn_v.weight")) ++n_attention_wv;
    if (name == "output.weight") tied = false;
  }
  const int n_layer = int(config.num_layers);
  int i_attention_wv = 0, i_ffn_down = 0;
  std::vector<Q4KMChoice> out(names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string& name = names[i];
    const std::vector<int64_t>& shape = shapes[i];
    Q4KMChoice& choice = out[i];
    if (!allows_quantization(name, shape)) continue;  // F32, as in the f32 file llama-quantize reads
    const int64_t ncols = shape.back();
    GgmlType type = GgmlType::Q4_K;
    const bool output = name == "output.weight";
    if (output || (tied && name == "token_embd.weight")) {
      if (ncols % formats::ggml_block_size(GgmlType::Q4_K) != 0) {
        type = GgmlType::Q8_0;
        choice.reason = fmt::format("the output{}: Q8_0, its rows of {} values not whole blocks of 256",
                                    output ? "" : " (tied to token_embd)", ncols);
      } else {
        type = GgmlType::Q6_K;
        choice.reason = output ? "the output" : "the output (tied to token_embd)";
      }
    } else if (contains(name, "attn_v.weight")) {
      if (use_more_bits(i_attention_wv, n_attention_wv)) {
        type = GgmlType::Q6_K;
        choice.reason = "attn_v of a layer use_more_bits picks";
      }
      ++i_attention_wv;
    } else if (contains(name, "ffn_down")) {
      // layer_info without experts: the count of ffn_down tensors so far, of the model's layers.
      if (use_more_bits(i_ffn_down, n_layer)) {
        type = GgmlType::Q6_K;
        choice.reason = "ffn_down of a layer use_more_bits picks";
      }
      ++i_ffn_down;
    }
    choice.type = fallback(type, ncols, choice.reason);
  }
  return out;
}

}  // namespace keel::model
