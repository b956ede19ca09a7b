#include "keel/data/chat_encoding.h"

#include <algorithm>

#include "keel/core/error.h"
#include "keel/data/tokenizer.h"

namespace keel::data {
namespace {

using Span = std::pair<size_t, size_t>;

bool all_space(std::string_view s) {
  size_t pos = 0;
  while (pos < s.size()) {
    size_t len;
    if (!jinja::is_python_space(jinja::decode_code_point(s, pos, len))) return false;
    pos += len;
  }
  return true;
}

// Each id's [begin, end) bytes in `text` (the text the ids were encoded from), by walking the
// ids' surface strings along it. Where the tokenizer changed the text (a normalizer, the prefix
// space SentencePiece adds, whitespace an added token swallowed), the walk steps over the
// difference; where it cannot follow (Unicode normalization), the ids up to the next added token
// found in the text share that stretch, which only widens a token's span for the mask.
std::vector<Span> token_offsets(const Tokenizer& tok, std::string_view text, const std::vector<int32_t>& ids) {
  std::vector<Span> out(ids.size());
  size_t p = 0;
  for (size_t k = 0; k < ids.size(); ++k) {
    const std::string s = tok.token_surface(ids[k]);
    if (text.compare(p, s.size(), s) == 0) {
      out[k] = {p, p + s.size()};
      p += s.size();
      continue;
    }
    if (!s.empty() && s[0] == ' ' && text.compare(p, s.size() - 1, std::string_view(s).substr(1)) == 0) {
      out[k] = {p, p + s.size() - 1};  // the prefix space the tokenizer added
      p += s.size() - 1;
      continue;
    }
    const size_t q = s.empty() ? std::string_view::npos : text.find(s, p);
    if (q != std::string_view::npos && all_space(text.substr(p, q - p))) {
      out[k] = {p, q + s.size()};  // whitespace swallowed before it (lstrip, rstrip of the previous)
      p = q + s.size();
      continue;
    }
    // Lost the thread: resynchronise on the next added token found in the text.
    size_t j = k + 1, resume = text.size();
    for (; j < ids.size(); ++j) {
      if (!tok.is_added(ids[j])) continue;
      const size_t at = text.find(tok.token_surface(ids[j]), p);
      if (at != std::string_view::npos) {
        resume = at;
        break;
      }
    }
    for (size_t m = k; m < j; ++m) out[m] = {p, std::max(p, resume)};
    p = std::max(p, resume);
    k = j - 1;
  }
  return out;
}

// transformers' rule: a token is the assistant's when it overlaps a span.
void mark_overlapping(const std::vector<Span>& offsets, const std::vector<Span>& spans, std::vector<uint8_t>& mask) {
  for (size_t t = 0; t < offsets.size(); ++t)
    for (const Span& s : spans)
      if (offsets[t].first < s.second && offsets[t].second > s.first) {
        mask[t] = 1;
        break;
      }
}

}  // namespace

ChatTemplateEncoder::ChatTemplateEncoder(ModelChatTemplate t, const Tokenizer* tokenizer, bool control_tokens_in_data)
    : t_(std::move(t)), tokenizer_(tokenizer), control_tokens_in_data_(control_tokens_in_data) {
  if (!tokenizer_) return;
  for (const AddedToken& a : tokenizer_->added_tokens()) {
    bool control = a.special;
    if (!control && !all_space(a.content))
      for (const std::string& literal : t_.templ->literals())
        if (literal.find(a.content) != std::string::npos) control = true;
    if (control && !a.content.empty()) control_tokens_.push_back(a.content);
  }
  std::stable_sort(control_tokens_.begin(), control_tokens_.end(),
                   [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
  newline_ids_ = tokenizer_->encode("\n");
}

std::string ChatTemplateEncoder::render(const ChatInput& input) const {
  return t_.templ->render(template_variables(t_, input)).text.text;
}

EncodedChat ChatTemplateEncoder::encode(const ChatInput& input) const {
  require(tokenizer_ != nullptr, "{}: encoding a conversation needs a tokenizer", t_.origin);
  const jinja::Rendered r = t_.templ->render(template_variables(t_, input));
  const std::string& text = r.text.text;
  EncodedChat out;
  out.text = text;
  out.from_generation_tags = t_.templ->has_generation();

  // Control-token strings inside the conversation's own strings: encoded as text.
  std::vector<Span> cuts;
  if (!control_tokens_in_data_)
    for (const jinja::Run& run : r.text.runs)
      for (size_t pos = run.begin; pos < run.end;) {
        const std::string* hit = nullptr;
        for (const std::string& c : control_tokens_)
          if (c.size() <= run.end - pos && text.compare(pos, c.size(), c) == 0) {
            hit = &c;
            break;
          }
        if (!hit) {
          ++pos;
          continue;
        }
        cuts.emplace_back(pos, pos + hit->size());
        pos += hit->size();
      }
  out.control_strings_in_data = int64_t(cuts.size());

  std::vector<Span> offsets;
  auto add_piece = [&](size_t begin, size_t end, bool as_text, bool first) {
    const std::string_view piece = std::string_view(text).substr(begin, end - begin);
    if (piece.empty() && !first) return;
    const EncodeOptions options{.split_special_tokens = as_text};
    std::vector<int32_t> ids;
    if (!first) {
      ids = tokenizer_->encode("\n" + std::string(piece), options);
      if (ids.size() >= newline_ids_.size() && std::equal(newline_ids_.begin(), newline_ids_.end(), ids.begin()))
        ids.erase(ids.begin(), ids.begin() + std::ptrdiff_t(newline_ids_.size()));
      else
        ids = tokenizer_->encode(piece, options);
    } else {
      ids = tokenizer_->encode(piece, options);
    }
    for (const Span& s : token_offsets(*tokenizer_, piece, ids)) offsets.emplace_back(s.first + begin, s.second + begin);
    out.ids.insert(out.ids.end(), ids.begin(), ids.end());
  };
  size_t pos = 0;
  bool first = true;
  for (const Span& c : cuts) {
    add_piece(pos, c.first, false, first);
    first = false;
    add_piece(c.first, c.second, true, false);
    pos = c.second;
  }
  add_piece(pos, text.size(), false, first);

  out.assistant_mask.assign(out.ids.size(), 0);
  if (out.from_generation_tags) {
    mark_overlapping(offsets, r.generation, out.assistant_mask);
    return out;
  }

  // Derived: per assistant message, its rendered extent widened to its turn.
  const jinja::List& messages = input.messages.as_list();
  std::vector<Span> extent(messages.size(), Span{std::string::npos, 0});
  for (const jinja::Run& run : r.text.runs)
    if (run.source >= 0 && size_t(run.source) < messages.size()) {
      Span& e = extent[size_t(run.source)];
      e.first = std::min(e.first, run.begin);
      e.second = std::max(e.second, run.end);
    }
  auto is_assistant = [&](size_t i) {
    const jinja::Value* role = messages[i].is_dict() ? messages[i].as_dict().find("role") : nullptr;
    return role && role->is_string() && role->as_str().text == "assistant";
  };
  // The generation prompt: what add_generation_prompt adds after the messages before the first answer.
  std::string prompt;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (!is_assistant(i)) continue;
    if (i == 0) break;
    try {
      ChatInput head = input;
      head.messages = jinja::Value(jinja::List(messages.begin(), messages.begin() + std::ptrdiff_t(i)));
      head.add_generation_prompt = false;
      const std::string without = render(head);
      head.add_generation_prompt = true;
      const std::string with = render(head);
      if (with.size() > without.size() && with.compare(0, without.size(), without) == 0)
        prompt = with.substr(without.size());
    } catch (const Error&) {
      // a template that refuses a conversation ending before the answer: no prompt to look for
    }
    break;
  }
  auto in_data = [&](size_t at) {
    for (const jinja::Run& run : r.text.runs)
      if (at >= run.begin && at < run.end) return true;
    return false;
  };
  std::vector<Span> spans;
  size_t previous_end = 0;
  for (size_t i = 0; i < messages.size(); ++i) {
    const Span e = extent[i];
    if (e.first == std::string::npos) {
      if (is_assistant(i)) ++out.assistant_turns_without_text;
      continue;
    }
    if (is_assistant(i)) {
      size_t begin = e.first;
      if (!prompt.empty() && e.first >= prompt.size()) {
        const size_t at = text.rfind(prompt, e.first - prompt.size());
        if (at != std::string::npos && at >= previous_end) begin = at + prompt.size();
      }
      size_t next_data = text.size();
      for (size_t j = i + 1; j < messages.size(); ++j) next_data = std::min(next_data, extent[j].first);
      size_t end = e.second;
      for (size_t at = e.second; at < next_data && at < text.size(); ++at) {
        if (in_data(at)) continue;
        const std::string* hit = nullptr;
        for (const std::string& c : control_tokens_)
          if (text.compare(at, c.size(), c) == 0) {
            hit = &c;
            break;
          }
        if (hit) {
          end = at + hit->size();
          break;
        }
      }
      spans.emplace_back(begin, end);
    }
    previous_end = std::max(previous_end, e.second);
  }
  mark_overlapping(offsets, spans, out.assistant_mask);
  return out;
}

}  // namespace keel::data
