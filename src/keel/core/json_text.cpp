#include "keel/core/json_text.h"

#include <fmt/format.h>

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

}  // namespace keel
