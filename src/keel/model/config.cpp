#include "keel/model/config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <simdjson.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string_view>

#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/core/json_text.h"
#include "keel/model/config_formats.h"

namespace keel::model {
namespace {

using namespace config_formats;

namespace dom = simdjson::dom;

std::string supported_architectures() {
  std::string list;
  for (const auto& format : family_formats()) {
    for (auto arch : format.architectures) list += (list.empty() ? "" : ", ") + std::string(arch);
  }
  return list;
}

// Sane upper bounds: a config.json is untrusted input, and these sizes become allocations.
constexpr int64_t kMaxVocab = int64_t(1) << 31;
constexpr int64_t kMaxHidden = int64_t(1) << 20;
constexpr int64_t kMaxIntermediate = int64_t(1) << 22;
constexpr int64_t kMaxLayers = 10000;
constexpr int64_t kMaxHeads = int64_t(1) << 14;
constexpr int64_t kMaxHeadDim = int64_t(1) << 14;
constexpr int64_t kMaxProjection = int64_t(1) << 22;  // heads * head_dim
constexpr int64_t kMaxPositions = int64_t(1) << 31;

// --- reading config.json -------------------------------------------------------------------------

// The top-level object of a config.json with typed, checked accessors. Absent and null are the
// same: transformers writes null for "use the default".
class ConfigObject {
 public:
  ConfigObject(dom::object object, const std::string& path) : path_(path) {
    for (dom::key_value_pair kv : object) {
      // Python's json keeps the last duplicate, simdjson the first: refuse rather than guess.
      if (!values_.emplace(kv.key, kv.value).second) fail("{}: key '{}': expected once, found twice", path, kv.key);
    }
  }

  const std::string& path() const { return path_; }

  // The key is written, even as null (where null and absent mean different things).
  bool written(std::string_view key) const { return values_.count(key) > 0; }

  // Present, null included (get() takes null for absent).
  bool has(std::string_view key) const { return values_.find(key) != values_.end(); }

  std::optional<dom::element> get(std::string_view key) const {
    auto it = values_.find(key);
    if (it == values_.end() || it->second.is_null()) return std::nullopt;
    return it->second;
  }

  [[noreturn]] void wrong_type(std::string_view key, std::string_view expected, dom::element found) const {
    fail("{}: key '{}': expected {}, found {}", path_, key, expected, json_describe(found));
  }

  int64_t positive_int(std::string_view key) const {
    auto v = get(key);
    if (!v) fail("{}: key '{}': expected a positive integer, found nothing (the key is required)", path_, key);
    return positive_int_value(key, *v);
  }

  int64_t positive_int_or(std::string_view key, int64_t fallback) const {
    auto v = get(key);
    return v ? positive_int_value(key, *v) : fallback;
  }

  // Token ids: absent or null -> -1.
  int64_t token_id_or_none(std::string_view key) const {
    auto v = get(key);
    if (!v) return -1;
    auto id = integer(*v);
    if (!id || *id < 0) wrong_type(key, "a non-negative integer or null", *v);
    return *id;
  }

  double positive_number_or(std::string_view key, double fallback) const {
    auto v = get(key);
    if (!v) return fallback;
    return positive_number_value(key, *v);
  }

  double positive_number_value(std::string_view key, dom::element v) const {
    if (!v.is_number()) wrong_type(key, "a positive number", v);
    double x = v.type() == dom::element_type::DOUBLE  ? double(v)
               : v.type() == dom::element_type::INT64 ? double(int64_t(v))
                                                      : double(uint64_t(v));
    if (!(x > 0) || !std::isfinite(x)) wrong_type(key, "a positive number", v);
    return x;
  }

  // A count that may be 0 (first_k_dense_replace, num_nextn_predict_layers), or the fallback when absent.
  int64_t non_negative_int_or(std::string_view key, int64_t fallback) const {
    auto v = get(key);
    if (!v) return fallback;
    auto x = integer(*v);
    if (!x || *x < 0) wrong_type(key, "a non-negative integer", *v);
    return *x;
  }

  bool bool_or(std::string_view key, bool fallback) const {
    auto v = get(key);
    if (!v) return fallback;
    if (!v->is_bool()) wrong_type(key, "true or false", *v);
    return bool(*v);
  }

  std::optional<std::string> string(std::string_view key) const {
    auto v = get(key);
    if (!v) return std::nullopt;
    if (!v->is_string()) wrong_type(key, "a string", *v);
    return std::string(std::string_view(*v));
  }

  static std::optional<int64_t> integer(dom::element v) {
    if (v.type() == dom::element_type::INT64) return int64_t(v);
    if (v.type() == dom::element_type::DOUBLE) {  // 4096.0: a float that is a whole number
      double x = double(v);
      if (std::isfinite(x) && x == std::floor(x) && std::abs(x) < 9.0e15) return int64_t(x);
    }
    return std::nullopt;  // UINT64 is above int64's range: too large for any size
  }

 private:
  int64_t positive_int_value(std::string_view key, dom::element v) const {
    auto x = integer(v);
    if (!x || *x <= 0) wrong_type(key, "a positive integer", v);
    return *x;
  }

  const std::string& path_;
  std::map<std::string_view, dom::element, std::less<>> values_;  // views into the parser's document
};

Family detect_family(const ConfigObject& cfg, std::string* architecture) {
  std::optional<std::string> model_type = cfg.string("model_type");
  if (auto archs = cfg.get("architectures")) {
    dom::array list;
    dom::element first;
    if (archs->get_array().get(list) != simdjson::SUCCESS || list.at(0).get(first) != simdjson::SUCCESS ||
        !first.is_string()) {
      cfg.wrong_type("architectures", "a non-empty array of strings", *archs);
    }
    *architecture = std::string(std::string_view(first));
    for (const auto& format : family_formats()) {
      for (auto arch : format.architectures) {
        if (arch == *architecture) return format.family;
      }
    }
    // THUDM's checkpoints name several remote-code classes; model_type is the reliable mark.
    if (model_type == "chatglm") return Family::GlmOriginal;
    fail("{}: key 'architectures': expected one of {}, found \"{}\" (not supported)", cfg.path(),
         supported_architectures(), *architecture);
  }
  if (model_type) {
    for (const auto& format : family_formats()) {
      if (format.model_type == *model_type) {
        *architecture = std::string(format.architectures.front());
        return format.family;
      }
    }
  }
  fail("{}: key 'architectures': expected one of {} (or a known model_type), found {}", cfg.path(),
       supported_architectures(), model_type ? fmt::format("model_type \"{}\"", *model_type) : "neither key");
}

// keel implements plain RoPE (Su et al. 2021); scaled variants (linear, dynamic NTK, YaRN,
// llama3) change the frequencies and would silently give wrong results.
void require_default_rope(const ConfigObject& cfg, std::string_view key, bool type_required) {
  auto v = cfg.get(key);
  if (!v) return;
  dom::object object;
  if (v->get_object().get(object) != simdjson::SUCCESS) cfg.wrong_type(key, "an object or null", *v);
  // Gemma 3 (transformers v5): one set of parameters per layer type, each checked the same way.
  for (std::string_view layer_type : {"full_attention", "sliding_attention"}) {
    dom::object per_type;
    if (object[layer_type].get(per_type) != simdjson::SUCCESS) continue;
    dom::element type;
    if ((per_type["rope_type"].get(type) == simdjson::SUCCESS || per_type["type"].get(type) == simdjson::SUCCESS) &&
        !(type.is_string() && std::string_view(type) == "default"))
      fail("{}: key '{}.{}': RoPE scaling {} is not supported (keel implements plain RoPE only; expected rope_type "
           "\"default\")",
           cfg.path(), key, layer_type, json_describe(type));
  }
  dom::element type;
  bool has_type = object["rope_type"].get(type) == simdjson::SUCCESS || object["type"].get(type) == simdjson::SUCCESS;
  if (!has_type && (!type_required || object.size() == 0)) return;
  if (has_type && type.is_string() && std::string_view(type) == "default") return;
  fail(
      "{}: key '{}': RoPE scaling {} is not supported (keel implements plain RoPE only; expected null or "
      "rope_type \"default\")",
      cfg.path(), key, has_type ? json_describe(type) : simdjson::minify(*v));
}

// transformers v5 moved rope_theta and partial_rotary_factor into "rope_parameters" (for Gemma 3
// one object per layer type: `layer_type`); the top-level key wins when both are present.
std::optional<double> rope_parameter(const ConfigObject& cfg, std::string_view name,
                                     std::string_view layer_type = {}) {
  auto params = cfg.get("rope_parameters");
  dom::element scope, v;
  if (!params || !params->is_object()) return std::nullopt;
  scope = *params;
  if (!layer_type.empty() && (scope[layer_type].get(scope) != simdjson::SUCCESS || !scope.is_object()))
    return std::nullopt;
  if (scope[name].get(v) != simdjson::SUCCESS || v.is_null()) return std::nullopt;
  return cfg.positive_number_value(
      layer_type.empty() ? fmt::format("rope_parameters.{}", name)
                         : fmt::format("rope_parameters.{}.{}", layer_type, name),
      v);
}

// Gemma 2 and 3: GeGLU, (1 + w) norms, scaled embeddings, sandwich norms, the attention's scale
// and the soft caps, read as Gemma2Config / Gemma3TextConfig read them (an absent cap is the
// class's default, null none).
void parse_gemma(const ConfigObject& cfg, ModelConfig& c) {
  std::optional<std::string> act = cfg.string("hidden_activation");
  std::string_view key = "hidden_activation";
  if (!act) act = cfg.string("hidden_act"), key = "hidden_act";
  if (act && *act != "gelu_pytorch_tanh") {
    fail("{}: key '{}': expected \"gelu_pytorch_tanh\" (the GeGLU MLP keel implements), found \"{}\" (not "
         "supported)",
         cfg.path(), key, *act);
  }
  if (cfg.bool_or("use_bidirectional_attention", false)) {
    fail("{}: key 'use_bidirectional_attention': true is not supported (keel trains causal language models; "
         "expected false)",
         cfg.path());
  }
  c.mlp_activation = kernels::GluActivation::GeluTanh;
  c.norm_weight_offset = 1.0;
  c.scale_embeddings = true;
  c.sandwich_norms = true;
  c.query_pre_attn_scalar = cfg.positive_number_or("query_pre_attn_scalar", 256.0);
  const bool gemma2 = c.family == Family::Gemma2;
  auto cap = [&](std::string_view name, double gemma2_default) {
    if (!cfg.written(name)) return gemma2 ? gemma2_default : 0.0;
    return cfg.positive_number_or(name, 0.0);
  };
  c.attn_logit_softcap = cap("attn_logit_softcapping", 50.0);
  c.final_logit_softcap = cap("final_logit_softcapping", 30.0);
}

// A flag of the original ChatGLM format that selects a variant keel does not implement.
void require_flag(const ConfigObject& cfg, std::string_view key, bool default_value, bool supported,
                  std::string_view why) {
  if (cfg.bool_or(key, default_value) != supported) {
    fail("{}: key '{}': {} is not supported ({}; expected {})", cfg.path(), key, json_bool(!supported), why,
         json_bool(supported));
  }
}

int64_t head_dim_or_derived(const ConfigObject& cfg, const FormatKeys& k, const ModelConfig& c) {
  if (cfg.get(k.head_dim)) return cfg.positive_int(k.head_dim);
  if (c.family == Family::Qwen3) return 128;  // Qwen3Config's default, not hidden / heads
  if (c.gemma()) return 256;                  // Gemma2Config's and Gemma3TextConfig's
  if (c.hidden_size % c.num_heads != 0) {
    fail("{}: key '{}': absent, and {} ({}) is not a multiple of {} ({}) to derive it from", cfg.path(), k.head_dim,
         k.hidden, c.hidden_size, k.heads, c.num_heads);
  }
  return c.hidden_size / c.num_heads;
}

// Llama's and Qwen3's attention_bias adds a bias to o_proj as well as q/k/v, and keel has no
// o_proj bias: accepting it would drop a trained tensor.
void refuse_attention_bias(const ConfigObject& cfg, std::string_view architecture) {
  if (cfg.bool_or("attention_bias", false)) {
    fail("{}: key 'attention_bias': true is not supported for {} (it adds an o_proj bias keel does not implement; "
         "expected false)",
         cfg.path(), architecture);
  }
}

// "layer_types": one "full_attention" or "sliding_attention" per layer.
std::vector<bool> parse_layer_types(const ConfigObject& cfg, int64_t layers) {
  constexpr std::string_view expected = "a list of \"full_attention\" / \"sliding_attention\", one per layer";
  auto v = cfg.get("layer_types");
  dom::array list;
  if (v->get_array().get(list) != simdjson::SUCCESS || int64_t(list.size()) != layers)
    cfg.wrong_type("layer_types", fmt::format("{} ({})", expected, layers), *v);
  std::vector<bool> sliding;
  for (dom::element item : list) {
    std::string_view type = item.is_string() ? std::string_view(item) : std::string_view();
    if (type != "full_attention" && type != "sliding_attention") cfg.wrong_type("layer_types", expected, *v);
    sliding.push_back(type == "sliding_attention");
  }
  return sliding;
}

// Sliding-window attention as each family's config class reads it: the window (an absent key is
// the classes' default 4096, null is none) and which layers use it (layer_types when written, or
// the family's rule).
void parse_sliding_window(const ConfigObject& cfg, ModelConfig& c) {
  // A layer count beyond the bound is validate()'s error to report; no per-layer list before it.
  if (c.num_layers >= kMaxLayers) return;
  std::function<bool(int64_t)> slides;  // the family's rule for layer l
  bool layer_types = true;              // whether the family reads layer_types
  switch (c.family) {
    case Family::Mistral:  // every layer; MistralModel ignores layer_types
    case Family::Mixtral:  // the same, but MixtralConfig's default is no window
      slides = [](int64_t) { return true; };
      layer_types = false;
      if (c.family == Family::Mixtral && !cfg.written("sliding_window")) return;
      break;
    case Family::Gemma2: slides = [](int64_t l) { return l % 2 == 0; }; break;
    case Family::Gemma3: {  // five of every sliding_window_pattern (6) layers
      const int64_t pattern = cfg.positive_int_or("sliding_window_pattern", 6);
      slides = [pattern](int64_t l) { return (l + 1) % pattern != 0; };
      break;
    }
    case Family::Qwen3Moe:
      if (cfg.bool_or("use_sliding_window", false))
        fail("{}: key 'use_sliding_window': true is not supported for Qwen3MoeForCausalLM (expected false)",
             cfg.path());
      return;
    case Family::Qwen2:
    case Family::Qwen3: {  // only with use_sliding_window, from max_window_layers on
      if (!cfg.bool_or("use_sliding_window", false)) return;
      if (c.family == Family::Qwen2) {
        fail("{}: key 'use_sliding_window': true is not supported for Qwen2ForCausalLM (expected false)", cfg.path());
      }
      const int64_t first = cfg.get("max_window_layers") ? cfg.positive_int("max_window_layers") : 28;
      slides = [first](int64_t l) { return l >= first; };
      break;
    }
    default: return;
  }
  c.sliding_window = cfg.written("sliding_window") ? cfg.positive_int_or("sliding_window", 0) : 4096;
  if (c.sliding_window == 0) return;
  if (layer_types && cfg.get("layer_types")) {
    c.sliding_layers = parse_layer_types(cfg, c.num_layers);
  } else {
    for (int64_t l = 0; l < c.num_layers; ++l) c.sliding_layers.push_back(slides(l));
  }
}

// A non-negative number (a coefficient that may be 0), or the fallback when absent.
double non_negative_number_or(const ConfigObject& cfg, std::string_view key, double fallback) {
  auto v = cfg.get(key);
  if (!v) return fallback;
  if (!v->is_number()) cfg.wrong_type(key, "a non-negative number", *v);
  const double x = v->type() == dom::element_type::DOUBLE  ? double(*v)
                   : v->type() == dom::element_type::INT64 ? double(int64_t(*v))
                                                            : double(uint64_t(*v));
  if (!(x >= 0) || !std::isfinite(x)) cfg.wrong_type(key, "a non-negative number", *v);
  return x;
}

// The number of experts under either of its names: Qwen3MoeConfig and MixtralConfig map
// num_experts to num_local_experts (their attribute_map), so published Qwen3-MoE configs say
// num_experts, Mixtral's and any config transformers 5 saves say num_local_experts, and each class
// reads both. Both present and different is a config transformers would read one way by key order.
int64_t experts_count(const ConfigObject& cfg, int64_t fallback) {
  const bool named = cfg.get("num_experts").has_value(), local = cfg.get("num_local_experts").has_value();
  const int64_t experts = cfg.positive_int_or(named ? "num_experts" : "num_local_experts", fallback);
  if (named && local && cfg.positive_int_or("num_local_experts", fallback) != experts)
    fail("{}: keys 'num_experts' ({}) and 'num_local_experts' ({}) differ: they name the same number (transformers' "
         "attribute_map); expected one of them, or equal values",
         cfg.path(), experts, cfg.positive_int_or("num_local_experts", fallback));
  return experts;
}

// Qwen3MoeConfig's experts (its defaults where a key is absent), and which layers are sparse as
// Qwen3MoeDecoderLayer decides: not in mlp_only_layers and (layer + 1) a multiple of
// decoder_sparse_step.
void parse_experts(const ConfigObject& cfg, ModelConfig& c) {
  auto& m = c.moe;
  m.experts = experts_count(cfg, 128);
  m.experts_per_token = cfg.positive_int_or("num_experts_per_tok", 8);
  m.intermediate_size = cfg.positive_int_or("moe_intermediate_size", 768);
  m.norm_topk_prob = cfg.bool_or("norm_topk_prob", false);
  m.router_aux_loss_coef = non_negative_number_or(cfg, "router_aux_loss_coef", 0.001);
  m.output_router_logits = cfg.bool_or("output_router_logits", false);
  const int64_t step = cfg.positive_int_or("decoder_sparse_step", 1);
  std::vector<bool> dense(size_t(std::min(c.num_layers, kMaxLayers)), false);
  if (auto v = cfg.get("mlp_only_layers")) {
    constexpr std::string_view expected = "a list of layer indices (integers from 0 to num_hidden_layers - 1)";
    dom::array list;
    if (v->get_array().get(list) != simdjson::SUCCESS) cfg.wrong_type("mlp_only_layers", expected, *v);
    for (dom::element item : list) {
      auto l = ConfigObject::integer(item);
      if (!l || *l < 0 || *l >= int64_t(dense.size())) cfg.wrong_type("mlp_only_layers", expected, *v);
      dense[size_t(*l)] = true;
    }
  }
  m.sparse_layers.clear();
  for (int64_t l = 0; l < int64_t(dense.size()); ++l)
    m.sparse_layers.push_back(!dense[size_t(l)] && (l + 1) % step == 0);
}

// MixtralConfig's experts: every layer sparse, intermediate_size their width, top-k always
// renormalised (MixtralTopKRouter divides by the sum).
void parse_mixtral_experts(const ConfigObject& cfg, ModelConfig& c) {
  auto& m = c.moe;
  m.experts = experts_count(cfg, 8);
  m.experts_per_token = cfg.positive_int_or("num_experts_per_tok", 2);
  m.intermediate_size = c.intermediate_size;
  m.norm_topk_prob = true;
  m.router_aux_loss_coef = non_negative_number_or(cfg, "router_aux_loss_coef", 0.001);
  m.output_router_logits = cfg.bool_or("output_router_logits", false);
  if (non_negative_number_or(cfg, "router_jitter_noise", 0.0) > 0)
    fail("{}: key 'router_jitter_noise': a positive value is not supported (MixtralSparseMoeBlock scales each "
         "hidden state by random noise in training; keel does not; expected 0)",
         cfg.path());
  m.sparse_layers.assign(size_t(std::min(c.num_layers, kMaxLayers)), true);
}

// Glm4MoeConfig's experts (its defaults where a key is absent): n_routed_experts (num_local_experts
// in its attribute_map) routed by a sigmoid router with group-limited top-k, n_shared_experts of
// width moe_intermediate_size, and the first first_k_dense_replace layers dense (Glm4MoeDecoderLayer:
// layer_idx >= first_k_dense_replace is sparse).
void parse_glm4_moe_experts(const ConfigObject& cfg, ModelConfig& c) {
  auto& m = c.moe;
  if (cfg.get("n_routed_experts") && cfg.get("num_local_experts") &&
      cfg.positive_int("n_routed_experts") != cfg.positive_int("num_local_experts"))
    fail("{}: keys 'n_routed_experts' and 'num_local_experts' differ: they name the same number (Glm4MoeConfig's "
         "attribute_map); expected one of them, or equal values",
         cfg.path());
  m.experts = cfg.positive_int_or("n_routed_experts", cfg.positive_int_or("num_local_experts", 128));
  m.experts_per_token = cfg.positive_int_or("num_experts_per_tok", 8);
  m.intermediate_size = cfg.positive_int_or("moe_intermediate_size", 1408);
  m.norm_topk_prob = cfg.bool_or("norm_topk_prob", true);
  m.sigmoid_router = true;
  m.groups = cfg.positive_int_or("n_group", 1);
  m.topk_groups = cfg.positive_int_or("topk_group", 1);
  m.routed_scaling_factor = cfg.positive_number_or("routed_scaling_factor", 1.0);
  // An absurd count is validate()'s to report; keep the product in range for it.
  m.shared_intermediate_size =
      std::min(cfg.non_negative_int_or("n_shared_experts", 1), kMaxIntermediate) *
      std::min(m.intermediate_size, kMaxIntermediate);
  m.output_router_logits = cfg.bool_or("output_router_logits", false);
  m.router_aux_loss_coef = 0;  // Glm4MoeConfig has none, and Glm4MoeForCausalLM adds no such loss
  if (auto scoring = cfg.string("scoring_func"); scoring && *scoring != "sigmoid")
    fail("{}: key 'scoring_func': Glm4MoeTopkRouter always scores with a sigmoid; expected \"sigmoid\", found \"{}\"",
         cfg.path(), *scoring);
  const int64_t dense = cfg.non_negative_int_or("first_k_dense_replace", 1);
  m.sparse_layers.clear();
  for (int64_t l = 0; l < std::min(c.num_layers, kMaxLayers); ++l) m.sparse_layers.push_back(l >= dense);
  c.nextn_predict_layers =
      std::min(cfg.non_negative_int_or("num_nextn_predict_layers", cfg.non_negative_int_or("num_mtp_layers", 1)),
               kMaxLayers);
}

// LlamaForCausalLM, Qwen2ForCausalLM, GlmForCausalLM, Qwen3ForCausalLM and MistralForCausalLM share
// transformers' key names.
void parse_transformers_format(const ConfigObject& cfg, ModelConfig& c) {
  const FormatKeys& k = kTransformersKeys;
  c.vocab_size = cfg.positive_int(k.vocab);
  c.hidden_size = cfg.positive_int(k.hidden);
  c.intermediate_size = cfg.positive_int(k.intermediate);
  c.num_layers = cfg.positive_int(k.layers);
  c.num_heads = cfg.positive_int(k.heads);
  c.num_kv_heads = cfg.positive_int_or(k.kv_heads, c.num_heads);
  c.head_dim = head_dim_or_derived(cfg, k, c);
  c.rms_norm_eps = cfg.positive_number_or(k.norm_eps, 1e-6);
  c.max_position_embeddings = cfg.positive_int_or(k.max_positions, format_of(c.family).default_max_positions);

  if (c.gemma()) {
    parse_gemma(cfg, c);
  } else if (auto act = cfg.string("hidden_act"); act && *act != "silu") {
    fail("{}: key 'hidden_act': expected \"silu\" (the SwiGLU MLP keel implements), found \"{}\" (not supported)",
         cfg.path(), *act);
  }
  require_default_rope(cfg, "rope_scaling", true);
  require_default_rope(cfg, "rope_parameters", false);
  // The config class's default_theta where neither key says: Mixtral's 1e6, the others' 1e4.
  const double default_theta = c.family == Family::Mixtral ? 1000000.0 : 10000.0;
  c.rope_theta = cfg.positive_number_or("rope_theta", rope_parameter(cfg, "rope_theta").value_or(default_theta));
  if (c.family == Family::Gemma3) {  // Gemma3TextConfig: global and local bases
    c.rope_theta = cfg.positive_number_or(
        "rope_theta", rope_parameter(cfg, "rope_theta", "full_attention").value_or(1000000.0));
    c.rope_local_theta = cfg.positive_number_or(
        "rope_local_base_freq", rope_parameter(cfg, "rope_theta", "sliding_attention").value_or(10000.0));
  }
  if (cfg.bool_or("mlp_bias", false)) {
    fail("{}: key 'mlp_bias': true is not supported (keel's MLP has no biases; expected false)", cfg.path());
  }

  c.rotary_dim = c.head_dim;
  c.rope_interleaved = false;
  switch (c.family) {
    case Family::Llama:
      refuse_attention_bias(cfg, "LlamaForCausalLM");
      c.qkv_bias = false;
      break;
    case Family::Qwen2:
      c.qkv_bias = true;  // Qwen2Attention always has q/k/v biases, whatever the config says
      break;
    case Family::Qwen3:
      refuse_attention_bias(cfg, "Qwen3ForCausalLM");
      c.qk_norm = true;
      break;
    case Family::Qwen3Moe:
      refuse_attention_bias(cfg, "Qwen3MoeForCausalLM");
      c.qk_norm = true;
      parse_experts(cfg, c);
      break;
    case Family::Mistral: break;  // MistralAttention has no biases, whatever the config says
    case Family::Mixtral: parse_mixtral_experts(cfg, c); break;  // MixtralAttention has no biases either
    case Family::Gemma2: refuse_attention_bias(cfg, "Gemma2ForCausalLM"); break;
    case Family::Gemma3:
      refuse_attention_bias(cfg, "Gemma3ForCausalLM");
      c.qk_norm = true;
      break;
    case Family::Glm: {
      c.qkv_bias = cfg.bool_or("attention_bias", true);
      double factor =
          cfg.positive_number_or("partial_rotary_factor", rope_parameter(cfg, "partial_rotary_factor").value_or(0.5));
      if (factor > 1.0) {
        fail("{}: key 'partial_rotary_factor': expected a number in (0, 1], found {}", cfg.path(), json_number(factor));
      }
      // As GlmRotaryEmbedding: int(head_dim * partial_rotary_factor), truncating.
      c.rotary_dim = int64_t(double(c.head_dim) * factor);
      c.rope_interleaved = true;
      break;
    }
    case Family::Glm4Moe: {
      // Glm4MoeAttention: q/k/v biases with attention_bias (o_proj never has one), q/k norms with
      // use_qk_norm; RoPE on the first head_dim x partial_rotary_factor channels of each head in
      // rotate_half's (i, i + d/2) pairs, not GLM-4's interleaved ones. Glm4MoeRotaryEmbedding reads
      // the factor from rope_parameters, where the config puts the top-level key (default 0.5).
      c.qkv_bias = cfg.bool_or("attention_bias", false);
      c.qk_norm = cfg.bool_or("use_qk_norm", false);
      double factor =
          rope_parameter(cfg, "partial_rotary_factor").value_or(cfg.positive_number_or("partial_rotary_factor", 0.5));
      if (factor > 1.0)
        fail("{}: key 'partial_rotary_factor': expected a number in (0, 1], found {}", cfg.path(), json_number(factor));
      c.rotary_dim = int64_t(double(c.head_dim) * factor);
      parse_glm4_moe_experts(cfg, c);
      break;
    }
    case Family::GlmOriginal: break;
  }
  parse_sliding_window(cfg, c);
}

// THUDM/glm-4-9b's own format (configuration_chatglm.py); defaults are ChatGLMConfig's.
void parse_chatglm_format(const ConfigObject& cfg, ModelConfig& c) {
  const FormatKeys& k = kChatGlmKeys;
  c.vocab_size = cfg.positive_int(k.vocab);
  c.hidden_size = cfg.positive_int(k.hidden);
  c.intermediate_size = cfg.positive_int(k.intermediate);
  c.num_layers = cfg.positive_int(k.layers);
  c.num_heads = cfg.positive_int(k.heads);
  c.head_dim = head_dim_or_derived(cfg, k, c);
  // Grouped-query attention is "multi-query attention" with multi_query_group_num groups.
  bool grouped = cfg.bool_or("multi_query_attention", false);
  c.num_kv_heads = grouped ? cfg.positive_int_or(k.kv_heads, 1) : c.num_heads;
  c.rms_norm_eps = cfg.positive_number_or(k.norm_eps, 1e-5);
  c.max_position_embeddings = cfg.positive_int_or(k.max_positions, format_of(c.family).default_max_positions);
  c.qkv_bias = cfg.bool_or("add_qkv_bias", false);
  c.rope_theta = kGlmRopeBase * cfg.positive_number_or("rope_ratio", 1.0);
  // RotaryEmbedding(kv_channels // 2) in modeling_chatglm.py: half of each head rotates, in
  // interleaved pairs (x[2i], x[2i+1]).
  c.rotary_dim = c.head_dim / 2;
  c.rope_interleaved = true;

  require_flag(cfg, "rmsnorm", true, true, "keel implements RMSNorm, not LayerNorm");
  require_flag(cfg, "post_layer_norm", true, true, "keel always applies the final norm");
  require_flag(cfg, "apply_residual_connection_post_layernorm", false, false, "keel implements the pre-norm residual");
  require_flag(cfg, "add_bias_linear", false, false, "keel's dense and MLP layers have no biases");
}

DType parse_torch_dtype(const ConfigObject& cfg) {
  // transformers >= 4.56 writes "dtype"; earlier versions "torch_dtype".
  std::string_view key = cfg.get("torch_dtype") ? "torch_dtype" : "dtype";
  auto v = cfg.get(key);
  if (!v) return DType::F32;
  std::string_view name = v->is_string() ? std::string_view(*v) : std::string_view();
  if (name == "float32") return DType::F32;
  if (name == "bfloat16") return DType::BF16;
  if (name == "float16") return DType::F16;
  cfg.wrong_type(key, "\"float32\", \"bfloat16\" or \"float16\"", *v);
}

std::vector<int64_t> parse_eos_token_ids(const ConfigObject& cfg) {
  auto v = cfg.get("eos_token_id");
  if (!v) return {};
  constexpr std::string_view expected = "a non-negative integer, a list of them, or null";
  if (auto id = ConfigObject::integer(*v)) {
    if (*id < 0) cfg.wrong_type("eos_token_id", expected, *v);
    return {*id};
  }
  dom::array list;
  if (v->get_array().get(list) != simdjson::SUCCESS) cfg.wrong_type("eos_token_id", expected, *v);
  std::vector<int64_t> ids;
  for (dom::element item : list) {
    auto id = ConfigObject::integer(item);
    if (!id || *id < 0) cfg.wrong_type("eos_token_id", expected, *v);
    ids.push_back(*id);
  }
  return ids;
}

void check_size(const std::string& where, const char* key, int64_t value, int64_t limit) {
  require(value > 0 && value < limit, "{}: {}: expected a positive integer below {}, found {}", where, key, limit,
          value);
}

}  // namespace

std::string family_name(Family f) { return std::string(format_of(f).name); }
std::string family_display_name(Family f) { return std::string(format_of(f).display_name); }

std::vector<Family> supported_families() {
  std::vector<Family> families;
  for (const auto& format : family_formats()) families.push_back(format.family);
  return families;
}

Family family_from_name(const std::string& name) {
  std::string valid;
  for (const auto& format : family_formats()) {
    if (format.name == name) return format.family;
    valid += (valid.empty() ? "" : ", ") + std::string(format.name);
  }
  fail("model family: expected one of {}, found \"{}\"", valid, name);
}

bool ModelConfig::next_token_prediction_tensor(const std::string& name) const {
  for (int64_t i = 0; i < nextn_predict_layers; ++i)
    if (name.starts_with("model.layers." + std::to_string(num_layers + i) + ".")) return true;
  return false;
}

int64_t ModelConfig::embedding_padding_idx() const {
  // nn.Embedding refuses a padding_idx outside the table; keel trains such a model without one.
  return format_of(family).embedding_padding_idx && pad_token_id >= 0 && pad_token_id < vocab_size ? pad_token_id : -1;
}

int64_t ModelConfig::matmul_parameters() const {
  int64_t attention = hidden_size * q_size() + 2 * hidden_size * kv_size() + q_size() * hidden_size;
  int64_t mlp = 3 * hidden_size * intermediate_size;  // gate, up, down (SwiGLU)
  // A sparse layer's token meets the router and its experts_per_token experts only: the active
  // parameters, as MoE MFU is counted.
  int64_t sparse_mlp = hidden_size * moe.experts + moe.experts_per_token * 3 * hidden_size * moe.intermediate_size +
                       3 * hidden_size * moe.shared_intermediate_size;  // + the shared experts (GLM-4.5)
  int64_t total = vocab_size * hidden_size;  // the LM head is a matmul on every token even when tied
  for (int64_t l = 0; l < num_layers; ++l) total += attention + (sparse_layer(l) ? sparse_mlp : mlp);
  return total;
}

int64_t ModelConfig::total_parameters() const {
  int64_t embedding = vocab_size * hidden_size;
  int64_t lm_head = tie_word_embeddings ? 0 : vocab_size * hidden_size;
  int64_t per_layer = hidden_size * q_size() + 2 * hidden_size * kv_size() + q_size() * hidden_size +
                      3 * hidden_size * intermediate_size + 2 * hidden_size;  // + input and post-attention norms
  if (qkv_bias) per_layer += q_size() + 2 * kv_size();
  if (qk_norm) per_layer += 2 * head_dim;         // q_norm, k_norm
  if (sandwich_norms) per_layer += 2 * hidden_size;  // the attention's and the MLP's output norms
  int64_t experts = 0;  // a sparse layer: the router and every expert in place of the dense MLP
  for (int64_t l = 0; l < num_layers; ++l)
    if (sparse_layer(l))
      experts += hidden_size * moe.experts + moe.experts * 3 * hidden_size * moe.intermediate_size -
                 3 * hidden_size * (intermediate_size - moe.shared_intermediate_size) +
                 (moe.sigmoid_router ? moe.experts : 0);  // GLM-4.5's e_score_correction_bias
  return embedding + lm_head + num_layers * per_layer + experts + hidden_size;  // + final norm
}

void validate(const ModelConfig& c, const std::string& where) {
  const FormatKeys& k = keys_of(c.family);
  const std::string family(format_of(c.family).name);
  check_size(where, k.vocab, c.vocab_size, kMaxVocab);
  check_size(where, k.hidden, c.hidden_size, kMaxHidden);
  check_size(where, k.intermediate, c.intermediate_size, kMaxIntermediate);
  check_size(where, k.layers, c.num_layers, kMaxLayers);
  check_size(where, k.heads, c.num_heads, kMaxHeads);
  check_size(where, k.kv_heads, c.num_kv_heads, kMaxHeads);
  check_size(where, k.head_dim, c.head_dim, kMaxHeadDim);
  check_size(where, k.max_positions, c.max_position_embeddings, kMaxPositions);
  require(c.num_heads % c.num_kv_heads == 0,
          "{}: {}: expected a multiple of {} ({}) so query heads share key/value heads evenly, found {}", where,
          k.heads, k.kv_heads, c.num_kv_heads, c.num_heads);
  require(c.q_size() < kMaxProjection, "{}: {} x {}: expected below {}, found {}", where, k.heads, k.head_dim,
          kMaxProjection, c.q_size());

  std::string_view rotary_source = c.family == Family::Glm || c.family == Family::Glm4Moe
                                       ? " (head_dim x partial_rotary_factor)"
                                   : c.family == Family::GlmOriginal ? " (kv_channels / 2)"
                                                                     : "";
  require(c.rotary_dim > 0 && c.rotary_dim % 2 == 0 && c.rotary_dim <= c.head_dim,
          "{}: rotary dimension{}: expected an even number from 2 to {} ({}), found {}", where, rotary_source,
          k.head_dim, c.head_dim, c.rotary_dim);
  require(c.rope_theta > 0 && std::isfinite(c.rope_theta), "{}: rope_theta: expected a positive number, found {}",
          where, c.rope_theta);
  require(c.rms_norm_eps > 0 && std::isfinite(c.rms_norm_eps), "{}: {}: expected a positive number, found {}", where,
          k.norm_eps, c.rms_norm_eps);
  for (int64_t id : c.eos_token_ids)
    require(id >= 0, "{}: eos_token_id: expected non-negative ids, found {}", where, id);
  require(c.bos_token_id >= -1 && c.pad_token_id >= -1, "{}: bos/pad_token_id: expected an id or -1 for none", where);

  // What each format can express: a config outside it could not be exported faithfully.
  bool transformers_rope = c.family == Family::Llama || c.family == Family::Qwen2 || c.family == Family::Qwen3 ||
                           c.family == Family::Qwen3Moe || c.family == Family::Mistral || c.family == Family::Mixtral ||
                           c.family == Family::Glm4Moe || c.gemma();
  require(c.rope_interleaved != transformers_rope,
          "{}: rope_interleaved: the {} format expects {} RoPE pairs, found the other layout", where, family,
          transformers_rope ? "half-split (i, i + d/2)" : "interleaved (2i, 2i+1)");
  require(!transformers_rope || c.family == Family::Glm4Moe || c.rotary_dim == c.head_dim,
          "{}: rotary dimension: the {} format rotates the whole head ({}), found {}", where, family, c.head_dim,
          c.rotary_dim);
  require(c.family != Family::GlmOriginal || c.rotary_dim * 2 == c.head_dim,
          "{}: rotary dimension: the glm_original format rotates half of each head ({}), found {}", where,
          c.head_dim / 2, c.rotary_dim);
  require(c.family != Family::Llama || !c.qkv_bias,
          "{}: qkv_bias: the llama format has no q/k/v-only biases (attention_bias adds an o_proj bias too)", where);
  require(c.family != Family::Qwen2 || c.qkv_bias, "{}: qkv_bias: the qwen2 format always has q/k/v biases", where);
  require(!c.qkv_bias || (c.family != Family::Qwen3 && c.family != Family::Qwen3Moe && c.family != Family::Mistral &&
                          c.family != Family::Mixtral && !c.gemma()),
          "{}: qkv_bias: the {} format has no q/k/v-only biases", where, family);
  const bool head_norms = c.family == Family::Qwen3 || c.family == Family::Qwen3Moe || c.family == Family::Gemma3;
  require(c.qk_norm == head_norms || c.family == Family::Glm4Moe, "{}: qk_norm: the {} format {} q/k norms", where,
          family,
          head_norms ? "always has" : "has no");
  const bool gemma_layout = c.norm_weight_offset == 1.0 && c.scale_embeddings && c.sandwich_norms &&
                            c.mlp_activation == kernels::GluActivation::GeluTanh;
  const bool llama_layout = c.norm_weight_offset == 0.0 && !c.scale_embeddings && !c.sandwich_norms &&
                            c.mlp_activation == kernels::GluActivation::Silu && c.attn_logit_softcap == 0 &&
                            c.final_logit_softcap == 0 && c.rope_local_theta == 0 && c.query_pre_attn_scalar == 0;
  require(c.gemma() ? gemma_layout : llama_layout,
          "{}: the {} format {}", where, family,
          c.gemma() ? "has Gemma's layout: (1 + w) norms, scaled embeddings, sandwich norms and GeGLU"
                    : "has none of Gemma's differences (norm offset, scaled embeddings, sandwich norms, GeGLU, "
                      "soft caps, attention scale, local RoPE base)");
  require(c.attn_logit_softcap >= 0 && c.final_logit_softcap >= 0 && c.query_pre_attn_scalar >= 0 &&
              c.rope_local_theta >= 0 && std::isfinite(c.query_pre_attn_scalar + c.attn_logit_softcap +
                                                       c.final_logit_softcap + c.rope_local_theta),
          "{}: soft caps, query_pre_attn_scalar and local RoPE base: expected finite non-negative numbers", where);
  require(c.sliding_window >= 0 && c.sliding_window < kMaxPositions,
          "{}: sliding_window: expected 0 (none) or a positive number of positions, found {}", where, c.sliding_window);
  require(c.sliding_window == 0 || c.family == Family::Mistral || c.family == Family::Mixtral ||
              c.family == Family::Qwen3 || c.gemma(),
          "{}: sliding_window: the {} format has no sliding-window attention", where, family);
  require(c.sliding_window == 0 ? c.sliding_layers.empty() : int64_t(c.sliding_layers.size()) == c.num_layers,
          "{}: sliding_layers: expected one entry per layer ({}) with a sliding window, none without, found {}", where,
          c.num_layers, c.sliding_layers.size());
  const auto& m = c.moe;
  const bool moe_format = c.family == Family::Qwen3Moe || c.family == Family::Mixtral || c.family == Family::Glm4Moe;
  require(moe_format == (m.experts > 0), "{}: num_experts: the {} format {}", where, family,
          moe_format ? "has experts (a positive number of them)" : "has no experts");
  require(c.family != Family::Mixtral ||
              (m.norm_topk_prob && m.intermediate_size == c.intermediate_size &&
               std::find(m.sparse_layers.begin(), m.sparse_layers.end(), false) == m.sparse_layers.end()),
          "{}: the mixtral format has experts of width intermediate_size on every layer, their weights "
          "renormalised",
          where);
  if (m.experts > 0) {
    check_size(where, "num_experts", m.experts, int64_t(1) << 16);
    check_size(where, "moe_intermediate_size", m.intermediate_size, kMaxIntermediate);
    require(m.experts_per_token > 0 && m.experts_per_token <= m.experts,
            "{}: num_experts_per_tok: expected from 1 to num_experts ({}), found {}", where, m.experts,
            m.experts_per_token);
    require(int64_t(m.sparse_layers.size()) == c.num_layers,
            "{}: sparse layers: expected one entry per layer ({}), found {}", where, c.num_layers,
            m.sparse_layers.size());
    require(m.router_aux_loss_coef >= 0 && std::isfinite(m.router_aux_loss_coef),
            "{}: router_aux_loss_coef: expected a non-negative number, found {}", where, m.router_aux_loss_coef);
  }
  // GLM-4.5's router and shared experts, and only GLM-4.5's.
  require(m.sigmoid_router == (c.family == Family::Glm4Moe) &&
              (c.family == Family::Glm4Moe || (m.groups == 1 && m.topk_groups == 1 && m.routed_scaling_factor == 1.0 &&
                                               m.shared_intermediate_size == 0 && c.nextn_predict_layers == 0)),
          "{}: the {} format {} a sigmoid router, expert groups, routed_scaling_factor, shared experts and "
          "multi-token-prediction layers",
          where, family, c.family == Family::Glm4Moe ? "has" : "has none of");
  if (m.sigmoid_router) {
    require(std::is_sorted(m.sparse_layers.begin(), m.sparse_layers.end()) &&
                m.shared_intermediate_size % m.intermediate_size == 0,
            "{}: the glm4_moe format has its dense layers first (first_k_dense_replace) and shared experts of a whole "
            "number of moe_intermediate_size",
            where);
    require(m.groups > 0 && m.groups <= 1024 && m.experts % m.groups == 0 && m.experts / m.groups >= 2,
            "{}: n_group: expected a divisor of n_routed_experts ({}), at most 1024, leaving at least 2 experts per "
            "group (the router scores a group by its two best), found {}",
            where, m.experts, m.groups);
    require(m.topk_groups > 0 && m.topk_groups <= m.groups &&
                m.experts_per_token <= m.topk_groups * (m.experts / m.groups),
            "{}: topk_group: expected from 1 to n_group ({}), its groups holding at least num_experts_per_tok ({}) "
            "experts, found {}",
            where, m.groups, m.experts_per_token, m.topk_groups);
    require(m.routed_scaling_factor > 0 && std::isfinite(m.routed_scaling_factor),
            "{}: routed_scaling_factor: expected a positive number, found {}", where, m.routed_scaling_factor);
    require(m.shared_intermediate_size >= 0 && m.shared_intermediate_size < kMaxIntermediate,
            "{}: n_shared_experts x moe_intermediate_size: expected below {}, found {}", where, kMaxIntermediate,
            m.shared_intermediate_size);
    require(c.nextn_predict_layers >= 0 && c.nextn_predict_layers < kMaxLayers,
            "{}: num_nextn_predict_layers: expected a non-negative count below {}, found {}", where, kMaxLayers,
            c.nextn_predict_layers);
  }
}

void apply_family_traits(ModelConfig& c) {
  const bool glm = c.family == Family::Glm || c.family == Family::GlmOriginal;
  c.architecture = std::string(format_of(c.family).architectures.front());
  // GLM-4 rotates half of each head in interleaved pairs; GLM-4.5 half (partial_rotary_factor's
  // default) in rotate_half's pairs.
  c.rotary_dim = glm || c.family == Family::Glm4Moe ? c.head_dim / 2 : c.head_dim;
  c.rope_interleaved = glm;
  c.qkv_bias = c.family == Family::Qwen2 || glm;
  c.qk_norm = c.family == Family::Qwen3 || c.family == Family::Qwen3Moe || c.family == Family::Gemma3;
  if (c.gemma()) {  // the config classes' defaults, bar the windows (set by the caller)
    c.norm_weight_offset = 1.0;
    c.mlp_activation = kernels::GluActivation::GeluTanh;
    c.scale_embeddings = true;
    c.sandwich_norms = true;
    c.query_pre_attn_scalar = 256.0;
    c.attn_logit_softcap = c.family == Family::Gemma2 ? 50.0 : 0.0;
    c.final_logit_softcap = c.family == Family::Gemma2 ? 30.0 : 0.0;
    c.rope_local_theta = c.family == Family::Gemma3 ? 10000.0 : 0.0;
  }
}

// A checkpoint saved already quantized. transformers + bitsandbytes in 4 bits is read (its codes as
// they are); anything else (8-bit, GPTQ, AWQ...) is not floating point keel could read, and reading
// it as such would be garbage: said here, by name.
std::optional<ModelConfig::SavedFourBit> parse_quantization_config(const ConfigObject& cfg) {
  auto q = cfg.get("quantization_config");
  if (!q) return std::nullopt;
  const std::string key = cfg.path() + ": key 'quantization_config'";
  dom::object object;
  if (q->get(object) != simdjson::SUCCESS) cfg.wrong_type("quantization_config", "an object", *q);
  ConfigObject qc(object, key);
  const std::string method = qc.string("quant_method").value_or("unknown");
  const char* full_precision =
      "point model_name at the full-precision model (keel quantizes it itself with "
      "quantization_bit = 4)";
  if (method != "bitsandbytes")
    fail(
        "{}: the checkpoint is saved quantized by \"{}\"; keel reads bitsandbytes 4-bit checkpoints and bf16/fp16/"
        "fp32 ones: {}",
        key, method, full_precision);
  if (qc.bool_or("load_in_8bit", false) || qc.bool_or("_load_in_8bit", false))
    fail("{}: an 8-bit bitsandbytes checkpoint (LLM.int8, load_in_8bit); keel reads 4-bit ones (load_in_4bit): {}", key,
         full_precision);
  if (!qc.bool_or("load_in_4bit", false) && !qc.bool_or("_load_in_4bit", false))
    fail("{}: quant_method \"bitsandbytes\" without load_in_4bit; keel reads 4-bit bitsandbytes checkpoints: {}", key,
         full_precision);
  ModelConfig::SavedFourBit saved;
  // BitsAndBytesConfig's defaults: fp4, no double quantization, uint8 storage.
  const std::string type = qc.string("bnb_4bit_quant_type").value_or("fp4");
  auto parsed = parse_four_bit_type(type);
  if (!parsed) fail("{}: bnb_4bit_quant_type: expected \"nf4\" or \"fp4\", found \"{}\"", key, type);
  saved.type = *parsed;
  saved.double_quantization = qc.bool_or("bnb_4bit_use_double_quant", false);
  const std::string storage = qc.string("bnb_4bit_quant_storage").value_or("uint8");
  if (storage != "uint8")
    fail("{}: bnb_4bit_quant_storage: expected \"uint8\" (codes two per byte), found \"{}\"", key, storage);
  return saved;
}

ModelConfig parse_model_config(const std::string& json_text, const std::string& path_for_errors) {
  dom::parser parser;
  dom::element root = parse_json(parser, json_text, path_for_errors);
  ConfigObject cfg(dom::object(root), path_for_errors);

  ModelConfig c;
  c.family = detect_family(cfg, &c.architecture);
  if (c.family == Family::GlmOriginal) {
    parse_chatglm_format(cfg, c);
  } else {
    parse_transformers_format(cfg, c);
  }
  c.tie_word_embeddings = cfg.bool_or("tie_word_embeddings", c.gemma());  // Gemma's configs tie by default
  c.initializer_range = cfg.positive_number_or("initializer_range", 0.02);
  c.saved_four_bit = parse_quantization_config(cfg);
  c.torch_dtype = parse_torch_dtype(cfg);
  c.eos_token_ids = parse_eos_token_ids(cfg);
  c.bos_token_id = cfg.token_id_or_none("bos_token_id");
  // An absent key is the config class's default, as transformers reads it (Gemma: 0, GLM: 151329);
  // null is None.
  c.pad_token_id = cfg.has("pad_token_id") ? cfg.token_id_or_none("pad_token_id")
                                           : format_of(c.family).default_pad_token_id;
  c.config_json = json_text;
  validate(c, path_for_errors);
  return c;
}

// A config.json is a few kilobytes; 16 MiB leaves room for any embedded extras and refuses a
// mistaken path (a weights file, a dataset) before reading it.
ModelConfig load_model_config(const std::string& path) {
  return parse_model_config(read_file(path, size_t(16) << 20), path);
}

ModelConfig config_for_family(const ModelConfig& c, Family family) {
  if (c.family == family) return c;
  const auto is_glm = [](Family f) { return f == Family::Glm || f == Family::GlmOriginal; };
  require(is_glm(c.family) && is_glm(family),
          "a {} model ({}) cannot be written in the {} format: only GLM-4 models convert between the glm "
          "(GlmForCausalLM) and glm_original (ChatGLMModel) formats",
          format_of(c.family).name, c.architecture, format_of(family).name);
  ModelConfig out = c;
  out.family = family;
  out.architecture = std::string(format_of(family).architectures.front());
  out.config_json.clear();
  validate(out, fmt::format("{} model in the {} format", format_of(c.family).name, format_of(family).name));
  return out;
}

}  // namespace keel::model
