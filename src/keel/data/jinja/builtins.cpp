// Jinja's built-in filters and tests, the Python str/list/dict methods a sandboxed template may
// call, and the globals transformers adds. Only what is side-effect free: the sandbox that
// transformers uses is immutable (no list.append, no dict.update), so these are all there is.
#include <unicode/uchar.h>
#include <unicode/locid.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <cmath>
#include <ctime>

#include "keel/core/error.h"
#include "keel/data/jinja/interpreter.h"

namespace keel::data::jinja {
namespace {

[[noreturn]] void bad(Interpreter& in, int line, const std::string& what) { in.error(line, what); }

// A result built from `from` by a transformation that does not keep byte positions: marked whole
// when any of `from` was.
Str rebuilt(std::string text, const Str& from) {
  if (from.marked() && text.size() == from.text.size()) {
    Str s(std::move(text));
    s.runs = from.runs;  // same length: the case change kept every byte where it was
    return s;
  }
  return from.marked() ? Str(std::move(text), from.first_source()) : Str(std::move(text));
}

int source_in(const Value& v) {
  if (v.is_string()) return v.as_str().first_source();
  if (v.is_list())
    for (const Value& x : v.as_list())
      if (int s = source_in(x); s != Str::kNoSource) return s;
  if (v.is_dict())
    for (const auto& [k, x] : v.as_dict().items)
      if (int s = source_in(x); s != Str::kNoSource) return s;
  return Str::kNoSource;
}

Str marked_like(std::string text, const Value& from) {
  const int s = source_in(from);
  return s == Str::kNoSource ? Str(std::move(text)) : Str(std::move(text), s);
}

std::string case_mapped(const std::string& s, int how) {  // 0 lower, 1 upper
  bool ascii = true;
  for (char c : s) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
  if (ascii) {
    std::string out = s;
    for (char& c : out) c = char(how ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)));
    return out;
  }
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(s);
  if (how) u.toUpper(icu::Locale::getRoot());
  else u.toLower(icu::Locale::getRoot());
  std::string out;
  u.toUTF8String(out);
  return out;
}

// Python's str.capitalize (first character upper, the rest lower) and Jinja's title filter
// (each word after a space, '-', or an opening bracket starts upper).
std::string capitalized(const std::string& s) {
  if (s.empty()) return s;
  size_t len;
  decode_code_point(s, 0, len);
  return case_mapped(s.substr(0, len), 1) + case_mapped(s.substr(len), 0);
}

std::string titled(const std::string& s) {
  std::string out, word;
  auto flush = [&] {
    if (!word.empty()) out += capitalized(word);
    word.clear();
  };
  for (size_t pos = 0; pos < s.size();) {
    size_t len;
    const uint32_t cp = decode_code_point(s, pos, len);
    if (is_python_space(cp) || cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<') {
      flush();
      out.append(s, pos, len);
    } else {
      word.append(s, pos, len);
    }
    pos += len;
  }
  flush();
  return out;
}

// str.strip(chars) bounds in bytes: which code points go (whitespace when chars is None).
std::pair<size_t, size_t> strip_bounds(const std::string& s, const Value& chars, bool left, bool right) {
  std::vector<uint32_t> set;
  const bool whitespace = chars.is_undefined() || chars.is_none();
  if (!whitespace)
    for (size_t pos = 0; pos < chars.as_str().text.size();) {
      size_t len;
      set.push_back(decode_code_point(chars.as_str().text, pos, len));
      pos += len;
    }
  auto goes = [&](uint32_t cp) {
    return whitespace ? is_python_space(cp) : std::find(set.begin(), set.end(), cp) != set.end();
  };
  size_t b = 0, e = s.size();
  while (left && b < e) {
    size_t len;
    if (!goes(decode_code_point(s, b, len))) break;
    b += len;
  }
  while (right && e > b) {
    size_t start = e - 1;
    while (start > b && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    size_t len;
    if (!goes(decode_code_point(s, start, len))) break;
    e = start;
  }
  return {b, e};
}

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
    if (from_right) cuts.erase(cuts.begin(), cuts.end() - maxsplit);
    else cuts.resize(size_t(maxsplit));
  }
  size_t begin = 0;
  for (size_t at : cuts) {
    out.emplace_back(s.substr(begin, at));
    begin = at + d.size();
  }
  out.emplace_back(s.substr(begin, t.size()));
  return out;
}

Str replaced(const Str& s, const std::string& old, const Str& with, int64_t count) {
  Str out;
  size_t begin = 0;
  int64_t n = 0;
  if (old.empty()) {  // Python inserts `with` between every character
    for (size_t pos = 0; pos <= s.text.size() && (count < 0 || n < count);) {
      out.append(s.substr(begin, pos));
      out.append(with);
      ++n;
      begin = pos;
      if (pos == s.text.size()) break;
      size_t len;
      decode_code_point(s.text, pos, len);
      pos += len;
    }
    out.append(s.substr(begin, s.text.size()));
    return out;
  }
  for (size_t at = s.text.find(old); at != std::string::npos && (count < 0 || n < count);
       at = s.text.find(old, at + old.size()), ++n) {
    out.append(s.substr(begin, at));
    out.append(with);
    begin = at + old.size();
  }
  out.append(s.substr(begin, s.text.size()));
  return out;
}

bool starts_or_ends(const Str& s, const Value& what, bool start) {
  auto one = [&](const std::string& p) {
    if (p.size() > s.text.size()) return false;
    return start ? s.text.compare(0, p.size(), p) == 0 : s.text.compare(s.text.size() - p.size(), p.size(), p) == 0;
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

Value string_method(const Value& self, const std::string& name) {
  using A = CallArgs;
  auto method = [&](auto body) {
    return Value::function(name, [self, body, name](Interpreter& in, A& a) -> Value { return body(in, self.as_str(), a); });
  };
  if (name == "strip" || name == "lstrip" || name == "rstrip")
    return method([name](Interpreter&, const Str& s, A& a) {
      const auto [b, e] = strip_bounds(s.text, a.get(0, "chars"), name != "rstrip", name != "lstrip");
      return Value(s.substr(b, e));
    });
  if (name == "split" || name == "rsplit")
    return method([name](Interpreter& in, const Str& s, A& a) {
      Value sep = a.get(0, "sep"), maxsplit = a.get(1, "maxsplit", Value(int64_t(-1)));
      if (!sep.is_undefined() && !sep.is_none()) need_str(in, sep, "split", 0);
      return Value(split(s, sep, maxsplit.as_int(), name == "rsplit"));
    });
  if (name == "splitlines")
    return method([](Interpreter&, const Str& s, A&) {
      List out;
      size_t begin = 0;
      for (size_t i = 0; i < s.text.size(); ++i)
        if (s.text[i] == '\n' || s.text[i] == '\r') {
          out.emplace_back(s.substr(begin, i));
          if (s.text[i] == '\r' && i + 1 < s.text.size() && s.text[i + 1] == '\n') ++i;
          begin = i + 1;
        }
      if (begin < s.text.size()) out.emplace_back(s.substr(begin, s.text.size()));
      return Value(std::move(out));
    });
  if (name == "startswith" || name == "endswith")
    return method([name](Interpreter&, const Str& s, A& a) {
      return Value(starts_or_ends(s, a.get(0, "prefix"), name == "startswith"));
    });
  if (name == "replace")
    return method([](Interpreter& in, const Str& s, A& a) {
      const Str& old = need_str(in, a.get(0, "old"), "replace", 0);
      const Value with = a.get(1, "new");
      return Value(replaced(s, old.text, need_str(in, with, "replace", 0), a.get(2, "count", Value(int64_t(-1))).as_int()));
    });
  if (name == "upper" || name == "lower")
    return method([name](Interpreter&, const Str& s, A&) { return Value(rebuilt(case_mapped(s.text, name == "upper"), s)); });
  if (name == "capitalize")
    return method([](Interpreter&, const Str& s, A&) { return Value(rebuilt(capitalized(s.text), s)); });
  if (name == "title")
    return method([](Interpreter&, const Str& s, A&) { return Value(rebuilt(titled(s.text), s)); });
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count")
    return method([name](Interpreter& in, const Str& s, A& a) -> Value {
      const std::string& sub = need_str(in, a.get(0, "sub"), name.c_str(), 0).text;
      if (name == "count") {
        if (sub.empty()) return Value(int64_t(code_point_count(s.text) + 1));
        int64_t n = 0;
        for (size_t at = s.text.find(sub); at != std::string::npos; at = s.text.find(sub, at + sub.size())) ++n;
        return Value(n);
      }
      const size_t at = name[0] == 'r' ? s.text.rfind(sub) : s.text.find(sub);
      if (at == std::string::npos) {
        if (name.find("index") != std::string::npos) in.error(0, "substring not found");
        return Value(int64_t(-1));
      }
      return Value(int64_t(code_point_count(std::string_view(s.text).substr(0, at))));
    });
  if (name == "join")
    return method([](Interpreter& in, const Str& s, A& a) {
      Value items = a.get(0, "iterable");
      Str out;
      if (!items.is_list()) in.error(0, "str.join expects a list");
      bool first = true;
      for (const Value& x : items.as_list()) {
        if (!first) out.append(s);
        first = false;
        out.append(need_str(in, x, "str.join", 0));
      }
      return Value(std::move(out));
    });
  if (name == "removeprefix" || name == "removesuffix")
    return method([name](Interpreter& in, const Str& s, A& a) {
      const std::string& p = need_str(in, a.get(0, "prefix"), name.c_str(), 0).text;
      if (name == "removeprefix" && s.text.compare(0, p.size(), p) == 0) return Value(s.substr(p.size(), s.text.size()));
      if (name == "removesuffix" && !p.empty() && p.size() <= s.text.size() &&
          s.text.compare(s.text.size() - p.size(), p.size(), p) == 0)
        return Value(s.substr(0, s.text.size() - p.size()));
      return Value(s);
    });
  if (name == "isdigit" || name == "isnumeric" || name == "isdecimal")
    return method([](Interpreter&, const Str& s, A&) {
      return Value(all_code_points(s.text, [](uint32_t c) { return bool(u_isdigit(UChar32(c))); }));
    });
  if (name == "isalpha")
    return method([](Interpreter&, const Str& s, A&) {
      return Value(all_code_points(s.text, [](uint32_t c) { return bool(u_isalpha(UChar32(c))); }));
    });
  if (name == "isalnum")
    return method([](Interpreter&, const Str& s, A&) {
      return Value(all_code_points(s.text, [](uint32_t c) { return bool(u_isalnum(UChar32(c))); }));
    });
  if (name == "isspace")
    return method([](Interpreter&, const Str& s, A&) { return Value(all_code_points(s.text, is_python_space)); });
  if (name == "islower" || name == "isupper")
    return method([name](Interpreter&, const Str& s, A&) {
      const std::string other = case_mapped(s.text, name == "islower" ? 1 : 0);
      return Value(other != s.text && case_mapped(s.text, name == "islower" ? 0 : 1) == s.text);
    });
  return Value::undefined(name);
}

}  // namespace

Value builtin_method(const Value& self, const std::string& name) {
  if (self.is_string()) return string_method(self, name);
  if (self.is_dict()) {
    if (name == "items" || name == "keys" || name == "values")
      return Value::function(name, [self, name](Interpreter&, CallArgs&) {
        List out;
        for (const auto& [k, v] : self.as_dict().items) {
          if (name == "items") out.emplace_back(List{Value(Str(k)), v}, true);
          else if (name == "keys") out.emplace_back(Str(k));
          else out.push_back(v);
        }
        return Value(std::move(out));
      });
    if (name == "get")
      return Value::function(name, [self](Interpreter& in, CallArgs& a) {
        Value key = a.get(0, "key");
        if (!key.is_string()) return a.get(1, "default", Value::none());
        const Value* v = self.as_dict().find(key.as_str().text);
        (void)in;
        return v ? *v : a.get(1, "default", Value::none());
      });
    return Value::undefined(name);
  }
  if (self.is_list()) {
    if (name == "index" || name == "count")
      return Value::function(name, [self, name](Interpreter& in, CallArgs& a) {
        Value x = a.get(0, "value");
        int64_t n = 0;
        for (size_t i = 0; i < self.as_list().size(); ++i)
          if (equal(self.as_list()[i], x)) {
            if (name == "index") return Value(int64_t(i));
            ++n;
          }
        if (name == "index") in.error(0, "value is not in list");
        return Value(n);
      });
  }
  return Value::undefined(name);
}

namespace {

List as_items(Interpreter& in, const Value& v, int line) {
  if (v.is_list()) return v.as_list();
  if (v.is_undefined()) return {};
  if (v.is_dict()) {
    List keys;
    for (const auto& [k, x] : v.as_dict().items) keys.emplace_back(Str(k));
    return keys;
  }
  if (v.is_string()) {
    List chars;
    for (size_t pos = 0; pos < v.as_str().text.size();) {
      size_t len;
      decode_code_point(v.as_str().text, pos, len);
      chars.emplace_back(v.as_str().substr(pos, pos + len));
      pos += len;
    }
    return chars;
  }
  bad(in, line, fmt::format("'{}' object is not iterable", v.type_name()));
}

// An attribute path "a.b" or an item index, as Jinja's make_attrgetter reads it.
Value get_path(Interpreter& in, const Value& v, const Value& path, int line) {
  if (path.is_number()) return in.item(v, path, line);
  Value cur = v;
  const std::string& p = path.as_str().text;
  size_t begin = 0;
  while (true) {
    const size_t dot = p.find('.', begin);
    std::string part = p.substr(begin, dot == std::string::npos ? std::string::npos : dot - begin);
    const bool digits = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit);
    cur = digits ? in.item(cur, Value(int64_t(std::stoll(part))), line) : in.item(cur, Value(part), line);
    if (dot == std::string::npos) return cur;
    begin = dot + 1;
  }
}

CallArgs rest_of(const CallArgs& a, size_t from) {
  CallArgs r;
  for (size_t i = from; i < a.positional.size(); ++i) r.positional.push_back(a.positional[i]);
  r.keywords = a.keywords;
  return r;
}

std::string sort_key_text(const Value& v, bool case_sensitive) {
  return case_sensitive ? v.as_str().text : case_mapped(v.as_str().text, 0);
}

bool sort_less(const Value& a, const Value& b, bool case_sensitive) {
  if (!case_sensitive && a.is_string() && b.is_string())
    return sort_key_text(a, false) < sort_key_text(b, false);
  return less(a, b);
}

Value select_like(Interpreter& in, const Value& subject, CallArgs& a, int line, bool attr, bool keep) {
  List out;
  for (const Value& x : as_items(in, subject, line)) {
    Value probe = attr ? get_path(in, x, a.get(0, "attribute"), line) : x;
    const size_t test_at = attr ? 1 : 0;
    bool ok;
    if (a.positional.size() <= test_at) {
      ok = probe.truthy();
    } else {
      CallArgs targs = rest_of(a, test_at + 1);
      targs.keywords.clear();
      ok = in.apply_test(a.positional[test_at].as_str().text, probe, targs, line);
    }
    if (ok == keep) out.push_back(x);
  }
  return Value(std::move(out));
}

Value html_escape(const Value& v) {
  const Str s = to_str(v);
  std::string out;
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
  return Value(rebuilt(std::move(out), s));
}

Value to_int(const Value& v, const Value& fallback) {
  if (v.is_number()) return v.kind() == Value::Kind::real ? Value(int64_t(v.as_real())) : Value(v.as_int());
  if (v.is_string()) {
    const std::string& t = v.as_str().text;
    const auto [b, e] = strip_bounds(t, Value(), true, true);
    std::string s = t.substr(b, e - b);
    try {
      size_t used;
      const long long x = std::stoll(s, &used, 10);
      if (used == s.size()) return Value(int64_t(x));
      const double d = std::stod(s, &used);
      if (used == s.size()) return Value(int64_t(d));
    } catch (const std::exception&) {
    }
  }
  return fallback;
}

}  // namespace

Value builtin_filter(Interpreter& in, const std::string& name, const Value& v, CallArgs& a, int line) {
  auto str_of = [&](const Value& x) { return to_str(x); };
  if (name == "tojson") {
    JsonOptions o;
    o.ensure_ascii = a.get(0, "ensure_ascii", Value(false)).truthy();
    const Value indent = a.get(1, "indent");
    if (indent.is_number()) {
      o.indent = int(indent.as_int());
      o.item_separator = ",";
    } else if (indent.is_string()) {
      bad(in, line, "tojson: a string indent is not supported");
    }
    const Value separators = a.get(2, "separators");
    if (separators.is_list() && separators.as_list().size() == 2) {
      o.item_separator = to_str(separators.as_list()[0]).text;
      o.key_separator = to_str(separators.as_list()[1]).text;
    }
    o.sort_keys = a.get(3, "sort_keys", Value(false)).truthy();
    try {
      return Value(marked_like(to_json(v, o), v));
    } catch (const Error& e) {
      bad(in, line, fmt::format("tojson: {}", e.what()));
    }
  }
  if (name == "trim" || name == "strip") {
    const Str s = str_of(v);
    const auto [b, e] = strip_bounds(s.text, a.get(0, "chars"), true, true);
    return Value(s.substr(b, e));
  }
  if (name == "length" || name == "count") {
    if (v.is_string()) return Value(int64_t(code_point_count(v.as_str().text)));
    if (v.is_list()) return Value(int64_t(v.as_list().size()));
    if (v.is_dict()) return Value(int64_t(v.as_dict().items.size()));
    if (v.is_undefined()) return Value(int64_t(0));
    bad(in, line, fmt::format("object of type '{}' has no len()", v.type_name()));
  }
  if (name == "first" || name == "last") {
    List items = as_items(in, v, line);
    if (items.empty()) return Value::undefined(name);
    return name == "first" ? items.front() : items.back();
  }
  if (name == "join") {
    Str sep = a.positional.empty() && !a.keyword("d") ? Str() : to_str(a.get(0, "d"));
    Value attribute = a.get(1, "attribute");
    Str out;
    bool first = true;
    for (const Value& x : as_items(in, v, line)) {
      if (!first) out.append(sep);
      first = false;
      out.append(str_of(attribute.is_undefined() ? x : get_path(in, x, attribute, line)));
    }
    return Value(std::move(out));
  }
  if (name == "default" || name == "d") {
    const bool boolean = a.get(1, "boolean", Value(false)).truthy();
    if (v.is_undefined() || (boolean && !v.truthy())) return a.get(0, "default_value", Value(""));
    return v;
  }
  if (name == "upper" || name == "lower") {
    const Str s = str_of(v);
    return Value(rebuilt(case_mapped(s.text, name == "upper"), s));
  }
  if (name == "capitalize") {
    const Str s = str_of(v);
    return Value(rebuilt(capitalized(s.text), s));
  }
  if (name == "title") {
    const Str s = str_of(v);
    return Value(rebuilt(titled(s.text), s));
  }
  if (name == "replace") {
    const Str s = str_of(v);
    const Value count = a.get(2, "count");
    return Value(replaced(s, str_of(a.get(0, "old")).text, str_of(a.get(1, "new")),
                          count.is_number() ? count.as_int() : -1));
  }
  if (name == "string") return v.is_string() ? v : Value(str_of(v));
  if (name == "safe") return v;
  if (name == "e" || name == "escape" || name == "forceescape") return html_escape(v);
  if (name == "pprint") return Value(marked_like(repr(v), v));
  if (name == "int") return to_int(v, a.get(0, "default", Value(int64_t(0))));
  if (name == "float") {
    if (v.is_number()) return Value(v.as_real());
    if (v.is_string()) try {
        return Value(std::stod(v.as_str().text));
      } catch (const std::exception&) {
      }
    return a.get(0, "default", Value(0.0));
  }
  if (name == "abs") {
    if (!v.is_number()) bad(in, line, fmt::format("bad operand type for abs(): '{}'", v.type_name()));
    return v.kind() == Value::Kind::real ? Value(std::fabs(v.as_real())) : Value(int64_t(std::llabs(v.as_int())));
  }
  if (name == "round") {
    const int precision = int(a.get(0, "precision", Value(int64_t(0))).as_int());
    const std::string method = a.get(1, "method", Value("common")).as_str().text;
    const double scale = std::pow(10.0, precision), x = v.as_real() * scale;
    const double r = method == "ceil" ? std::ceil(x) : method == "floor" ? std::floor(x) : std::round(x);
    return Value(r / scale);
  }
  if (name == "list") return Value(as_items(in, v, line));
  if (name == "items") {
    if (v.is_undefined()) return Value(List{});
    if (!v.is_dict()) bad(in, line, fmt::format("items: expected a mapping, got {}", v.type_name()));
    List out;
    for (const auto& [k, x] : v.as_dict().items) out.emplace_back(List{Value(Str(k)), x}, true);
    return Value(std::move(out));
  }
  if (name == "reverse") {
    if (v.is_string()) {
      Str out;
      std::vector<std::pair<size_t, size_t>> chars;
      for (size_t pos = 0; pos < v.as_str().text.size();) {
        size_t len;
        decode_code_point(v.as_str().text, pos, len);
        chars.emplace_back(pos, pos + len);
        pos += len;
      }
      for (auto it = chars.rbegin(); it != chars.rend(); ++it) out.append(v.as_str().substr(it->first, it->second));
      return Value(std::move(out));
    }
    List items = as_items(in, v, line);
    std::reverse(items.begin(), items.end());
    return Value(std::move(items));
  }
  if (name == "unique") {
    List out;
    const bool case_sensitive = a.get(0, "case_sensitive", Value(false)).truthy();
    Value attribute = a.get(1, "attribute");
    for (const Value& x : as_items(in, v, line)) {
      Value key = attribute.is_undefined() ? x : get_path(in, x, attribute, line);
      bool seen = false;
      for (const Value& y : out) {
        Value other = attribute.is_undefined() ? y : get_path(in, y, attribute, line);
        seen = seen || (!case_sensitive && key.is_string() && other.is_string()
                            ? sort_key_text(key, false) == sort_key_text(other, false)
                            : equal(key, other));
      }
      if (!seen) out.push_back(x);
    }
    return Value(std::move(out));
  }
  if (name == "sort") {
    List items = as_items(in, v, line);
    const bool reverse = a.get(0, "reverse", Value(false)).truthy();
    const bool case_sensitive = a.get(1, "case_sensitive", Value(false)).truthy();
    Value attribute = a.get(2, "attribute");
    std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
      Value kx = attribute.is_undefined() ? x : get_path(in, x, attribute, line);
      Value ky = attribute.is_undefined() ? y : get_path(in, y, attribute, line);
      return reverse ? sort_less(ky, kx, case_sensitive) : sort_less(kx, ky, case_sensitive);
    });
    return Value(std::move(items));
  }
  if (name == "dictsort") {
    if (!v.is_dict()) bad(in, line, "dictsort expects a mapping");
    const bool case_sensitive = a.get(0, "case_sensitive", Value(false)).truthy();
    const bool by_value = a.get(1, "by", Value("key")).as_str().text == "value";
    const bool reverse = a.get(2, "reverse", Value(false)).truthy();
    List items;
    for (const auto& [k, x] : v.as_dict().items) items.emplace_back(List{Value(Str(k)), x}, true);
    std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
      const Value& kx = x.as_list()[by_value ? 1 : 0];
      const Value& ky = y.as_list()[by_value ? 1 : 0];
      return reverse ? sort_less(ky, kx, case_sensitive) : sort_less(kx, ky, case_sensitive);
    });
    return Value(std::move(items));
  }
  if (name == "sum") {
    Value total = a.get(1, "start", Value(int64_t(0)));
    Value attribute = a.get(0, "attribute");
    for (const Value& x : as_items(in, v, line)) {
      Value y = attribute.is_undefined() ? x : get_path(in, x, attribute, line);
      if (!y.is_number() || !total.is_number()) bad(in, line, "sum: expects numbers");
      total = total.kind() == Value::Kind::real || y.kind() == Value::Kind::real ? Value(total.as_real() + y.as_real())
                                                                                 : Value(total.as_int() + y.as_int());
    }
    return total;
  }
  if (name == "min" || name == "max") {
    List items = as_items(in, v, line);
    if (items.empty()) return Value::undefined(name);
    const bool case_sensitive = a.get(0, "case_sensitive", Value(false)).truthy();
    Value best = items[0];
    for (const Value& x : items)
      if (name == "min" ? sort_less(x, best, case_sensitive) : sort_less(best, x, case_sensitive)) best = x;
    return best;
  }
  if (name == "map") {
    List out;
    if (const Value* attribute = a.keyword("attribute")) {
      const Value* fallback = a.keyword("default");
      for (const Value& x : as_items(in, v, line)) {
        Value y = get_path(in, x, *attribute, line);
        out.push_back(y.is_undefined() && fallback ? *fallback : y);
      }
      return Value(std::move(out));
    }
    if (a.positional.empty()) bad(in, line, "map needs a filter name or attribute=");
    const std::string filter = to_str(a.positional[0]).text;
    CallArgs fargs = rest_of(a, 1);
    for (const Value& x : as_items(in, v, line)) out.push_back(in.apply_filter(filter, x, fargs, line));
    return Value(std::move(out));
  }
  if (name == "select") return select_like(in, v, a, line, false, true);
  if (name == "reject") return select_like(in, v, a, line, false, false);
  if (name == "selectattr") return select_like(in, v, a, line, true, true);
  if (name == "rejectattr") return select_like(in, v, a, line, true, false);
  if (name == "attr") return in.attribute(v, to_str(a.get(0, "name")).text, line);
  if (name == "indent") {
    const Value width = a.get(0, "width", Value(int64_t(4)));
    const bool first = a.get(1, "first", Value(false)).truthy(), blank = a.get(2, "blank", Value(false)).truthy();
    const Str pad = width.is_string() ? width.as_str() : Str(std::string(size_t(width.as_int()), ' '));
    // Jinja's: lines of s + "\n" (so a trailing newline keeps an empty last line); every line
    // but the first indented unless empty (or always with blank); the first with first=True.
    const Str s = str_of(v);
    std::vector<Str> lines;
    size_t begin = 0;
    for (size_t at = s.text.find('\n'); at != std::string::npos; at = s.text.find('\n', begin)) {
      lines.push_back(s.substr(begin, at));
      begin = at + 1;
    }
    lines.push_back(s.substr(begin, s.text.size()));
    Str out;
    if (first) out.append(pad);
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i) {
        out.append(Str("\n"));
        if (blank || !lines[i].text.empty()) out.append(pad);
      }
      out.append(lines[i]);
    }
    return Value(std::move(out));
  }
  if (name == "wordcount") return Value(int64_t(split(str_of(v), Value(), -1, false).size()));
  if (name == "batch" || name == "slice") {
    const int64_t n = a.get(0, name == "batch" ? "linecount" : "slices").as_int();
    if (n <= 0) bad(in, line, fmt::format("{}: needs a positive count", name));
    List items = as_items(in, v, line), out;
    if (name == "batch") {
      for (size_t i = 0; i < items.size(); i += size_t(n))
        out.emplace_back(List(items.begin() + std::ptrdiff_t(i), items.begin() + std::ptrdiff_t(std::min(items.size(), i + size_t(n)))));
      return Value(std::move(out));
    }
    const size_t per = items.size() / size_t(n), extra = items.size() % size_t(n);
    size_t offset = 0;
    for (size_t k = 0; k < size_t(n); ++k) {
      const size_t take = per + (k < extra ? 1 : 0);
      out.emplace_back(List(items.begin() + std::ptrdiff_t(offset), items.begin() + std::ptrdiff_t(offset + take)));
      offset += take;
    }
    return Value(std::move(out));
  }
  bad(in, line, fmt::format("unknown filter '{}'", name));
}

bool builtin_test(Interpreter& in, const std::string& name, const Value& v, CallArgs& a, int line) {
  using K = Value::Kind;
  const Value other = a.get(0, "other");
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "boolean") return v.kind() == K::boolean;
  if (name == "true") return v.kind() == K::boolean && v.as_bool();
  if (name == "false") return v.kind() == K::boolean && !v.as_bool();
  if (name == "integer") return v.kind() == K::integer;
  if (name == "float") return v.kind() == K::real;
  if (name == "number") return v.is_number();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.is_dict();
  if (name == "iterable") return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined();
  if (name == "sequence") return v.is_string() || v.is_list() || v.is_dict();
  if (name == "callable") return v.kind() == K::callable;
  if (name == "sameas") return v.kind() == other.kind() && (v.is_none() || v.kind() == K::boolean ? equal(v, other) : false);
  if (name == "eq" || name == "equalto" || name == "==") return equal(v, other);
  if (name == "ne" || name == "!=") return !equal(v, other);
  try {
    if (name == "lt" || name == "lessthan" || name == "<") return less(v, other);
    if (name == "le" || name == "<=") return !less(other, v);
    if (name == "gt" || name == "greaterthan" || name == ">") return less(other, v);
    if (name == "ge" || name == ">=") return !less(v, other);
  } catch (const Error& e) {
    bad(in, line, e.what());
  }
  if (name == "in") {
    const Value seq = a.get(0, "seq");
    if (seq.is_string()) return v.is_string() && seq.as_str().text.find(v.as_str().text) != std::string::npos;
    if (seq.is_dict()) return v.is_string() && seq.as_dict().find(v.as_str().text);
    for (const Value& x : as_items(in, seq, line))
      if (equal(x, v)) return true;
    return false;
  }
  if (name == "odd" || name == "even" || name == "divisibleby") {
    if (!v.is_number()) bad(in, line, fmt::format("test '{}' expects a number", name));
    if (name == "divisibleby") {
      const int64_t d = a.get(0, "num").as_int();
      if (d == 0) bad(in, line, "division by zero");
      return v.as_int() % d == 0;
    }
    return (v.as_int() % 2 != 0) == (name == "odd");
  }
  if (name == "lower" || name == "upper") {
    const std::string& t = to_str(v).text;
    return case_mapped(t, name == "upper") == t;
  }
  if (name == "escaped") return false;
  if (name == "filter" || name == "test") return v.is_string();  // every name asked about is known or refused
  bad(in, line, fmt::format("unknown test '{}'", name));
}

void add_builtin_globals(Dict& g) {
  g.set("raise_exception", Value::function("raise_exception", [](Interpreter& in, CallArgs& a) -> Value {
    fail("{}: the template refused the conversation: {}", in.origin(), to_str(a.get(0, "message")).text);
  }));
  g.set("strftime_now", Value::function("strftime_now", [](Interpreter&, CallArgs& a) {
    const std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    char buf[256];
    const size_t n = std::strftime(buf, sizeof buf, to_str(a.get(0, "format")).text.c_str(), &local);
    return Value(std::string(buf, n));
  }));
  auto make_dict = [](Interpreter& in, CallArgs& a, bool ns) {
    Dict d;
    for (const Value& p : a.positional) {
      if (!p.is_dict()) in.error(0, "namespace()/dict() take a mapping or keyword arguments");
      for (const auto& [k, v] : p.as_dict().items) d.set(k, v);
    }
    for (const auto& [k, v] : a.keywords) {
      if (ns && !k.empty() && k[0] == '_') in.error(0, "a namespace cannot store underscore-prefixed attributes");
      d.set(k, v);
    }
    return ns ? Value::namespace_of(std::move(d)) : Value(std::move(d));
  };
  g.set("namespace", Value::function("namespace", [make_dict](Interpreter& in, CallArgs& a) { return make_dict(in, a, true); }));
  g.set("dict", Value::function("dict", [make_dict](Interpreter& in, CallArgs& a) { return make_dict(in, a, false); }));
  g.set("range", Value::function("range", [](Interpreter& in, CallArgs& a) {
    int64_t start = 0, stop, step = 1;
    if (a.positional.size() == 1) {
      stop = a.positional[0].as_int();
    } else if (a.positional.size() >= 2) {
      start = a.positional[0].as_int();
      stop = a.positional[1].as_int();
      if (a.positional.size() > 2) step = a.positional[2].as_int();
    } else {
      in.error(0, "range expects 1 to 3 integers");
    }
    if (step == 0) in.error(0, "range() arg 3 must not be zero");
    List out;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      if (out.size() >= 1'000'000) in.error(0, "range() longer than 1000000 items");
      out.emplace_back(i);
    }
    return Value(std::move(out));
  }));
}

}  // namespace keel::data::jinja
