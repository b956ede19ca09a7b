// Jinja's built-in filters (`messages|length`, `x|tojson`), in a table from name to code.
#include <unicode/uchar.h>

#include <algorithm>
#include <cmath>

#include "keel/core/error.h"
#include "keel/data/jinja/builtins.h"

namespace keel::data::jinja {
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

// The code of a filter: `v|name(a)`. Filters that differ by little (upper, lower) share one and
// read `name`.
using Filter = Value (*)(Interpreter& in, const std::string& name, const Value& v, CallArgs& a, int line);

// length and count
Value filter_length(Interpreter& in, const std::string&, const Value& v, CallArgs&, int line) {
  if (v.is_string()) return Value(int64_t(code_point_count(v.as_str().text)));
  if (v.is_list()) return Value(int64_t(v.as_list().size()));
  if (v.is_dict()) return Value(int64_t(v.as_dict().items.size()));
  if (v.is_undefined()) return Value(int64_t(0));
  bad(in, line, fmt::format("object of type '{}' has no len()", v.type_name()));
}

Value filter_tojson(Interpreter& in, const std::string&, const Value& v, CallArgs& a, int line) {
  JsonOptions o;
  o.ensure_ascii = a.get(0, "ensure_ascii", Value(false)).truthy();
  const Value indent = a.get(1, "indent");
  if (indent.is_number()) {
    o.indent = int(indent.as_int());
    o.item_separator = ',';
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

// trim and strip
Value filter_trim(Interpreter&, const std::string&, const Value& v, CallArgs& a, int) {
  const Str s = to_str(v);
  const auto [b, e] = strip_bounds(s.text, a.get(0, "chars"), true, true);
  return Value(s.substr(b, e));
}

Value filter_first(Interpreter& in, const std::string& name, const Value& v, CallArgs&, int line) {
  List items = iteration_items(in, v, line);
  if (items.empty()) return Value::undefined(name);
  return same_name(name, "first") ? items.front() : items.back();
}

Value filter_join(Interpreter& in, const std::string&, const Value& v, CallArgs& a, int line) {
  Str sep = a.positional.empty() && !a.keyword("d") ? Str() : to_str(a.get(0, "d"));
  Value attribute = a.get(1, "attribute");
  Str out;
  bool first = true;
  for (const Value& x : iteration_items(in, v, line)) {
    if (!first) out.append(sep);
    first = false;
    out.append(to_str(attribute.is_undefined() ? x : get_path(in, x, attribute, line)));
  }
  return Value(std::move(out));
}

// default and d
Value filter_default(Interpreter&, const std::string&, const Value& v, CallArgs& a, int) {
  const bool boolean = a.get(1, "boolean", Value(false)).truthy();
  if (v.is_undefined() || (boolean && !v.truthy())) return a.get(0, "default_value", Value(""));
  return v;
}

// upper and lower
Value filter_upper(Interpreter&, const std::string& name, const Value& v, CallArgs&, int) {
  const Str s = to_str(v);
  return Value(rebuilt(case_mapped(s.text, same_name(name, "upper")), s));
}

Value filter_capitalize(Interpreter&, const std::string&, const Value& v, CallArgs&, int) {
  const Str s = to_str(v);
  return Value(rebuilt(capitalized(s.text), s));
}

Value filter_title(Interpreter&, const std::string&, const Value& v, CallArgs&, int) {
  const Str s = to_str(v);
  return Value(rebuilt(titled(s.text), s));
}

Value filter_replace(Interpreter&, const std::string&, const Value& v, CallArgs& a, int) {
  const Str s = to_str(v);
  const Value count = a.get(2, "count");
  return Value(
      replaced(s, to_str(a.get(0, "old")).text, to_str(a.get(1, "new")), count.is_number() ? count.as_int() : -1));
}

Value filter_string(Interpreter&, const std::string&, const Value& v, CallArgs&, int) {
  return v.is_string() ? v : Value(to_str(v));
}

Value filter_format(Interpreter& in, const std::string&, const Value& v, CallArgs& a, int line) {
  Value args;
  if (!a.keywords.empty()) {
    Dict d;
    for (const auto& [k, x] : a.keywords) d.set(k, x);
    args = Value(std::move(d));
  } else {
    args = Value(List(a.positional.begin(), a.positional.end()), true);
  }
  return Value(python_percent_format(in, to_str(v), args, line));
}

Value filter_safe(Interpreter&, const std::string&, const Value& v, CallArgs&, int) {
  return v.is_markup() ? v : Value::markup(to_str(v));
}

// e and escape
Value filter_escape(Interpreter&, const std::string&, const Value& v, CallArgs&, int) { return html_escape(v); }

Value filter_forceescape(Interpreter&, const std::string&, const Value& v, CallArgs&, int) {
  return html_escape(Value(to_str(v)));
}

Value filter_pprint(Interpreter&, const std::string&, const Value& v, CallArgs&, int) {
  return Value(marked_like(repr(v), v));
}

Value filter_int(Interpreter&, const std::string&, const Value& v, CallArgs& a, int) {
  return to_int(v, a.get(0, "default", Value(int64_t(0))));
}

Value filter_float(Interpreter&, const std::string&, const Value& v, CallArgs& a, int) {
  if (v.is_number()) return Value(v.as_real());
  if (v.is_string()) try {
      return Value(std::stod(v.as_str().text));
    } catch (const std::exception&) {}
  return a.get(0, "default", Value(0.0));
}

Value filter_abs(Interpreter& in, const std::string&, const Value& v, CallArgs&, int line) {
  if (!v.is_number()) bad(in, line, fmt::format("bad operand type for abs(): '{}'", v.type_name()));
  return v.kind() == Value::Kind::real ? Value(std::fabs(v.as_real())) : Value(int64_t(std::llabs(v.as_int())));
}

Value filter_round(Interpreter& in, const std::string&, const Value& v, CallArgs& a, int line) {
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

Value filter_list(Interpreter& in, const std::string&, const Value& v, CallArgs&, int line) {
  return Value(iteration_items(in, v, line));
}

Value filter_items(Interpreter& in, const std::string&, const Value& v, CallArgs&, int line) {
  if (v.is_undefined()) return Value(List{});
  if (!v.is_dict()) bad(in, line, fmt::format("items: expected a mapping, got {}", v.type_name()));
  List out;
  for (const auto& [k, x] : v.as_dict().items) out.emplace_back(List{key_value(k), x}, true);
  return Value(std::move(out));
}

Value filter_reverse(Interpreter& in, const std::string&, const Value& v, CallArgs&, int line) {
  List items = iteration_items(in, v, line);  // a string's characters, too
  std::reverse(items.begin(), items.end());
  if (!v.is_string()) return Value(std::move(items));
  Str out;
  for (const Value& c : items) out.append(c.as_str());
  return Value(std::move(out));
}

Value filter_unique(Interpreter& in, const std::string&, const Value& v, CallArgs& a, int line) {
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

Value filter_sort(Interpreter& in, const std::string&, const Value& v, CallArgs& a, int line) {
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

Value filter_dictsort(Interpreter& in, const std::string&, const Value& v, CallArgs& a, int line) {
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

Value filter_sum(Interpreter& in, const std::string&, const Value& v, CallArgs& a, int line) {
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

// min and max
Value filter_min(Interpreter& in, const std::string& name, const Value& v, CallArgs& a, int line) {
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

Value filter_map(Interpreter& in, const std::string&, const Value& v, CallArgs& a, int line) {
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

// select, reject, selectattr and rejectattr
Value filter_select(Interpreter& in, const std::string& name, const Value& v, CallArgs& a, int line) {
  const bool attr = same_name(name, "selectattr") || same_name(name, "rejectattr");
  return select_like(in, v, a, line, attr, same_name(name, "select") || same_name(name, "selectattr"));
}

Value filter_attr(Interpreter& in, const std::string&, const Value& v, CallArgs& a, int line) {
  // Python's getattr only: a dict's keys are not attributes
  const std::string attribute = to_str(a.get(0, "name")).text;
  if (v.kind() == Value::Kind::ns) return in.attribute(v, attribute, line);
  const Value method = builtin_method(v, attribute);
  return method.is_undefined() ? Value::undefined(attribute) : method;
}

Value filter_indent(Interpreter&, const std::string&, const Value& v, CallArgs& a, int) {
  const Value width = a.get(0, "width", Value(int64_t(4)));
  if (!width.is_string()) ValueSizeLimit::check(uint64_t(std::max<int64_t>(width.as_int(), 0)));
  const bool first = a.get(1, "first", Value(false)).truthy(), blank = a.get(2, "blank", Value(false)).truthy();
  const Str pad =
      width.is_string() ? width.as_str() : Str(std::string(size_t(std::max<int64_t>(width.as_int(), 0)), ' '));
  // Jinja's: lines of s + "\n" (so a trailing newline keeps an empty last line); every line
  // but the first indented unless empty (or always with blank); the first with first=True.
  const Str s = to_str(v);
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

Value filter_center(Interpreter& in, const std::string&, const Value& v, CallArgs& a, int line) {
  CallArgs args;
  args.positional.push_back(a.get(0, "width", Value(int64_t(80))));
  Value method = builtin_method(Value(to_str(v)), "center");
  return in.call(method, args, line);
}

// Jinja's: cut at a word (unless killwords) when longer than length + leeway
Value filter_truncate(Interpreter& in, const std::string&, const Value& v, CallArgs& a, int line) {
  const Str s = to_str(v);
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

// Jinja counts runs of \w (letters, digits, underscore)
Value filter_wordcount(Interpreter&, const std::string&, const Value& v, CallArgs&, int) {
  const std::string t = to_str(v).text;
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

// batch and slice
Value filter_batch(Interpreter& in, const std::string& name, const Value& v, CallArgs& a, int line) {
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

// First the filter chat templates use most (`messages|length`, once per message in many).
constexpr Named<Filter> kFilters[] = {
    {"length", filter_length},
    {"count", filter_length},
    {"tojson", filter_tojson},
    {"trim", filter_trim},
    {"strip", filter_trim},
    {"first", filter_first},
    {"last", filter_first},
    {"join", filter_join},
    {"default", filter_default},
    {"d", filter_default},
    {"upper", filter_upper},
    {"lower", filter_upper},
    {"capitalize", filter_capitalize},
    {"title", filter_title},
    {"replace", filter_replace},
    {"string", filter_string},
    {"format", filter_format},
    {"safe", filter_safe},
    {"e", filter_escape},
    {"escape", filter_escape},
    {"forceescape", filter_forceescape},
    {"pprint", filter_pprint},
    {"int", filter_int},
    {"float", filter_float},
    {"abs", filter_abs},
    {"round", filter_round},
    {"list", filter_list},
    {"items", filter_items},
    {"reverse", filter_reverse},
    {"unique", filter_unique},
    {"sort", filter_sort},
    {"dictsort", filter_dictsort},
    {"sum", filter_sum},
    {"min", filter_min},
    {"max", filter_min},
    {"map", filter_map},
    {"select", filter_select},
    {"reject", filter_select},
    {"selectattr", filter_select},
    {"rejectattr", filter_select},
    {"attr", filter_attr},
    {"indent", filter_indent},
    {"center", filter_center},
    {"truncate", filter_truncate},
    {"wordcount", filter_wordcount},
    {"batch", filter_batch},
    {"slice", filter_batch},
};

}  // namespace

Value builtin_filter(Interpreter& in, const std::string& name, const Value& v, CallArgs& a, int line) {
  if (const Filter filter = find_builtin(kFilters, name)) return filter(in, name, v, a, line);
  bad(in, line, fmt::format("unknown filter '{}'", name));
}

bool is_builtin_filter(std::string_view name) { return find_builtin(kFilters, name) != nullptr; }

}  // namespace keel::data::jinja
