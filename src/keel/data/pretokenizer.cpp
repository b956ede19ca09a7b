#include "keel/data/pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>
#include <cstring>

#include "keel/core/error.h"

namespace keel::data {
namespace {

// Unicode White_Space (PropList.txt), the `\s` of Rust regex, Python regex and Oniguruma, as the
// inside of a PCRE2 character class.
constexpr std::string_view kWhiteSpace =
    "\\t\\n\\x0B\\f\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}"
    "\\x{3000}";

struct NamedPattern {
  std::string_view name;
  std::string_view pattern;
};

// Verbatim from the references: tiktoken_ext/openai_public.py (gpt2, cl100k_base, o200k_base, as
// the npm tiktoken package ships them), GLM-4's tokenization_chatglm.py and Qwen2's tokenizer.json
// (cl100k's with single digits: every number is spelled digit by digit, which arithmetic needs).
constexpr std::array<NamedPattern, 5> kNamedPatterns{{
    {"gpt2", R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)"},
    {"cl100k",
     R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
    {"o200k",
     R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
    {"glm4",
     R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
    {"qwen2",
     R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
}};

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof buffer);
  return reinterpret_cast<const char*>(buffer);
}

// Per-thread PCRE2 state: match data is written by every match, so threads cannot share it; the
// JIT stack is raised from PCRE2's 32 KiB default so that long runs of lookahead-heavy input
// (`\s+(?!\S)` over megabytes of spaces) do not exhaust it.
struct MatchState {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  MatchState() {
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    jit_stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    if (!data || !context || !jit_stack) throw std::bad_alloc();
    pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~MatchState() {
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

MatchState& match_state() {
  thread_local MatchState state;
  return state;
}

}  // namespace

std::string translate_pattern(std::string_view pattern, RegexDialect dialect, std::string_view origin) {
  std::string out;
  out.reserve(pattern.size() * 2);
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      char d = pattern[++i];
      if (d == 's') {
        if (in_class)
          out += kWhiteSpace;
        else
          out.append("[").append(kWhiteSpace).append("]");
      } else if (d == 'S') {
        require(!in_class, "{}: pattern '{}': \\S inside a character class is not supported", origin, pattern);
        out.append("[^").append(kWhiteSpace).append("]");
      } else if (dialect == RegexDialect::oniguruma && (d == 'h' || d == 'H')) {
        // Oniguruma's \h is a hex digit; PCRE2's would be horizontal space.
        if (in_class)
          require(d == 'h', "{}: pattern '{}': \\H inside a character class is not supported", origin, pattern);
        out += in_class ? "0-9a-fA-F" : (d == 'h' ? "[0-9a-fA-F]" : "[^0-9a-fA-F]");
      } else {
        out += c;
        out += d;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' first in the class (after an optional '^') is a literal, not the end.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (in_class && c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
      // POSIX class such as [:alpha:]: copy through its closing ']' so it does not end the class.
      size_t close = pattern.find(":]", i + 2);
      require(close != std::string_view::npos, "{}: pattern '{}': unterminated POSIX class at offset {}", origin,
              pattern, i);
      out.append(pattern.substr(i, close + 2 - i));
      i = close + 1;
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

std::string_view named_pattern(std::string_view name) {
  for (const auto& p : kNamedPatterns)
    if (p.name == name) return p.pattern;
  fail("unknown pre-tokenizer pattern '{}': expected one of gpt2, cl100k, o200k, glm4, qwen2", name);
}

bool is_named_pattern(std::string_view name) {
  for (const auto& p : kNamedPatterns)
    if (p.name == name) return true;
  return false;
}

size_t find_invalid_utf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    // ASCII runs dominate most text: test eight bytes at a time.
    while (i + 8 <= n) {
      uint64_t word;
      std::memcpy(&word, s + i, 8);
      if (word & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t min;
    if (c >= 0xC2 && c <= 0xDF)
      len = 2, min = 0x80;
    else if (c >= 0xE0 && c <= 0xEF)
      len = 3, min = 0x800;
    else if (c >= 0xF0 && c <= 0xF4)
      len = 4, min = 0x10000;
    else
      return i;
    if (i + len > n) return i;
    uint32_t cp = c & (0x7F >> len);
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::string_view::npos;
}

PretokenizerRegex::PretokenizerRegex(std::string_view pattern, RegexDialect dialect, std::string_view origin)
    : pattern_(pattern) {
  const std::string source = translate_pattern(pattern, dialect, origin);
  uint32_t options = PCRE2_UTF | PCRE2_UCP | PCRE2_NEVER_BACKSLASH_C;
  options |= dialect == RegexDialect::tiktoken ? PCRE2_DOLLAR_ENDONLY : PCRE2_MULTILINE;
  pcre2_compile_context* context = pcre2_compile_context_create(nullptr);
  pcre2_set_newline(context, PCRE2_NEWLINE_LF);
  int error = 0;
  PCRE2_SIZE error_offset = 0;
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(source.data()), source.size(), options, &error, &error_offset,
                        context);
  pcre2_compile_context_free(context);
  if (code_ == nullptr)  // the message only for a failure (require() would build it every time)
    fail("{}: cannot compile pre-tokenizer pattern '{}': {} (at offset {} of '{}')", origin, pattern,
         pcre2_message(error), error_offset, source);
  // Without JIT (an unsupported CPU) matching still works through the interpreter, only slower.
  jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
}

PretokenizerRegex::~PretokenizerRegex() { pcre2_code_free(code_); }

bool PretokenizerRegex::find(std::string_view text, size_t start, size_t& match_begin, size_t& match_end) const {
  MatchState& state = match_state();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  while (start < text.size()) {
    int rc = jit_ ? pcre2_jit_match(code_, subject, text.size(), start, PCRE2_NO_UTF_CHECK, state.data, state.context)
                  : pcre2_match(code_, subject, text.size(), start, PCRE2_NO_UTF_CHECK, state.data, state.context);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    // Not require(): its arguments are built on every call, and PCRE2 has no message for a match's
    // (non-negative) result, so the message was read from an unwritten buffer on every match.
    if (rc < 0)
      fail("pre-tokenizer pattern '{}' failed at byte {} of a {}-byte text: {}", pattern_, start, text.size(),
           pcre2_message(rc));
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
    if (ovector[1] > ovector[0]) {
      match_begin = ovector[0];
      match_end = ovector[1];
      return true;
    }
    // An empty match cuts nothing (Hugging Face drops empty pieces): look again one character on.
    if (ovector[0] >= text.size()) return false;
    start = ovector[0] + utf8_length(static_cast<unsigned char>(text[ovector[0]]));
  }
  return false;
}

}  // namespace keel::data
