// A conversation through a model's own chat template into token ids and the loss mask, as
// transformers' apply_chat_template(tokenize=True) produces them:
//
// - Ids: the rendered text is encoded as one string (the tokenizer matches the template's special
//   tokens), except that a control token written inside the conversation's own strings (a user's
//   "<|im_end|><|im_start|>assistant") is encoded as plain text, as transformers does with
//   sanitize_control_tokens=True: the text is cut before and after each such string and the pieces
//   after the first are encoded after a "\n" that is then dropped (so SentencePiece adds no prefix
//   space). Control tokens: the tokenizer's special tokens and the added tokens the template's
//   literal text contains (whitespace tokens aside).
// - Mask: with {% generation %} in the template, the tokens overlapping a generation block (as
//   transformers' return_assistant_tokens_mask). Without, derived (docs/chat-templates.md): for
//   each assistant message, from the end of the generation prompt before the message's first
//   rendered character (or that character, when the prompt is not there) to the end of the first
//   control token the template writes after the message's last rendered character: the answer,
//   any reasoning and tool calls in it, and the end-of-turn token the model must learn to stop with.
#pragma once
#include <map>
#include <mutex>
#include <optional>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "keel/data/control_strings.h"
#include "keel/data/jinja/replay.h"
#include "keel/data/model_chat_template.h"

namespace keel::data {

class Tokenizer;

struct EncodedChat {
  std::string text;
  std::vector<int32_t> ids;
  std::vector<uint8_t> assistant_mask;       // per id: 1 = an assistant token
  bool from_generation_tags = false;         // the mask is transformers' (else derived)
  int64_t control_strings_in_data = 0;       // control-token strings in the conversation, encoded as text
  std::string first_control_string;          // the first of them
  int64_t assistant_turns_without_text = 0;  // assistant messages that rendered nothing of their own
};

class ChatTemplateEncoder {
 public:
  // `tokenizer` (not owned: it must outlive the encoder) may be null for render();
  // `control_tokens_in_data` = true matches special-token strings inside the conversation as the
  // tokens (for datasets that rely on it).
  ChatTemplateEncoder(ModelChatTemplate t, const Tokenizer* tokenizer, bool control_tokens_in_data = false);

  std::string render(const ChatInput& input) const;
  // keel::Error for a template error or raise_exception (its message names the template).
  EncodedChat encode(const ChatInput& input) const;

  const ModelChatTemplate& chat_template() const { return t_; }

 private:
  ModelChatTemplate t_;
  const Tokenizer* tokenizer_;
  bool control_tokens_in_data_;
  ControlStrings control_;  // the control tokens' strings
  std::vector<int32_t> newline_ids_;
  // The generation prompt of a conversation whose answer follows `key` (the role before it,
  // whether tools are given, the extra variables): rendered twice the first time, then reused.
  std::string generation_prompt(const ChatInput& input, size_t first_answer) const;
  mutable std::mutex prompts_mutex_;
  mutable std::map<std::string, std::string> prompts_;
  // Conversations of a shape seen before replay its recording instead of being interpreted.
  mutable jinja::ReplayCache replay_;
};

// The token that ends an assistant turn as training learns it: the last token of the answer's loss
// span in a probe conversation (user "x", assistant "y"), when it is an added token (GLM-4's next
// <|user|>, or <|im_end|>, <|eot_id|>, <end_of_turn>, ... which EOS may not be). nullopt when the
// span ends in an ordinary token or the template refuses the probe. Generation stops on it.
std::optional<int32_t> end_of_turn_id(const ChatTemplateEncoder& encoder, const Tokenizer& tokenizer);

}  // namespace keel::data
