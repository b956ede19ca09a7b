#include "keel/data/chat_encoding.h"

#include <algorithm>
#include <span>

#include "keel/core/error.h"
#include "keel/data/tokenizer.h"

namespace keel::data {
namespace {

// [begin, end) bytes of the text. Its default constructor leaves both unset, so that sizing the
// per-token offsets (one per token of the conversation, each then written once) is not also a
// pass that zeroes them.
struct Span {
  size_t first, second;
  Span() {}  // NOLINT: deliberately uninitialized
  Span(size_t begin, size_t end) : first(begin), second(end) {}
};

bool all_space(std::string_view s) {
  size_t pos = 0;
  while (pos < s.size()) {
    size_t len;
    if (!jinja::is_python_space(jinja::decode_code_point(s, pos, len))) return false;
    pos += len;
  }
  return true;
}

// Tokens [k, j) over text[begin, end), which the tokenizer saw normalized: each token's span in the
// normalized stretch, mapped back to the raw text by the normalized length of each raw prefix (a
// raw character that normalization merged with the next lands in the token holding the merge).
// False when the tokens do not spell the normalized stretch (or it is too long to map).
// The bytes a token's surface `s` takes in `text` at `p`: all of it, or all but the prefix space
// the tokenizer added (SentencePiece's); npos when it is not there.
// Tokens are a few bytes: comparing them in place beats a call to memcmp per token.
bool spelled_at(std::string_view text, size_t p, std::string_view s) {
  if (s.size() > text.size() - p) return false;
  for (size_t i = 0; i < s.size(); ++i)
    if (text[p + i] != s[i]) return false;
  return true;
}

size_t surface_at(std::string_view text, size_t p, std::string_view s) {
  if (spelled_at(text, p, s)) return s.size();
  if (!s.empty() && s[0] == ' ' && spelled_at(text, p, s.substr(1))) return s.size() - 1;
  return std::string_view::npos;
}

bool align_normalized(const Tokenizer& tok, std::string_view text, size_t begin, size_t end,
                      std::span<const int32_t> ids, size_t k, size_t j, Span* out) {
  const std::string_view raw = text.substr(begin, end - begin);
  if (raw.size() > 4096) return false;  // quadratic below: normalized prefixes
  const std::string norm = tok.normalize_unicode(raw);
  if (norm == raw) return false;
  std::vector<Span> spans;  // in the normalized stretch
  std::string scratch;
  size_t q = 0;
  for (size_t m = k; m < j; ++m) {
    const size_t n = surface_at(norm, q, tok.token_surface(ids[m], scratch));
    if (n == std::string_view::npos) return false;
    spans.emplace_back(q, q + n);
    q += n;
  }
  // normalized length of each raw prefix that ends at a character boundary
  std::vector<std::pair<size_t, size_t>> prefix;  // (raw bytes, normalized bytes)
  for (size_t r = 0; r <= raw.size();) {
    prefix.emplace_back(r, tok.normalize_unicode(raw.substr(0, r)).size());
    if (r == raw.size()) break;
    size_t len;
    jinja::decode_code_point(raw, r, len);
    r += len;
  }
  auto to_raw = [&](size_t x) {  // the first raw boundary whose prefix covers x normalized bytes
    auto it = std::lower_bound(prefix.begin(), prefix.end(), x,
                               [](const std::pair<size_t, size_t>& a, size_t v) { return a.second < v; });
    return begin + (it == prefix.end() ? raw.size() : it->first);
  };
  for (size_t m = k; m < j; ++m) out[m] = {to_raw(spans[m - k].first), to_raw(spans[m - k].second)};
  return true;
}

// Appends each id's [begin, end) bytes in `text` (the text the ids were encoded from), plus
// `base`, to `offsets`, by walking the ids' surface strings along it. Where the tokenizer changed
// the text (a normalizer, the prefix space SentencePiece adds, whitespace an added token
// swallowed), the walk steps over the difference; where it cannot follow (Unicode normalization),
// the ids up to the next added token found in the text share that stretch, which only widens a
// token's span for the mask.
void token_offsets(const Tokenizer& tok, std::string_view text, std::span<const int32_t> ids, size_t base,
                   std::vector<Span>& offsets) {
  const size_t first = offsets.size();
  offsets.resize(first + ids.size());
  Span* out = offsets.data() + first;
  std::string scratch;
  size_t p = 0;
  for (size_t k = 0; k < ids.size(); ++k) {
    const std::string_view s = tok.token_surface(ids[k], scratch);
    if (const size_t n = surface_at(text, p, s); n != std::string_view::npos) {
      out[k] = {p, p + n};
      p += n;
      continue;
    }
    const size_t q = s.empty() ? std::string_view::npos : text.find(s, p);
    if (q != std::string_view::npos && all_space(text.substr(p, q - p))) {
      out[k] = {p, q + s.size()};  // whitespace swallowed before it (lstrip, rstrip of the previous)
      p = q + s.size();
      continue;
    }
    // Lost the thread: up to the next added token found in the text, the tokenizer saw the text
    // normalized (NFC: "e" + U+0301 is "é"). Walk the normalized stretch and map back.
    size_t j = k + 1, resume = text.size();
    for (; j < ids.size(); ++j) {
      if (!tok.is_added(ids[j])) continue;
      const size_t at = text.find(tok.token_surface(ids[j], scratch), p);
      if (at != std::string_view::npos) {
        resume = at;
        break;
      }
    }
    resume = std::max(p, resume);
    if (!align_normalized(tok, text, p, resume, ids, k, j, out))
      for (size_t m = k; m < j; ++m) out[m] = {p, resume};  // each of them somewhere in the stretch
    p = resume;
    k = j - 1;
  }
  for (size_t k = 0; k < ids.size(); ++k) out[k] = {out[k].first + base, out[k].second + base};
}

// Each id's [begin, end) bytes in the text, plus `base`, appended to `offsets`, for ids that spell
// their text (Tokenizer::encode_spelled): the running sum of their surfaces' lengths. False, and
// nothing appended, when the lengths do not add up to the text's (then token_offsets walks).
bool spelled_offsets(const Tokenizer& tok, size_t text_size, std::span<const int32_t> ids, size_t base,
                     std::vector<Span>& offsets) {
  const size_t first = offsets.size();
  offsets.resize(first + ids.size());
  Span* const out = offsets.data() + first;
  size_t p = base;
  for (size_t k = 0; k < ids.size(); ++k) {
    const size_t n = tok.spelled_length(ids[k]);
    out[k] = {p, p + n};
    p += n;
  }
  if (p - base == text_size) return true;
  offsets.resize(first);
  return false;
}

// transformers' rule: a token is the assistant's when it overlaps a span ([a, b) and [s, e) with
// s < b and e > a). The tokens' begins and ends never decrease (token_offsets and
// spelled_offsets walk forward), so the tokens overlapping a span are one run: from the first
// token ending after s to the last beginning before e. Two binary searches per span and the run
// marked, instead of a test per token and span.
template <class Spans>  // Span, or the renderer's (begin, end) pairs
void mark_overlapping(const std::vector<Span>& offsets, const Spans& spans, std::vector<uint8_t>& mask) {
  for (const auto& [s, e] : spans) {
    const auto from =
        std::partition_point(offsets.begin(), offsets.end(), [s](const Span& t) { return t.second <= s; });
    const auto to = std::partition_point(from, offsets.end(), [e](const Span& t) { return t.first < e; });
    std::fill(mask.begin() + (from - offsets.begin()), mask.begin() + (to - offsets.begin()), uint8_t{1});
  }
}

}  // namespace

ChatTemplateEncoder::ChatTemplateEncoder(ModelChatTemplate t, const Tokenizer* tokenizer, bool control_tokens_in_data)
    : t_(std::move(t)), tokenizer_(tokenizer), control_tokens_in_data_(control_tokens_in_data) {
  if (!tokenizer_) return;
  std::vector<std::string> control;
  for (const AddedToken& a : tokenizer_->added_tokens()) {
    bool is_control = a.special;
    if (!is_control && !all_space(a.content))
      for (const std::string& literal : t_.templ->literals())
        if (literal.find(a.content) != std::string::npos) is_control = true;
    if (is_control) control.push_back(a.content);
  }
  control_ = ControlStrings(std::move(control));
  newline_ids_ = tokenizer_->encode("\n");
}

std::string ChatTemplateEncoder::generation_prompt(const ChatInput& input, size_t first_answer) const {
  if (first_answer == 0) return {};
  const jinja::List& messages = input.messages.as_list();
  const jinja::Value* role =
      messages[first_answer - 1].is_dict() ? messages[first_answer - 1].as_dict().find("role") : nullptr;
  // Built for every conversation: plain appends, and the variables' JSON only when there are any.
  std::string key = role && role->is_string() ? role->as_str().text : "?";
  key += input.tools.is_list() ? "|tools|" : "|-|";
  if (!input.variables.items.empty()) try {
      key += jinja::to_json(jinja::Value(input.variables), {});
    } catch (const Error&) {
      key += "?";  // a variable JSON cannot show: never reused
    }
  {
    std::lock_guard lock(prompts_mutex_);
    if (auto it = prompts_.find(key); it != prompts_.end()) return it->second;
  }
  // What add_generation_prompt adds after the messages before the first answer.
  std::string prompt;
  try {
    ChatInput head = input;
    head.messages = jinja::Value(jinja::List(messages.begin(), messages.begin() + std::ptrdiff_t(first_answer)));
    head.add_generation_prompt = false;
    const std::string without = render(head);
    head.add_generation_prompt = true;
    const std::string with = render(head);
    if (with.size() > without.size() && with.compare(0, without.size(), without) == 0)
      prompt = with.substr(without.size());
  } catch (const Error&) {
    // a template that refuses a conversation ending before the answer: no prompt to look for
  }
  std::lock_guard lock(prompts_mutex_);
  if (key.back() != '?' && prompts_.size() < 1024) prompts_.emplace(key, prompt);
  return prompt;
}

std::string ChatTemplateEncoder::render(const ChatInput& input) const {
  return t_.templ->render(template_variables(input)).text.text;
}

EncodedChat ChatTemplateEncoder::encode(const ChatInput& input) const {
  require(tokenizer_ != nullptr, "{}: encoding a conversation needs a tokenizer", t_.origin);
  jinja::Rendered r = replay_.render(*t_.templ, template_variables(input));
  const std::string& text = r.text.text;
  EncodedChat out;
  out.from_generation_tags = t_.templ->has_generation();

  // Control-token strings inside the conversation's own strings: encoded as text.
  std::vector<Span> cuts;
  if (!control_tokens_in_data_)
    for (const jinja::Run& run : r.text.runs)
      for (size_t pos = run.begin; pos < run.end;) {
        pos = control_.next_start(text, pos, run.end);
        if (pos >= run.end) break;
        const std::string* hit = control_.at(text, pos, run.end);
        if (!hit) {
          ++pos;
          continue;
        }
        if (cuts.empty()) out.first_control_string = *hit;
        cuts.emplace_back(pos, pos + hit->size());
        pos += hit->size();
      }
  out.control_strings_in_data = int64_t(cuts.size());

  std::vector<Span> offsets;
  offsets.reserve(text.size() / 3 + 4);  // as Tokenizer::encode reserves ids
  out.ids.reserve(text.size() / 3 + 4);
  auto add_piece = [&](size_t begin, size_t end, bool as_text, bool first) {
    const std::string_view piece = std::string_view(text).substr(begin, end - begin);
    if (piece.empty() && !first) return;
    // transformers encodes a marked control token with no added token matched, special or not.
    const EncodeOptions options{.split_special_tokens = as_text, .no_added_tokens = as_text};
    // Encoded straight onto out.ids (the conversation's first piece is usually all of it).
    const size_t at = out.ids.size();
    bool spelled;
    if (!first) {
      std::string after_newline;  // not "\n" + std::string(piece): GCC 12 warns falsely (-Wrestrict) on it
      after_newline.reserve(piece.size() + 1);
      after_newline += '\n';
      after_newline += piece;
      spelled = tokenizer_->encode_spelled(after_newline, out.ids, options);
      const auto ids = out.ids.begin() + std::ptrdiff_t(at);
      if (out.ids.size() - at >= newline_ids_.size() && std::equal(newline_ids_.begin(), newline_ids_.end(), ids)) {
        out.ids.erase(ids, ids + std::ptrdiff_t(newline_ids_.size()));
      } else {
        out.ids.resize(at);
        spelled = tokenizer_->encode_spelled(piece, out.ids, options);
      }
    } else {
      spelled = tokenizer_->encode_spelled(piece, out.ids, options);
    }
    const std::span<const int32_t> ids = std::span<const int32_t>(out.ids).subspan(at);
    if (!spelled || !spelled_offsets(*tokenizer_, piece.size(), ids, begin, offsets))
      token_offsets(*tokenizer_, piece, ids, begin, offsets);
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
    out.text = std::move(r.text.text);
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
  std::string prompt;
  for (size_t i = 0; i < messages.size(); ++i)
    if (is_assistant(i)) {
      prompt = generation_prompt(input, i);
      break;
    }
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
      // The first control token of the template's text (outside every data run) after the message.
      size_t end = e.second;
      auto run = std::lower_bound(r.text.runs.begin(), r.text.runs.end(), e.second,
                                  [](const jinja::Run& x, size_t at) { return x.end <= at; });
      for (size_t at = e.second; at < next_data && at < text.size(); ++at) {
        while (run != r.text.runs.end() && run->end <= at) ++run;
        if (run != r.text.runs.end() && run->begin <= at) {
          at = run->end - 1;  // inside data: skip the run
          continue;
        }
        if (const std::string* hit = control_.at(text, at, text.size())) {
          end = at + hit->size();
          break;
        }
      }
      spans.emplace_back(begin, end);
    }
    previous_end = std::max(previous_end, e.second);
  }
  mark_overlapping(offsets, spans, out.assistant_mask);
  out.text = std::move(r.text.text);
  return out;
}

std::optional<int32_t> end_of_turn_id(const ChatTemplateEncoder& encoder, const Tokenizer& tokenizer) {
  EncodedChat probe;
  try {
    probe = encoder.encode(chat_input_from_messages({{"user", "x"}, {"assistant", "y"}}));
  } catch (const Error&) {
    return std::nullopt;  // a template that refuses the probe
  }
  for (size_t t = probe.ids.size(); t-- > 0;)
    if (probe.assistant_mask[t]) return tokenizer.is_added(probe.ids[t]) ? std::optional<int32_t>(probe.ids[t]) : std::nullopt;
  return std::nullopt;
}

}  // namespace keel::data
