// Jinja's built-in filters and tests, the Python str/list/dict methods a sandboxed template may
// call, and the globals transformers adds. Only what is side-effect free: the sandbox that
// transformers uses is immutable (no list.append, no dict.update), so these are all there is.
#include <unicode/uchar.h>
#include <unicode/locid.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>
#include <ctime>
#include <cstring>
#include <set>

#include <fmt/printf.h>

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

std::string case_mapped(const std::string& s, int how) {  // 0 lower, 1 upper
  bool ascii = true;
  for (char c : s) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
  if (ascii) {
    std::string out = s;
    for (char& c : out)
      c = char(how ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)));
    return out;
  }
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(s);
  if (how)
    u.toUpper(icu::Locale::getRoot());
  else
    u.toLower(icu::Locale::getRoot());
  std::string out;
  u.toUTF8String(out);
  return out;
}

// One character in title case (full mapping: "ﬁ" -> "Fi", "ǆ" -> "ǅ"), as Python's str.title
// and str.capitalize write a word's first character.
std::string title_case(const std::string& ch) {
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(ch);
  u.toTitle(nullptr, icu::Locale::getRoot(), U_TITLECASE_NO_LOWERCASE | U_TITLECASE_NO_BREAK_ADJUSTMENT);
  std::string out;
  u.toUTF8String(out);
  return out;
}

// Python's str.capitalize: the first character in title case, the rest lower.
std::string capitalized(const std::string& s) {
  if (s.empty()) return s;
  size_t len;
  decode_code_point(s, 0, len);
  return title_case(s.substr(0, len)) + case_mapped(s.substr(len), 0);
}

// Python's str.title: a cased character after a cased one lowercased, any other titlecased.
std::string python_title(const std::string& s) {
  std::string out;
  bool previous_cased = false;
  for (size_t pos = 0; pos < s.size();) {
    size_t len;
    const uint32_t cp = decode_code_point(s, pos, len);
    const std::string ch = s.substr(pos, len);
    out += previous_cased ? case_mapped(ch, 0) : title_case(ch);
    previous_cased = u_hasBinaryProperty(UChar32(cp), UCHAR_CASED);
    pos += len;
  }
  return out;
}

// Python's str.islower / isupper: some cased character, and none of the other case.
bool python_is_case(const std::string& s, bool lower) {
  return case_mapped(s, lower ? 0 : 1) == s && case_mapped(s, lower ? 1 : 0) != s;
}

// Jinja's title filter: each word (after whitespace, '-' or an opening bracket) upper first,
// the rest lower.
std::string titled(const std::string& s) {
  std::string out, word;
  auto flush = [&] {
    if (!word.empty()) {
      size_t len;
      decode_code_point(word, 0, len);
      out += case_mapped(word.substr(0, len), 1) + case_mapped(word.substr(len), 0);
    }
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
  const bool whitespace = chars.is_undefined() || chars.is_none();
  const std::string_view set = whitespace ? std::string_view() : std::string_view(chars.as_str().text);
  // A code point goes when its UTF-8 bytes are one of the set's code points (no decoded copy of the
  // set: strip('\n') runs per message).
  auto in_set = [&](uint32_t cp) {
    for (size_t pos = 0; pos < set.size();) {
      size_t len;
      if (decode_code_point(set, pos, len) == cp) return true;
      pos += len;
    }
    return false;
  };
  auto goes = [&](uint32_t cp) { return whitespace ? is_python_space(cp) : in_set(cp); };
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

// A run of digits as an index; one too large for any list indexes nothing.
size_t parse_index(const std::string& digits) {
  size_t v = 0;
  const auto r = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  return r.ec == std::errc() ? std::min<size_t>(v, size_t(INT64_MAX)) : size_t(INT64_MAX);
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

// Python's line boundaries: \n, \r, \r\n, \v, \f, \x1c-\x1e, \x85, U+2028, U+2029.
size_t line_break_length(const std::string& s, size_t pos) {
  const auto c = static_cast<unsigned char>(s[pos]);
  if (c == '\r') return pos + 1 < s.size() && s[pos + 1] == '\n' ? 2 : 1;
  if (c == '\n' || c == '\v' || c == '\f' || (c >= 0x1C && c <= 0x1E)) return 1;
  if (s.compare(pos, 2, "\xC2\x85") == 0) return 2;
  if (s.compare(pos, 3, "\xE2\x80\xA8") == 0 || s.compare(pos, 3, "\xE2\x80\xA9") == 0) return 3;
  return 0;
}

// s cut at Python's line boundaries (with them when keepends), the text after the last boundary
// included even when empty: str.splitlines drops that one when empty, Jinja's indent keeps it.
std::vector<Str> line_pieces(const Str& s, bool keepends) {
  std::vector<Str> out;
  size_t begin = 0;
  for (size_t i = 0; i < s.text.size();) {
    const size_t n = line_break_length(s.text, i);
    if (n == 0) {
      ++i;
      continue;
    }
    out.push_back(s.substr(begin, keepends ? i + n : i));
    i += n;
    begin = i;
  }
  out.push_back(s.substr(begin, s.text.size()));
  return out;
}

// Finds str method `name` and hands its body, a callable (Interpreter&, const Str& self,
// CallArgs&), to `method`: to bind it to a string as a value (`s.strip`), or to call it at once
// (`s.strip()`, which builds no callable). An unnamed undefined when str has no such method.
template <class Method>
Value with_string_method(const std::string& name, Method&& method) {
  using A = CallArgs;
  if (same_name(name, "strip") || same_name(name, "lstrip") || same_name(name, "rstrip"))
    return method([name](Interpreter&, const Value& self, A& a) {
      const Str& s = self.as_str();
      const auto [b, e] = strip_bounds(s.text, a.get(0, "chars"), name != "rstrip", name != "lstrip");
      // Nothing goes: the string itself, as CPython returns it (no copy of a message's text for
      // content.lstrip('\n')). Not for Markup, which keel's strip turns into a plain str.
      if (b == 0 && e == s.text.size() && !self.is_markup()) return self;
      return Value(s.substr(b, e));
    });
  if (same_name(name, "split") || same_name(name, "rsplit"))
    return method([name](Interpreter& in, const Value& self, A& a) {
      const Str& s = self.as_str();
      Value sep = a.get(0, "sep"), maxsplit = a.get(1, "maxsplit", Value(int64_t(-1)));
      if (!sep.is_undefined() && !sep.is_none()) need_str(in, sep, "split", 0);
      return Value(split(s, sep, maxsplit.as_int(), same_name(name, "rsplit")));
    });
  if (same_name(name, "splitlines"))
    return method([](Interpreter&, const Value& self, A& a) {
      const Str& s = self.as_str();
      std::vector<Str> lines = line_pieces(s, a.get(0, "keepends", Value(false)).truthy());
      if (lines.back().text.empty()) lines.pop_back();
      return Value(List(lines.begin(), lines.end()));
    });
  if (same_name(name, "startswith") || same_name(name, "endswith"))
    return method([name](Interpreter& in, const Value& self, A& a) {
      const Str& s = self.as_str();
      // Without start/end the whole string: no copy, no count of its characters.
      const auto [b, e] = a.positional.size() > 1 || !a.keywords.empty() ? python_range(in, s.text, a, 1)
                                                                         : std::pair<size_t, size_t>{0, s.text.size()};
      return Value(
          starts_or_ends(std::string_view(s.text).substr(b, e - b), a.get(0, "prefix"), same_name(name, "startswith")));
    });
  if (same_name(name, "replace"))
    return method([](Interpreter& in, const Value& self, A& a) {
      const Str& s = self.as_str();
      const Str& old = need_str(in, a.get(0, "old"), "replace", 0);
      const Value with = a.get(1, "new");
      return Value(
          replaced(s, old.text, need_str(in, with, "replace", 0), a.get(2, "count", Value(int64_t(-1))).as_int()));
    });
  if (same_name(name, "upper") || same_name(name, "lower"))
    return method([name](Interpreter&, const Value& self, A&) {
      const Str& s = self.as_str();
      return Value(rebuilt(case_mapped(s.text, same_name(name, "upper")), s));
    });
  if (same_name(name, "capitalize"))
    return method([](Interpreter&, const Value& self, A&) {
      const Str& s = self.as_str();
      return Value(rebuilt(capitalized(s.text), s));
    });
  if (same_name(name, "title"))
    return method([](Interpreter&, const Value& self, A&) {
      const Str& s = self.as_str();
      return Value(rebuilt(python_title(s.text), s));
    });
  if (same_name(name, "swapcase") || same_name(name, "casefold"))
    return method([name](Interpreter&, const Value& self, A&) {
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
    });
  if (same_name(name, "find") || same_name(name, "rfind") || same_name(name, "index") || same_name(name, "rindex") ||
      same_name(name, "count"))
    return method([name](Interpreter& in, const Value& self, A& a) -> Value {
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
    });
  if (same_name(name, "join"))
    return method([](Interpreter& in, const Value& self, A& a) {
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
    });
  if (same_name(name, "center") || same_name(name, "ljust") || same_name(name, "rjust") || same_name(name, "zfill"))
    return method([name](Interpreter& in, const Value& self, A& a) {
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
    });
  if (same_name(name, "partition") || same_name(name, "rpartition"))
    return method([name](Interpreter& in, const Value& self, A& a) {
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
    });
  if (same_name(name, "format"))
    return method([](Interpreter& in, const Value& self, A& a) {
      const Str& s = self.as_str();
      // str.format with {}, {0} and {name} fields (no format specs: chat templates use none).
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
    });
  if (same_name(name, "removeprefix") || same_name(name, "removesuffix"))
    return method([name](Interpreter& in, const Value& self, A& a) {
      const Str& s = self.as_str();
      const std::string& p = need_str(in, a.get(0, "prefix"), name.c_str(), 0).text;
      if (same_name(name, "removeprefix") && s.text.compare(0, p.size(), p) == 0)
        return Value(s.substr(p.size(), s.text.size()));
      if (same_name(name, "removesuffix") && !p.empty() && p.size() <= s.text.size() &&
          s.text.compare(s.text.size() - p.size(), p.size(), p) == 0)
        return Value(s.substr(0, s.text.size() - p.size()));
      return Value(s);
    });
  if (same_name(name, "isdigit") || same_name(name, "isnumeric") || same_name(name, "isdecimal"))
    return method([](Interpreter&, const Value& self, A&) {
      const Str& s = self.as_str();
      return Value(all_code_points(s.text, [](uint32_t c) { return bool(u_isdigit(UChar32(c))); }));
    });
  if (same_name(name, "isalpha"))
    return method([](Interpreter&, const Value& self, A&) {
      const Str& s = self.as_str();
      return Value(all_code_points(s.text, [](uint32_t c) { return bool(u_isalpha(UChar32(c))); }));
    });
  if (same_name(name, "isalnum"))
    return method([](Interpreter&, const Value& self, A&) {
      const Str& s = self.as_str();
      return Value(all_code_points(s.text, [](uint32_t c) { return bool(u_isalnum(UChar32(c))); }));
    });
  if (same_name(name, "isspace"))
    return method([](Interpreter&, const Value& self, A&) {
      const Str& s = self.as_str();
      return Value(all_code_points(s.text, is_python_space));
    });
  if (same_name(name, "islower") || same_name(name, "isupper"))
    return method([name](Interpreter&, const Value& self, A&) {
      const Str& s = self.as_str();
      return Value(python_is_case(s.text, same_name(name, "islower")));
    });
  return Value();
}

Value string_method(const Value& self, const std::string& name) {
  return with_string_method(name, [&](auto body) {
    return Value::function(name,
                           [self, body, name](Interpreter& in, CallArgs& a) -> Value { return body(in, self, a); });
  });
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
  bool found = false;
  result = with_string_method(name, [&](auto body) {
    found = true;
    return body(in, self, args);
  });
  return found;
}

namespace {

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
    cur = digits ? in.item(cur, Value(int64_t(parse_index(part))), line) : in.item(cur, Value(part), line);
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
  if (!case_sensitive && a.is_string() && b.is_string()) return sort_key_text(a, false) < sort_key_text(b, false);
  return less(a, b);
}

Value select_like(Interpreter& in, const Value& subject, CallArgs& a, int line, bool attr, bool keep) {
  List out;
  if (!subject.truthy()) return Value(std::move(out));  // Jinja: `if value:` first (none selects nothing)
  for (const Value& x : iteration_items(in, subject, line)) {
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

}  // namespace

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

namespace {

Value to_int(const Value& v, const Value& fallback) {
  if (v.is_number()) return v.kind() == Value::Kind::real ? Value(int64_t(v.as_real())) : Value(v.as_int());
  if (v.is_string()) {
    const std::string& t = v.as_str().text;
    const auto [b, e] = strip_bounds(t, Value(), true, true);
    std::string s = t.substr(b, e - b);
    // Python's int() takes one underscore between digits ("1_000").
    for (size_t i = 1; i + 1 < s.size(); ++i)
      if (s[i] == '_' && std::isdigit(static_cast<unsigned char>(s[i - 1])) &&
          std::isdigit(static_cast<unsigned char>(s[i + 1])))
        s.erase(i, 1);
    try {
      size_t used;
      const long long x = std::stoll(s, &used, 10);
      if (used == s.size()) return Value(int64_t(x));
      const double d = std::stod(s, &used);
      if (used == s.size()) return Value(int64_t(d));
    } catch (const std::exception&) {}
  }
  return fallback;
}

}  // namespace

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
      precision = ".";
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

Value builtin_filter(Interpreter& in, const std::string& name, const Value& v, CallArgs& a, int line) {
  auto str_of = [&](const Value& x) { return to_str(x); };
  // First the filter chat templates use most (`messages|length`, once per message in many).
  if (same_name(name, "length") || same_name(name, "count")) {
    if (v.is_string()) return Value(int64_t(code_point_count(v.as_str().text)));
    if (v.is_list()) return Value(int64_t(v.as_list().size()));
    if (v.is_dict()) return Value(int64_t(v.as_dict().items.size()));
    if (v.is_undefined()) return Value(int64_t(0));
    bad(in, line, fmt::format("object of type '{}' has no len()", v.type_name()));
  }
  if (same_name(name, "tojson")) {
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
  if (same_name(name, "trim") || same_name(name, "strip")) {
    const Str s = str_of(v);
    const auto [b, e] = strip_bounds(s.text, a.get(0, "chars"), true, true);
    return Value(s.substr(b, e));
  }
  if (same_name(name, "first") || same_name(name, "last")) {
    List items = iteration_items(in, v, line);
    if (items.empty()) return Value::undefined(name);
    return same_name(name, "first") ? items.front() : items.back();
  }
  if (same_name(name, "join")) {
    Str sep = a.positional.empty() && !a.keyword("d") ? Str() : to_str(a.get(0, "d"));
    Value attribute = a.get(1, "attribute");
    Str out;
    bool first = true;
    for (const Value& x : iteration_items(in, v, line)) {
      if (!first) out.append(sep);
      first = false;
      out.append(str_of(attribute.is_undefined() ? x : get_path(in, x, attribute, line)));
    }
    return Value(std::move(out));
  }
  if (same_name(name, "default") || same_name(name, "d")) {
    const bool boolean = a.get(1, "boolean", Value(false)).truthy();
    if (v.is_undefined() || (boolean && !v.truthy())) return a.get(0, "default_value", Value(""));
    return v;
  }
  if (same_name(name, "upper") || same_name(name, "lower")) {
    const Str s = str_of(v);
    return Value(rebuilt(case_mapped(s.text, same_name(name, "upper")), s));
  }
  if (same_name(name, "capitalize")) {
    const Str s = str_of(v);
    return Value(rebuilt(capitalized(s.text), s));
  }
  if (same_name(name, "title")) {
    const Str s = str_of(v);
    return Value(rebuilt(titled(s.text), s));
  }
  if (same_name(name, "replace")) {
    const Str s = str_of(v);
    const Value count = a.get(2, "count");
    return Value(
        replaced(s, str_of(a.get(0, "old")).text, str_of(a.get(1, "new")), count.is_number() ? count.as_int() : -1));
  }
  if (same_name(name, "string")) return v.is_string() ? v : Value(str_of(v));
  if (same_name(name, "format")) {
    Value args;
    if (!a.keywords.empty()) {
      Dict d;
      for (const auto& [k, x] : a.keywords) d.set(k, x);
      args = Value(std::move(d));
    } else {
      args = Value(List(a.positional.begin(), a.positional.end()), true);
    }
    return Value(python_percent_format(in, str_of(v), args, line));
  }
  if (same_name(name, "safe")) return v.is_markup() ? v : Value::markup(str_of(v));
  if (same_name(name, "e") || same_name(name, "escape")) return html_escape(v);
  if (same_name(name, "forceescape")) return html_escape(Value(str_of(v)));
  if (same_name(name, "pprint")) return Value(marked_like(repr(v), v));
  if (same_name(name, "int")) return to_int(v, a.get(0, "default", Value(int64_t(0))));
  if (same_name(name, "float")) {
    if (v.is_number()) return Value(v.as_real());
    if (v.is_string()) try {
        return Value(std::stod(v.as_str().text));
      } catch (const std::exception&) {}
    return a.get(0, "default", Value(0.0));
  }
  if (same_name(name, "abs")) {
    if (!v.is_number()) bad(in, line, fmt::format("bad operand type for abs(): '{}'", v.type_name()));
    return v.kind() == Value::Kind::real ? Value(std::fabs(v.as_real())) : Value(int64_t(std::llabs(v.as_int())));
  }
  if (same_name(name, "round")) {
    if (!v.is_number()) bad(in, line, fmt::format("round: expects a number, got {}", v.type_name()));
    // Beyond ±400 digits a double has nothing left to round (and printf would be asked for a
    // billion digits).
    const int precision = int(std::clamp<int64_t>(a.get(0, "precision", Value(int64_t(0))).as_int(), -400, 400));
    const std::string method = a.get(1, "method", Value("common")).as_str().text;
    if (same_name(method, "common")) {
      // Python's round(): an int stays an int; a float rounds its exact binary value to the
      // nearest decimal, ties to even, as printf does.
      if (v.kind() != Value::Kind::real && precision >= 0) return v;
      if (precision < 0) {
        const double scale = std::pow(10.0, -precision);
        return Value(std::nearbyint(v.as_real() / scale) * scale);
      }
      return Value(std::stod(fmt::format("{:.{}f}", v.as_real(), precision)));
    }
    if (method != "ceil" && method != "floor") bad(in, line, "round: method must be common, ceil or floor");
    const double scale = std::pow(10.0, precision), x = v.as_real() * scale;
    return Value((same_name(method, "ceil") ? std::ceil(x) : std::floor(x)) / scale);
  }
  if (same_name(name, "list")) return Value(iteration_items(in, v, line));
  if (same_name(name, "items")) {
    if (v.is_undefined()) return Value(List{});
    if (!v.is_dict()) bad(in, line, fmt::format("items: expected a mapping, got {}", v.type_name()));
    List out;
    for (const auto& [k, x] : v.as_dict().items) out.emplace_back(List{key_value(k), x}, true);
    return Value(std::move(out));
  }
  if (same_name(name, "reverse")) {
    List items = iteration_items(in, v, line);  // a string's characters, too
    std::reverse(items.begin(), items.end());
    if (!v.is_string()) return Value(std::move(items));
    Str out;
    for (const Value& c : items) out.append(c.as_str());
    return Value(std::move(out));
  }
  if (same_name(name, "unique")) {
    List out;
    const bool case_sensitive = a.get(0, "case_sensitive", Value(false)).truthy();
    Value attribute = a.get(1, "attribute");
    for (const Value& x : iteration_items(in, v, line)) {
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
  if (same_name(name, "sort")) {
    List items = iteration_items(in, v, line);
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
  if (same_name(name, "dictsort")) {
    if (!v.is_dict()) bad(in, line, "dictsort expects a mapping");
    const bool case_sensitive = a.get(0, "case_sensitive", Value(false)).truthy();
    const bool by_value = a.get(1, "by", Value("key")).as_str().text == "value";
    const bool reverse = a.get(2, "reverse", Value(false)).truthy();
    List items;
    for (const auto& [k, x] : v.as_dict().items) items.emplace_back(List{key_value(k), x}, true);
    std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
      const Value& kx = x.as_list()[by_value ? 1 : 0];
      const Value& ky = y.as_list()[by_value ? 1 : 0];
      return reverse ? sort_less(ky, kx, case_sensitive) : sort_less(kx, ky, case_sensitive);
    });
    return Value(std::move(items));
  }
  if (same_name(name, "sum")) {
    Value total = a.get(1, "start", Value(int64_t(0)));
    Value attribute = a.get(0, "attribute");
    for (const Value& x : iteration_items(in, v, line)) {
      Value y = attribute.is_undefined() ? x : get_path(in, x, attribute, line);
      if (!y.is_number() || !total.is_number()) bad(in, line, "sum: expects numbers");
      total = total.kind() == Value::Kind::real || y.kind() == Value::Kind::real ? Value(total.as_real() + y.as_real())
                                                                                 : Value(total.as_int() + y.as_int());
    }
    return total;
  }
  if (same_name(name, "min") || same_name(name, "max")) {
    List items = iteration_items(in, v, line);
    if (items.empty()) return Value::undefined(name);
    const bool case_sensitive = a.get(0, "case_sensitive", Value(false)).truthy();
    const Value attribute = a.get(1, "attribute");
    auto key = [&](const Value& x) { return attribute.is_undefined() ? x : get_path(in, x, attribute, line); };
    Value best = items[0];
    for (const Value& x : items)
      if (same_name(name, "min") ? sort_less(key(x), key(best), case_sensitive)
                                 : sort_less(key(best), key(x), case_sensitive))
        best = x;
    return best;
  }
  if (same_name(name, "map")) {
    List out;
    if (!v.truthy()) return Value(std::move(out));  // Jinja maps nothing over a falsy value (none)
    if (const Value* attribute = a.keyword("attribute")) {
      const Value* fallback = a.keyword("default");
      for (const Value& x : iteration_items(in, v, line)) {
        Value y = get_path(in, x, *attribute, line);
        out.push_back(y.is_undefined() && fallback ? *fallback : y);
      }
      return Value(std::move(out));
    }
    if (a.positional.empty()) bad(in, line, "map needs a filter name or attribute=");
    const std::string filter = to_str(a.positional[0]).text;
    CallArgs fargs = rest_of(a, 1);
    for (const Value& x : iteration_items(in, v, line)) out.push_back(in.apply_filter(filter, x, fargs, line));
    return Value(std::move(out));
  }
  if (same_name(name, "select")) return select_like(in, v, a, line, false, true);
  if (same_name(name, "reject")) return select_like(in, v, a, line, false, false);
  if (same_name(name, "selectattr")) return select_like(in, v, a, line, true, true);
  if (same_name(name, "rejectattr")) return select_like(in, v, a, line, true, false);
  if (same_name(name, "attr")) {  // Python's getattr only: a dict's keys are not attributes
    const std::string attribute = to_str(a.get(0, "name")).text;
    if (v.kind() == Value::Kind::ns) return in.attribute(v, attribute, line);
    const Value method = builtin_method(v, attribute);
    return method.is_undefined() ? Value::undefined(attribute) : method;
  }
  if (same_name(name, "indent")) {
    const Value width = a.get(0, "width", Value(int64_t(4)));
    if (!width.is_string()) ValueSizeLimit::check(uint64_t(std::max<int64_t>(width.as_int(), 0)));
    const bool first = a.get(1, "first", Value(false)).truthy(), blank = a.get(2, "blank", Value(false)).truthy();
    const Str pad =
        width.is_string() ? width.as_str() : Str(std::string(size_t(std::max<int64_t>(width.as_int(), 0)), ' '));
    // Jinja's: lines of s + "\n" (so a trailing newline keeps an empty last line); every line
    // but the first indented unless empty (or always with blank); the first with first=True.
    const Str s = str_of(v);
    const std::vector<Str> lines = line_pieces(s, false);  // Python's splitlines of s + "\n"
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
  if (same_name(name, "center")) {
    CallArgs args;
    args.positional.push_back(a.get(0, "width", Value(int64_t(80))));
    Value method = builtin_method(Value(str_of(v)), "center");
    return in.call(method, args, line);
  }
  if (same_name(name, "truncate")) {  // Jinja's: cut at a word (unless killwords) when longer than length + leeway
    const Str s = str_of(v);
    const int64_t length = a.get(0, "length", Value(int64_t(255))).as_int();
    const bool killwords = a.get(1, "killwords", Value(false)).truthy();
    const Str end = to_str(a.get(2, "end", Value("...")));
    const int64_t leeway = a.get(3, "leeway", Value(int64_t(5))).as_int();
    const int64_t n = int64_t(code_point_count(s.text)), end_n = int64_t(code_point_count(end.text));
    if (length < end_n) bad(in, line, "truncate: expected length >= the end's length");
    if (n <= length + leeway) return Value(s);
    Str out = s.substr(0, byte_offset(s.text, size_t(length - end_n)));
    if (!killwords) {
      const size_t space = out.text.rfind(' ');
      if (space != std::string::npos) out = out.substr(0, space);
    }
    out.append(end);
    return Value(std::move(out));
  }
  if (same_name(name, "wordcount")) {  // Jinja counts runs of \w (letters, digits, underscore)
    const std::string t = str_of(v).text;
    int64_t words = 0;
    bool in_word = false;
    for (size_t pos = 0; pos < t.size();) {
      size_t len;
      const uint32_t cp = decode_code_point(t, pos, len);
      const bool w = cp == '_' || u_isalnum(UChar32(cp)) || u_hasBinaryProperty(UChar32(cp), UCHAR_ALPHABETIC);
      words += w && !in_word;
      in_word = w;
      pos += len;
    }
    return Value(words);
  }
  if (same_name(name, "batch") || same_name(name, "slice")) {
    const int64_t n = a.get(0, same_name(name, "batch") ? "linecount" : "slices").as_int();
    if (n <= 0) bad(in, line, fmt::format("{}: needs a positive count", name));
    if (same_name(name, "slice")) ValueSizeLimit::check(uint64_t(n) * sizeof(Value));  // n lists are made, even empty
    List items = iteration_items(in, v, line), out;
    const Value fill = a.get(1, "fill_with");
    if (same_name(name, "batch")) {
      for (size_t i = 0; i < items.size(); i += size_t(n)) {
        List group(items.begin() + std::ptrdiff_t(i),
                   items.begin() + std::ptrdiff_t(std::min(items.size(), i + size_t(n))));
        while (!fill.is_undefined() && !fill.is_none() && group.size() < size_t(n)) group.push_back(fill);
        out.emplace_back(std::move(group));
      }
      return Value(std::move(out));
    }
    const size_t per = items.size() / size_t(n), extra = items.size() % size_t(n);
    size_t offset = 0;
    for (size_t k = 0; k < size_t(n); ++k) {
      const size_t take = per + (k < extra ? 1 : 0);
      List group(items.begin() + std::ptrdiff_t(offset), items.begin() + std::ptrdiff_t(offset + take));
      if (!fill.is_undefined() && !fill.is_none() && k >= extra && extra > 0) group.push_back(fill);
      out.emplace_back(std::move(group));
      offset += take;
    }
    return Value(std::move(out));
  }
  bad(in, line, fmt::format("unknown filter '{}'", name));
}

bool builtin_test(Interpreter& in, const std::string& name, const Value& v, CallArgs& a, int line) {
  using K = Value::Kind;
  const Value other = a.get(0, "other");
  if (same_name(name, "defined")) return !v.is_undefined();
  if (same_name(name, "undefined")) return v.is_undefined();
  if (same_name(name, "none")) return v.is_none();
  if (same_name(name, "boolean")) return v.kind() == K::boolean;
  if (same_name(name, "true")) return v.kind() == K::boolean && v.as_bool();
  if (same_name(name, "false")) return v.kind() == K::boolean && !v.as_bool();
  if (same_name(name, "integer")) return v.kind() == K::integer;
  if (same_name(name, "float")) return v.kind() == K::real;
  if (same_name(name, "number")) return v.is_number();
  if (same_name(name, "string")) return v.is_string();
  if (same_name(name, "mapping")) return v.is_dict();
  if (same_name(name, "iterable")) return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined();
  if (same_name(name, "sequence")) return v.is_string() || v.is_list() || v.is_dict();
  if (same_name(name, "callable")) return v.kind() == K::callable;
  if (same_name(name, "sameas")) {  // Python's `is`: the same object (small ints and strings are shared, as in CPython)
    if (v.kind() != other.kind()) return false;
    if (v.is_list() || v.is_dict() || v.kind() == K::ns || v.kind() == K::callable)
      return v.identity() == other.identity();
    return equal(v, other);
  }
  if (same_name(name, "eq") || same_name(name, "equalto") || same_name(name, "==")) return equal(v, other);
  if (same_name(name, "ne") || same_name(name, "!=")) return !equal(v, other);
  try {
    if (same_name(name, "lt") || same_name(name, "lessthan") || same_name(name, "<")) return less(v, other);
    if (same_name(name, "le") || same_name(name, "<=")) return !less(other, v);
    if (same_name(name, "gt") || same_name(name, "greaterthan") || same_name(name, ">")) return less(other, v);
    if (same_name(name, "ge") || same_name(name, ">=")) return !less(v, other);
  } catch (const Error& e) {
    bad(in, line, e.what());
  }
  if (same_name(name, "in")) {
    const Value seq = a.get(0, "seq");
    if (seq.is_string()) return v.is_string() && seq.as_str().text.find(v.as_str().text) != std::string::npos;
    if (seq.is_dict()) return !v.is_list() && !v.is_dict() && seq.as_dict().find(dict_key(v));
    for (const Value& x : iteration_items(in, seq, line))
      if (equal(x, v)) return true;
    return false;
  }
  if (same_name(name, "odd") || same_name(name, "even") || same_name(name, "divisibleby")) {
    if (!v.is_number()) bad(in, line, fmt::format("test '{}' expects a number", name));
    if (same_name(name, "divisibleby")) {
      const int64_t d = a.get(0, "num").as_int();
      if (d == 0) bad(in, line, "division by zero");
      return v.as_int() % d == 0;
    }
    return (v.as_int() % 2 != 0) == (same_name(name, "odd"));
  }
  if (same_name(name, "lower") || same_name(name, "upper"))
    return python_is_case(to_str(v).text, same_name(name, "lower"));
  if (same_name(name, "escaped")) return v.is_markup();
  if (same_name(name, "filter")) return v.is_string() && is_builtin_filter(v.as_str().text);
  if (same_name(name, "test")) return v.is_string() && is_builtin_test(v.as_str().text);
  bad(in, line, fmt::format("unknown test '{}'", name));
}

bool is_builtin_filter(std::string_view name) {
  static const std::set<std::string_view, std::less<>> names = {
      "tojson",  "trim",   "strip",     "length", "count",       "first",  "last",       "join",
      "default", "d",      "upper",     "lower",  "capitalize",  "title",  "replace",    "string",
      "format",  "safe",   "e",         "escape", "forceescape", "pprint", "int",        "float",
      "abs",     "round",  "list",      "items",  "reverse",     "unique", "sort",       "dictsort",
      "sum",     "min",    "max",       "map",    "select",      "reject", "selectattr", "rejectattr",
      "attr",    "indent", "wordcount", "batch",  "slice",       "center", "truncate"};
  return names.count(name) != 0;
}

bool is_builtin_test(std::string_view name) {
  static const std::set<std::string_view, std::less<>> names = {
      "defined", "undefined", "none",     "boolean",     "true",   "false", "integer",     "float",  "number", "string",
      "mapping", "iterable",  "sequence", "callable",    "sameas", "eq",    "equalto",     "==",     "ne",     "!=",
      "lt",      "lessthan",  "<",        "le",          "<=",     "gt",    "greaterthan", ">",      "ge",     ">=",
      "in",      "odd",       "even",     "divisibleby", "lower",  "upper", "escaped",     "filter", "test"};
  return names.count(name) != 0;
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
      if (p.is_list()) {  // dict([("a", 1), ...])
        for (const Value& pair : p.as_list()) {
          if (!pair.is_list() || pair.as_list().size() != 2) in.error(0, "dict() takes pairs of a key and a value");
          d.set(dict_key(pair.as_list()[0]), pair.as_list()[1]);
        }
        continue;
      }
      if (!p.is_dict()) in.error(0, "namespace()/dict() take a mapping or keyword arguments");
      for (const auto& [k, v] : p.as_dict().items) d.set(k, v);
    }
    for (const auto& [k, v] : a.keywords) {
      if (ns && !k.empty() && k[0] == '_') in.error(0, "a namespace cannot store underscore-prefixed attributes");
      d.set(k, v);
    }
    return ns ? Value::namespace_of(std::move(d)) : Value(std::move(d));
  };
  g.set("namespace",
        Value::function("namespace", [make_dict](Interpreter& in, CallArgs& a) { return make_dict(in, a, true); }));
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
            if (out.size() >= 100'000) in.error(0, "range too big (the sandbox allows 100000 items)");
            out.emplace_back(i);
          }
          return Value(std::move(out));
        }));
}

}  // namespace keel::data::jinja
