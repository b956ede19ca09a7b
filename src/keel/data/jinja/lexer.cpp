#include "keel/data/jinja/lexer.h"

#include <unicode/uchar.h>

#include <cctype>
#include <climits>
#include <cstring>

#include "keel/core/error.h"
#include "keel/data/jinja/value.h"

namespace keel::data::jinja {
namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// Python's str.rstrip() / lstrip() on the UTF-8 text: every Unicode space.
size_t rstrip_end(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    size_t len;
    if (!is_python_space(decode_code_point(s, start, len))) break;
    end = start;
  }
  return end;
}

size_t lstrip_begin(std::string_view s, size_t pos) {
  while (pos < s.size()) {
    size_t len;
    if (!is_python_space(decode_code_point(s, pos, len))) break;
    pos += len;
  }
  return pos;
}

// Jinja reads string literals with Python's unicode-escape codec.
std::string decode_string(std::string_view body, int line) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    if (body[i] != '\\' || i + 1 == body.size()) {
      out += body[i];
      continue;
    }
    const char c = body[++i];
    auto hex = [&](int digits) {
      uint32_t cp = 0;
      for (int k = 0; k < digits; ++k) {
        require(i + 1 < body.size() && std::isxdigit(static_cast<unsigned char>(body[i + 1])),
                "chat template line {}: truncated \\x/\\u escape in a string literal", line);
        const char h = body[++i];
        cp = cp * 16 + uint32_t(std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
      }
      append_utf8(out, cp);
    };
    switch (c) {
      case 'n': out += '\n'; break;
      case 't': out += '\t'; break;
      case 'r': out += '\r'; break;
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case 'a': out += '\a'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'v': out += '\v'; break;
      case '\n': break;  // a backslash-newline continues the line
      case 'N': {        // \N{NAME}: the character by its Unicode name
        const size_t close = body.find('}', i);
        UErrorCode status = U_ZERO_ERROR;
        const UChar32 cp =
            i + 1 < body.size() && body[i + 1] == '{' && close != std::string_view::npos
                ? u_charFromName(U_EXTENDED_CHAR_NAME, std::string(body.substr(i + 2, close - i - 2)).c_str(), &status)
                : -1;
        require(cp >= 0 && U_SUCCESS(status), "chat template line {}: malformed \\N{{...}} escape", line);
        append_utf8(out, uint32_t(cp));
        i = close;
        break;
      }
      case 'x': hex(2); break;
      case 'u': hex(4); break;
      case 'U': hex(8); break;
      default:
        if (c >= '0' && c <= '7') {
          uint32_t cp = uint32_t(c - '0');
          for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7'; ++k)
            cp = cp * 8 + uint32_t(body[++i] - '0');
          append_utf8(out, cp);
        } else {
          out += '\\';  // unknown escapes stay as written
          out += c;
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) : src_(normalize_newlines(source)) {}

  std::vector<Token> run() {
    bool line_starting = true;
    while (pos_ < src_.size()) {
      const size_t tag = find_tag(pos_);
      std::string data = src_.substr(pos_, tag - pos_);
      if (tag == src_.size()) {
        emit_data(data);
        pos_ = tag;
        break;
      }
      const char kind = src_[tag + 1];  // '{', '%' or '#'
      const char modifier = tag + 2 < src_.size() ? src_[tag + 2] : 0;
      if (modifier == '-') {
        data.resize(rstrip_end(data));
      } else if (modifier != '+' && kind != '{') {  // lstrip_blocks: blocks and comments only
        const size_t l_pos = data.rfind('\n') == std::string::npos ? 0 : data.rfind('\n') + 1;
        if ((l_pos > 0 || line_starting) && l_pos < data.size()) {
          bool blank = true;
          for (size_t i = l_pos; i < data.size(); ++i) blank = blank && is_space(data[i]) && data[i] != '\n';
          if (blank) data.resize(l_pos);
        }
      }
      emit_data(data);
      line_ += count_lines(pos_, tag);
      pos_ = tag + 2 + ((modifier == '-' || modifier == '+') ? 1 : 0);
      if (kind == '#') {
        line_starting = comment();
      } else if (kind == '%') {
        line_starting = block();
      } else {
        out_.push_back({Token::Type::variable_begin, "{{", line_});
        const char close_modifier = expression("}}");
        out_.push_back({Token::Type::variable_end, "}}", line_});
        if (close_modifier == '-') strip_following_whitespace();
        line_starting = false;
      }
    }
    out_.push_back({Token::Type::end, "", line_});
    return std::move(out_);
  }

 private:
  static std::string normalize_newlines(std::string_view s) {
    std::string out;
    out.reserve(s.size());
    for (size_t i = 0; i < s.size(); ++i) {
      if (s[i] == '\r') {
        out += '\n';
        if (i + 1 < s.size() && s[i + 1] == '\n') ++i;
      } else {
        out += s[i];
      }
    }
    if (!out.empty() && out.back() == '\n') out.pop_back();  // keep_trailing_newline = False
    return out;
  }

  size_t find_tag(size_t from) const {
    for (size_t i = from; i + 1 < src_.size(); ++i)
      if (src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    return src_.size();
  }

  int count_lines(size_t from, size_t to) const {
    int n = 0;
    for (size_t i = from; i < to; ++i) n += src_[i] == '\n';
    return n;
  }

  void emit_data(const std::string& data) {
    if (!data.empty()) out_.push_back({Token::Type::data, data, line_});
  }

  void strip_following_whitespace() {
    const size_t next = lstrip_begin(src_, pos_);
    line_ += count_lines(pos_, next);
    pos_ = next;
  }

  // After a block or comment end ('-', '+' or 0 before it): `-` strips all following whitespace,
  // `+` keeps it, else trim_blocks drops one newline. Returns whether the next text starts a line.
  bool after_block_end(char modifier) {
    if (modifier == '-') {
      strip_following_whitespace();
      return false;
    }
    if (modifier != '+' && pos_ < src_.size() && src_[pos_] == '\n') {
      ++pos_;
      ++line_;
      return true;
    }
    return false;
  }

  bool comment() {
    const size_t end = src_.find("#}", pos_);
    require(end != std::string::npos, "chat template line {}: comment not closed with '#}}'", line_);
    const char modifier = end > pos_ && (src_[end - 1] == '-' || src_[end - 1] == '+') ? src_[end - 1] : 0;
    line_ += count_lines(pos_, end);
    pos_ = end + 2;
    return after_block_end(modifier);
  }

  bool block() {
    const size_t first = out_.size();
    out_.push_back({Token::Type::block_begin, "{%", line_});
    const char modifier = expression("%}");
    out_.push_back({Token::Type::block_end, "%}", line_});
    if (out_.size() == first + 3 && out_[first + 1].type == Token::Type::name && out_[first + 1].text == "raw") {
      out_.resize(first);
      return raw(modifier);
    }
    return after_block_end(modifier);
  }

  // {% raw %}...{% endraw %}: the text as it is, up to the end tag. Jinja keeps the newline after
  // {% raw %} (no trim_blocks there), and treats the end tag as any block tag: `-` or lstrip_blocks
  // before it, `-`, `+` or trim_blocks after it.
  bool raw(char open_modifier) {
    if (open_modifier == '-') strip_following_whitespace();
    for (size_t at = src_.find("{%", pos_); at != std::string::npos; at = src_.find("{%", at + 2)) {
      size_t p = at + 2;
      const bool strip_before = p < src_.size() && src_[p] == '-';
      if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) ++p;
      while (p < src_.size() && is_space(src_[p])) ++p;
      if (src_.compare(p, 6, "endraw") != 0) continue;
      p += 6;
      while (p < src_.size() && is_space(src_[p])) ++p;
      const bool strip_after = p < src_.size() && src_[p] == '-';
      if (strip_after) ++p;
      if (src_.compare(p, 2, "%}") != 0) continue;
      std::string data = src_.substr(pos_, at - pos_);
      const bool keep_before = src_[at + 2] == '+';
      if (strip_before) {
        data.resize(rstrip_end(data));
      } else if (!keep_before) {
        const size_t l_pos = data.rfind('\n') == std::string::npos ? std::string::npos : data.rfind('\n') + 1;
        if (l_pos != std::string::npos && l_pos < data.size() &&
            data.find_first_not_of(" \t", l_pos) == std::string::npos)
          data.resize(l_pos);
      }
      emit_data(data);
      line_ += count_lines(pos_, p + 2);
      pos_ = p + 2;
      return after_block_end(strip_after ? '-' : 0);
    }
    fail("chat template line {}: {{% raw %}} without {{% endraw %}}", line_);
  }

  // Tokens up to the closing delimiter, which only closes the tag outside brackets ({{ {'a': 1}}}
  // is a dict); returns the modifier before it: '-', '+' or 0.
  char expression(std::string_view close) {
    const int start_line = line_;
    int depth = 0;
    while (true) {
      while (pos_ < src_.size() && is_space(src_[pos_])) line_ += src_[pos_++] == '\n';
      require(pos_ < src_.size(), "chat template line {}: tag not closed with '{}'", start_line, close);
      if (depth == 0 && src_.compare(pos_, close.size(), close) == 0) {
        pos_ += close.size();
        return 0;
      }
      if (depth == 0 && (src_[pos_] == '-' || src_[pos_] == '+') && src_.compare(pos_ + 1, close.size(), close) == 0) {
        const char modifier = src_[pos_];
        pos_ += 1 + close.size();
        return modifier;
      }
      const char c = src_[pos_];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t end = pos_;
        while (end < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[end])) || src_[end] == '_')) ++end;
        out_.push_back({Token::Type::name, src_.substr(pos_, end - pos_), line_});
        pos_ = end;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        number();
      } else if (c == '\'' || c == '"') {
        string_literal(c);
      } else {
        static const char* const two[] = {"//", "**", "==", "!=", ">=", "<="};
        std::string op(1, c);
        for (const char* t : two)
          if (src_.compare(pos_, 2, t) == 0) op = t;
        require(std::string_view("+-*/%~<>=()[]{},.:|;!").find(c) != std::string_view::npos || op.size() == 2,
                "chat template line {}: unexpected character '{}'", line_, c);
        require(op != "!", "chat template line {}: unexpected character '!'", line_);
        if (op == "(" || op == "[" || op == "{") ++depth;
        if ((op == ")" || op == "]" || op == "}") && depth > 0) --depth;
        out_.push_back({Token::Type::op, op, line_});
        pos_ += op.size();
      }
    }
  }

  void number() {
    if (src_[pos_] == '0' && pos_ + 1 < src_.size() && std::strchr("xXoObB", src_[pos_ + 1])) {
      const int base = std::strchr("xX", src_[pos_ + 1]) ? 16 : std::strchr("oO", src_[pos_ + 1]) ? 8 : 2;
      size_t end = pos_ + 2;
      std::string digits;
      while (end < src_.size() && (std::isxdigit(static_cast<unsigned char>(src_[end])) || src_[end] == '_')) {
        if (src_[end] != '_') digits += src_[end];
        ++end;
      }
      require(!digits.empty(), "chat template line {}: a number prefix without digits", line_);
      size_t used = 0;
      unsigned long long v = 0;
      try {
        v = std::stoull(digits, &used, base);
      } catch (const std::exception&) {
        fail("chat template line {}: integer {} is out of range (64 bits)", line_, src_.substr(pos_, end - pos_));
      }
      require(used == digits.size() && v <= uint64_t(INT64_MAX), "chat template line {}: bad integer {}", line_,
              src_.substr(pos_, end - pos_));
      out_.push_back({Token::Type::integer, std::to_string(v), line_});
      pos_ = end;
      return;
    }
    size_t end = pos_;
    auto digits = [&] {
      while (end < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[end])) || src_[end] == '_')) ++end;
    };
    digits();
    bool real = false;
    if (end + 1 < src_.size() && src_[end] == '.' && std::isdigit(static_cast<unsigned char>(src_[end + 1]))) {
      real = true;
      ++end;
      digits();
    }
    if (end < src_.size() && (src_[end] == 'e' || src_[end] == 'E')) {
      size_t e = end + 1;
      if (e < src_.size() && (src_[e] == '+' || src_[e] == '-')) ++e;
      if (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) {
        real = true;
        end = e;
        digits();
      }
    }
    std::string text;
    for (size_t i = pos_; i < end; ++i)
      if (src_[i] != '_') text += src_[i];
    // Python: a decimal integer does not start with 0 ("007" is a syntax error, as in Jinja).
    require(real || text.size() == 1 || text[0] != '0' || text.find_first_not_of('0') == std::string::npos,
            "chat template line {}: leading zeros in integer {}", line_, text);
    out_.push_back({real ? Token::Type::real : Token::Type::integer, text, line_});
    pos_ = end;
  }

  void string_literal(char quote) {
    const int start_line = line_;
    size_t end = pos_ + 1;
    while (end < src_.size() && src_[end] != quote) {
      if (src_[end] == '\\') ++end;
      if (end < src_.size() && src_[end] == '\n') ++line_;
      ++end;
    }
    require(end < src_.size(), "chat template line {}: string literal not closed", start_line);
    out_.push_back({Token::Type::string, decode_string(std::string_view(src_).substr(pos_ + 1, end - pos_ - 1), line_),
                    start_line});
    pos_ = end + 1;
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> out_;
};

}  // namespace

std::vector<Token> tokenize_template(std::string_view source) { return Lexer(source).run(); }

}  // namespace keel::data::jinja
