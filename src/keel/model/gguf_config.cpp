#include "keel/model/gguf_config.h"

#include <fmt/format.h>

#include <cmath>
#include <string_view>
#include <utility>

#include "keel/core/error.h"

namespace keel::model {
namespace {

// The GGUF architectures keel trains from, and the family each is (gguf_architecture's inverse:
// Mistral's files are "llama", and train as Llama, which they are but for the sliding window the
// file does not carry).
constexpr std::pair<std::string_view, Family> kArchitectures[] = {
    {"llama", Family::Llama},
    {"qwen2", Family::Qwen2},
    {"qwen3", Family::Qwen3},
    {"gemma2", Family::Gemma2},
    {"gemma3", Family::Gemma3},
    {"chatglm", Family::Glm},  // GLM-4 as the converter writes GlmForCausalLM (ChatGLMModel)
    {"qwen3moe", Family::Qwen3Moe},
    {"glm4moe", Family::Glm4Moe},
    // Mixtral is "llama" with llama.expert_count (gguf_model_config).
};

const formats::GgufTensorInfo* find_tensor(const formats::GgufFile& file, std::string_view name) {
  for (const auto& t : file.tensors())
    if (t.name == name) return &t;
  return nullptr;
}

int64_t positive(const formats::GgufFile& file, const std::string& key, std::optional<int64_t> fallback = {}) {
  const auto v = file.integer_value(key);
  require(v || fallback, "{}: metadata key '{}' is missing (llama.cpp's converter writes it for every model)",
          file.path(), key);
  const int64_t value = v ? *v : *fallback;
  require(value > 0, "{}: {}: expected a positive integer, found {}", file.path(), key, value);
  return value;
}

// llama.cpp's attention scale for Gemma (llama_model_gemma2/3::load_arch_hparams), which no key
// carries: 1/sqrt(head_dim), or 1/sqrt(hidden / heads) for the 27B models (46 and 62 layers).
double gemma_query_pre_attn_scalar(const ModelConfig& c) {
  const bool is_27b = c.num_layers == (c.family == Family::Gemma2 ? 46 : 62);
  return is_27b ? double(c.hidden_size / c.num_heads) : double(c.head_dim);
}

// Gemma 2 and 3 as llama.cpp runs the file (checkpoint/gguf_export.h writes what it reads and
// refuses what it would run otherwise): the soft caps and window from the file, with llama.cpp's
// defaults where a key is absent (Gemma 2: caps 50 and 30, window 4096; Gemma 3: no final cap, no
// window, local RoPE base 10000), the scale and the windowed layers from its tables (Gemma 2 every
// even layer, Gemma 3 all but each sixth).
void read_gemma(const formats::GgufFile& file, const std::string& k, ModelConfig& c) {
  const bool gemma2 = c.family == Family::Gemma2;
  c.query_pre_attn_scalar = gemma_query_pre_attn_scalar(c);
  auto cap = [&](const std::string& key, double fallback) {
    const double v = file.number_value(k + key).value_or(fallback);
    require(v >= 0 && std::isfinite(v), "{}: {}{}: expected a non-negative number, found {}", file.path(), k, key, v);
    return v;
  };
  if (gemma2) c.attn_logit_softcap = cap("attn_logit_softcapping", 50.0);
  c.final_logit_softcap = cap("final_logit_softcapping", gemma2 ? 30.0 : 0.0);
  if (!gemma2) c.rope_local_theta = file.number_value(k + "rope.freq_base_swa").value_or(10000.0);
  // Gemma 3 without a window key (or 0) has none in llama.cpp.
  const auto window = file.integer_value(k + "attention.sliding_window");
  c.sliding_window = gemma2 ? positive(file, k + "attention.sliding_window", 4096) : window.value_or(0);
  require(c.sliding_window >= 0, "{}: {}attention.sliding_window: expected a non-negative integer, found {}",
          file.path(), k, c.sliding_window);
  // One entry per layer with a window, none without (ModelConfig's rule): a Gemma 3 file without
  // the key (the converter leaves it out for sliding_window_pattern 1) has all layers global.
  c.sliding_layers.clear();
  if (c.sliding_window == 0) return;
  c.sliding_layers.assign(size_t(c.num_layers), false);
  for (int64_t i = 0; i < c.num_layers; ++i) c.sliding_layers[size_t(i)] = gemma2 ? i % 2 == 0 : i % 6 < 5;
}

// A mixture of experts as llama.cpp runs the file. Qwen3-MoE (qwen3moe) and Mixtral (llama with
// experts): every layer sparse, the top-k weights always renormalised (build_moe_ffn's norm_w,
// which no key changes); Mixtral's experts as wide as feed_forward_length (its intermediate_size).
// GLM-4.5 (glm4moe): its leading dense layers, sigmoid scores with the correction bias, expert
// groups, renormalisation, scaling and shared experts from the keys, llama.cpp's defaults where a
// key is absent; block_count counts the multi-token-prediction layers, which keel does not run.
void read_experts(const formats::GgufFile& file, const std::string& k, ModelConfig& c) {
  auto& m = c.moe;
  m.experts = positive(file, k + "expert_count");
  m.experts_per_token = positive(file, k + "expert_used_count");
  m.intermediate_size = c.family == Family::Mixtral
                            ? positive(file, k + "expert_feed_forward_length", c.intermediate_size)
                            : positive(file, k + "expert_feed_forward_length");
  m.norm_topk_prob = true;
  m.output_router_logits = false;  // transformers' loaded config's default: no load-balancing loss
  m.sparse_layers.assign(size_t(c.num_layers), true);
  if (c.family != Family::Glm4Moe) return;
  const int64_t nextn = file.integer_value(k + "nextn_predict_layers").value_or(0);
  require(nextn >= 0 && nextn < c.num_layers, "{}: {}nextn_predict_layers: expected from 0 to block_count - 1, "
          "found {}", file.path(), k, nextn);
  c.num_layers -= nextn;
  c.nextn_predict_layers = nextn;
  const int64_t dense = file.integer_value(k + "leading_dense_block_count").value_or(0);
  require(dense >= 0 && dense < c.num_layers, "{}: {}leading_dense_block_count: expected from 0 to {}, found {}",
          file.path(), k, c.num_layers - 1, dense);
  m.sparse_layers.assign(size_t(c.num_layers), true);
  for (int64_t i = 0; i < dense; ++i) m.sparse_layers[size_t(i)] = false;
  const int64_t gating = file.integer_value(k + "expert_gating_func").value_or(2);
  require(gating == 2, "{}: {}expert_gating_func is {}: GLM-4.5 scores its experts with a sigmoid (2), which is "
          "what keel trains", file.path(), k, gating);
  m.sigmoid_router = true;
  m.groups = file.integer_value(k + "expert_group_count").value_or(1);
  m.topk_groups = file.integer_value(k + "expert_group_used_count").value_or(1);
  m.norm_topk_prob = file.bool_value(k + "expert_weights_norm").value_or(false);
  // llama.cpp scales by the key where it is not 0 (its default): 0 and absent are 1.
  const double scale = file.number_value(k + "expert_weights_scale").value_or(0.0);
  m.routed_scaling_factor = scale == 0.0 ? 1.0 : scale;
  const int64_t shared = file.integer_value(k + "expert_shared_count").value_or(0);
  require(shared >= 0 && shared <= 1024 && m.intermediate_size <= (int64_t(1) << 22),
          "{}: {}expert_shared_count {} of experts {} wide: expected at most 1024 shared experts of at most 4194304",
          file.path(), k, shared, m.intermediate_size);
  m.shared_intermediate_size = shared * m.intermediate_size;
  m.router_aux_loss_coef = 0;  // Glm4MoeForCausalLM adds no such loss
}

}  // namespace

std::vector<std::string> gguf_config_notes(const ModelConfig& c) {
  if (c.family == Family::Qwen3Moe)
    // transformers' GGUF config mapping (integrations/ggml.py, 5.24) reads no expert width or
    // renormalisation for qwen3moe: Qwen3MoeConfig's defaults (768, norm_topk_prob false) stand in.
    return {fmt::format(
        "each token's top-{} expert weights renormalised to sum to 1, as llama.cpp runs a qwen3moe file (no key says "
        "otherwise; the published Qwen3-MoE models do the same); transformers' GGUF loader reads neither that nor the "
        "experts' width ({}) and takes Qwen3MoeConfig's defaults (norm_topk_prob false, 768), so a directory it makes "
        "of this file trains another model",
        c.moe.experts_per_token, c.moe.intermediate_size)};
  if (!c.gemma()) return {};
  std::vector<std::string> notes;
  const bool gemma2 = c.family == Family::Gemma2;
  // transformers' GGUF config mapping (integrations/ggml.py, 5.24) reads the window, not the caps
  // or the scale: Gemma2Config's / Gemma3TextConfig's defaults stand in for them.
  const double hf_attn = gemma2 ? 50.0 : 0.0, hf_final = gemma2 ? 30.0 : 0.0;
  if (c.query_pre_attn_scalar != 256.0 || c.attn_logit_softcap != hf_attn || c.final_logit_softcap != hf_final)
    notes.push_back(fmt::format(
        "attention scaled by query_pre_attn_scalar^-0.5 = {:g}^-0.5 (llama.cpp's rule; no key carries it), soft caps "
        "{:g} (attention) and {:g} (final, 0: none) as the file states: the model as llama.cpp runs it. transformers' "
        "GGUF loader reads none of them and takes its config class's defaults (256, {:g}, {:g}), so a directory it "
        "makes of this file trains another model",
        c.query_pre_attn_scalar, c.attn_logit_softcap, c.final_logit_softcap, hf_attn, hf_final));
  if (!gemma2 && c.sliding_window == 0)
    notes.push_back(
        "no attention.sliding_window: every layer attends to all positions, as llama.cpp runs the file; "
        "transformers' GGUF loader takes Gemma3TextConfig's window of 4096 on all but each sixth layer");
  if (!gemma2 && c.rope_local_theta != 10000.0)
    notes.push_back(fmt::format(
        "the windowed layers' RoPE base {:g} from rope.freq_base_swa; transformers' GGUF loader does not read it "
        "and takes Gemma3TextConfig's 10000",
        c.rope_local_theta));
  return notes;
}

std::string gguf_readable_architectures() {
  std::string out;
  for (const auto& [name, family] : kArchitectures) out += (out.empty() ? "" : ", ") + std::string(name);
  return out;
}

bool is_gguf_path(const std::string& path) { return std::string_view(path).ends_with(".gguf"); }

ModelConfig gguf_model_config(const formats::GgufFile& file) {
  const auto arch = file.string_value("general.architecture");
  require(arch.has_value(), "{}: metadata key 'general.architecture' is missing: not a model file", file.path());
  require(file.string_value("general.type").value_or("model") == "model",
          "{}: general.type is '{}': a {} file, not a model (train from the base model's file; a LoRA adapter "
          "GGUF is for llama.cpp's --lora)",
          file.path(), *file.string_value("general.type"), *file.string_value("general.type"));
  ModelConfig c;
  bool known = false;
  for (const auto& [name, family] : kArchitectures)
    if (*arch == name) c.family = family, known = true;
  if (c.family == Family::Llama && file.integer_value("llama.expert_count").value_or(0) > 0)
    c.family = Family::Mixtral;  // the converter's LlamaModel writes MixtralForCausalLM as llama with experts
  require(known, "{}: general.architecture '{}': keel trains GGUF files of the architectures {} (convert the model "
          "to a Hugging Face directory with transformers' from_pretrained(dir, gguf_file=...) and save_pretrained "
          "for another family keel trains)",
          file.path(), *arch, gguf_readable_architectures());
  const std::string k = *arch + ".";
  c.hidden_size = positive(file, k + "embedding_length");
  c.num_layers = positive(file, k + "block_count");
  // Bounded before anything is sized by it (config.json's limit; validate checks the rest).
  require(c.num_layers < 10000, "{}: {}block_count: expected fewer than 10000 layers, found {}", file.path(), k,
          c.num_layers);
  c.intermediate_size = positive(file, k + "feed_forward_length");
  c.num_heads = positive(file, k + "attention.head_count");
  c.num_kv_heads = positive(file, k + "attention.head_count_kv", c.num_heads);
  c.head_dim = positive(file, k + "attention.key_length", c.hidden_size / c.num_heads);
  const int64_t value_length = positive(file, k + "attention.value_length", c.head_dim);
  require(value_length == c.head_dim, "{}: {}attention.value_length {} differs from key_length {}: keel's attention "
          "has one head size", file.path(), k, value_length, c.head_dim);
  c.max_position_embeddings = positive(file, k + "context_length");
  // llama.cpp's defaults where the converter left the key out (llama-model.cpp).
  c.rope_theta = file.number_value(k + "rope.freq_base").value_or(10000.0);
  const auto eps = file.number_value(k + "attention.layer_norm_rms_epsilon");
  require(eps.has_value() && *eps > 0, "{}: metadata key '{}attention.layer_norm_rms_epsilon' is missing or not "
          "positive", file.path(), k);
  c.rms_norm_eps = *eps;
  // Anything that would make RoPE differ from the plain one keel computes: said, not trained past.
  const auto scaling = file.string_value(k + "rope.scaling.type");
  require(!scaling || *scaling == "none",
          "{}: {}rope.scaling.type is '{}': keel trains GGUF models with plain RoPE only", file.path(), k,
          scaling.value_or(""));
  require(!find_tensor(file, "rope_freqs.weight"),
          "{}: tensor 'rope_freqs.weight' (Llama 3.1-style RoPE frequency factors): keel trains GGUF models with "
          "plain RoPE only",
          file.path());
  const auto* embedding = find_tensor(file, "token_embd.weight");
  require(embedding && embedding->shape.size() == 2,
          "{}: tensor 'token_embd.weight' is missing or not a matrix: not a model file", file.path());
  c.vocab_size = embedding->shape[0];
  require(embedding->shape[1] == c.hidden_size, "{}: token_embd.weight has {} columns, {}embedding_length is {}",
          file.path(), embedding->shape[1], k, c.hidden_size);
  c.tie_word_embeddings = !find_tensor(file, "output.weight");  // the converter drops a tied head
  const auto id = [&](std::string_view which) {
    return file.integer_value("tokenizer.ggml." + std::string(which) + "_token_id").value_or(-1);
  };
  c.bos_token_id = id("bos");
  c.pad_token_id = id("padding");
  if (id("eos") >= 0) c.eos_token_ids = {id("eos")};
  c.torch_dtype = DType::F32;  // dequantized to fp32 at load, as transformers does
  apply_family_traits(c);
  if (c.gemma()) read_gemma(file, k, c);
  if (c.family == Family::Mixtral || c.family == Family::Qwen3Moe || c.family == Family::Glm4Moe)
    read_experts(file, k, c);
  if (c.family == Family::Glm4Moe) {
    // llama.cpp's glm4moe: RoPE on the first rope.dimension_count channels in rotate_half's pairs;
    // biases and q/k norms where the file has them (the GLM-4.5 355B model has no q/k norms).
    c.rotary_dim = positive(file, k + "rope.dimension_count", c.head_dim / 2);
    c.qkv_bias = find_tensor(file, "blk.0.attn_q.bias") != nullptr;
    c.qk_norm = find_tensor(file, "blk.0.attn_q_norm.weight") != nullptr;
  }
  if (c.family == Family::Glm) {
    // llama.cpp's chatglm: RoPE on the first rope.dimension_count channels of each head, in
    // adjacent pairs (GLM-4's interleaved ones); q/k/v biases where the file has them.
    c.rotary_dim = positive(file, k + "rope.dimension_count", c.head_dim / 2);
    c.qkv_bias = find_tensor(file, "blk.0.attn_q.bias") != nullptr;
  }
  validate(c, file.path());
  c.config_json = model_config_json(c, DType::F32);
  return c;
}

}  // namespace keel::model
