// What the files of Jinja's built-ins share: lookup of a built-in by name in a table, and
// Python's text operations on Str that filters, tests and str methods alike use
// (builtin_text.cpp). The built-ins, one kind to a file:
//   builtin_filters.cpp  the filters (`x|length`)
//   builtin_tests.cpp    the tests (`x is defined`)
//   builtin_methods.cpp  the methods of str, dict and list (`s.strip()`)
//   builtin_globals.cpp  raise_exception, strftime_now, namespace, dict and range
//   builtin_format.cpp   Python's `%` formatting and Markup's escape (operators use them too)
// Only what is side-effect free: the sandbox that transformers uses is immutable (no
// list.append, no dict.update), so these are all there is.
#pragma once
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "keel/data/jinja/interpreter.h"
#include "keel/data/jinja/value.h"

namespace keel::data::jinja {

// A built-in's name and its code, in a table searched in order.
template <class Fn>
struct Named {
  std::string_view name;
  Fn fn;
};

// The code of built-in `name`, or null. Compared by same_name (the length first) in the table's
// order, as the chain of ifs each table replaced was: the names templates use most come first.
template <class Fn, size_t N>
Fn find_builtin(const Named<Fn> (&table)[N], std::string_view name) {
  for (const Named<Fn>& entry : table)
    if (same_name(entry.name, name)) return entry.fn;
  return nullptr;
}

[[noreturn]] inline void bad(Interpreter& in, int line, const std::string& what) { in.error(line, what); }

// builtin_text.cpp

// A result built from `from` by a transformation that does not keep byte positions: marked whole
// when any of `from` was.
Str rebuilt(std::string text, const Str& from);
std::string case_mapped(const std::string& s, int how);  // 0 lower, 1 upper
// Python's str.capitalize: the first character in title case, the rest lower.
std::string capitalized(const std::string& s);
// Python's str.title: a cased character after a cased one lowercased, any other titlecased.
std::string python_title(const std::string& s);
// Python's str.islower / isupper: some cased character, and none of the other case.
bool python_is_case(const std::string& s, bool lower);
// Jinja's title filter: each word (after whitespace, '-' or an opening bracket) upper first,
// the rest lower.
std::string titled(const std::string& s);
// str.strip(chars) bounds in bytes: which code points go (whitespace when chars is None).
std::pair<size_t, size_t> strip_bounds(const std::string& s, const Value& chars, bool left, bool right);
// str.replace: `count` occurrences of `old` (all when negative) replaced by `with`.
Str replaced(const Str& s, const std::string& old, const Str& with, int64_t count);
// A run of digits as an index; one too large for any list indexes nothing.
size_t parse_index(const std::string& digits);
// s cut at Python's line boundaries (with them when keepends), the text after the last boundary
// included even when empty: str.splitlines drops that one when empty, Jinja's indent keeps it.
std::vector<Str> line_pieces(const Str& s, bool keepends);

}  // namespace keel::data::jinja
