// Jinja's built-in tests (`x is defined`, `n is divisibleby 3`), in tables from name to code:
// the tests of what a value is, the comparisons, and the rest.
#include "keel/core/error.h"
#include "keel/data/jinja/builtins.h"

namespace keel::data::jinja {
namespace {

using K = Value::Kind;

// A test of the value alone.
using KindTest = bool (*)(const Value& v);
constexpr Named<KindTest> kKindTests[] = {
    {"defined", [](const Value& v) { return !v.is_undefined(); }},
    {"undefined", [](const Value& v) { return v.is_undefined(); }},
    {"none", [](const Value& v) { return v.is_none(); }},
    {"boolean", [](const Value& v) { return v.kind() == K::boolean; }},
    {"true", [](const Value& v) { return v.kind() == K::boolean && v.as_bool(); }},
    {"false", [](const Value& v) { return v.kind() == K::boolean && !v.as_bool(); }},
    {"integer", [](const Value& v) { return v.kind() == K::integer; }},
    {"float", [](const Value& v) { return v.kind() == K::real; }},
    {"number", [](const Value& v) { return v.is_number(); }},
    {"string", [](const Value& v) { return v.is_string(); }},
    {"mapping", [](const Value& v) { return v.is_dict(); }},
    {"iterable", [](const Value& v) { return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined(); }},
    {"sequence", [](const Value& v) { return v.is_string() || v.is_list() || v.is_dict(); }},
    {"callable", [](const Value& v) { return v.kind() == K::callable; }},
    {"lower", [](const Value& v) { return python_is_case(to_str(v).text, true); }},
    {"upper", [](const Value& v) { return python_is_case(to_str(v).text, false); }},
    {"escaped", [](const Value& v) { return v.is_markup(); }},
    {"filter", [](const Value& v) { return v.is_string() && is_builtin_filter(v.as_str().text); }},
    {"test", [](const Value& v) { return v.is_string() && is_builtin_test(v.as_str().text); }},
};

// `v is name other`: a comparison with the test's first argument. Ordering values that have none
// (a list and a number) is an error naming the line.
using Comparison = bool (*)(const Value& v, const Value& other);
constexpr Named<Comparison> kComparisons[] = {
    // Python's `is`: the same object (small ints and strings are shared, as in CPython)
    {"sameas",
     [](const Value& v, const Value& other) {
       if (v.kind() != other.kind()) return false;
       if (v.is_list() || v.is_dict() || v.kind() == K::ns || v.kind() == K::callable)
         return v.identity() == other.identity();
       return equal(v, other);
     }},
    {"eq", [](const Value& v, const Value& other) { return equal(v, other); }},
    {"equalto", [](const Value& v, const Value& other) { return equal(v, other); }},
    {"==", [](const Value& v, const Value& other) { return equal(v, other); }},
    {"ne", [](const Value& v, const Value& other) { return !equal(v, other); }},
    {"!=", [](const Value& v, const Value& other) { return !equal(v, other); }},
    {"lt", [](const Value& v, const Value& other) { return less(v, other); }},
    {"lessthan", [](const Value& v, const Value& other) { return less(v, other); }},
    {"<", [](const Value& v, const Value& other) { return less(v, other); }},
    {"le", [](const Value& v, const Value& other) { return !less(other, v); }},
    {"<=", [](const Value& v, const Value& other) { return !less(other, v); }},
    {"gt", [](const Value& v, const Value& other) { return less(other, v); }},
    {"greaterthan", [](const Value& v, const Value& other) { return less(other, v); }},
    {">", [](const Value& v, const Value& other) { return less(other, v); }},
    {"ge", [](const Value& v, const Value& other) { return !less(v, other); }},
    {">=", [](const Value& v, const Value& other) { return !less(v, other); }},
};

// A test that reads its arguments or fails naming the line.
using Test = bool (*)(Interpreter& in, const std::string& name, const Value& v, CallArgs& a, int line);

bool test_in(Interpreter& in, const std::string&, const Value& v, CallArgs& a, int line) {
  const Value seq = a.get(0, "seq");
  if (seq.is_string()) return v.is_string() && seq.as_str().text.find(v.as_str().text) != std::string::npos;
  if (seq.is_dict()) return !v.is_list() && !v.is_dict() && seq.as_dict().find(dict_key(v));
  for (const Value& x : iteration_items(in, seq, line))
    if (equal(x, v)) return true;
  return false;
}

// odd, even and divisibleby
bool test_odd(Interpreter& in, const std::string& name, const Value& v, CallArgs& a, int line) {
  if (!v.is_number()) bad(in, line, fmt::format("test '{}' expects a number", name));
  if (same_name(name, "divisibleby")) {
    const int64_t d = a.get(0, "num").as_int();
    if (d == 0) bad(in, line, "division by zero");
    return v.as_int() % d == 0;
  }
  return (v.as_int() % 2 != 0) == (same_name(name, "odd"));
}

constexpr Named<Test> kTests[] = {
    {"in", test_in},
    {"odd", test_odd},
    {"even", test_odd},
    {"divisibleby", test_odd},
};

}  // namespace

bool builtin_test(Interpreter& in, const std::string& name, const Value& v, CallArgs& a, int line) {
  if (const KindTest test = find_builtin(kKindTests, name)) return test(v);
  if (const Comparison compare = find_builtin(kComparisons, name)) {
    try {
      return compare(v, a.get(0, "other"));
    } catch (const Error& e) {
      bad(in, line, e.what());
    }
  }
  if (const Test test = find_builtin(kTests, name)) return test(in, name, v, a, line);
  bad(in, line, fmt::format("unknown test '{}'", name));
}

bool is_builtin_test(std::string_view name) {
  return find_builtin(kKindTests, name) || find_builtin(kComparisons, name) || find_builtin(kTests, name);
}

}  // namespace keel::data::jinja
