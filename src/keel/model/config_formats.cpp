#include "keel/model/config_formats.h"

#include <fmt/format.h>

#include "keel/core/error.h"
#include "keel/core/json_text.h"

namespace keel::model::config_formats {

namespace dom = simdjson::dom;

const std::vector<FamilyFormat>& family_formats() {
  static const std::vector<FamilyFormat> formats = {
      {Family::Llama, "llama", "Llama", "llama", {"LlamaForCausalLM"}, 2048, -1, true},
      {Family::Qwen2, "qwen2", "Qwen2", "qwen2", {"Qwen2ForCausalLM"}, 32768, -1, true},
      {Family::Glm, "glm", "GLM-4", "glm", {"GlmForCausalLM"}, 131072, 151329, true},
      {Family::GlmOriginal, "glm_original", "ChatGLM-format GLM-4", "chatglm",
       {"ChatGLMModel", "ChatGLMForConditionalGeneration"}, 2048, -1, false},
      {Family::Qwen3, "qwen3", "Qwen3", "qwen3", {"Qwen3ForCausalLM"}, 32768, -1, true},
      {Family::Mistral, "mistral", "Mistral", "mistral", {"MistralForCausalLM"}, 4096 * 32, -1, true},
      {Family::Gemma2, "gemma2", "Gemma 2", "gemma2", {"Gemma2ForCausalLM"}, 8192, 0, true},
      {Family::Gemma3, "gemma3", "Gemma 3", "gemma3_text", {"Gemma3ForCausalLM"}, 131072, 0, true},
      {Family::Qwen3Moe, "qwen3_moe", "Qwen3-MoE", "qwen3_moe", {"Qwen3MoeForCausalLM"}, 32768, -1, true},
      {Family::Mixtral, "mixtral", "Mixtral", "mixtral", {"MixtralForCausalLM"}, 4096 * 32, -1, true},
      {Family::Glm4Moe, "glm4_moe", "GLM-4.5", "glm4_moe", {"Glm4MoeForCausalLM"}, 131072, -1, true},
  };
  return formats;
}

const FamilyFormat& format_of(Family f) {
  for (const auto& format : family_formats()) {
    if (format.family == f) return format;
  }
  fail("model config: unknown family value {}", int(f));
}

std::string json_number(double v) {
  std::string text = fmt::format("{}", v);
  if (text.find_first_of(".eni") == std::string::npos) text += ".0";
  return text;
}

const char* json_bool(bool v) { return v ? "true" : "false"; }

dom::element parse_json(dom::parser& parser, const std::string& text, const std::string& path) {
  dom::element root;
  if (auto error = parse_json_document(parser, text, root)) {
    fail("{}: expected valid JSON: {}", path, simdjson::error_message(error));
  }
  if (!root.is_object()) fail("{}: expected a JSON object at the top level, found {}", path, json_type_name(root));
  return root;
}

}  // namespace keel::model::config_formats
