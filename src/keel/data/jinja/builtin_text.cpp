// Python's text operations on Str (case mapping, strip, replace, line boundaries) that the
// filters, tests and str methods share (builtins.h).
#include <unicode/locid.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <charconv>
#include <climits>

#include "keel/data/jinja/builtins.h"

namespace keel::data::jinja {
namespace {

// One character in title case (full mapping: "ﬁ" -> "Fi", "ǆ" -> "ǅ"), as Python's str.title
// and str.capitalize write a word's first character.
std::string title_case(const std::string& ch) {
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(ch);
  u.toTitle(nullptr, icu::Locale::getRoot(), U_TITLECASE_NO_LOWERCASE | U_TITLECASE_NO_BREAK_ADJUSTMENT);
  std::string out;
  u.toUTF8String(out);
  return out;
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

}  // namespace

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

std::string capitalized(const std::string& s) {
  if (s.empty()) return s;
  size_t len;
  decode_code_point(s, 0, len);
  return title_case(s.substr(0, len)) + case_mapped(s.substr(len), 0);
}

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

bool python_is_case(const std::string& s, bool lower) {
  return case_mapped(s, lower ? 0 : 1) == s && case_mapped(s, lower ? 1 : 0) != s;
}

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

size_t parse_index(const std::string& digits) {
  size_t v = 0;
  const auto r = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  return r.ec == std::errc() ? std::min<size_t>(v, size_t(INT64_MAX)) : size_t(INT64_MAX);
}

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

}  // namespace keel::data::jinja
