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

}  // namespace keel
