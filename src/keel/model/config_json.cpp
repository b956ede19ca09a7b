// Writing config.json: a model keel built from scratch (or converted between the GLM formats) in
// its family's format, sorted as transformers writes it; and any config written back with only
// its dtype changed, pretty-printed as transformers does.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <map>

#include "keel/core/error.h"
#include "keel/core/json_text.h"
#include "keel/model/config.h"
#include "keel/model/config_formats.h"

namespace keel::model {
namespace {

using namespace config_formats;
namespace dom = simdjson::dom;

// Pretty-printed like Python's json.dumps(indent=2), the layout transformers writes.
void append_pretty(std::string& out, dom::element e, int indent) {
  // An array's or object's members, one a line, `member(item)` writing each after its indent.
  auto container = [&](auto members, char open, char close, auto&& member) {
    if (members.size() == 0) {
      out += open;
      out += close;
      return;
    }
    const std::string pad(size_t(indent) + 2, ' ');
    out += open;
    bool first = true;
    for (auto item : members) {
      out += first ? "\n" : ",\n";
      first = false;
      out += pad;
      member(item);
    }
    out += '\n' + std::string(size_t(indent), ' ') + close;
  };
  switch (e.type()) {
    case dom::element_type::ARRAY:
      container(dom::array(e), '[', ']', [&](dom::element item) { append_pretty(out, item, indent + 2); });
      return;
    case dom::element_type::OBJECT:
      container(dom::object(e), '{', '}', [&](dom::key_value_pair kv) {
        out += json_quoted(kv.key) + ": ";
        append_pretty(out, kv.value, indent + 2);
      });
      return;
    case dom::element_type::INT64: out += std::to_string(int64_t(e)); return;
    case dom::element_type::UINT64: out += std::to_string(uint64_t(e)); return;
    case dom::element_type::DOUBLE: out += json_number(double(e)); return;
    case dom::element_type::STRING: out += json_quoted(std::string_view(e)); return;
    case dom::element_type::BOOL: out += json_bool(bool(e)); return;
    case dom::element_type::NULL_VALUE: out += "null"; return;
  }
}

// The double f nearest to target / base for which base * f == target, so that a value a reader
// rebuilds by multiplication (rope_theta = 10000 * rope_ratio) comes back bit-identical.
double factor_reproducing(double target, double base) {
  double f = target / base;
  for (int i = 0; i < 8 && base * f != target; ++i) f = std::nextafter(f, base * f < target ? INFINITY : -INFINITY);
  return f;
}

std::string eos_json(const std::vector<int64_t>& ids) {
  if (ids.size() == 1) return std::to_string(ids[0]);
  return fmt::format("[{}]", fmt::join(ids, ","));
}

// Fields as key -> JSON text; std::map sorts the keys, as transformers' sort_keys=True does.
using JsonFields = std::map<std::string, std::string>;

void add_common_fields(JsonFields& f, const ModelConfig& c, DType dtype) {
  const FamilyFormat& format = format_of(c.family);
  std::string_view arch = format.architectures.front();
  for (auto known : format.architectures) {
    if (known == c.architecture) arch = known;  // keep ChatGLMForConditionalGeneration if that was read
  }
  f["architectures"] = fmt::format("[{}]", json_quoted(arch));
  f["model_type"] = json_quoted(format.model_type);
  f["torch_dtype"] = json_quoted(dtype == DType::BF16 ? "bfloat16" : dtype == DType::F16 ? "float16" : "float32");
  f["tie_word_embeddings"] = json_bool(c.tie_word_embeddings);
  // Ids the model does not have are written as null, not left out: transformers fills a missing
  // key with the family's defaults (GlmConfig: GLM-4's pad and eos ids, beyond a new model's
  // vocabulary), and GlmForCausalLM cannot even be built with a pad id outside the vocabulary.
  f["eos_token_id"] = c.eos_token_ids.empty() ? "null" : eos_json(c.eos_token_ids);
  f["bos_token_id"] = c.bos_token_id >= 0 ? std::to_string(c.bos_token_id) : "null";
  f["pad_token_id"] = c.pad_token_id >= 0 ? std::to_string(c.pad_token_id) : "null";
  f["use_cache"] = "true";
  f["initializer_range"] = json_number(c.initializer_range);
}

std::string layer_types_json(const ModelConfig& c) {
  std::string types;
  for (int64_t l = 0; l < c.num_layers; ++l)
    types += fmt::format("{}\"{}_attention\"", l ? "," : "", c.window_of(l) > 0 ? "sliding" : "full");
  return "[" + types + "]";
}

// The shape every format names, under that format's keys.
void add_shape_fields(JsonFields& f, const ModelConfig& c, const FormatKeys& k) {
  f[k.vocab] = std::to_string(c.vocab_size);
  f[k.hidden] = std::to_string(c.hidden_size);
  f[k.intermediate] = std::to_string(c.intermediate_size);
  f[k.layers] = std::to_string(c.num_layers);
  f[k.heads] = std::to_string(c.num_heads);
  f[k.kv_heads] = std::to_string(c.num_kv_heads);
  f[k.head_dim] = std::to_string(c.head_dim);
  f[k.norm_eps] = json_number(c.rms_norm_eps);
  f[k.max_positions] = std::to_string(c.max_position_embeddings);
}

void add_transformers_fields(JsonFields& f, const ModelConfig& c) {
  add_shape_fields(f, c, kTransformersKeys);
  f[c.gemma() ? "hidden_activation" : "hidden_act"] = c.gemma() ? "\"gelu_pytorch_tanh\"" : "\"silu\"";
  f["rope_theta"] = json_number(c.rope_theta);
  f["rope_scaling"] = "null";
  f["attention_dropout"] = "0.0";
  switch (c.family) {
    case Family::Llama:
      f["attention_bias"] = "false";
      f["mlp_bias"] = "false";
      break;
    case Family::Qwen2: f["use_sliding_window"] = "false"; break;
    case Family::Qwen3: {
      f["attention_bias"] = "false";
      f["use_sliding_window"] = json_bool(c.sliding_window > 0);
      f["sliding_window"] = c.sliding_window > 0 ? std::to_string(c.sliding_window) : "null";
      f["layer_types"] = layer_types_json(c);
      break;
    }
    case Family::Qwen3Moe: {
      f["attention_bias"] = "false";
      f["use_sliding_window"] = "false";
      f["sliding_window"] = "null";
      const auto& m = c.moe;
      f["num_experts"] = std::to_string(m.experts);
      f["num_experts_per_tok"] = std::to_string(m.experts_per_token);
      f["moe_intermediate_size"] = std::to_string(m.intermediate_size);
      f["norm_topk_prob"] = json_bool(m.norm_topk_prob);
      f["router_aux_loss_coef"] = json_number(m.router_aux_loss_coef);
      f["output_router_logits"] = json_bool(m.output_router_logits);
      // Every layer's kind said outright: decoder_sparse_step 1 and the dense ones listed.
      f["decoder_sparse_step"] = "1";
      std::string dense;
      for (int64_t l = 0; l < c.num_layers; ++l)
        if (!c.sparse_layer(l)) dense += (dense.empty() ? "" : ",") + std::to_string(l);
      f["mlp_only_layers"] = "[" + dense + "]";
      break;
    }
    case Family::Mistral:
      f["sliding_window"] = c.sliding_window > 0 ? std::to_string(c.sliding_window) : "null";
      break;
    case Family::Mixtral:
      f["sliding_window"] = c.sliding_window > 0 ? std::to_string(c.sliding_window) : "null";
      f["num_local_experts"] = std::to_string(c.moe.experts);
      f["num_experts_per_tok"] = std::to_string(c.moe.experts_per_token);
      f["router_aux_loss_coef"] = json_number(c.moe.router_aux_loss_coef);
      f["output_router_logits"] = json_bool(c.moe.output_router_logits);
      f["router_jitter_noise"] = "0.0";
      break;
    case Family::Gemma2:
    case Family::Gemma3: {
      f["attention_bias"] = "false";
      f["sliding_window"] = c.sliding_window > 0 ? std::to_string(c.sliding_window) : "null";
      f["layer_types"] = layer_types_json(c);
      // Gemma's config classes type it as an integer (and validate that): written as one when it is.
      const double scalar = c.query_pre_attn_scalar;
      f["query_pre_attn_scalar"] = scalar == std::floor(scalar) && scalar < 9.0e15 ? std::to_string(int64_t(scalar))
                                                                                    : json_number(scalar);
      f["attn_logit_softcapping"] = c.attn_logit_softcap > 0 ? json_number(c.attn_logit_softcap) : "null";
      f["final_logit_softcapping"] = c.final_logit_softcap > 0 ? json_number(c.final_logit_softcap) : "null";
      if (c.family == Family::Gemma3) f["rope_local_base_freq"] = json_number(c.rope_local_theta);
      break;
    }
    case Family::Glm:
    case Family::Glm4Moe: {
      f["attention_bias"] = json_bool(c.qkv_bias);
      double factor = double(c.rotary_dim) / double(c.head_dim);
      // The reader truncates head_dim * factor; make sure that lands on rotary_dim, not below.
      for (int i = 0; i < 8 && int64_t(double(c.head_dim) * factor) < c.rotary_dim; ++i) {
        factor = std::nextafter(factor, INFINITY);
      }
      f["partial_rotary_factor"] = json_number(factor);
      if (c.family == Family::Glm) break;
      const auto& m = c.moe;
      f["use_qk_norm"] = json_bool(c.qk_norm);
      f["n_routed_experts"] = std::to_string(m.experts);
      f["num_experts_per_tok"] = std::to_string(m.experts_per_token);
      f["moe_intermediate_size"] = std::to_string(m.intermediate_size);
      f["n_shared_experts"] = std::to_string(m.shared_intermediate_size / m.intermediate_size);
      f["norm_topk_prob"] = json_bool(m.norm_topk_prob);
      f["n_group"] = std::to_string(m.groups);
      f["topk_group"] = std::to_string(m.topk_groups);
      f["routed_scaling_factor"] = json_number(m.routed_scaling_factor);
      f["output_router_logits"] = json_bool(m.output_router_logits);
      int64_t dense = 0;  // Glm4MoeConfig can say only "the first k layers are dense"
      while (dense < c.num_layers && !c.sparse_layer(dense)) ++dense;
      f["first_k_dense_replace"] = std::to_string(dense);
      f["num_nextn_predict_layers"] = std::to_string(c.nextn_predict_layers);
      break;
    }
    case Family::GlmOriginal: break;
  }
}

void add_chatglm_fields(JsonFields& f, const ModelConfig& c) {
  add_shape_fields(f, c, kChatGlmKeys);
  f["multi_query_attention"] = json_bool(c.num_kv_heads != c.num_heads);
  f["add_qkv_bias"] = json_bool(c.qkv_bias);
  f["rope_ratio"] = json_number(factor_reproducing(c.rope_theta, kGlmRopeBase));
  f["rmsnorm"] = "true";
  f["post_layer_norm"] = "true";
  f["apply_residual_connection_post_layernorm"] = "false";
  f["add_bias_linear"] = "false";
  f["original_rope"] = "true";
  f["attention_dropout"] = "0.0";
  f["hidden_dropout"] = "0.0";
}

std::string generated_config_json(const ModelConfig& c, DType dtype) {
  JsonFields fields;
  add_common_fields(fields, c, dtype);
  if (c.family == Family::GlmOriginal) {
    add_chatglm_fields(fields, c);
  } else {
    add_transformers_fields(fields, c);
  }
  std::string json = "{";
  for (const auto& [key, value] : fields) json += (json.size() > 1 ? "," : "") + json_quoted(key) + ":" + value;
  return json + "}";
}

}  // namespace

std::string model_config_json(const ModelConfig& c, DType dtype) {
  bool original = !c.config_json.empty();
  std::string source = original ? c.config_json : generated_config_json(c, dtype);
  dom::parser parser;
  dom::object root = dom::object(parse_json(parser, source, "model config (config_json)"));

  // Rewrite key by key in the original order; only the dtype changes.
  std::string dtype_text = json_quoted(dtype == DType::BF16 ? "bfloat16" : dtype == DType::F16 ? "float16" : "float32");
  std::string out = "{";
  bool has_dtype = false;
  for (dom::key_value_pair kv : root) {
    // What keel writes is full precision, even when the model was read from a 4-bit checkpoint
    // (keel export --merge of a QLoRA run on one): its config must not claim otherwise.
    if (kv.key == "quantization_config") continue;
    out += out.size() > 1 ? ",\n  " : "\n  ";
    out += json_quoted(kv.key) + ": ";
    if (kv.key == "torch_dtype" || kv.key == "dtype") {
      out += dtype_text;
      has_dtype = true;
    } else {
      append_pretty(out, kv.value, 2);
    }
  }
  if (!has_dtype) out += std::string(out.size() > 1 ? ",\n  " : "\n  ") + "\"torch_dtype\": " + dtype_text;
  return out + "\n}\n";
}

}  // namespace keel::model
