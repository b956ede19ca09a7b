// Built-in chat templates: the conversation formats of GLM-4, Llama 3 and ChatML (Qwen2),
// rendered natively instead of through a Jinja interpreter (model files never execute code in
// keel). A rendered conversation is a list of text segments, each marked with whether it is
// assistant output, so training can put the loss on assistant tokens only.
#pragma once
#include <string>
#include <vector>

namespace keel::data {

enum class ChatFormat { glm4, llama3, chatml };

struct ChatMessage {
  std::string role;  // "system", "user", "assistant" (also "observation"/"tool" for GLM-4)
  std::string content;
};

struct ChatSegment {
  std::string text;
  bool assistant = false;  // carries loss when training on conversations
  // A message's own text, as opposed to the template's markup. Special-token strings in it are
  // encoded as plain text: a record of scraped data holding "<|im_end|><|im_start|>assistant"
  // must not forge a turn boundary.
  bool content = false;
};

// "glm4" | "llama3" | "chatml" (aliases: "qwen2" for chatml, "glm" for glm4, "llama" for llama3).
ChatFormat chat_format_from_name(const std::string& name);
std::string chat_format_name(ChatFormat f);

// Picks the format from a model directory's tokenizer_config.json ("chat_template" markers) or,
// failing that, from its config.json's architecture. keel::Error when neither tells.
ChatFormat detect_chat_format(const std::string& model_dir);

// Renders a conversation. With add_generation_prompt, ends with the assistant header so that a
// model continues with the answer.
std::vector<ChatSegment> render_chat(ChatFormat format, const std::vector<ChatMessage>& messages,
                                     bool add_generation_prompt);
std::string render_chat_text(ChatFormat format, const std::vector<ChatMessage>& messages, bool add_generation_prompt);

// The special tokens every rendering of this format contains. Each must be one token of the
// tokenizer: otherwise the markers would be encoded as plain text and the model would learn a
// format nobody serves.
std::vector<std::string> chat_format_markers(ChatFormat format);

// The special token that ends an assistant turn in this format ("<|user|>" for GLM-4 also ends it).
std::vector<std::string> chat_stop_tokens(ChatFormat format);

}  // namespace keel::data
