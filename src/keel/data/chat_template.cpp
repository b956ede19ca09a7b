#include "keel/data/chat_template.h"

#include <fmt/format.h>

#include "keel/core/error.h"
#include "keel/core/file_io.h"

namespace keel::data {

ChatFormat chat_format_from_name(const std::string& name) {
  if (name == "glm4" || name == "glm") return ChatFormat::glm4;
  if (name == "llama3" || name == "llama") return ChatFormat::llama3;
  if (name == "chatml" || name == "qwen2") return ChatFormat::chatml;
  fail("unknown chat template '{}': expected glm4, llama3 or chatml", name);
}

std::string chat_format_name(ChatFormat f) {
  switch (f) {
    case ChatFormat::glm4: return "glm4";
    case ChatFormat::llama3: return "llama3";
    case ChatFormat::chatml: return "chatml";
  }
  return "?";
}

ChatFormat detect_chat_format(const std::string& dir) {
  const std::string tokenizer_config = dir + "/tokenizer_config.json";
  if (path_exists(tokenizer_config)) {
    const std::string text = read_file(tokenizer_config);
    if (text.find("[gMASK]") != std::string::npos || text.find("<|assistant|>") != std::string::npos)
      return ChatFormat::glm4;
    if (text.find("<|start_header_id|>") != std::string::npos) return ChatFormat::llama3;
    if (text.find("<|im_start|>") != std::string::npos) return ChatFormat::chatml;
  }
  const std::string config = dir + "/config.json";
  if (path_exists(config)) {
    const std::string text = read_file(config);
    if (text.find("Glm") != std::string::npos || text.find("ChatGLM") != std::string::npos) return ChatFormat::glm4;
    if (text.find("Qwen2") != std::string::npos) return ChatFormat::chatml;
    if (text.find("Llama") != std::string::npos) return ChatFormat::llama3;
  }
  fail(
      "{}: cannot tell the chat format (no chat_template in tokenizer_config.json, unknown architecture); "
      "name it with --chat-template glm4|llama3|chatml",
      dir);
}

std::vector<ChatSegment> render_chat(ChatFormat f, const std::vector<ChatMessage>& messages,
                                     bool add_generation_prompt) {
  std::vector<ChatSegment> out;
  // Consecutive pieces of the same kind (loss or not, content or markup) join one segment.
  auto add = [&](std::string s, bool assistant, bool content) {
    if (s.empty()) return;
    if (!out.empty() && out.back().assistant == assistant && out.back().content == content)
      out.back().text += s;
    else
      out.push_back({std::move(s), assistant, content});
  };
  auto text = [&](std::string s) { add(std::move(s), false, false); };          // markup, no loss
  auto said = [&](const std::string& s) { add(s, false, true); };               // a prompt's content
  auto answer = [&](const std::string& s) { add(s, true, true); };              // an answer's content
  auto answer_markup = [&](std::string s) { add(std::move(s), true, false); };  // its end marker
  switch (f) {
    case ChatFormat::glm4:
      // [gMASK]<sop><|user|>\nQ<|assistant|>\nA ... ; the next <|user|> (or <|endoftext|>) ends a turn.
      text("[gMASK]<sop>");
      for (const auto& m : messages) {
        if (m.role == "assistant") {
          text("<|assistant|>\n");
          answer(m.content);
        } else {
          text(fmt::format("<|{}|>\n", m.role));
          said(m.content);
        }
      }
      if (add_generation_prompt) text("<|assistant|>\n");
      break;
    case ChatFormat::llama3:
      text("<|begin_of_text|>");
      for (const auto& m : messages) {
        text(fmt::format("<|start_header_id|>{}<|end_header_id|>\n\n", m.role));
        if (m.role == "assistant") {
          answer(m.content);
          answer_markup("<|eot_id|>");
        } else {
          said(m.content);
          text("<|eot_id|>");
        }
      }
      if (add_generation_prompt) text("<|start_header_id|>assistant<|end_header_id|>\n\n");
      break;
    case ChatFormat::chatml:
      for (const auto& m : messages) {
        text(fmt::format("<|im_start|>{}\n", m.role));
        if (m.role == "assistant") {
          answer(m.content);
          answer_markup("<|im_end|>");
          text("\n");
        } else {
          said(m.content);
          text("<|im_end|>\n");
        }
      }
      if (add_generation_prompt) text("<|im_start|>assistant\n");
      break;
  }
  // GLM-4 fine-tuning ends the last answer with the EOS token, which the model must learn to emit.
  if (f == ChatFormat::glm4 && !out.empty() && out.back().assistant) answer_markup("<|endoftext|>");
  return out;
}

std::string render_chat_text(ChatFormat f, const std::vector<ChatMessage>& messages, bool add_generation_prompt) {
  std::string s;
  for (const auto& seg : render_chat(f, messages, add_generation_prompt)) s += seg.text;
  return s;
}

std::vector<std::string> chat_format_markers(ChatFormat format) {
  switch (format) {
    case ChatFormat::glm4: return {"[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|endoftext|>"};
    case ChatFormat::llama3: return {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"};
    case ChatFormat::chatml: return {"<|im_start|>", "<|im_end|>"};
  }
  return {};
}

std::vector<std::string> chat_stop_tokens(ChatFormat f) {
  switch (f) {
    case ChatFormat::glm4: return {"<|user|>", "<|endoftext|>", "<|observation|>"};
    case ChatFormat::llama3: return {"<|eot_id|>", "<|end_of_text|>"};
    case ChatFormat::chatml: return {"<|im_end|>", "<|endoftext|>"};
  }
  return {};
}

}  // namespace keel::data
