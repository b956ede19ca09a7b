// A model's own chat template (the Jinja text its tokenizer directory ships) and the inputs
// transformers' apply_chat_template gives it: the messages, tools and documents of a record, the
// tokenizer's special tokens (bos_token, eos_token, ...) and any extra variables. Rendering and
// encoding a conversation with it is chat_encoding.h's job.
#pragma once
#include <optional>
#include <string>

#include "keel/data/chat_template.h"
#include "keel/data/jinja/template.h"
#include "keel/data/jinja/value.h"

namespace simdjson::dom {
class element;
}

namespace keel::data {

struct ModelChatTemplate {
  std::shared_ptr<const jinja::Template> templ;
  std::string origin;          // the file (and the template's name when it has several)
  std::string checksum;        // of the template text: prepared data depends on it
};

// Where transformers looks, in its order: chat_template.jinja, chat_template.json
// ({"chat_template": ...}), then tokenizer_config.json's "chat_template" (a string, or a list of
// {"name", "template"}). `name` picks a named template ("" = "default", or "tool_use" when
// `tools` is set and the directory has one). nullopt when the directory has no template;
// keel::Error for a file that is not what it should be or a template that does not parse.
std::optional<ModelChatTemplate> find_model_chat_template(const std::string& model_dir, const std::string& name = "",
                                                          bool with_tools = false);
// A template from a .jinja file (or a tokenizer_config.json / chat_template.json), with the special
// tokens of `tokenizer_dir` when given.
ModelChatTemplate chat_template_from_file(const std::string& path, const std::string& tokenizer_dir = "");

// What one conversation gives the template.
struct ChatInput {
  jinja::Value messages;  // a list of dicts; each string in message i marked with source i
  jinja::Value tools;     // a list, or none
  jinja::Value documents;
  jinja::Dict variables;  // extra template variables (enable_thinking, date_string, ...)
  bool add_generation_prompt = false;
};

// A JSON value as the template sees it, every string marked with `source`.
jinja::Value json_to_value(simdjson::dom::element e, int source);

// A record's conversation: "messages" (role/content and whatever else each message holds:
// tool_calls, reasoning_content, ...) or ShareGPT "conversations" (from/value), plus "tools"
// and "documents". As transformers does, keys whose value is null are dropped and a reasoning
// field (reasoning_content, thinking, reasoning) is given under both `thinking` and
// `reasoning_content`. Returns "" or why the record is not a conversation.
std::string chat_input_from_record(simdjson::dom::element record, ChatInput& out);

// A conversation given as role/content pairs (prompt/response and instruction/output records).
ChatInput chat_input_from_messages(const std::vector<ChatMessage>& messages);

// The variables of one rendering: messages, tools, documents, add_generation_prompt and the
// extra variables. The special tokens are the template's own defaults (ModelChatTemplate::templ),
// which these override.
jinja::Dict template_variables(const ChatInput& input);

}  // namespace keel::data
