// Pre-tokenizer regular expressions: the patterns that cut text into the pieces BPE then encodes
// (GPT-2, cl100k, o200k, GLM-4, and the Split regexes of tokenizer.json files), compiled with PCRE2
// (JIT, UTF, Unicode properties).
//
// The reference tokenizers run these patterns in other engines: tiktoken in Rust's regex crates,
// GLM-4's tokenization_chatglm.py in Python's `regex`, Hugging Face tokenizers in Oniguruma. All
// three read `\s` as the Unicode White_Space property; PCRE2's `\s` with UCP adds U+180E and so
// would split Mongolian text differently. translate_pattern() therefore spells `\s`/`\S` out as the
// White_Space set before PCRE2 sees them. (U+0085 is White_Space, U+FEFF is not.)
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

struct pcre2_real_code_8;

namespace keel::data {

// Which engine a pattern was written for; it changes what `$`, `^` and `\h` mean.
enum class RegexDialect {
  // Rust regex / fancy-regex / Python regex (tiktoken, tokenization_chatglm.py): `$` is the end of
  // the text only.
  tiktoken,
  // Oniguruma with Ruby syntax (Hugging Face tokenizers' Split): `^`/`$` are line anchors and `\h`
  // is a hex digit.
  oniguruma,
};

// The pattern source PCRE2 is given for `pattern` (see the file comment). `origin` names where
// the pattern came from, for the error message of an unsupported construct.
std::string translate_pattern(std::string_view pattern, RegexDialect dialect, std::string_view origin);

// Pre-tokenizer patterns by name: gpt2, cl100k, o200k, glm4, qwen2 (the pattern of GLM-4's
// tokenization_chatglm.py, which is cl100k's). keel::Error naming the known names otherwise.
std::string_view named_pattern(std::string_view name);
bool is_named_pattern(std::string_view name);

// Byte offset of the first byte that is not part of well-formed UTF-8 (overlongs, surrogates and
// code points past U+10FFFF are malformed), or npos when `text` is valid.
size_t find_invalid_utf8(std::string_view text);
// Bytes of the UTF-8 sequence a lead byte starts (valid UTF-8 assumed).
inline size_t utf8_length(unsigned char lead) { return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4; }

// A compiled pre-tokenizer pattern. Immutable after construction, so one instance serves every
// thread (each thread keeps its own PCRE2 match data).
class PretokenizerRegex {
 public:
  PretokenizerRegex(std::string_view pattern, RegexDialect dialect, std::string_view origin);
  ~PretokenizerRegex();
  PretokenizerRegex(const PretokenizerRegex&) = delete;
  PretokenizerRegex& operator=(const PretokenizerRegex&) = delete;

  // Finds the leftmost non-empty match in text[start, end) and stores its byte range. `text`
  // must be valid UTF-8 (the caller checks once; checking at every call would make a scan
  // quadratic). Returns false when there is none.
  bool find(std::string_view text, size_t start, size_t& match_begin, size_t& match_end) const;

  // Calls piece(begin, end) for every piece of `text` in order: the matches, and the text between
  // matches (which tiktoken's patterns never leave, as they match every character).
  template <typename PieceFn>
  void split(std::string_view text, PieceFn&& piece) const {
    size_t pos = 0, begin = 0, end = 0;
    while (pos < text.size() && find(text, pos, begin, end)) {
      if (begin > pos) piece(pos, begin);
      piece(begin, end);
      pos = end;
    }
    if (pos < text.size()) piece(pos, text.size());
  }

  const std::string& pattern() const { return pattern_; }

 private:
  std::string pattern_;
  pcre2_real_code_8* code_ = nullptr;
  bool jit_ = false;
};

}  // namespace keel::data
