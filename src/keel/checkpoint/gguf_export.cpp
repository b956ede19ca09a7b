#include "keel/checkpoint/gguf_export.h"

#include <fmt/format.h>
#include <simdjson.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

#include "keel/checkpoint/gguf_experts.h"
#include "keel/checkpoint/gguf_tokenizer.h"
#include "keel/checkpoint/ollama_modelfile.h"
#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/core/json_text.h"
#include "keel/data/chat_encoding.h"
#include "keel/data/hf_tokenizer_json.h"
#include "keel/data/llama_cpp_vocab.h"
#include "keel/data/prepare.h"
#include "keel/data/tokenizer.h"
#include "keel/formats/gguf_writer.h"
#include "keel/model/gguf_names.h"
#include "keel/model/gguf_q4_k_m.h"
#include "keel/model/hf_weights.h"

namespace keel::checkpoint {
namespace {

namespace fs = std::filesystem;
using formats::GgmlType;
using formats::GgufMetadata;

bool config_has(const std::string& config_json, std::string_view key) {
  simdjson::dom::parser parser;
  simdjson::dom::element root, value;
  if (parse_json_document(parser, config_json, root)) return false;
  return root.at_key(key).get(value) == simdjson::SUCCESS && !value.is_null();
}

// Gemma2Model.set_gguf_parameters, which writes its own keys in its own order (no RoPE base: its
// 10000 is llama.cpp's default).
void add_gemma2_keys(GgufMetadata& kv, const model::ModelConfig& c, GgmlType outtype) {
  kv.add_uint32("gemma2.context_length", uint32_t(c.max_position_embeddings));
  kv.add_uint32("gemma2.embedding_length", uint32_t(c.hidden_size));
  kv.add_uint32("gemma2.block_count", uint32_t(c.num_layers));
  kv.add_uint32("gemma2.feed_forward_length", uint32_t(c.intermediate_size));
  kv.add_uint32("gemma2.attention.head_count", uint32_t(c.num_heads));
  kv.add_uint32("gemma2.attention.head_count_kv", uint32_t(c.num_kv_heads));
  kv.add_float32("gemma2.attention.layer_norm_rms_epsilon", float(c.rms_norm_eps));
  kv.add_uint32("gemma2.attention.key_length", uint32_t(c.head_dim));
  kv.add_uint32("gemma2.attention.value_length", uint32_t(c.head_dim));
  if (outtype != GgmlType::Q4_K) kv.add_uint32("general.file_type", model::gguf_file_type(outtype));
  kv.add_float32("gemma2.attn_logit_softcapping", float(c.attn_logit_softcap));
  kv.add_float32("gemma2.final_logit_softcapping", float(c.final_logit_softcap));
  kv.add_uint32("gemma2.attention.sliding_window", uint32_t(c.sliding_window));
}

// The RMSNorm epsilon the converter writes for GLM-4: ChatGLMModel reads ChatGLM's
// layernorm_epsilon, which GlmForCausalLM's config.json does not have, and falls back to 1e-5.
constexpr float kChatglmRmsEps = 1e-5f;

std::optional<bool> adds_bos(const data::LlamaCppVocab& v) {
  for (const auto& [type, add] : v.add_special)
    if (type == "bos") return add;
  return std::nullopt;
}

// ChatGLMModel.set_gguf_parameters, its keys in its order, for GlmForCausalLM's config.json: the
// keys it reads for ChatGLM's own format are absent there, so it writes its fallbacks (the context
// length is the hidden size, for seq_length; epsilon 1e-5; RoPE base 10000, for 10000 x
// rope_ratio: check_llama_cpp_runs_as_trained says where the model differs). Its add_bos_token
// false is set among these keys, and SpecialVocab's value later replaces it in place (gguf-py
// keeps a key's position when it is set again).
void add_chatglm_keys(GgufMetadata& kv, const model::ModelConfig& c, GgmlType outtype, const data::LlamaCppVocab& v) {
  kv.add_uint32("chatglm.context_length", uint32_t(c.hidden_size));
  kv.add_uint32("chatglm.embedding_length", uint32_t(c.hidden_size));
  kv.add_uint32("chatglm.feed_forward_length", uint32_t(c.intermediate_size));
  kv.add_uint32("chatglm.block_count", uint32_t(c.num_layers));
  kv.add_uint32("chatglm.attention.head_count", uint32_t(c.num_heads));
  kv.add_uint32("chatglm.attention.head_count_kv", uint32_t(c.num_kv_heads));
  kv.add_float32("chatglm.attention.layer_norm_rms_epsilon", kChatglmRmsEps);
  kv.add_uint32("general.file_type", model::gguf_file_type(outtype));
  kv.add_uint32("chatglm.rope.dimension_count", uint32_t(c.rotary_dim));  // hidden / heads x partial_rotary_factor
  kv.add_bool("tokenizer.ggml.add_bos_token", adds_bos(v).value_or(false));
  kv.add_float32("chatglm.rope.freq_base", 10000.0f);
}

// The GLM vocabularies' special ids, which the converter takes from the tokenizer's added tokens
// after SpecialVocab's (where each is still unset): ChatGLMModel.set_vocab for GlmForCausalLM sets
// EOS <|endoftext|>, EOT <|user|> -- a GLM-4 answer ends where the next user turn begins, and
// llama.cpp stops on EOT -- and UNK <|endoftext|>; Glm4MoeModel's _set_vocab_glm (GLM-4.5) BOS
// [gMASK], EOT <|user|>, UNK <|endoftext|> and EOM <|observation|>.
void add_glm_special_ids(data::LlamaCppVocab& v, const std::string& tokenizer_dir, const std::string& arch) {
  const std::string family = arch == "glm4moe" ? "GLM-4.5" : "GLM-4";
  const std::string converter = arch == "glm4moe" ? "Glm4MoeModel._set_vocab_glm" : "ChatGLMModel.set_vocab";
  require(v.model == "gpt2",
          "{}: a SentencePiece tokenizer.model beside a {} model: llama.cpp's converter reads {}'s vocabulary "
          "from tokenizer.json ({}), which keel's GGUF export does too; remove tokenizer.model or export --format hf",
          tokenizer_dir, family, family, converter);
  auto added_id = [&](std::string_view text, std::string_view role) {
    for (size_t i = 0; i < v.tokens.size(); ++i)
      if (v.tokens[i] == text && (v.token_types[i] == int32_t(data::LlamaCppTokenType::Control) ||
                                  v.token_types[i] == int32_t(data::LlamaCppTokenType::UserDefined)))
        return int64_t(i);
    fail("{}/tokenizer.json: no added token '{}', which llama.cpp's converter takes {}'s {} from ({}); {}'s "
         "tokenizers have it",
         tokenizer_dir, text, family, role, converter, family);
  };
  auto set = [&](const char* type, int64_t id) {
    for (const auto& [t, unused] : v.special_ids)
      if (t == type) return;
    v.special_ids.emplace_back(type, id);
  };
  if (arch == "glm4moe") {
    set("bos", added_id("[gMASK]", "BOS"));
    set("eot", added_id("<|user|>", "end of turn (EOT)"));
    set("unk", added_id("<|endoftext|>", "UNK"));
    set("eom", added_id("<|observation|>", "end of message (EOM)"));
    return;
  }
  const int64_t end = added_id("<|endoftext|>", "EOS and UNK"), user = added_id("<|user|>", "end of turn (EOT)");
  set("eos", end);
  set("eot", user);
  set("unk", end);
}

// gguf-py's ExpertGatingFuncType.SIGMOID.
constexpr uint32_t kGgufExpertGatingSigmoid = 2;

// Glm4MoeModel.set_gguf_parameters, after its parent's keys: the rotated channels (head_dim x
// partial_rotary_factor), the experts' width and shared count, the leading dense layers, the
// sigmoid gating (already written in its parent's place where config.json names scoring_func: gguf-py
// sets a key again where it stands), the routed scaling and renormalisation, and the MTP layers --
// each of the last four where config.json has the key, as the converter reads them.
void add_glm4moe_keys(GgufMetadata& kv, const model::ModelConfig& c, const std::string& config_json,
                      const std::function<std::string(std::string_view)>& key, bool gating_written) {
  kv.add_uint32(key("rope.dimension_count"), uint32_t(c.rotary_dim));
  kv.add_uint32(key("expert_feed_forward_length"), uint32_t(c.moe.intermediate_size));
  if (config_has(config_json, "n_shared_experts"))
    kv.add_uint32(key("expert_shared_count"), uint32_t(c.moe.shared_intermediate_size / c.moe.intermediate_size));
  if (config_has(config_json, "first_k_dense_replace")) {
    int64_t dense = 0;
    while (dense < c.num_layers && !c.sparse_layer(dense)) ++dense;
    kv.add_uint32(key("leading_dense_block_count"), uint32_t(dense));
  }
  if (!gating_written) kv.add_uint32(key("expert_gating_func"), kGgufExpertGatingSigmoid);
  if (config_has(config_json, "routed_scaling_factor"))
    kv.add_float32(key("expert_weights_scale"), float(c.moe.routed_scaling_factor));
  if (config_has(config_json, "norm_topk_prob")) kv.add_bool(key("expert_weights_norm"), c.moe.norm_topk_prob);
  if (config_has(config_json, "num_nextn_predict_layers"))
    kv.add_uint32(key("nextn_predict_layers"), uint32_t(c.nextn_predict_layers));
}

// TextModel.set_gguf_parameters and the family's additions, in the converter's order.
void add_model_keys(GgufMetadata& kv, const model::ModelConfig& c, const std::string& arch,
                    const std::string& config_json, GgmlType outtype) {
  if (arch == "gemma2") return add_gemma2_keys(kv, c, outtype);
  auto key = [&](std::string_view k) { return fmt::format("{}.{}", arch, k); };
  const bool glm4moe = arch == "glm4moe";
  // Glm4MoeModel counts GLM-4.5's multi-token-prediction layers among the blocks (llama.cpp runs
  // block_count - nextn_predict_layers of them); keel writes none of their tensors (note_mtp_layers).
  const int64_t nextn = glm4moe ? c.nextn_predict_layers : 0;
  kv.add_uint32(key("block_count"), uint32_t(c.num_layers + nextn));
  kv.add_uint32(key("context_length"), uint32_t(c.max_position_embeddings));
  kv.add_uint32(key("embedding_length"), uint32_t(c.hidden_size));
  kv.add_uint32(key("feed_forward_length"), uint32_t(c.intermediate_size));
  kv.add_uint32(key("attention.head_count"), uint32_t(c.num_heads));
  kv.add_uint32(key("attention.head_count_kv"), uint32_t(c.num_kv_heads));
  kv.add_float32(key("rope.freq_base"), float(c.rope_theta));
  if (c.rope_local_theta > 0) kv.add_float32(key("rope.freq_base_swa"), float(c.rope_local_theta));
  kv.add_float32(key("attention.layer_norm_rms_epsilon"), float(c.rms_norm_eps));
  if (c.has_experts()) {  // num_local_experts or num_experts, and num_experts_per_tok
    kv.add_uint32(key("expert_count"), uint32_t(c.moe.experts));
    kv.add_uint32(key("expert_used_count"), uint32_t(c.moe.experts_per_token));
  }
  // TextModel's group-limited routing keys (GLM-4.5's n_group and topk_group) and its gating
  // function, each where config.json has the key.
  if (c.has_experts() && config_has(config_json, "n_group")) kv.add_uint32(key("expert_group_count"), uint32_t(c.moe.groups));
  if (c.has_experts() && config_has(config_json, "topk_group"))
    kv.add_uint32(key("expert_group_used_count"), uint32_t(c.moe.topk_groups));
  const bool scoring_stated = c.moe.sigmoid_router && config_has(config_json, "scoring_func");
  if (scoring_stated) kv.add_uint32(key("expert_gating_func"), kGgufExpertGatingSigmoid);
  // Only where config.json states head_dim, as the converter; Gemma 3 adds them anyway, after.
  const bool head_dim_stated = config_has(config_json, "head_dim");
  auto add_head_lengths = [&] {
    kv.add_uint32(key("attention.key_length"), uint32_t(c.head_dim));
    kv.add_uint32(key("attention.value_length"), uint32_t(c.head_dim));
  };
  if (head_dim_stated) add_head_lengths();
  // q4_k_m: llama-quantize sets general.quantization_version and general.file_type anew, which
  // moves them to the end of the f32 file's keys (write_gguf_model adds them there).
  if (outtype != GgmlType::Q4_K) kv.add_uint32("general.file_type", model::gguf_file_type(outtype));
  if (arch == "qwen3moe")  // Qwen2MoeModel.set_gguf_parameters, after its parent's keys
    kv.add_uint32(key("expert_feed_forward_length"), uint32_t(c.moe.intermediate_size));
  if (glm4moe) add_glm4moe_keys(kv, c, config_json, key, scoring_stated);
  if (arch == "gemma3") {  // Gemma3Model.set_gguf_parameters
    if (!head_dim_stated) add_head_lengths();
    if (c.final_logit_softcap > 0) kv.add_float32(key("final_logit_softcapping"), float(c.final_logit_softcap));
    if (c.sliding_window > 0) kv.add_uint32(key("attention.sliding_window"), uint32_t(c.sliding_window));
  }
  if (arch == "llama") {  // LlamaModel.set_gguf_parameters
    kv.add_uint32(key("vocab_size"), uint32_t(c.vocab_size));
    kv.add_uint32(key("rope.dimension_count"), uint32_t(c.head_dim));
  }
}

void add_tokenizer_keys(GgufMetadata& kv, const data::LlamaCppVocab& v, const std::string& arch) {
  if (arch == "llama" && v.add_prefix_space) kv.add_bool("tokenizer.ggml.add_space_prefix", *v.add_prefix_space);
  kv.add_string("tokenizer.ggml.model", v.model);
  kv.add_string("tokenizer.ggml.pre", v.pre);
  kv.add_strings("tokenizer.ggml.tokens", v.tokens);
  if (v.model == "llama") kv.add_float32s("tokenizer.ggml.scores", v.scores);
  kv.add_int32s("tokenizer.ggml.token_type", v.token_types);
  if (!v.merges.empty()) kv.add_strings("tokenizer.ggml.merges", v.merges);
  for (const auto& [type, id] : v.special_ids)
    if (auto k = gguf_special_id_key(type)) kv.add_uint32(*k, uint32_t(id));
  for (const auto& [type, add] : v.add_special)
    if ((type == "bos" && arch != "chatglm") || type == "eos" || type == "sep")  // chatglm's bos: add_chatglm_keys
      kv.add_bool(fmt::format("tokenizer.ggml.add_{}_token", type), add);
  if (v.chat_template) kv.add_string("tokenizer.chat_template", *v.chat_template);
  if (v.normalizer_lowercase) kv.add_bool("tokenizer.ggml.normalizer.lowercase", *v.normalizer_lowercase);
  if (v.normalizer_strip_accents)
    kv.add_bool("tokenizer.ggml.normalizer.strip_accents", *v.normalizer_strip_accents);
  // Gemma2Model.set_vocab and Gemma3Model's SentencePiece path, after the vocabulary.
  if (v.model == "llama" && (arch == "gemma2" || arch == "gemma3"))
    kv.add_bool("tokenizer.ggml.add_space_prefix", false);
}

// The encoded general.quantized_by entry, to recognise a file keel wrote from its first bytes.
std::string writer_entry() {
  GgufMetadata kv;
  kv.add_string("general.quantized_by", kGgufWriterName);
  return kv.encoded();
}

// The chat template's end of turn, which llama.cpp must stop on: a model that never stops in
// llama.cpp or Ollama is what a lost end-of-turn token gives. "" without a template or a probe.
std::string check_end_of_turn(const data::LlamaCppVocab& vocab, const std::string& tokenizer_dir) {
  if (!vocab.chat_template) return "";
  const data::Tokenizer tokenizer = data::load_hf_tokenizer_json(tokenizer_dir + "/tokenizer.json");
  data::DocumentEncoder chat;
  chat.tokenizer = &tokenizer;
  data::choose_chat_template(chat, "auto", tokenizer_dir);
  if (!chat.model_template) return "";
  const auto end = data::end_of_turn_id(*chat.model_template, tokenizer);
  if (!end) return "";
  const std::string text = size_t(*end) < vocab.tokens.size() ? vocab.tokens[size_t(*end)] : "?";
  std::string eos = "none";
  for (const auto& [type, id] : vocab.special_ids)
    if (type == "eos") eos = fmt::format("{} '{}'", id, size_t(id) < vocab.tokens.size() ? vocab.tokens[size_t(id)] : "?");
  require(data::llama_cpp_ends_generation(vocab, *end),
          "{}: the chat template ends an assistant turn with '{}' (id {}), which llama.cpp would not stop on (it stops "
          "on the EOS token, here {}, and tokens it knows by name): the model would never stop there. Name that "
          "token eos_token in tokenizer_config.json, or export --format hf and convert with llama.cpp's converter",
          tokenizer_dir, text, *end, eos);
  return text;
}

// The GGUF type whose bytes are `dtype`'s.
GgmlType ggml_type_storing(DType dtype) {
  switch (dtype) {
    case DType::F32: return GgmlType::F32;
    case DType::F16: return GgmlType::F16;
    case DType::BF16: return GgmlType::BF16;
  }
  fail("GGUF export: unknown dtype {}", int(dtype));
}

// --outtype q4_k_m: the f32 file's tensors as llama-quantize writes them, in its order and with its
// types (model/gguf_q4_k_m.h); the tensors not Q4_K (vectors aside) recorded with the reason.
void choose_q4_k_m_types(const model::ModelConfig& c, GgufExportResult& result, std::vector<formats::GgufTensor>& tensors) {
  std::stable_sort(tensors.begin(), tensors.end(),
                   [](const auto& a, const auto& b) { return model::llama_quantize_order(a.name, b.name); });
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& t : tensors) {
    names.push_back(t.name);
    shapes.push_back(t.shape);
  }
  const auto choices = model::q4_k_m_tensor_types(c, result.architecture, names, shapes);
  for (size_t i = 0; i < tensors.size(); ++i) {
    tensors[i].type = choices[i].type;
    if (!choices[i].reason.empty())
      result.q4_k_m_exceptions.emplace_back(
          tensors[i].name, fmt::format("{}: {}", formats::ggml_type_name(choices[i].type), choices[i].reason));
  }
}

}  // namespace

// llama.cpp's gemma2 and gemma3 scale attention scores by 1/sqrt(head_dim), or for their 27B
// models (`layers_of_27b`) by 1/sqrt(hidden / heads), from their own table: they do not read
// query_pre_attn_scalar from the file, so a model trained with another scale is refused.
void require_llama_cpp_gemma_scale(const model::ModelConfig& c, const char* family, const char* arch,
                                   int64_t layers_of_27b) {
  const bool is_27b = c.num_layers == layers_of_27b;
  const double llama_cpp_scalar = is_27b ? double(c.hidden_size / c.num_heads) : double(c.head_dim);
  require(c.query_pre_attn_scalar == llama_cpp_scalar,
          "--format gguf: this {} model scales attention scores by query_pre_attn_scalar^-0.5 = {:g}^-0.5, and "
          "llama.cpp's {} by {}^-0.5 ({}; it does not read the value from the file): llama.cpp would not run the "
          "model as trained. Export --format hf for runtimes that read config.json",
          family, c.query_pre_attn_scalar, arch, llama_cpp_scalar,
          is_27b ? fmt::format("hidden / heads for the {}-layer model", layers_of_27b) : std::string("head_dim"));
}

// llama.cpp's gemma2 and gemma3 give layer i a sliding window when i % period < period - 1 (every
// other layer from the first; all but each sixth), from their own table: a model whose layers
// slide otherwise is refused.
void require_llama_cpp_window_pattern(const model::ModelConfig& c, const char* family, const char* arch,
                                      int64_t period, const char* pattern) {
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const bool llama_cpp_slides = i % period < period - 1;
    const bool slides = size_t(i) < c.sliding_layers.size() && c.sliding_layers[size_t(i)];
    require(slides == llama_cpp_slides,
            "--format gguf: layer {} of this {} model {} a sliding window, and llama.cpp's {} gives one to {}: "
            "llama.cpp would not run the model as trained. Export --format hf for runtimes that read layer_types",
            i, family, slides ? "has" : "has no", arch, pattern);
  }
}

std::vector<std::string> check_llama_cpp_runs_as_trained(const model::ModelConfig& c, const std::string& arch) {
  std::vector<std::string> notes;
  require_llama_cpp_runs_experts(c, arch);
  if (arch == "gemma3") {
    // llama_model_gemma3::load_arch_hparams: scores scaled by 1/sqrt(head_dim), or for the 62-layer
    // (27B) model 1/sqrt(hidden / heads), whatever query_pre_attn_scalar says; what the published
    // checkpoints state. Other values would give every token other attention than in training.
    require_llama_cpp_gemma_scale(c, "Gemma 3", "gemma3", 62);
    // Sliding windows: llama.cpp's default pattern for gemma3 is 6 (layers i with i % 6 < 5 slide),
    // and the converter writes no pattern key, as Gemma 3's published configs follow it.
    if (c.sliding_window > 0)
      require_llama_cpp_window_pattern(c, "Gemma 3", "gemma3", 6,
                                       "every layer but each sixth (Gemma 3's published pattern; the file holds no "
                                       "pattern)");
  } else if (arch == "gemma2") {
    // llama_model_gemma2::load_arch_hparams: the same scale from its table (1/sqrt(hidden / heads)
    // for the 46-layer 27B model), windows on every other layer from the first (pattern 2), and
    // both soft caps always applied (the file's values, or 50 and 30 where it has none).
    require_llama_cpp_gemma_scale(c, "Gemma 2", "gemma2", 46);
    require(c.attn_logit_softcap > 0 && c.final_logit_softcap > 0,
            "--format gguf: this Gemma 2 model has no {} soft cap (null in config.json), and llama.cpp's gemma2 "
            "always applies one: llama.cpp would not run the model as trained. Export --format hf instead",
            c.attn_logit_softcap > 0 ? "final logit" : "attention logit");
    require(c.sliding_window > 0,
            "--format gguf: this Gemma 2 model has no sliding window (null in config.json), and llama.cpp's gemma2 "
            "gives every other layer one: llama.cpp would not run the model as trained. Export --format hf instead");
    require_llama_cpp_window_pattern(c, "Gemma 2", "gemma2", 2,
                                     "every even layer (Gemma 2's pattern; the converter writes none)");
    // Gemma2Model skips lm_head.weight; llama.cpp's gemma2 always uses the embedding as the head.
    require(c.tie_word_embeddings,
            "--format gguf: this Gemma 2 model has its own LM head (tie_word_embeddings false), which llama.cpp's "
            "converter drops and llama.cpp's gemma2 replaces by the embedding: llama.cpp would not run the model as "
            "trained. Export --format hf instead");
  } else if (arch == "chatglm") {
    // llama_model_chatglm: heads of hidden / heads channels (the converter writes no head size,
    // and the output projection is read as hidden x hidden).
    require(c.head_dim * c.num_heads == c.hidden_size,
            "--format gguf: this GLM-4 model has {} heads of {} channels and a hidden size of {}, and llama.cpp's "
            "chatglm takes heads of hidden / heads = {} channels (the file has no head size): llama.cpp could not run "
            "it. Export --format hf instead",
            c.num_heads, c.head_dim, c.hidden_size, c.hidden_size / c.num_heads);
    // The converter writes RoPE base 10000 x ChatGLM's rope_ratio, which GlmForCausalLM's config lacks.
    require(c.rope_theta == 10000.0,
            "--format gguf: this GLM-4 model's RoPE base is {:g}, and llama.cpp's converter writes 10000 for "
            "GlmForCausalLM (it reads ChatGLM's rope_ratio, which this format has not), as keel does: llama.cpp "
            "would rotate otherwise than training. Export --format hf instead",
            c.rope_theta);
    if (float(c.rms_norm_eps) != kChatglmRmsEps)
      notes.push_back(fmt::format(
          "the RMSNorm epsilon in the file is 1e-05, as llama.cpp's converter writes for GLM-4 (it reads ChatGLM's "
          "layernorm_epsilon, which GlmForCausalLM's config has not), where the model's is {:g}: llama.cpp "
          "normalizes with that, which moves each norm's output by a relative {:.1g} at most for activations of unit "
          "mean square",
          c.rms_norm_eps, std::abs(1.0 - std::sqrt((1.0 + c.rms_norm_eps) / (1.0 + double(kChatglmRmsEps))))));
    notes.push_back(fmt::format(
        "chatglm.context_length is the hidden size ({}), as llama.cpp's converter writes for GLM-4 (it reads ChatGLM's "
        "seq_length); the model has {} positions, and llama.cpp runs past the file's length with a warning",
        c.hidden_size, c.max_position_embeddings));
  } else if (c.sliding_window > 0) {
    // Mistral v0.1 and Qwen with use_sliding_window: llama.cpp's llama/qwen2/qwen3 attend to the
    // whole context (the converter writes no window either); the same up to the window's length.
    notes.push_back(fmt::format(
        "the model's sliding window ({} tokens) is not in the file: llama.cpp's {} attends to the whole context, "
        "which is the same as training up to {} tokens of context and differs past it",
        c.sliding_window, arch, c.sliding_window));
  }
  return notes;
}

GgmlType default_gguf_outtype(DType weights_dtype, std::string* reason) {
  const bool bf16 = weights_dtype == DType::BF16;
  if (reason)
    *reason = bf16 ? "the weights are bf16"
                   : fmt::format("the weights are {} (f16 for anything but bf16, as llama.cpp's converter)",
                                 weights_dtype == DType::F16 ? "fp16" : "fp32");
  return bf16 ? GgmlType::BF16 : GgmlType::F16;
}

void check_gguf_destination(const std::string& path, bool overwrite) {
  require(path.size() > 5 && path.ends_with(".gguf"), "--to: expected a file name ending in .gguf, found '{}'", path);
  const fs::path parent = fs::path(path).parent_path();
  std::error_code ec;
  require(parent.empty() || fs::is_directory(parent, ec), "--to {}: the directory {} does not exist", path,
          parent.string());
  require(!fs::is_directory(path, ec), "--to {}: is a directory; give the .gguf file to write", path);
  check_modelfile_destination(path, overwrite);
  if (overwrite || !fs::exists(path, ec)) return;
  // keel's files name keel in general.quantized_by, the third key, within the first bytes.
  std::ifstream in(path, std::ios::binary);
  std::string head(4096, '\0');
  in.read(head.data(), std::streamsize(head.size()));
  head.resize(size_t(in.gcount()));
  require(head.starts_with("GGUF") && head.find(writer_entry()) != std::string::npos,
          "--to {}: the file exists and keel did not write it (it may be someone's model); choose another name, or "
          "pass --overwrite to replace it",
          path);
}

std::vector<HfTensorSource> decoder_tensor_sources(const model::Decoder& decoder) {
  std::vector<HfTensorSource> out;
  for (const auto& t : model::hf_weight_tensors(decoder)) {
    const float* data = t.data;
    out.push_back({t.name, t.shape, [data](int64_t begin, int64_t count, float* dst) {
                     std::memcpy(dst, data + begin, size_t(count) * sizeof(float));
                   }});
  }
  return out;
}

formats::GgufFill gguf_file_values(HfTensorSource::Read read, int64_t heads, int64_t rows, int64_t cols, float shift,
                                   bool f16_arithmetic) {
  return [read = std::move(read), heads, rows, cols, shift, f16_arithmetic](int64_t begin, int64_t count,
                                                                            float* dst) {
    if (heads)
      model::permute_rows_for_gguf_part(read, heads, rows, cols, begin, count, dst);
    else
      read(begin, count, dst);
    if (shift != 0.0f)
      for (int64_t i = 0; i < count; ++i)
        dst[i] = f16_arithmetic ? f16_to_float(float_to_f16(dst[i] + shift)) : dst[i] + shift;
  };
}

GgufExportResult write_gguf_model(const model::ModelConfig& c, std::vector<HfTensorSource> hf,
                                  const GgufModelSource& source, const std::string& path,
                                  std::optional<GgmlType> outtype, WorkProgress* progress) {
  GgufExportResult result;
  result.architecture = model::gguf_architecture(c);
  result.outtype = outtype ? *outtype : default_gguf_outtype(source.weights_dtype, &result.outtype_reason);
  result.notes = check_llama_cpp_runs_as_trained(c, result.architecture);
  if (result.architecture == "glm4moe" && c.nextn_predict_layers > 0)
    result.notes.push_back(fmt::format(
        "glm4moe.block_count is {} + {}: it counts the model's multi-token-prediction layer(s), as llama.cpp's converter "
        "does, and the file holds none of their tensors, so llama.cpp runs the {} layers and drafts no tokens with them",
        c.num_layers, c.nextn_predict_layers, c.num_layers));
  const bool chatglm = result.architecture == "chatglm";
  require(!(chatglm && result.outtype == GgmlType::Q4_K),
          "--outtype q4_k_m: not written for GLM-4 (keel's Q4_K_M mix is checked against llama-quantize on Llama, "
          "Qwen2, Qwen3 and Gemma 3 only); export --outtype f32 and quantize with llama.cpp's llama-quantize");
  // llama-quantize's Q4_K_M has rules of its own for a mixture (attn_v of 8-expert models, the expert
  // stacks' layer counts) that model/gguf_q4_k_m.h does not follow: refused rather than a different mix.
  require(!(c.has_experts() && result.outtype == GgmlType::Q4_K),
          "--outtype q4_k_m: keel's Q4_K_M mix follows llama-quantize for dense models only, not for a mixture of "
          "experts (llama-quantize chooses some tensors' types by the expert count); export --outtype f16 (or f32) "
          "and run llama-quantize on the file for Q4_K_M");

  data::LlamaCppVocab vocab =
      data::llama_cpp_vocab(source.tokenizer_dir, c.vocab_size, source.config_json, result.architecture == "gemma2");
  if (chatglm || result.architecture == "glm4moe") add_glm_special_ids(vocab, source.tokenizer_dir, result.architecture);
  if (vocab.pre_by_glm4_rule)
    result.notes.push_back(
        "tokenizer.ggml.pre 'glm4' by keel's rule: llama.cpp's table does not know this tokenizer's hash (its ids "
        "of the converter's test text), and it is a GLM-4 tokenizer (GLM-4's Split regex, [gMASK] and <sop>), which "
        "llama.cpp's 'glm4' splits as training did; llama.cpp's converter would refuse it");
  require(!(vocab.model == "gpt2" && vocab.byte_fallback && result.architecture == "llama"),
          "{}/tokenizer.json: a SentencePiece-style vocabulary (byte_fallback) without the tokenizer.model it was "
          "made from: llama.cpp's converter then rebuilds scores from tokenizer.json (LlamaHfVocab), which keel's GGUF "
          "export does not; put the model's tokenizer.model beside it, or use convert_hf_to_gguf.py on a --format hf "
          "export",
          source.tokenizer_dir);
  result.end_of_turn = check_end_of_turn(vocab, source.tokenizer_dir);
  // GLM-4: an answer ends where the next turn begins, the converter's EOT <|user|>, which the
  // template's probe (the answer last) cannot show; llama.cpp stops on it, and so does the Modelfile.
  if (result.end_of_turn.empty())
    for (const auto& [type, id] : vocab.special_ids)
      if (type == "eot" && size_t(id) < vocab.tokens.size()) result.end_of_turn = vocab.tokens[size_t(id)];
  result.tokenizer_model = vocab.model;
  result.pre_tokenizer = vocab.pre;
  result.tokens = int64_t(vocab.tokens.size());
  result.merges = int64_t(vocab.merges.size());
  result.chat_template = vocab.chat_template.has_value();
  for (const auto& [type, id] : vocab.special_ids)
    if (type == "eos" && size_t(id) < vocab.tokens.size()) result.eos = vocab.tokens[size_t(id)];

  GgufMetadata kv;
  kv.add_string("general.architecture", result.architecture);
  kv.add_string("general.type", "model");
  kv.add_string("general.name", source.name);
  kv.add_string("general.quantized_by", kGgufWriterName);
  if (chatglm)
    add_chatglm_keys(kv, c, result.outtype, vocab);
  else
    add_model_keys(kv, c, result.architecture, source.config_json, result.outtype);
  const bool q4_k_m = result.outtype == GgmlType::Q4_K;
  if (!q4_k_m) kv.add_uint32("general.quantization_version", model::kGgmlQuantizationVersion);
  add_tokenizer_keys(kv, vocab, result.architecture);
  if (q4_k_m) {  // llama_model_quantize_impl: gguf_set_val_u32 removes a key and appends it
    kv.add_uint32("general.quantization_version", model::kGgmlQuantizationVersion);
    kv.add_uint32("general.file_type", model::gguf_file_type(result.outtype));
  }

  // The converter reads a checkpoint's tensors sorted by name and writes them in that order (a
  // mixture's experts stacked where they sort).
  hf = gguf_converter_order(c, std::move(hf));
  std::vector<formats::GgufTensor> tensors;
  for (const auto& t : hf) {
    formats::GgufTensor g;
    g.name = model::gguf_tensor_name(c, t.name);
    g.shape = t.shape;
    bool fallback = false;
    g.type = model::gguf_tensor_type(g.name, g.shape, result.outtype, &fallback);
    if (fallback && !q4_k_m) result.f16_fallbacks.push_back(g.name);  // q4_k_m's: choose_q4_k_m_types
    const int64_t heads = model::gguf_permuted_heads(c, t.name);
    int64_t rows = t.shape[0];
    const int64_t cols = t.shape.size() > 1 ? t.shape[1] : 1;
    if (result.architecture == "gemma3" && g.name == "token_embd.weight") {
      // Gemma3Model drops the embedding's rows past the tokenizer's: tokenizer.json's vocab and
      // added tokens, or a SentencePiece vocabulary's length (the model's, so nothing).
      rows = std::min(rows, vocab.model == "llama" ? int64_t(vocab.tokens.size())
                                                   : vocab.tokenizer_json_entries + vocab.added_tokens);
      g.shape[0] = rows;
      result.embedding_rows_dropped = t.shape[0] - rows;
    }
    // Fewer rows than the source's (the embedding's first rows): the writer asks for no more.
    const float shift = model::gguf_norm_shift(c, t.name);
    g.fill = gguf_file_values(t.read, heads, rows, cols, shift, source.weights_dtype == DType::F16);
    // Where the file keeps the source's type (a bf16 checkpoint, a bf16 file) and its values as they
    // are, their bytes are copied, not widened to fp32 and converted back (the writer still converts
    // a piece whose bytes that would change: a NaN). q4_k_m chooses its types below: converted.
    if (t.stored && heads == 0 && shift == 0.0f && !q4_k_m && ggml_type_storing(t.stored_dtype) == g.type)
      g.stored = t.stored;
    tensors.push_back(std::move(g));
  }
  if (q4_k_m) choose_q4_k_m_types(c, result, tensors);
  result.tensor_count = tensors.size();
  formats::write_gguf(path, kv, tensors, progress);
  std::error_code ec;
  result.file_bytes = fs::file_size(path, ec);
  result.modelfile = ollama_modelfile_path(path);
  result.modelfile_text = ollama_modelfile(path, {result.end_of_turn, result.eos});
  write_file_atomic(result.modelfile, result.modelfile_text);
  return result;
}

}  // namespace keel::checkpoint
