// The syntax tree of a chat template: expressions and statements as Jinja's parser builds them.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "keel/data/jinja/value.h"

namespace keel::data::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

// The operators of binary and compare expressions, resolved from their text when parsed: the
// interpreter switches on them at every step instead of comparing strings.
enum class Op : uint8_t { none, add, sub, mul, div, floordiv, mod, pow, concat, eq, ne, lt, gt, le, ge, in, not_in };
Op operator_of(std::string_view text);  // Op::none for anything else
std::string_view operator_text(Op op);  // as Python writes it in messages ("+", "//", "not in")

struct Expr {
  enum class Kind {
    literal,    // value
    name,       // name
    list,       // args
    tuple,      // args
    dict,       // args = key, value, key, value, ...
    attribute,  // args[0] . name
    item,       // args[0] [ args[1] ]
    slice,      // args[0] [ args[1] : args[2] : args[3] ] (null = omitted)
    call,       // args[0] ( args[1..] , kwargs )
    filter,     // name, args[0] = the value, args[1..] and kwargs = the filter's arguments
    test,       // name, args[0] = the value, args[1..] = the test's arguments; negated
    logical_not,
    negate,
    plus,
    binary,   // name and op = the operator (+ - * / // % ** ~), args[0], args[1]
    compare,  // args[0] then per operator in `ops` the next operand
    logical_and,
    logical_or,
    conditional,  // args[0] if args[1] else args[2] (null: undefined)
  };
  Kind kind;
  int line = 0;
  Value value;
  std::string name;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  Op op = Op::none;     // binary
  std::vector<Op> ops;  // compare: ==, !=, <, >, <=, >=, in, not in
  bool negated = false;
  // No call inside: evaluating it cannot run a macro, whose `set ns.x` may replace or move what
  // the interpreter is holding a reference to (Interpreter::ref). Set by parse_template.
  bool pure = true;
  // name: its index in TemplateAst::symbols (set by parse_template), what scopes are keyed by.
  int symbol = -1;
};

struct Node;
using Body = std::vector<Node>;

struct Node {
  enum class Kind {
    text,          // text
    print,         // {{ expr }}
    if_block,      // expr, body, else_body (an elif is an if inside else_body)
    for_loop,      // targets in expr [if condition]: body, else_body
    set,           // targets (or namespace target.attribute) = expr
    set_block,     // {% set target %}body{% endset %}, optionally | filters (expr applies them to `caller`)
    macro,         // name(params = defaults): body
    call_block,    // {% call macro(args) %}body{% endcall %}
    filter_block,  // {% filter f %}body{% endfilter %}
    break_loop,
    continue_loop,
    generation,  // {% generation %}body{% endgeneration %}: transformers' assistant-tracking tag
    with_block,  // {% with targets = params... %}body{% endwith %}: params' names and values, a scope
  };
  Kind kind;
  int line = 0;
  std::string text;
  ExprPtr expr, condition;
  std::vector<std::string> targets;
  std::string attribute;  // set ns.attribute
  std::vector<std::pair<std::string, ExprPtr>> params;
  Body body, else_body;
  // The symbols (TemplateAst::symbols) of `targets`, of `params`' names and of a macro's name
  // (`text`), set by parse_template.
  std::vector<int> target_symbols, param_symbols;
  int symbol = -1;
};

struct TemplateAst {
  Body body;
  // Every literal string of the template (its text and string constants): transformers counts a
  // non-special added token as a control token when the template writes it.
  std::vector<std::string> literals;
  bool has_generation = false;
  // Every name the template reads or binds, once: a variable, loop target, macro or parameter is
  // looked up by its index here, an integer compare, instead of by its text at every use. A name
  // the template never writes cannot be read by it either, so a scope holds only symbols.
  std::vector<std::string> symbols;
  std::unordered_map<std::string, int> symbol_index;
  int symbol(const std::string& name) const {  // its index, -1 if the template has no such name
    const auto it = symbol_index.find(name);
    return it == symbol_index.end() ? -1 : it->second;
  }
  static constexpr int kLoop = 0, kCaller = 1;  // interned first in every template
  // The built-in globals (raise_exception, namespace, ...) and the Template's defaults the
  // template names, by symbol, defaults first: what every rendering's variables do not name.
  std::vector<std::pair<int, Value>> globals;
};

// The built-in filters and tests by name (builtin_filters.cpp, builtin_tests.cpp): an unknown one is a syntax error where
// Jinja's compiler reports it.
bool is_builtin_filter(std::string_view name);
bool is_builtin_test(std::string_view name);

// keel::Error "chat template line N: ..." for a syntax error or a construct keel does not run
// (extends, include, import: a template is rendered alone, without file access).
TemplateAst parse_template(std::string_view source);

}  // namespace keel::data::jinja
