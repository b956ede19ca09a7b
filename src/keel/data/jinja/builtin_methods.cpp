// The Python methods of str, dict and list a sandboxed template may call (`s.strip()`,
// `message.items()`, `roles.index(r)`): the str methods in a table from name to code.
#include <unicode/uchar.h>

#include <algorithm>

#include "keel/core/error.h"
#include "keel/data/jinja/builtins.h"

namespace keel::data::jinja {
namespace {

const Str& need_str(Interpreter& in, const Value& v, const char* what, int line) {
  if (!v.is_string()) bad(in, line, fmt::format("{} expects a string, got {}", what, v.type_name()));
  return v.as_str();
}

List split(const Str& s, const Value& sep, int64_t maxsplit, bool from_right) {
  List out;
  const std::string& t = s.text;
  if (sep.is_undefined() || sep.is_none()) {  // runs of whitespace, empty pieces dropped
    std::vector<std::pair<size_t, size_t>> words;
    for (size_t pos = 0; pos < t.size();) {
      size_t len;
      if (is_python_space(decode_code_point(t, pos, len))) {
        pos += len;
        continue;
      }
      size_t end = pos;
      while (end < t.size() && !is_python_space(decode_code_point(t, end, len))) end += len;
      words.emplace_back(pos, end);
      pos = end;
    }
    if (maxsplit >= 0 && int64_t(words.size()) > maxsplit + 1) {
      if (!from_right) {
        const auto [b, e] = strip_bounds(t.substr(words[size_t(maxsplit)].first), Value(), false, true);
        words.resize(size_t(maxsplit) + 1);
        words.back().second = words.back().first + (e - b);
      } else {
        const size_t keep = words.size() - size_t(maxsplit) - 1;
        words.erase(words.begin(), words.begin() + std::ptrdiff_t(keep));
        words.front().first = strip_bounds(t, Value(), true, false).first;
      }
    }
    for (auto [b, e] : words) out.emplace_back(s.substr(b, e));
    return out;
  }
  const std::string& d = sep.as_str().text;
  if (d.empty()) fail("empty separator");
  std::vector<size_t> cuts;
  for (size_t at = t.find(d); at != std::string::npos; at = t.find(d, at + d.size())) cuts.push_back(at);
  if (maxsplit >= 0 && int64_t(cuts.size()) > maxsplit) {
    if (from_right)
      cuts.erase(cuts.begin(), cuts.end() - maxsplit);
    else
      cuts.resize(size_t(maxsplit));
  }
  size_t begin = 0;
  for (size_t at : cuts) {
    out.emplace_back(s.substr(begin, at));
    begin = at + d.size();
  }
  out.emplace_back(s.substr(begin, t.size()));
  return out;
}

bool starts_or_ends(std::string_view s, const Value& what, bool start) {
  auto one = [&](const std::string& p) {
    if (p.size() > s.size()) return false;
    return start ? s.compare(0, p.size(), p) == 0 : s.compare(s.size() - p.size(), p.size(), p) == 0;
  };
  if (what.is_list()) {
    for (const Value& p : what.as_list())
      if (p.is_string() && one(p.as_str().text)) return true;
    return false;
  }
  return what.is_string() && one(what.as_str().text);
}

bool all_code_points(const std::string& s, bool (*pred)(uint32_t)) {
  if (s.empty()) return false;
  for (size_t pos = 0; pos < s.size();) {
    size_t len;
    if (!pred(decode_code_point(s, pos, len))) return false;
    pos += len;
  }
  return true;
}

// The byte range of s[start:end] for a method's optional start/end arguments (positions
// `first`, `first + 1`), in characters with Python's negative and clamped indices.
std::pair<size_t, size_t> python_range(Interpreter& in, const std::string& s, const CallArgs& a, size_t first) {
  const int64_t n = int64_t(code_point_count(s));
  auto index = [&](const Value& v, int64_t fallback) {
    if (v.is_undefined() || v.is_none()) return fallback;
    if (!v.is_number()) in.error(0, "slice indices must be integers or None");
    int64_t x = v.as_int();
    if (x < 0) x += n;
    return std::clamp<int64_t>(x, 0, n);
  };
  const int64_t b = index(a.get(first, "start"), 0), e = std::max(b, index(a.get(first + 1, "end"), n));
  return {byte_offset(s, size_t(b)), byte_offset(s, size_t(e))};
}

// The code of a str method: `self.name(a)`, self a string. Methods that differ by little
// (strip, lstrip, rstrip) share one and read `name`.
using StrMethod = Value (*)(Interpreter& in, const std::string& name, const Value& self, CallArgs& a);

Value str_strip(Interpreter&, const std::string& name, const Value& self, CallArgs& a) {
  const Str& s = self.as_str();
  const auto [b, e] = strip_bounds(s.text, a.get(0, "chars"), name != "rstrip", name != "lstrip");
  // Nothing goes: the string itself, as CPython returns it (no copy of a message's text for
  // content.lstrip('\n')). Not for Markup, which keel's strip turns into a plain str.
  if (b == 0 && e == s.text.size() && !self.is_markup()) return self;
  return Value(s.substr(b, e));
}

Value str_split(Interpreter& in, const std::string& name, const Value& self, CallArgs& a) {
  const Str& s = self.as_str();
  Value sep = a.get(0, "sep"), maxsplit = a.get(1, "maxsplit", Value(int64_t(-1)));
  if (!sep.is_undefined() && !sep.is_none()) need_str(in, sep, "split", 0);
  return Value(split(s, sep, maxsplit.as_int(), same_name(name, "rsplit")));
}

Value str_splitlines(Interpreter&, const std::string&, const Value& self, CallArgs& a) {
  const Str& s = self.as_str();
  std::vector<Str> lines = line_pieces(s, a.get(0, "keepends", Value(false)).truthy());
  if (lines.back().text.empty()) lines.pop_back();
  return Value(List(lines.begin(), lines.end()));
}

Value str_startswith(Interpreter& in, const std::string& name, const Value& self, CallArgs& a) {
  const Str& s = self.as_str();
  // Without start/end the whole string: no copy, no count of its characters.
  const auto [b, e] = a.positional.size() > 1 || !a.keywords.empty() ? python_range(in, s.text, a, 1)
                                                                     : std::pair<size_t, size_t>{0, s.text.size()};
  return Value(
      starts_or_ends(std::string_view(s.text).substr(b, e - b), a.get(0, "prefix"), same_name(name, "startswith")));
}

Value str_replace(Interpreter& in, const std::string&, const Value& self, CallArgs& a) {
  const Str& s = self.as_str();
  const Str& old = need_str(in, a.get(0, "old"), "replace", 0);
  const Value with = a.get(1, "new");
  return Value(
      replaced(s, old.text, need_str(in, with, "replace", 0), a.get(2, "count", Value(int64_t(-1))).as_int()));
}

Value str_upper(Interpreter&, const std::string& name, const Value& self, CallArgs&) {
  const Str& s = self.as_str();
  return Value(rebuilt(case_mapped(s.text, same_name(name, "upper")), s));
}

Value str_capitalize(Interpreter&, const std::string&, const Value& self, CallArgs&) {
  const Str& s = self.as_str();
  return Value(rebuilt(capitalized(s.text), s));
}

Value str_title(Interpreter&, const std::string&, const Value& self, CallArgs&) {
  const Str& s = self.as_str();
  return Value(rebuilt(python_title(s.text), s));
}

Value str_swapcase(Interpreter&, const std::string& name, const Value& self, CallArgs&) {
  const Str& s = self.as_str();
  if (same_name(name, "casefold")) return Value(rebuilt(case_mapped(s.text, 0), s));
  std::string out;
  for (size_t pos = 0; pos < s.text.size();) {
    size_t len;
    const uint32_t cp = decode_code_point(s.text, pos, len);
    const std::string ch = s.text.substr(pos, len);
    out += u_isupper(UChar32(cp)) ? case_mapped(ch, 0) : u_islower(UChar32(cp)) ? case_mapped(ch, 1) : ch;
    pos += len;
  }
  return Value(rebuilt(std::move(out), s));
}

// find, rfind, index, rindex and count
Value str_find(Interpreter& in, const std::string& name, const Value& self, CallArgs& a) {
  const Str& s = self.as_str();
  const std::string& sub = need_str(in, a.get(0, "sub"), name.c_str(), 0).text;
  const auto [b, e] = python_range(in, s.text, a, 1);
  const std::string_view window = std::string_view(s.text).substr(b, e - b);
  if (same_name(name, "count")) {
    if (sub.empty()) return Value(int64_t(code_point_count(window) + 1));
    int64_t n = 0;
    for (size_t at = window.find(sub); at != std::string::npos; at = window.find(sub, at + sub.size())) ++n;
    return Value(n);
  }
  const size_t at = name[0] == 'r' ? window.rfind(sub) : window.find(sub);
  if (at == std::string::npos) {
    if (name.find("index") != std::string::npos) in.error(0, "substring not found");
    return Value(int64_t(-1));
  }
  return Value(int64_t(code_point_count(std::string_view(s.text).substr(0, b + at))));
}

Value str_join(Interpreter& in, const std::string&, const Value& self, CallArgs& a) {
  const Str& s = self.as_str();
  Value items = a.get(0, "iterable");
  Str out;
  if (!items.is_list() && !items.is_string()) in.error(0, "str.join expects a list or a string");
  bool first = true;
  for (const Value& x : iteration_items(in, items, 0)) {
    if (!first) out.append(s);
    first = false;
    out.append(need_str(in, x, "str.join", 0));
  }
  return Value(std::move(out));
}

// center, ljust, rjust and zfill
Value str_center(Interpreter& in, const std::string& name, const Value& self, CallArgs& a) {
  const Str& s = self.as_str();
  const int64_t width = a.get(0, "width", Value(int64_t(0))).as_int();
  ValueSizeLimit::check(uint64_t(std::max<int64_t>(width, 0)));
  const int64_t n = int64_t(code_point_count(s.text));
  if (width <= n) return Value(s);
  const Value fill_v = a.get(1, "fillchar", Value(same_name(name, "zfill") ? "0" : " "));
  const std::string fill = need_str(in, fill_v, name.c_str(), 0).text;
  auto pad = [&](int64_t k) {
    std::string p;
    for (int64_t i = 0; i < k; ++i) p += fill;
    return Str(p);
  };
  const int64_t total = width - n;
  // Python's center puts the extra character on the right when the text's length is even
  // relative to the total, as its formula does: left = total / 2 + (total & width & 1).
  const int64_t left = same_name(name, "ljust")    ? 0
                       : same_name(name, "center") ? total / 2 + (total & width & 1)
                                                   : total;
  Str out = pad(left);
  if (same_name(name, "zfill") && !s.text.empty() && (s.text[0] == '-' || s.text[0] == '+')) {
    out = Str(s.text.substr(0, 1));
    out.append(pad(left));
    out.append(s.substr(1, s.text.size()));
    return Value(std::move(out));
  }
  out.append(s);
  out.append(pad(total - left));
  return Value(std::move(out));
}

Value str_partition(Interpreter& in, const std::string& name, const Value& self, CallArgs& a) {
  const Str& s = self.as_str();
  const std::string& sep = need_str(in, a.get(0, "sep"), name.c_str(), 0).text;
  if (sep.empty()) in.error(0, "empty separator");
  const size_t at = same_name(name, "partition") ? s.text.find(sep) : s.text.rfind(sep);
  if (at == std::string::npos)
    return same_name(name, "partition") ? Value(List{Value(s), Value(""), Value("")}, true)
                                        : Value(List{Value(""), Value(""), Value(s)}, true);
  return Value(List{Value(s.substr(0, at)), Value(s.substr(at, at + sep.size())),
                    Value(s.substr(at + sep.size(), s.text.size()))},
               true);
}

// str.format with {}, {0} and {name} fields (no format specs: chat templates use none).
Value str_format(Interpreter& in, const std::string&, const Value& self, CallArgs& a) {
  const Str& s = self.as_str();
  Str out;
  size_t next = 0, literal = 0;
  const std::string& f = s.text;
  for (size_t i = 0; i < f.size(); ++i) {
    if (f[i] != '{' && f[i] != '}') continue;
    out.append(s.substr(literal, i));
    if (i + 1 < f.size() && f[i + 1] == f[i]) {
      out.append(Str(std::string(1, f[i])));
      literal = ++i + 1;
      continue;
    }
    if (f[i] == '}') in.error(0, "str.format: single '}'");
    const size_t close = f.find('}', i);
    if (close == std::string::npos) in.error(0, "str.format: '{' without '}'");
    const std::string field = f.substr(i + 1, close - i - 1);
    if (field.find_first_of(":!.[") != std::string::npos) in.error(0, "str.format: format specs are not supported");
    Value v;
    if (field.empty())
      v = a.get(next++, "");
    else if (std::all_of(field.begin(), field.end(), ::isdigit))
      v = a.get(parse_index(field), "");
    else if (const Value* k = a.keyword(field))
      v = *k;
    if (v.is_undefined()) in.error(0, fmt::format("str.format: no value for {{{}}}", field));
    out.append(to_str(v));
    literal = close + 1;
    i = close;
  }
  out.append(s.substr(literal, f.size()));
  return Value(std::move(out));
}

Value str_removeprefix(Interpreter& in, const std::string& name, const Value& self, CallArgs& a) {
  const Str& s = self.as_str();
  const std::string& p = need_str(in, a.get(0, "prefix"), name.c_str(), 0).text;
  if (same_name(name, "removeprefix") && s.text.compare(0, p.size(), p) == 0)
    return Value(s.substr(p.size(), s.text.size()));
  if (same_name(name, "removesuffix") && !p.empty() && p.size() <= s.text.size() &&
      s.text.compare(s.text.size() - p.size(), p.size(), p) == 0)
    return Value(s.substr(0, s.text.size() - p.size()));
  return Value(s);
}

// isdigit, isnumeric and isdecimal
Value str_isdigit(Interpreter&, const std::string&, const Value& self, CallArgs&) {
  return Value(all_code_points(self.as_str().text, [](uint32_t c) { return bool(u_isdigit(UChar32(c))); }));
}

Value str_isalpha(Interpreter&, const std::string&, const Value& self, CallArgs&) {
  return Value(all_code_points(self.as_str().text, [](uint32_t c) { return bool(u_isalpha(UChar32(c))); }));
}

Value str_isalnum(Interpreter&, const std::string&, const Value& self, CallArgs&) {
  return Value(all_code_points(self.as_str().text, [](uint32_t c) { return bool(u_isalnum(UChar32(c))); }));
}

Value str_isspace(Interpreter&, const std::string&, const Value& self, CallArgs&) {
  return Value(all_code_points(self.as_str().text, is_python_space));
}

Value str_islower(Interpreter&, const std::string& name, const Value& self, CallArgs&) {
  return Value(python_is_case(self.as_str().text, same_name(name, "islower")));
}

constexpr Named<StrMethod> kStrMethods[] = {
    {"strip", str_strip},
    {"lstrip", str_strip},
    {"rstrip", str_strip},
    {"split", str_split},
    {"rsplit", str_split},
    {"splitlines", str_splitlines},
    {"startswith", str_startswith},
    {"endswith", str_startswith},
    {"replace", str_replace},
    {"upper", str_upper},
    {"lower", str_upper},
    {"capitalize", str_capitalize},
    {"title", str_title},
    {"swapcase", str_swapcase},
    {"casefold", str_swapcase},
    {"find", str_find},
    {"rfind", str_find},
    {"index", str_find},
    {"rindex", str_find},
    {"count", str_find},
    {"join", str_join},
    {"center", str_center},
    {"ljust", str_center},
    {"rjust", str_center},
    {"zfill", str_center},
    {"partition", str_partition},
    {"rpartition", str_partition},
    {"format", str_format},
    {"removeprefix", str_removeprefix},
    {"removesuffix", str_removeprefix},
    {"isdigit", str_isdigit},
    {"isnumeric", str_isdigit},
    {"isdecimal", str_isdigit},
    {"isalpha", str_isalpha},
    {"isalnum", str_isalnum},
    {"isspace", str_isspace},
    {"islower", str_islower},
    {"isupper", str_islower},
};

// str method `name` bound to `self` as a value (`s.strip`); an unnamed undefined when str has
// no such method.
Value string_method(const Value& self, const std::string& name) {
  const StrMethod body = find_builtin(kStrMethods, name);
  if (!body) return Value();
  return Value::function(name,
                         [self, body, name](Interpreter& in, CallArgs& a) -> Value { return body(in, name, self, a); });
}

}  // namespace

Value builtin_method(const Value& self, const std::string& name) {
  if (self.is_string()) return string_method(self, name);
  if (self.is_dict()) {
    // Every `message.role` asks here first (Python's getattr before the keys): compared as a view,
    // a name checks the length before any byte (a std::string against a literal runs strlen).
    const std::string_view n = name;
    if (!is_dict_method(n)) return Value();
    if (same_name(n, "items") || same_name(n, "keys") || same_name(n, "values"))
      return Value::function(name, [self, name](Interpreter&, CallArgs&) {
        List out;
        for (const auto& [k, v] : self.as_dict().items) {
          if (same_name(name, "items"))
            out.emplace_back(List{key_value(k), v}, true);
          else if (same_name(name, "keys"))
            out.push_back(key_value(k));
          else
            out.push_back(v);
        }
        return Value(std::move(out));
      });
    if (same_name(n, "copy"))
      return Value::function(name, [self](Interpreter&, CallArgs&) { return Value(self.as_dict()); });
    if (same_name(n, "get"))
      return Value::function(name, [self](Interpreter& in, CallArgs& a) {
        Value key = a.get(0, "key");
        if (key.is_list() || key.is_dict()) in.error(0, fmt::format("unhashable type: '{}'", key.type_name()));
        const Value* v = self.as_dict().find(dict_key(key));
        (void)in;
        return v ? *v : a.get(1, "default", Value::none());
      });
    return Value();
  }
  if (self.is_list()) {
    if (same_name(name, "index") || same_name(name, "count"))
      return Value::function(name, [self, name](Interpreter& in, CallArgs& a) {
        Value x = a.get(0, "value");
        int64_t n = 0;
        for (size_t i = 0; i < self.as_list().size(); ++i)
          if (equal(self.as_list()[i], x)) {
            if (same_name(name, "index")) return Value(int64_t(i));
            ++n;
          }
        if (same_name(name, "index")) in.error(0, "value is not in list");
        return Value(n);
      });
  }
  return Value();
}

bool call_string_method(Interpreter& in, const Value& self, const std::string& name, CallArgs& args, Value& result) {
  const StrMethod body = find_builtin(kStrMethods, name);
  if (!body) {
    result = Value();
    return false;
  }
  result = body(in, name, self, args);
  return true;
}

}  // namespace keel::data::jinja
