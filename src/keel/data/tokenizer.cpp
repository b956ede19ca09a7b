#include "keel/data/tokenizer.h"

#include <unicode/bytestream.h>
#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/unistr.h>
#include <unicode/stringpiece.h>

#include <algorithm>
#include <cctype>
#include <deque>
#include <filesystem>
#include <fstream>
#include <limits>
#include <tuple>

#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/data/byte_level.h"
#include "keel/data/hf_tokenizer_json.h"
#include "keel/data/tiktoken.h"

namespace keel::data {
namespace {

// Decodes the code point at text[i] (valid UTF-8 assumed) and its length.
uint32_t code_point_at(std::string_view text, size_t i, size_t& length) {
  const auto c = static_cast<unsigned char>(text[i]);
  length = utf8_length(c);
  if (length == 1) return c;
  uint32_t cp = c & (0x7F >> length);
  for (size_t k = 1; k < length && i + k < text.size(); ++k) cp = (cp << 6) | (text[i + k] & 0x3F);
  return cp;
}

// Start of the code point that ends just before byte `i`.
size_t previous_code_point(std::string_view text, size_t i) {
  do --i;
  while (i > 0 && (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80);
  return i;
}

bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// For single_word added tokens: letters, digits and '_' (ASCII is what matters in practice; any
// non-ASCII code point counts as a word character, so a match next to one is refused).
bool is_word_byte(unsigned char c) { return c >= 0x80 || std::isalnum(c) || c == '_'; }

std::string normalize(std::string_view text, NormalizationForm form) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* normalizer = nullptr;
  switch (form) {
    case NormalizationForm::nfc: normalizer = icu::Normalizer2::getNFCInstance(status); break;
    case NormalizationForm::nfd: normalizer = icu::Normalizer2::getNFDInstance(status); break;
    case NormalizationForm::nfkc: normalizer = icu::Normalizer2::getNFKCInstance(status); break;
    case NormalizationForm::nfkd: normalizer = icu::Normalizer2::getNFKDInstance(status); break;
  }
  require(U_SUCCESS(status), "cannot load the ICU normalizer: {}", u_errorName(status));
  const icu::StringPiece piece(text.data(), int32_t(text.size()));
  // Most text is already normalized; checking is much cheaper than rewriting.
  if (normalizer->isNormalizedUTF8(piece, status) && U_SUCCESS(status)) return std::string(text);
  status = U_ZERO_ERROR;
  std::string out;
  icu::StringByteSink<std::string> sink(&out, int32_t(text.size()));
  normalizer->normalizeUTF8(0, piece, sink, nullptr, status);
  require(U_SUCCESS(status), "cannot normalize text: {}", u_errorName(status));
  return out;
}

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty()) return;
  std::string out;
  size_t pos = 0;
  for (size_t at; (at = s.find(from, pos)) != std::string::npos; pos = at + from.size())
    out.append(s, pos, at - pos).append(to);
  if (pos == 0) return;
  out.append(s, pos, std::string::npos);
  s = std::move(out);
}

void apply(const NormalizerStep& step, std::string& s) {
  switch (step.kind) {
    case NormalizerStep::Kind::unicode: s = normalize(s, step.form); return;
    case NormalizerStep::Kind::prepend:
      if (!s.empty()) s.insert(0, step.text);
      return;
    case NormalizerStep::Kind::replace:
      if (!step.regex) {
        replace_all(s, step.text, step.content);
      } else {
        std::string out;
        size_t pos = 0, b = 0, e = 0;
        while (pos < s.size() && step.regex->find(s, pos, b, e)) {
          out.append(s, pos, b - pos);
          out += step.content;
          pos = e;
        }
        out.append(s, pos, std::string::npos);
        s = std::move(out);
      }
      return;
    case NormalizerStep::Kind::strip: {
      size_t b = 0, e = s.size(), len;
      while (step.left && b < e && is_white_space(code_point_at(s, b, len))) b += len;
      while (step.right && e > b) {
        const size_t p = previous_code_point(s, e);
        if (!is_white_space(code_point_at(s, p, len))) break;
        e = p;
      }
      s = s.substr(b, e - b);
      return;
    }
    case NormalizerStep::Kind::lowercase: {
      icu::UnicodeString u = icu::UnicodeString::fromUTF8(s);
      u.toLower(icu::Locale::getRoot());
      s.clear();
      u.toUTF8String(s);
      return;
    }
  }
}

// "<0xXX>" (SentencePiece's byte tokens): the byte, or -1.
int fallback_byte(std::string_view token) {
  if (token.size() != 6 || token.substr(0, 3) != "<0x" || token[5] != '>') return -1;
  int value = 0;
  for (char c : token.substr(3, 2)) {
    const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (digit < 0) return -1;
    value = value * 16 + digit;
  }
  return value;
}

// The number of leading (or trailing) characters `c` of `s`, at most `limit`.
size_t run_of(std::string_view s, std::string_view c, size_t limit, bool from_end) {
  size_t n = 0;
  while (n < limit && !c.empty() && s.size() >= (n + 1) * c.size() &&
         s.substr(from_end ? s.size() - (n + 1) * c.size() : n * c.size(), c.size()) == c)
    ++n;
  return n;
}

// Hugging Face's decoders::wordpiece::cleanup, in its order.
void word_piece_cleanup(std::string& t) {
  static const std::pair<const char*, const char*> kRules[] = {
      {" .", "."},   {" ?", "?"},           {" !", "!"},   {" ,", ","},     {" ' ", "'"},   {" n't", "n't"},
      {" 'm", "'m"}, {" do not", " don't"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
  for (auto [from, to] : kRules) replace_all(t, from, to);
}

void apply(const DecoderStep& step, std::vector<std::string>& tokens) {
  switch (step.kind) {
    case DecoderStep::Kind::replace:
      for (auto& t : tokens) replace_all(t, step.text, step.content);
      return;
    case DecoderStep::Kind::byte_fallback: {
      std::vector<std::string> out;
      std::string bytes;
      size_t run = 0;  // byte tokens in `bytes`
      auto flush = [&] {
        if (run == 0) return;
        if (find_invalid_utf8(bytes) == std::string_view::npos)
          out.push_back(bytes);
        else
          for (size_t i = 0; i < run; ++i) out.emplace_back("\xEF\xBF\xBD");  // U+FFFD per byte token
        bytes.clear();
        run = 0;
      };
      for (auto& t : tokens) {
        const int b = fallback_byte(t);
        if (b >= 0) {
          bytes.push_back(char(b));
          ++run;
        } else {
          flush();
          out.push_back(std::move(t));
        }
      }
      flush();
      tokens = std::move(out);
      return;
    }
    case DecoderStep::Kind::fuse: {
      std::string all;
      for (const auto& t : tokens) all += t;
      tokens.assign(1, std::move(all));
      return;
    }
    case DecoderStep::Kind::metaspace:
      for (size_t i = 0; i < tokens.size(); ++i) replace_all(tokens[i], step.text, i == 0 && step.start ? "" : " ");
      return;
    case DecoderStep::Kind::bpe_suffix:
      for (size_t i = 0; i < tokens.size(); ++i) replace_all(tokens[i], step.text, i + 1 == tokens.size() ? "" : " ");
      return;
    case DecoderStep::Kind::word_piece:
      for (size_t i = 0; i < tokens.size(); ++i) {
        std::string& t = tokens[i];
        if (i > 0) {
          if (!step.text.empty() && t.rfind(step.text, 0) == 0)
            t.erase(0, step.text.size());
          else
            t.insert(0, " ");
        }
        if (step.start) word_piece_cleanup(t);
      }
      return;
    case DecoderStep::Kind::strip:
      for (auto& t : tokens) {
        const size_t head = run_of(t, step.text, step.start, false) * step.text.size();
        t.erase(0, head);
        const size_t tail = run_of(t, step.text, step.stop, true) * step.text.size();
        t.erase(t.size() - tail);
      }
      return;
  }
}

// One split step over one piece (Hugging Face's NormalizedString::split).
void split_piece(std::string_view piece, const PreTokenizerStep& step, std::vector<std::string_view>& out) {
  thread_local std::vector<std::tuple<size_t, size_t, bool>> parts;
  parts.clear();
  size_t pos = 0;
  auto add_match = [&](size_t begin, size_t end) {
    if (begin > pos) parts.emplace_back(pos, begin, false);
    parts.emplace_back(begin, end, true);
    pos = end;
  };
  if (step.regex) {
    size_t begin = 0, end = 0;
    while (pos < piece.size() && step.regex->find(piece, pos, begin, end)) add_match(begin, end);
  } else if (!step.literal.empty()) {
    for (size_t at; pos < piece.size() && (at = piece.find(step.literal, pos)) != std::string_view::npos;)
      add_match(at, at + step.literal.size());
  }
  if (pos < piece.size()) parts.emplace_back(pos, piece.size(), false);
  if (step.invert)
    for (auto& p : parts) std::get<2>(p) = !std::get<2>(p);

  thread_local std::vector<std::pair<size_t, size_t>> kept;
  kept.clear();
  bool previous_match = false;
  switch (step.behavior) {
    case SplitBehavior::isolated:
      for (auto [b, e, m] : parts) kept.emplace_back(b, e);
      break;
    case SplitBehavior::removed:
      for (auto [b, e, m] : parts)
        if (!m) kept.emplace_back(b, e);
      break;
    case SplitBehavior::contiguous:
      for (auto [b, e, m] : parts) {
        if (m == previous_match && !kept.empty())
          kept.back().second = e;
        else
          kept.emplace_back(b, e);
        previous_match = m;
      }
      break;
    case SplitBehavior::merged_with_previous:
      for (auto [b, e, m] : parts) {
        if (m && !previous_match && !kept.empty())
          kept.back().second = e;
        else
          kept.emplace_back(b, e);
        previous_match = m;
      }
      break;
    case SplitBehavior::merged_with_next:
      for (size_t i = parts.size(); i-- > 0;) {
        auto [b, e, m] = parts[i];
        if (m && !previous_match && !kept.empty())
          kept.back().first = b;
        else
          kept.emplace_back(b, e);
        previous_match = m;
      }
      std::reverse(kept.begin(), kept.end());
      break;
  }
  for (auto [b, e] : kept)
    if (e > b) out.push_back(piece.substr(b, e - b));
}

// A tokenizer.json starts with '{'; a tiktoken rank file with base64.
bool looks_like_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  require(bool(in), "{}: cannot open the tokenizer file", path);
  char c;
  while (in.get(c))
    if (!std::isspace(static_cast<unsigned char>(c))) return c == '{';
  fail("{}: the tokenizer file is empty", path);
}

}  // namespace

Tokenizer::Tokenizer(TokenizerParts parts) : parts_(std::move(parts)) {
  vocab_size_ = parts_.model.id_limit();
  added_by_first_byte_.resize(256);
  for (uint32_t i = 0; i < parts_.added_tokens.size(); ++i) {
    const AddedToken& t = parts_.added_tokens[i];
    require(!t.content.empty(), "{}: added token {} has empty content", parts_.origin, t.id);
    require(t.id >= 0, "{}: added token '{}' has a negative id {}", parts_.origin, t.content, t.id);
    require(find_invalid_utf8(t.content) == std::string_view::npos, "{}: added token {} is not valid UTF-8",
            parts_.origin, t.id);
    require(added_by_content_.emplace(t.content, t.id).second, "{}: added token '{}' appears twice", parts_.origin,
            t.content);
    added_by_first_byte_[static_cast<unsigned char>(t.content[0])].push_back(i);
    vocab_size_ = std::max(vocab_size_, t.id + 1);
    has_normalized_added_ = has_normalized_added_ || (t.normalized && !parts_.normalizers.empty());
  }
  std::vector<std::string> special;
  for (const AddedToken& t : parts_.added_tokens)
    if (t.special) special.push_back(t.content);
  special_strings_ = ControlStrings(std::move(special));
  if (!parts_.added_tokens.empty()) {
    int32_t max_id = 0;
    added_min_id_ = std::numeric_limits<int32_t>::max();
    for (const AddedToken& t : parts_.added_tokens) {
      added_min_id_ = std::min(added_min_id_, t.id);
      max_id = std::max(max_id, t.id);
    }
    // A file whose added ids are spread over billions (hostile or broken) is refused, not tabled.
    require(int64_t(max_id) - added_min_id_ < (int64_t(1) << 26),
            "{}: added token ids span {}..{}, more than 2^26 apart", parts_.origin, added_min_id_, max_id);
    added_by_id_.assign(size_t(max_id - added_min_id_) + 1, -1);
    for (uint32_t i = 0; i < parts_.added_tokens.size(); ++i) {
      int32_t& slot = added_by_id_[size_t(parts_.added_tokens[i].id - added_min_id_)];
      require(slot < 0, "{}: two added tokens have id {}", parts_.origin, parts_.added_tokens[i].id);
      slot = int32_t(i);
    }
  }
  // Over the model's ids (the loader keeps them within the vocabulary's size, plus 2^16), not the
  // added tokens' (those may sit up to 2^31: spelled_length asks added_token() past the table).
  spelled_lengths_.resize(size_t(parts_.model.id_limit()));
  for (int32_t id = 0; id < parts_.model.id_limit(); ++id) {
    const AddedToken* t = added_token(id);
    spelled_lengths_[size_t(id)] = uint32_t(t ? t->content.size() : parts_.model.token_length(id));
  }
  for (auto& group : added_by_first_byte_)
    std::stable_sort(group.begin(), group.end(), [&](uint32_t a, uint32_t b) {
      return parts_.added_tokens[a].content.size() > parts_.added_tokens[b].content.size();
    });
  for (int32_t id : parts_.template_prefix)
    require(id >= 0 && id < vocab_size_, "{}: post-processor id {} is outside the vocabulary", parts_.origin, id);
  for (int32_t id : parts_.template_suffix)
    require(id >= 0 && id < vocab_size_, "{}: post-processor id {} is outside the vocabulary", parts_.origin, id);
  for (auto id : {parts_.bos_id, parts_.eos_id})
    require(!id || (*id >= 0 && *id < vocab_size_), "{}: BOS/EOS id {} is outside the vocabulary", parts_.origin,
            id.value_or(-1));
  // What can make a token's surface differ from the bytes it was encoded from, whatever the text:
  // a decoder's rewrite (SentencePiece's marker, byte fallback, word-piece marks), a space a
  // pre-tokenizer adds or bytes a split removes (Whitespace), an unknown-byte symbol or marks of
  // the BPE model itself. The rest (a normalizer, whitespace an added token takes) depends on the
  // text: encode_spelled checks it.
  spells_as_is_ = parts_.decoders.empty() && !parts_.model.options().unk_id && !parts_.model.options().byte_fallback &&
                  parts_.model.options().continuing_subword_prefix.empty() &&
                  parts_.model.options().end_of_word_suffix.empty() &&
                  std::none_of(parts_.pre_tokenizer.begin(), parts_.pre_tokenizer.end(), [](const PreTokenizerStep& p) {
                    return p.kind != PreTokenizerStep::Kind::split || p.behavior == SplitBehavior::removed;
                  });
  fast_split_ = parts_.pre_tokenizer.size() == 1 && parts_.pre_tokenizer[0].kind == PreTokenizerStep::Kind::split &&
                parts_.pre_tokenizer[0].regex && parts_.pre_tokenizer[0].behavior == SplitBehavior::isolated &&
                !parts_.pre_tokenizer[0].invert;
  std::string marker;
  for (const NormalizerStep& step : parts_.normalizers)
    if (step.kind == NormalizerStep::Kind::replace && !step.regex && step.text == " ") marker = step.content;
  // No pre-tokenizer, or Gemma 3's Split on " " that the normalizer leaves nothing to split.
  const bool one_piece =
      parts_.pre_tokenizer.empty() ||
      (parts_.pre_tokenizer.size() == 1 && parts_.pre_tokenizer[0].kind == PreTokenizerStep::Kind::split &&
       !parts_.pre_tokenizer[0].regex && parts_.pre_tokenizer[0].literal == " " && !marker.empty() &&
       marker.find(' ') == std::string::npos);
  if (one_piece && !marker.empty()) {
    bool too_many = false;
    for (int32_t id = 0; id < vocab_size_ && !too_many; ++id) {
      const std::string_view t = parts_.model.token_bytes(id);
      size_t lead = 0;
      while (t.compare(lead, marker.size(), marker) == 0) lead += marker.size();
      for (size_t at = t.find(marker, lead); at != std::string_view::npos; at = t.find(marker, at + marker.size())) {
        if (at >= marker.size() && t.compare(at - marker.size(), marker.size(), marker) == 0) continue;  // in a run
        inner_marker_tokens_.push_back({std::string(t), at});
        too_many = inner_marker_tokens_.size() > 64;
      }
    }
    if (!too_many) word_marker_ = marker;
    else inner_marker_tokens_.clear();
  }
}

void Tokenizer::set_bos_eos(std::optional<int32_t> bos, std::optional<int32_t> eos) {
  for (auto id : {bos, eos})
    require(!id || (*id >= 0 && *id < vocab_size_), "{}: BOS/EOS id {} is outside the vocabulary", parts_.origin,
            id.value_or(-1));
  parts_.bos_id = bos;
  parts_.eos_id = eos;
}

std::optional<Tokenizer::AddedMatch> Tokenizer::find_added(std::string_view text, size_t from, bool normalized_pass,
                                                           const EncodeOptions& options) const {
  if (parts_.added_tokens.empty()) return std::nullopt;
  for (size_t i = from; i < text.size(); ++i) {
    const auto& group = added_by_first_byte_[static_cast<unsigned char>(text[i])];
    if (group.empty()) continue;
    for (uint32_t index : group) {
      const AddedToken& t = parts_.added_tokens[index];
      // Without a normalizer both passes are one; with one, a normalized token is found in the
      // normalized text and a raw one in the raw text (Hugging Face's AddedVocabulary).
      if (has_normalized_added_ && (t.normalized && !t.special) != normalized_pass) continue;
      if ((t.special && options.split_special_tokens) || options.no_added_tokens) continue;
      if (text.compare(i, t.content.size(), t.content) != 0) continue;
      size_t begin = i, end = i + t.content.size();
      if (t.single_word) {
        if (begin > 0 && is_word_byte(text[begin - 1])) continue;
        if (end < text.size() && is_word_byte(text[end])) continue;
      }
      if (t.lstrip)
        while (begin > from) {
          size_t p = previous_code_point(text, begin), len;
          if (!is_white_space(code_point_at(text, p, len))) break;
          begin = p;
        }
      if (t.rstrip)
        while (end < text.size()) {
          size_t len;
          if (!is_white_space(code_point_at(text, end, len))) break;
          end += len;
        }
      return AddedMatch{begin, end, t.id};
    }
  }
  return std::nullopt;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, EncodeOptions options) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  encode(text, ids, options);
  return ids;
}

void Tokenizer::encode(std::string_view text, std::vector<int32_t>& out, EncodeOptions options) const {
  encode_checked(text, out, options, nullptr);
}

bool Tokenizer::encode_spelled(std::string_view text, std::vector<int32_t>& out, EncodeOptions options) const {
  bool spelled = spells_as_is_ && !options.add_special_tokens;
  encode_checked(text, out, options, &spelled);
  return spelled;
}

void Tokenizer::encode_checked(std::string_view text, std::vector<int32_t>& out, const EncodeOptions& options,
                               bool* spelled) const {
  const size_t bad = find_invalid_utf8(text);
  if (bad != std::string_view::npos)
    fail("text is not valid UTF-8: byte 0x{:02X} at offset {} does not start a well-formed character",
         static_cast<unsigned char>(text[bad]), bad);
  if (options.add_special_tokens) out.insert(out.end(), parts_.template_prefix.begin(), parts_.template_prefix.end());
  encode_segment(text, false, true, out, options, spelled);
  if (options.add_special_tokens) out.insert(out.end(), parts_.template_suffix.begin(), parts_.template_suffix.end());
}

void Tokenizer::encode_segment(std::string_view text, bool normalized_pass, bool at_start, std::vector<int32_t>& out,
                               const EncodeOptions& options, bool* spelled) const {
  size_t pos = 0;
  auto plain = [&](std::string_view segment) {
    if (segment.empty()) return;
    const bool first = at_start && segment.data() == text.data();  // the input's first stretch
    if (normalized_pass || parts_.normalizers.empty()) {
      encode_normalized(segment, first, out);
      return;
    }
    std::string normalized(segment);
    for (const NormalizerStep& step : parts_.normalizers) apply(step, normalized);
    if (spelled && *spelled && normalized != segment) *spelled = false;
    if (has_normalized_added_)
      encode_segment(normalized, true, first, out, options, spelled);
    else
      encode_normalized(normalized, first, out);
  };
  while (auto match = find_added(text, pos, normalized_pass, options)) {
    plain(text.substr(pos, match->begin - pos));
    out.push_back(match->id);
    // lstrip / rstrip: the token took whitespace its content does not spell
    if (spelled && match->end - match->begin != added_token(match->id)->content.size()) *spelled = false;
    pos = match->end;
  }
  plain(text.substr(pos));
}

void Tokenizer::encode_normalized(std::string_view text, bool at_start, std::vector<int32_t>& out) const {
  const BytePairModel& model = parts_.model;
  if (fast_split_) {
    parts_.pre_tokenizer[0].regex->split(
        text, [&](size_t begin, size_t end) { model.encode(text.substr(begin, end - begin), out); });
    return;
  }
  if (!word_marker_.empty()) {  // cut before each run of markers that follows other text
    size_t begin = 0;
    for (size_t at = text.find(word_marker_); at != std::string_view::npos;
         at = text.find(word_marker_, at + word_marker_.size())) {
      if (at == begin ||
          (at >= word_marker_.size() && text.compare(at - word_marker_.size(), word_marker_.size(), word_marker_) == 0))
        continue;
      bool spanned = false;  // a vocabulary token spells the text across this cut
      for (const InnerMarkerToken& t : inner_marker_tokens_)
        spanned = spanned || (at >= t.marker_at && text.compare(at - t.marker_at, t.text.size(), t.text) == 0);
      if (spanned) continue;
      model.encode(text.substr(begin, at - begin), out);
      begin = at;
    }
    model.encode(text.substr(begin), out);
    return;
  }
  thread_local std::vector<std::string_view> pieces, next;
  thread_local std::deque<std::string> prefixed;  // a deque keeps earlier strings where they are
  pieces.assign(1, text);
  prefixed.clear();
  for (const PreTokenizerStep& step : parts_.pre_tokenizer) {
    next.clear();
    for (std::string_view piece : pieces) {
      if (step.kind == PreTokenizerStep::Kind::metaspace) {
        // Hugging Face's Metaspace: spaces become the replacement, which is prepended (always, or
        // only to the input's first piece), then each replacement starts a new piece.
        std::string s(piece);
        replace_all(s, " ", step.literal);
        const bool prepend =
            step.prepend == PreTokenizerStep::Prepend::always ||
            (step.prepend == PreTokenizerStep::Prepend::first && at_start && piece.data() == text.data());
        if (prepend && s.compare(0, step.literal.size(), step.literal) != 0) s.insert(0, step.literal);
        prefixed.push_back(std::move(s));
        const std::string_view whole = prefixed.back();
        if (!step.split_on_literal) {
          next.push_back(whole);
          continue;
        }
        size_t begin = 0;
        for (size_t at = whole.find(step.literal, 1); at != std::string_view::npos;
             at = whole.find(step.literal, at + step.literal.size())) {
          next.push_back(whole.substr(begin, at - begin));
          begin = at;
        }
        next.push_back(whole.substr(begin));
      } else if (step.kind == PreTokenizerStep::Kind::prefix_space) {
        if (!piece.empty() && piece[0] == ' ') {
          next.push_back(piece);
        } else {
          prefixed.emplace_back(1, ' ');
          prefixed.back().append(piece);
          next.push_back(prefixed.back());
        }
      } else {
        split_piece(piece, step, next);
      }
    }
    std::swap(pieces, next);
  }
  for (std::string_view piece : pieces) model.encode(piece, out);
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  if (!parts_.decoders.empty()) return decode_chain(ids, skip_special_tokens);
  std::string text;
  text.reserve(ids.size() * 4);
  for (int32_t id : ids) {
    if (const AddedToken* t = added_token(id)) {
      if (!(skip_special_tokens && t->special)) text += t->content;
      continue;
    }
    std::string_view bytes = parts_.model.token_bytes(id);
    require(!bytes.empty(), "cannot decode id {}: no token has it (vocabulary size {})", id, vocab_size_);
    text += bytes;
  }
  return text;
}

// Hugging Face's decode for tokenizers with a decoder chain (SentencePiece-style): each id's string
// (an added token's content, else its vocabulary spelling), then each step over the list.
std::string Tokenizer::decode_chain(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (const AddedToken* t = added_token(id)) {
      if (!(skip_special_tokens && t->special)) tokens.push_back(t->content);
      continue;
    }
    std::string_view bytes = parts_.model.token_bytes(id);
    require(!bytes.empty(), "cannot decode id {}: no token has it (vocabulary size {})", id, vocab_size_);
    tokens.emplace_back(bytes);
  }
  for (const DecoderStep& step : parts_.decoders) apply(step, tokens);
  std::string text;
  for (const auto& t : tokens) text += t;
  return text;
}

std::string_view Tokenizer::rewritten_surface(int32_t id, std::string& scratch) const {
  if (const AddedToken* t = added_token(id)) return t->content;
  if (parts_.decoders.empty()) return parts_.model.token_bytes(id);
  std::string& token = scratch;
  token.assign(parts_.model.token_bytes(id));
  for (const DecoderStep& step : parts_.decoders) {
    if (step.kind == DecoderStep::Kind::replace) replace_all(token, step.text, step.content);
    if (step.kind == DecoderStep::Kind::metaspace) replace_all(token, step.text, " ");
    // The text a marked piece covers: its word-piece marks are not in it.
    if (step.kind == DecoderStep::Kind::bpe_suffix) replace_all(token, step.text, "");
    if (step.kind == DecoderStep::Kind::word_piece && !step.text.empty() && token.rfind(step.text, 0) == 0)
      token.erase(0, step.text.size());
    if (step.kind == DecoderStep::Kind::byte_fallback) {
      const int b = fallback_byte(token);
      if (b >= 0) token.assign(1, char(b));
    }
  }
  return token;
}

std::string Tokenizer::normalize_unicode(std::string_view text) const {
  std::string s(text);
  for (const NormalizerStep& step : parts_.normalizers)
    if (step.kind == NormalizerStep::Kind::unicode) apply(step, s);
  return s;
}

bool Tokenizer::is_special(int32_t id) const {
  const AddedToken* t = added_token(id);
  return t && t->special;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  auto added = added_by_content_.find(std::string(token));
  if (added != added_by_content_.end()) return added->second;
  if (!parts_.byte_level_names) return parts_.model.find(token);
  std::string bytes;
  if (!bytes_from_byte_level(token, bytes)) return std::nullopt;
  return parts_.model.find(bytes);
}

std::string Tokenizer::id_to_token(int32_t id) const {
  if (const AddedToken* t = added_token(id)) return t->content;
  std::string_view bytes = parts_.model.token_bytes(id);
  require(!bytes.empty(), "no token has id {} (vocabulary size {})", id, vocab_size_);
  return parts_.byte_level_names ? byte_level_spelling(bytes) : std::string(bytes);
}

Tokenizer load_tokenizer(const std::string& path, std::string_view pattern) {
  std::string file = path;
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    const std::string dir = path.back() == '/' ? path : path + "/";
    if (path_exists(dir + "tokenizer.json")) {
      file = dir + "tokenizer.json";
    } else if (path_exists(dir + "tokenizer.model")) {
      // GLM-4's original checkpoints ship their tiktoken ranks under this name.
      return load_tiktoken(dir + "tokenizer.model", pattern.empty() ? "glm4" : pattern);
    } else {
      fail("{}: no tokenizer.json or tokenizer.model in this directory", path);
    }
  }
  if (looks_like_json(file)) {
    require(pattern.empty(), "{}: --pattern applies to tiktoken rank files; a tokenizer.json names its own", file);
    return load_hf_tokenizer_json(file);
  }
  return load_tiktoken(file, pattern);
}

}  // namespace keel::data
