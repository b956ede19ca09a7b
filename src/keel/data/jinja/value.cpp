#include "keel/data/jinja/value.h"

#include <unicode/uchar.h>

#include <algorithm>
#include <charconv>
#include <cmath>

#include "keel/core/error.h"
#include "keel/core/json_text.h"

namespace keel::data::jinja {

namespace {
thread_local size_t max_value_bytes = SIZE_MAX;
}  // namespace

ValueSizeLimit::ValueSizeLimit(size_t bytes) : previous_(max_value_bytes) { max_value_bytes = bytes; }
ValueSizeLimit::~ValueSizeLimit() { max_value_bytes = previous_; }

void ValueSizeLimit::check(size_t bytes) {
  if (bytes > max_value_bytes)
    fail("a value of {} bytes or more exceeds the limit of {} (the rendering's output limit)", bytes, max_value_bytes);
}

Str::Str(std::string t, int source) : text(std::move(t)) {
  if (!text.empty()) runs.push_back({0, text.size(), source});
}

void Str::append(const Str& other) {
  ValueSizeLimit::check(text.size() + other.text.size());
  const size_t shift = text.size();
  text += other.text;
  for (const Run& r : other.runs) {
    if (!runs.empty() && runs.back().end == r.begin + shift && runs.back().source == r.source)
      runs.back().end = r.end + shift;
    else
      runs.push_back({r.begin + shift, r.end + shift, r.source});
  }
}

Str Str::substr(size_t begin, size_t end) const {
  Str out(text.substr(begin, end - begin));
  for (const Run& r : runs) {
    const size_t b = std::max(r.begin, begin), e = std::min(r.end, end);
    if (b < e) out.runs.push_back({b - begin, e - begin, r.source});
  }
  return out;
}

void Str::truncate(size_t size) {
  if (size >= text.size()) return;
  text.resize(size);
  while (!runs.empty() && runs.back().begin >= size) runs.pop_back();
  if (!runs.empty() && runs.back().end > size) runs.back().end = size;
}

const Value* Dict::find(std::string_view key) const {
  for (const auto& [k, v] : items)
    if (same_name(k, key)) return &v;
  return nullptr;
}

Value* Dict::find(std::string_view key) {
  for (auto& [k, v] : items)
    if (same_name(k, key)) return &v;
  return nullptr;
}

void Dict::set(std::string_view key, Value value) {
  if (Value* existing = find(key))
    *existing = std::move(value);
  else
    items.emplace_back(std::string(key), std::move(value));
}

Value Value::undefined(std::string name) {
  Value v;
  if (!name.empty()) v.p_ = std::make_shared<const std::string>(std::move(name));
  return v;
}

void Value::wrong_kind(const char* wanted) const {
  fail("expected a {}, got {}{}", wanted, type_name(),
       kind_ == Kind::undefined && !undefined_name().empty() ? " ('" + undefined_name() + "')" : "");
}

Str Value::take_str() && {
  expect(kind_ == Kind::string, "str");
  // One owner: nobody else can see the string change (a copy would take a second reference).
  if (p_.use_count() == 1) return std::move(*const_cast<Str*>(static_cast<const Str*>(p_.get())));
  return as_str();
}

Value Value::undefined_borrowing(const std::string& name) {
  Value v;
  v.i_ = int64_t(reinterpret_cast<intptr_t>(&name));
  return v;
}

const std::string& Value::undefined_name() const {
  static const std::string unnamed;
  if (kind_ != Kind::undefined) return unnamed;
  if (p_) return *static_cast<const std::string*>(p_.get());
  return i_ ? *reinterpret_cast<const std::string*>(intptr_t(i_)) : unnamed;
}

Value Value::none() {
  Value v;
  v.kind_ = Kind::none;
  return v;
}

Value::Value(Str s) : kind_(Kind::string), p_(std::make_shared<const Str>(std::move(s))) {}
Value::Value(List l, bool tuple) : kind_(Kind::list), tuple_(tuple), p_(std::make_shared<const List>(std::move(l))) {}
Value::Value(Dict d) : kind_(Kind::dict), p_(std::make_shared<Dict>(std::move(d))) {}

Value Value::markup(Str s) {
  Value v(std::move(s));
  v.tuple_ = true;
  return v;
}

Value Value::namespace_of(Dict d) {
  Value v(std::move(d));
  v.kind_ = Kind::ns;
  return v;
}

Value Value::callable(Callable c) {
  Value v;
  v.kind_ = Kind::callable;
  v.p_ = std::make_shared<const Callable>(std::move(c));
  return v;
}

Value Value::function(std::string name, NativeFunction f) { return callable({std::move(name), std::move(f)}); }
Value Value::macro(std::string name, NativeFunction f) { return callable({std::move(name), std::move(f), true}); }

bool Value::truthy() const {
  switch (kind_) {
    case Kind::undefined:
    case Kind::none: return false;
    case Kind::boolean:
    case Kind::integer: return i_ != 0;
    case Kind::real: return d_ != 0;
    case Kind::string: return !as_str().text.empty();
    case Kind::list: return !as_list().empty();
    case Kind::dict: return !as_dict().items.empty();
    case Kind::ns:
    case Kind::callable: return true;
  }
  return false;
}

std::string Value::type_name() const {
  switch (kind_) {
    case Kind::undefined: return "Undefined";
    case Kind::none: return "NoneType";
    case Kind::boolean: return "bool";
    case Kind::integer: return "int";
    case Kind::real: return "float";
    case Kind::string: return "str";
    case Kind::list: return tuple_ ? "tuple" : "list";
    case Kind::dict: return "dict";
    case Kind::ns: return "Namespace";
    case Kind::callable: return "function";
  }
  return "?";
}

std::string string_dict_key(std::string_view s) {
  if (s.empty() || s[0] != '\0') return std::string(s);
  std::string escaped("\0s", 2);  // appended, not "+": GCC 12 warns falsely (-Wrestrict) on the sum
  escaped += s;
  return escaped;
}

std::string dict_key(const Value& key) {
  using K = Value::Kind;
  switch (key.kind()) {
    case K::string: return string_dict_key(key.as_str().text);
    case K::boolean:
    case K::integer: return std::string("\0i", 2) + std::to_string(key.as_int());
    case K::real:
      if (key.as_real() == std::floor(key.as_real()) && std::fabs(key.as_real()) < 9e18)
        return std::string("\0i", 2) + std::to_string(int64_t(key.as_real()));  // 1.0 and 1 are one key
      return std::string("\0f", 2) + float_repr(key.as_real());
    case K::none: return std::string("\0n", 2);
    default: fail("unhashable type: '{}'", key.type_name());
  }
}

Value key_value(const std::string& key) {
  if (key.empty() || key[0] != '\0') return Value(Str(key));
  const std::string rest = key.substr(2);
  switch (key.size() > 1 ? key[1] : 's') {
    case 'i': return Value(int64_t(std::stoll(rest)));
    case 'f': return Value(std::stod(rest));
    case 'n': return Value::none();
    default: return Value(Str(rest));
  }
}

std::string json_key(const std::string& key) {
  const Value v = key_value(key);
  if (v.is_string()) return v.as_str().text;
  if (v.is_none()) return "null";
  return to_str(v).text;
}

bool equal(const Value& a, const Value& b) {
  using K = Value::Kind;
  if (a.is_number() && b.is_number()) {
    if (a.kind() == K::real || b.kind() == K::real) return a.as_real() == b.as_real();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind() || a.is_tuple() != b.is_tuple()) return false;  // (1, 2) != [1, 2]
  switch (a.kind()) {
    case K::undefined:
    case K::none: return true;
    case K::string: return a.as_str().text == b.as_str().text;
    case K::list: {
      const List &x = a.as_list(), &y = b.as_list();
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i)
        if (!equal(x[i], y[i])) return false;
      return true;
    }
    case K::dict: {
      const Dict &x = a.as_dict(), &y = b.as_dict();
      if (x.items.size() != y.items.size()) return false;
      for (const auto& [k, v] : x.items) {
        const Value* w = y.find(k);
        if (!w || !equal(v, *w)) return false;
      }
      return true;
    }
    case K::ns: return &a.ns_dict() == &b.ns_dict();
    case K::callable: return &a.as_callable() == &b.as_callable();
    default: return false;
  }
}

bool less(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind() == Value::Kind::real || b.kind() == Value::Kind::real) return a.as_real() < b.as_real();
    return a.as_int() < b.as_int();
  }
  if (a.is_string() && b.is_string()) return a.as_str().text < b.as_str().text;  // UTF-8 order = code point order
  if (a.is_list() && b.is_list()) {
    const List &x = a.as_list(), &y = b.as_list();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (less(x[i], y[i])) return true;
      if (less(y[i], x[i])) return false;
    }
    return x.size() < y.size();
  }
  fail("'<' not supported between instances of '{}' and '{}'", a.type_name(), b.type_name());
}

uint32_t decode_code_point(std::string_view s, size_t pos, size_t& length) {
  const auto c = static_cast<unsigned char>(s[pos]);
  if (c < 0x80) {
    length = 1;
    return c;
  }
  const int n = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
  uint32_t cp = c & (0x3F >> (n - 1));
  for (int k = 1; k < n && pos + size_t(k) < s.size(); ++k)
    cp = (cp << 6) | (static_cast<unsigned char>(s[pos + k]) & 0x3F);
  length = std::min(size_t(n), s.size() - pos);
  return cp;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

size_t code_point_count(std::string_view s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

size_t byte_offset(std::string_view s, size_t index) {
  size_t pos = 0;
  for (size_t k = 0; k < index && pos < s.size(); ++k) {
    size_t len;
    decode_code_point(s, pos, len);
    pos += len;
  }
  return pos;
}

// str.isspace(): Unicode White_Space plus the ASCII separators Python counts (0x1C-0x1F).
bool is_python_space(uint32_t cp) {
  if (cp < 0x80) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x1F);
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  auto end = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific).ptr;
  std::string sci(buf, end);  // [-]d[.ddd]e[+-]XX
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  const size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exponent = std::stoi(sci.substr(e + 1));
  const int decpt = exponent + 1;
  const int n = int(digits.size());
  std::string out;
  if (decpt <= -4 || decpt > 16) {
    out = digits.substr(0, 1);
    if (n > 1) out += "." + digits.substr(1);
    const int x = decpt - 1;
    out += fmt::format("e{}{:02d}", x < 0 ? '-' : '+', std::abs(x));
  } else if (decpt <= 0) {
    out = "0." + std::string(size_t(-decpt), '0') + digits;
  } else if (decpt >= n) {
    out = digits + std::string(size_t(decpt - n), '0') + ".0";
  } else {
    out = digits.substr(0, size_t(decpt)) + "." + digits.substr(size_t(decpt));
  }
  return sign + out;
}

namespace {

bool printable(uint32_t cp) {
  if (cp == ' ') return true;
  if (cp < 0x20 || cp == 0x7F) return false;
  if (cp < 0x7F) return true;
  switch (u_charType(UChar32(cp))) {
    case U_CONTROL_CHAR:
    case U_FORMAT_CHAR:
    case U_SURROGATE:
    case U_PRIVATE_USE_CHAR:
    case U_UNASSIGNED:
    case U_LINE_SEPARATOR:
    case U_PARAGRAPH_SEPARATOR:
    case U_SPACE_SEPARATOR: return false;
    default: return true;
  }
}

std::string string_repr(std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos, has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (size_t pos = 0; pos < s.size();) {
    size_t len;
    const uint32_t cp = decode_code_point(s, pos, len);
    if (cp == uint32_t(quote) || cp == '\\') {
      out += '\\';
      out += char(cp);
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (!printable(cp)) {
      out += cp < 0x100     ? fmt::format("\\x{:02x}", cp)
             : cp < 0x10000 ? fmt::format("\\u{:04x}", cp)
                            : fmt::format("\\U{:08x}", cp);
    } else {
      out.append(s.substr(pos, len));
    }
    pos += len;
  }
  out += quote;
  return out;
}

// Python's json.dumps escapes as keel's JSON writer does; with ensure_ascii, every non-ASCII
// character as \uXXXX (a surrogate pair above the BMP).
void json_string(std::string& out, std::string_view s, bool ensure_ascii) {
  const std::string escaped = json_quoted(s);
  if (!ensure_ascii) {
    out += escaped;
    return;
  }
  for (size_t pos = 0; pos < escaped.size();) {
    size_t len;
    const uint32_t cp = decode_code_point(escaped, pos, len);
    if (cp < 0x80)
      out += char(cp);
    else if (cp < 0x10000)
      out += fmt::format("\\u{:04x}", cp);
    else
      out += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + ((cp - 0x10000) >> 10), 0xDC00 + ((cp - 0x10000) & 0x3FF));
    pos += len;
  }
}

void json_value(std::string& out, const Value& v, const JsonOptions& o, int level) {
  using K = Value::Kind;
  ValueSizeLimit::check(out.size());
  auto newline = [&](int depth) {
    if (o.indent < 0) return;
    out += '\n';
    out.append(size_t(o.indent) * size_t(depth), ' ');
  };
  switch (v.kind()) {
    case K::none: out += "null"; return;
    case K::boolean: out += v.as_bool() ? "true" : "false"; return;
    case K::integer: out += std::to_string(v.as_int()); return;
    case K::real: {
      const double d = v.as_real();
      out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d < 0 ? "-Infinity" : "Infinity") : float_repr(d);
      return;
    }
    case K::string: json_string(out, v.as_str().text, o.ensure_ascii); return;
    case K::list: {
      const List& l = v.as_list();
      if (l.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < l.size(); ++i) {
        if (i) out += o.item_separator;
        newline(level + 1);
        json_value(out, l[i], o, level + 1);
      }
      newline(level);
      out += ']';
      return;
    }
    case K::dict: {
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& item : v.as_dict().items) items.push_back(&item);
      if (o.sort_keys)
        std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      if (items.empty()) {
        out += "{}";
        return;
      }
      out += '{';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += o.item_separator;
        newline(level + 1);
        json_string(out, json_key(items[i]->first), o.ensure_ascii);
        out += o.key_separator;
        json_value(out, items[i]->second, o, level + 1);
      }
      newline(level);
      out += '}';
      return;
    }
    default: fail("Object of type {} is not JSON serializable", v.type_name());
  }
}

}  // namespace

std::string repr(const Value& v) {
  using K = Value::Kind;
  if (v.is_list() || v.is_dict()) ValueSizeLimit::check(v.is_list() ? v.as_list().size() : v.as_dict().items.size());
  switch (v.kind()) {
    case K::string: return string_repr(v.as_str().text);
    case K::list: {
      const List& l = v.as_list();
      std::string out = v.is_tuple() ? "(" : "[";
      for (size_t i = 0; i < l.size(); ++i) {
        if (i) out += ", ";
        out += repr(l[i]);
        ValueSizeLimit::check(out.size());
      }
      if (v.is_tuple() && l.size() == 1) out += ',';
      return out + (v.is_tuple() ? ")" : "]");
    }
    case K::dict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, x] : v.as_dict().items) {
        if (!first) out += ", ";
        first = false;
        out += repr(key_value(k)) + ": " + repr(x);
        ValueSizeLimit::check(out.size());
      }
      return out + "}";
    }
    case K::undefined: return "Undefined";
    default: return to_str(v).text;
  }
}

Str to_str(const Value& v) {
  using K = Value::Kind;
  switch (v.kind()) {
    case K::undefined: return Str();
    case K::none: return Str("None");
    case K::boolean: return Str(v.as_bool() ? "True" : "False");
    case K::integer: return Str(std::to_string(v.as_int()));
    case K::real: return Str(float_repr(v.as_real()));
    case K::string: return v.as_str();
    case K::ns: return Str("<Namespace " + repr(Value(v.ns_dict())) + ">");
    case K::callable: return Str("<function " + v.as_callable().name + ">");
    default: break;
  }
  return marked_like(repr(v), v);  // a container printed whole
}

int first_source(const Value& v) {
  if (v.is_string()) return v.as_str().first_source();
  if (v.is_list())
    for (const Value& x : v.as_list())
      if (const int s = first_source(x); s != Str::kNoSource) return s;
  if (v.is_dict())
    for (const auto& [k, x] : v.as_dict().items)
      if (const int s = first_source(x); s != Str::kNoSource) return s;
  return Str::kNoSource;
}

Str marked_like(std::string text, const Value& from) {
  const int s = first_source(from);
  return s == Str::kNoSource ? Str(std::move(text)) : Str(std::move(text), s);
}

std::string to_json(const Value& v, const JsonOptions& options) {
  std::string out;
  json_value(out, v, options, 0);
  return out;
}

}  // namespace keel::data::jinja
