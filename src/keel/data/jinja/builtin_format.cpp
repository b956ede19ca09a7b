// Python's printf-style `format % args` (the % operator on a string and the format filter) and
// Markup.escape (the escape filter, and ~ on Markup).
#include <cstring>

#include <fmt/printf.h>

#include "keel/core/error.h"
#include "keel/data/jinja/builtins.h"

namespace keel::data::jinja {

// Markup.escape: HTML-escaped, as Markup; a Markup value is already escaped.
Value html_escape(const Value& v) {
  if (v.is_markup()) return v;
  const Str s = to_str(v);
  std::string out;
  ValueSizeLimit::check(s.text.size() * 5);  // at most 5 bytes per byte
  for (char c : s.text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return Value::markup(rebuilt(std::move(out), s));
}

Str python_percent_format(Interpreter& in, const Str& format, const Value& args, int line) {
  // Python's printf-style `format % args`: a tuple gives the values in order, a dict names them
  // with %(key)s, anything else is the one value.
  const List single{args};
  const List& values = args.is_list() && args.is_tuple() ? args.as_list() : single;
  size_t next = 0;
  Str out;
  const std::string& f = format.text;
  size_t literal = 0;
  for (size_t i = 0; i < f.size(); ++i) {
    if (f[i] != '%') continue;
    out.append(format.substr(literal, i));
    size_t j = i + 1;
    Value value;
    bool have = false;
    if (j < f.size() && f[j] == '(') {
      const size_t close = f.find(')', j);
      if (close == std::string::npos || !args.is_dict()) bad(in, line, "format requires a mapping");
      const Value* found = args.as_dict().find(f.substr(j + 1, close - j - 1));
      if (!found) bad(in, line, fmt::format("format: no key '{}'", f.substr(j + 1, close - j - 1)));
      value = *found;
      have = true;
      j = close + 1;
    }
    std::string flags;
    while (j < f.size() && std::strchr("-+ #0", f[j])) flags += f[j++];
    std::string width, precision;
    while (j < f.size() && std::isdigit(static_cast<unsigned char>(f[j]))) width += f[j++];
    if (j < f.size() && f[j] == '.') {
      precision = '.';
      ++j;
      while (j < f.size() && std::isdigit(static_cast<unsigned char>(f[j]))) precision += f[j++];
    }
    for (const std::string& n : {width, precision.empty() ? std::string() : precision.substr(1)})
      if (n.size() > 9 || (!n.empty() && std::stoul(n) > 1'000'000))
        bad(in, line, "format: width or precision too large");
    if (j >= f.size()) bad(in, line, "incomplete format");
    const char conversion = f[j];
    literal = j + 1;
    i = j;
    if (conversion == '%') {
      out.append(Str("%"));
      continue;
    }
    if (!have) {
      if (next >= values.size()) bad(in, line, "not enough arguments for format string");
      value = values[next++];
    }
    const std::string spec = "%" + flags + width + precision;
    std::string piece;
    try {  // fmt rejects some flag and conversion pairs Python accepts ("%#s"): an error, not a crash
      switch (conversion) {
        case 's':
        case 'r':
        case 'a': {
          const Str s = conversion == 's' ? to_str(value) : Str(repr(value));
          std::string w = fmt::sprintf(spec + "s", s.text);
          if (w == s.text && s.marked()) {
            out.append(s);
            continue;
          }
          piece = w;
          break;
        }
        case 'd':
        case 'i':
        case 'u':
        case 'x':
        case 'X':
        case 'o':
          if (!value.is_number())
            bad(in, line, fmt::format("%{} format: a number is required, not {}", conversion, value.type_name()));
          piece = fmt::sprintf(spec + "ll" + (conversion == 'i' || conversion == 'u' ? 'd' : conversion),
                               (long long)value.as_int());
          break;
        case 'f':
        case 'F':
        case 'e':
        case 'E':
        case 'g':
        case 'G':
          if (!value.is_number())
            bad(in, line, fmt::format("%{} format: a number is required, not {}", conversion, value.type_name()));
          piece = fmt::sprintf(spec + conversion, value.as_real());
          break;
        case 'c':
          if (value.is_string()) {
            piece = value.as_str().text;
          } else {
            const int64_t cp = value.as_int();
            if (cp < 0 || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
              bad(in, line, "%c arg not in range(0x110000)");
            append_utf8(piece, uint32_t(cp));
          }
          break;
        default: bad(in, line, fmt::format("unsupported format character '{}'", conversion));
      }
    } catch (const fmt::format_error& e) {
      bad(in, line, fmt::format("format: unsupported conversion '{}' ({})", spec + conversion, e.what()));
    }
    out.append(marked_like(piece, value));
  }
  if (next < values.size() && !args.is_dict() && args.is_tuple())
    bad(in, line, "not all arguments converted during string formatting");
  out.append(format.substr(literal, f.size()));
  return out;
}

}  // namespace keel::data::jinja
