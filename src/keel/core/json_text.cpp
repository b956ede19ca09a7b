#include "keel/core/json_text.h"

#include <fmt/format.h>

#include <algorithm>

namespace keel {

std::string json_escaped(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char ch : s) {
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20)
          out += fmt::format("\\u{:04x}", static_cast<unsigned>(static_cast<unsigned char>(ch)));
        else
          out += ch;
    }
  }
  return out;
}

std::string json_quoted(std::string_view s) { return "\"" + json_escaped(s) + "\""; }

std::string_view json_type_name(simdjson::dom::element e) {
  using simdjson::dom::element_type;
  switch (e.type()) {
    case element_type::ARRAY: return "array";
    case element_type::OBJECT: return "object";
    case element_type::INT64:
    case element_type::UINT64: return "integer";
    case element_type::DOUBLE: return "number";
    case element_type::STRING: return "string";
    case element_type::BOOL: return "boolean";
    case element_type::NULL_VALUE: return "null";
  }
  return "unknown";
}

std::string json_describe(simdjson::dom::element e) {
  std::string text = simdjson::minify(e);
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return e.is_null() ? "null" : fmt::format("{} {}", json_type_name(e), text);
}

namespace {

// Whether the digits of an integer literal (no sign, no leading zeros beyond "0") exceed `limit`,
// a decimal of the same kind.
bool digits_exceed(std::string_view digits, std::string_view limit) {
  return digits.size() != limit.size() ? digits.size() > limit.size() : digits > limit;
}

}  // namespace

std::string json_with_big_integers_as_doubles(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 16);
  size_t i = 0;
  while (i < text.size()) {
    const char c = text[i];
    if (c == '"') {  // a string: copied through, escapes included
      const size_t start = i++;
      while (i < text.size() && text[i] != '"') i += text[i] == '\\' ? 2 : 1;
      i = std::min(i + 1, text.size());
      out.append(text.substr(start, i - start));
      continue;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
      const size_t start = i;
      if (text[i] == '-') ++i;
      const size_t digits_start = i;
      while (i < text.size() && text[i] >= '0' && text[i] <= '9') ++i;
      const std::string_view digits = text.substr(digits_start, i - digits_start);
      const bool plain_integer = i >= text.size() || (text[i] != '.' && text[i] != 'e' && text[i] != 'E');
      out.append(text.substr(start, i - start));
      const bool negative = text[start] == '-';
      if (plain_integer && !digits.empty() &&
          digits_exceed(digits, negative ? "9223372036854775808" : "18446744073709551615"))
        out += ".0";
      continue;
    }
    out += c;
    ++i;
  }
  return out;
}

simdjson::error_code parse_json_document(simdjson::dom::parser& parser, std::string_view text,
                                         simdjson::dom::element& root) {
  auto error = parser.parse(text.data(), text.size()).get(root);
  if (error != simdjson::NUMBER_ERROR) return error;
  // Only now, and only for this document: valid JSON with an integer simdjson cannot hold.
  const std::string rewritten = json_with_big_integers_as_doubles(text);
  if (rewritten.size() == text.size()) return error;  // no big integer: a malformed number
  return parser.parse(rewritten.data(), rewritten.size()).get(root);
}

}  // namespace keel
