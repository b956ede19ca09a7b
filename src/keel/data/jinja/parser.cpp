// Jinja's grammar, precedence from lowest: conditional (a if b else c), or, and, not,
// comparisons (chained as in Python), + -, ~, * / // %, **, unary - +, then primaries with
// their postfixes (.attr, [item], [a:b:c], (call)) followed by filters (|f) and tests (is t).
#include <charconv>
#include <cstdlib>
#include <set>

#include "keel/core/error.h"
#include "keel/data/jinja/ast.h"
#include "keel/data/jinja/lexer.h"

namespace keel::data::jinja {
namespace {

using T = Token::Type;

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  TemplateAst run() {
    TemplateAst ast;
    std::string end;
    ast.body = body({}, end);
    ast.literals = std::move(literals_);
    ast.has_generation = has_generation_;
    return ast;
  }

 private:
  const Token& peek(size_t ahead = 0) const { return t_[std::min(i_ + ahead, t_.size() - 1)]; }
  const Token& next() { return t_[std::min(i_++, t_.size() - 1)]; }
  bool is_op(std::string_view op, size_t ahead = 0) const {
    return peek(ahead).type == T::op && peek(ahead).text == op;
  }
  bool is_name(std::string_view name, size_t ahead = 0) const {
    return peek(ahead).type == T::name && peek(ahead).text == name;
  }
  [[noreturn]] void error(const std::string& what) const {
    const Token& t = peek();
    fail("chat template line {}: {} (at {})", t.line, what,
         t.type == T::end ? "the end of the template" : "'" + t.text + "'");
  }
  void expect_op(std::string_view op) {
    if (!is_op(op)) error(fmt::format("expected '{}'", op));
    ++i_;
  }
  std::string expect_name() {
    if (peek().type != T::name) error("expected a name");
    return next().text;
  }
  void expect_block_end() {
    if (peek().type != T::block_end) error("expected '%}'");
    ++i_;
  }

  // Statements until a block tag named in `ends`; `end` gets the name found (its tag is consumed
  // up to the name: the caller reads the rest).
  Body body(const std::set<std::string>& ends, std::string& end) {
    Body out;
    while (true) {
      const Token& t = peek();
      if (t.type == T::end) {
        if (!ends.empty())
          fail("chat template line {}: missing {{% {} %}} before the end of the template", t.line, *ends.begin());
        return out;
      }
      if (t.type == T::data) {
        literals_.push_back(t.text);
        out.push_back(Node{.kind = Node::Kind::text, .line = t.line, .text = t.text});
        ++i_;
      } else if (t.type == T::variable_begin) {
        ++i_;
        Node n{.kind = Node::Kind::print, .line = t.line};
        n.expr = expression();
        if (peek().type != T::variable_end) error("expected '}}'");
        ++i_;
        out.push_back(std::move(n));
      } else {  // block_begin
        ++i_;
        const std::string name = expect_name();
        if (ends.count(name)) {
          end = name;
          return out;
        }
        out.push_back(statement(name, t.line));
      }
    }
  }

  // Nesting is bounded (blocks in blocks, brackets in brackets, `not not ...`): the parser and the
  // interpreter recurse once per level, and a template must not be able to exhaust the stack.
  static constexpr int kMaxNesting = 128;
  struct Nested {
    Parser& p;
    explicit Nested(Parser& parser) : p(parser) {
      if (++p.nesting_ > kMaxNesting) p.error(fmt::format("nested more than {} levels deep", kMaxNesting));
    }
    ~Nested() { --p.nesting_; }
  };

  // The statement of block tag `name` (its name read), up to the end of its end tag.
  Node statement(const std::string& name, int line) {
    const Nested nested(*this);
    if (name == "if") return if_statement(line);
    if (name == "for") return for_statement(line);
    if (name == "with") return with_statement(line);
    if (name == "set") return set_statement(line);
    if (name == "macro") return macro_statement(line);
    if (name == "call") return call_statement(line);
    if (name == "filter") return filter_statement(line);
    if (name == "break" || name == "continue") {
      if (loop_depth_ == 0) fail("chat template line {}: '{}' outside a loop", line, name);
      expect_block_end();
      return Node{.kind = name == "break" ? Node::Kind::break_loop : Node::Kind::continue_loop, .line = line};
    }
    if (name == "generation") {
      has_generation_ = true;
      return block_statement(Node::Kind::generation, line, "endgeneration");
    }
    if (name == "extends" || name == "include" || name == "import" || name == "from" || name == "block")
      fail("chat template line {}: '{}' is not supported: a chat template is rendered alone, without other files", line,
           name);
    fail("chat template line {}: unknown statement '{}'", line, name);
  }

  // The rest of a tag with nothing more to read (`{% generation %}`), its body, and end tag `end`.
  Node block_statement(Node::Kind kind, int line, const std::string& end_tag) {
    Node n{.kind = kind, .line = line};
    expect_block_end();
    std::string end;
    n.body = body({end_tag}, end);
    expect_block_end();
    return n;
  }

  Node if_statement(int line) {
    // Jinja compiles an if's test and branches in a "soft" frame: an unknown filter or test
    // there fails only when run (templates guard them with `is filter`).
    const bool was_soft = soft_;
    soft_ = true;
    std::string end;
    Node n{.kind = Node::Kind::if_block, .line = line};
    n.expr = expression();
    expect_block_end();
    n.body = body({"elif", "else", "endif"}, end);
    Node* tail = &n;
    while (end == "elif") {
      Node e{.kind = Node::Kind::if_block, .line = peek().line};
      e.expr = expression();
      expect_block_end();
      e.body = body({"elif", "else", "endif"}, end);
      tail->else_body.push_back(std::move(e));
      tail = &tail->else_body.back();
    }
    if (end == "else") {
      expect_block_end();
      tail->else_body = body({"endif"}, end);
    }
    expect_block_end();
    soft_ = was_soft;
    return n;
  }

  Node for_statement(int line) {
    Node n{.kind = Node::Kind::for_loop, .line = line};
    const bool parenthesized = is_op("(");
    if (parenthesized) ++i_;
    do n.targets.push_back(expect_name());
    while (is_op(",") && (++i_, true) && !is_op(")"));
    if (parenthesized) expect_op(")");
    if (!is_name("in")) error("expected 'in'");
    ++i_;
    n.expr = expression(false);
    if (is_name("if")) {
      ++i_;
      n.condition = expression(false);
    }
    if (is_name("recursive")) error("recursive loops are not supported");
    expect_block_end();
    const bool was_soft = soft_;
    soft_ = false;  // a loop body is a new frame: strict again
    ++loop_depth_;
    std::string end;
    n.body = body({"else", "endfor"}, end);
    --loop_depth_;
    if (end == "else") {
      expect_block_end();
      n.else_body = body({"endfor"}, end);
    }
    soft_ = was_soft;
    expect_block_end();
    return n;
  }

  Node with_statement(int line) {
    std::vector<std::pair<std::string, ExprPtr>> params;
    while (!(peek().type == T::block_end)) {
      std::string target = expect_name();
      expect_op("=");
      params.emplace_back(std::move(target), expression());
      if (peek().type != T::block_end) expect_op(",");
    }
    Node n = block_statement(Node::Kind::with_block, line, "endwith");
    n.params = std::move(params);
    return n;
  }

  // {% set x = ... %}, {% set a, b = ... %}, {% set ns.x = ... %}, or a set block {% set x %}...
  Node set_statement(int line) {
    Node n{.kind = Node::Kind::set, .line = line};
    n.targets.push_back(expect_name());
    if (is_op(".")) {
      ++i_;
      n.attribute = expect_name();
    } else {
      while (is_op(",")) {
        ++i_;
        n.targets.push_back(expect_name());
      }
    }
    if (is_op("=")) {
      ++i_;
      n.expr = expression();
      if (is_op(",")) {  // {% set a, b = 1, 2 %}: a tuple without parentheses
        auto tuple = make(Expr::Kind::tuple, n.expr->line);
        tuple->args.push_back(std::move(n.expr));
        while (is_op(",")) {
          ++i_;
          if (peek().type == T::block_end) break;
          tuple->args.push_back(expression());
        }
        n.expr = std::move(tuple);
      }
      expect_block_end();
      return n;
    }
    if (n.targets.size() != 1 || !n.attribute.empty()) error("expected '='");
    n.kind = Node::Kind::set_block;
    n.expr = filters_on_caller();
    expect_block_end();
    std::string end;
    n.body = body({"endset"}, end);
    expect_block_end();
    return n;
  }

  Node macro_statement(int line) {
    Node n{.kind = Node::Kind::macro, .line = line};
    n.text = expect_name();
    expect_op("(");
    while (!is_op(")")) {
      std::string param = expect_name();
      ExprPtr def;
      if (is_op("=")) {
        ++i_;
        def = expression();
      }
      n.params.emplace_back(std::move(param), std::move(def));
      if (!is_op(")")) expect_op(",");
    }
    ++i_;
    expect_block_end();
    const bool was_soft = soft_;
    const int loops = loop_depth_;
    soft_ = false;
    loop_depth_ = 0;  // `break` in a macro does not leave the caller's loop
    std::string end;
    n.body = body({"endmacro"}, end);
    soft_ = was_soft;
    loop_depth_ = loops;
    if (peek().type == T::name) ++i_;  // {% endmacro name %}
    expect_block_end();
    return n;
  }

  Node call_statement(int line) {
    if (is_op("(")) error("call blocks with caller arguments are not supported");
    ExprPtr call = expression();
    if (call->kind != Expr::Kind::call) error("expected a macro call");
    Node n = block_statement(Node::Kind::call_block, line, "endcall");
    n.expr = std::move(call);
    return n;
  }

  Node filter_statement(int line) {
    ExprPtr filters = filters_on_caller(true);
    Node n = block_statement(Node::Kind::filter_block, line, "endfilter");
    n.expr = std::move(filters);
    return n;
  }

  // `| f(args) | g` applied to a placeholder named "caller" (set blocks and filter blocks).
  ExprPtr filters_on_caller(bool first_without_pipe = false) {
    auto e = std::make_unique<Expr>(Expr{.kind = Expr::Kind::name, .line = peek().line, .name = "caller"});
    if (first_without_pipe) e = filter(std::move(e));
    while (is_op("|")) {
      ++i_;
      e = filter(std::move(e));
    }
    return e;
  }

  ExprPtr make(Expr::Kind kind, int line) { return std::make_unique<Expr>(Expr{.kind = kind, .line = line}); }

  // Unknown filters and tests are reported when the outermost expression ends: only then is it
  // known whether they sat in a conditional expression (Jinja's soft frame: a run-time error).
  ExprPtr expression(bool with_conditional = true) {
    const Nested nested(*this);
    const size_t unknown_before = unknown_.size();
    ++expression_depth_;
    ExprPtr e = conditional(with_conditional);
    --expression_depth_;
    if (e->kind == Expr::Kind::conditional) unknown_.resize(unknown_before);
    if (expression_depth_ == 0 && !unknown_.empty()) {
      const std::string what = unknown_.front();
      unknown_.clear();
      error(what);
    }
    return e;
  }

  ExprPtr conditional(bool with_conditional) {
    ExprPtr e = logical_or();
    if (!with_conditional) return e;
    while (is_name("if")) {
      // Parsed already as the value: a conditional's parts are in Jinja's soft frame, where an
      // unknown filter is a run-time error (checked again below for the value).
      const int line = next().line;
      const bool was_soft = soft_;
      soft_ = true;
      auto c = make(Expr::Kind::conditional, line);
      c->args.push_back(std::move(e));
      c->args.push_back(logical_or());
      if (is_name("else")) {
        ++i_;
        c->args.push_back(expression());
      } else {
        c->args.push_back(nullptr);
      }
      soft_ = was_soft;
      e = std::move(c);
    }
    return e;
  }

  ExprPtr logical_or() {
    ExprPtr e = logical_and();
    while (is_name("or")) {
      auto o = make(Expr::Kind::logical_or, next().line);
      o->args.push_back(std::move(e));
      o->args.push_back(logical_and());
      e = std::move(o);
    }
    return e;
  }

  ExprPtr logical_and() {
    ExprPtr e = logical_not();
    while (is_name("and")) {
      auto o = make(Expr::Kind::logical_and, next().line);
      o->args.push_back(std::move(e));
      o->args.push_back(logical_not());
      e = std::move(o);
    }
    return e;
  }

  ExprPtr logical_not() {
    const Nested nested(*this);
    if (is_name("not")) {
      auto o = make(Expr::Kind::logical_not, next().line);
      o->args.push_back(logical_not());
      return o;
    }
    return compare();
  }

  ExprPtr compare() {
    ExprPtr first = math1();
    ExprPtr c;
    while (true) {
      std::string op;
      if (peek().type == T::op && (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
                                   peek().text == ">" || peek().text == "<=" || peek().text == ">=")) {
        op = next().text;
      } else if (is_name("in")) {
        ++i_;
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        i_ += 2;
        op = "notin";
      } else {
        break;
      }
      if (!c) {
        c = make(Expr::Kind::compare, first->line);
        c->args.push_back(std::move(first));
      }
      c->ops.push_back(operator_of(op));
      c->args.push_back(math1());
    }
    return c ? std::move(c) : std::move(first);
  }

  ExprPtr binary(ExprPtr left, const std::string& op, ExprPtr right) {
    auto b = make(Expr::Kind::binary, left->line);
    b->name = op;
    b->op = operator_of(op);
    b->args.push_back(std::move(left));
    b->args.push_back(std::move(right));
    return b;
  }

  ExprPtr math1() {
    ExprPtr e = concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = next().text;
      e = binary(std::move(e), op, concat());
    }
    return e;
  }

  ExprPtr concat() {
    ExprPtr e = math2();
    while (is_op("~")) {
      ++i_;
      e = binary(std::move(e), "~", math2());
    }
    return e;
  }

  ExprPtr math2() {
    ExprPtr e = power();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = next().text;
      e = binary(std::move(e), op, power());
    }
    return e;
  }

  ExprPtr power() {
    ExprPtr e = unary();
    while (is_op("**")) {
      ++i_;
      e = binary(std::move(e), "**", unary());
    }
    return e;
  }

  ExprPtr unary(bool with_filter = true) {
    const Nested nested(*this);
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      const Token& t = next();
      e = make(t.text == "-" ? Expr::Kind::negate : Expr::Kind::plus, t.line);
      e->args.push_back(unary(false));
    } else {
      e = primary();
    }
    e = postfix(std::move(e));
    if (with_filter) e = filters_and_tests(std::move(e));
    return e;
  }

  ExprPtr primary() {
    const Token& t = peek();
    if (t.type == T::name) {
      ++i_;
      if (t.text == "true" || t.text == "True") return literal(Value(true), t.line);
      if (t.text == "false" || t.text == "False") return literal(Value(false), t.line);
      if (t.text == "none" || t.text == "None") return literal(Value::none(), t.line);
      auto e = make(Expr::Kind::name, t.line);
      e->name = t.text;
      return e;
    }
    if (t.type == T::string) {
      std::string s;
      while (peek().type == T::string) s += next().text;  // adjacent literals join
      literals_.push_back(s);
      return literal(Value(s), t.line);
    }
    if (t.type == T::integer) {
      ++i_;
      int64_t v = 0;
      const auto r = std::from_chars(t.text.data(), t.text.data() + t.text.size(), v);
      if (r.ec != std::errc()) fail("chat template line {}: integer {} is out of range", t.line, t.text);
      return literal(Value(v), t.line);
    }
    if (t.type == T::real) {
      ++i_;
      return literal(Value(std::strtod(t.text.c_str(), nullptr)), t.line);  // 1e999 is inf, as in Python
    }
    if (is_op("(")) {
      ++i_;
      if (is_op(")")) {
        ++i_;
        return make(Expr::Kind::tuple, t.line);
      }
      ExprPtr e = expression();
      if (is_op(",")) {
        auto tuple = make(Expr::Kind::tuple, t.line);
        tuple->args.push_back(std::move(e));
        while (is_op(",")) {
          ++i_;
          if (is_op(")")) break;
          tuple->args.push_back(expression());
        }
        e = std::move(tuple);
      }
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      ++i_;
      auto e = make(Expr::Kind::list, t.line);
      while (!is_op("]")) {
        e->args.push_back(expression());
        if (!is_op("]")) expect_op(",");
      }
      ++i_;
      return e;
    }
    if (is_op("{")) {
      ++i_;
      auto e = make(Expr::Kind::dict, t.line);
      while (!is_op("}")) {
        e->args.push_back(expression());
        expect_op(":");
        e->args.push_back(expression());
        if (!is_op("}")) expect_op(",");
      }
      ++i_;
      return e;
    }
    error("expected an expression");
  }

  ExprPtr literal(Value v, int line) {
    auto e = make(Expr::Kind::literal, line);
    e->value = std::move(v);
    return e;
  }

  ExprPtr postfix(ExprPtr e) {
    while (true) {
      if (is_op(".")) {
        const int line = next().line;
        auto a = make(Expr::Kind::attribute, line);
        if (peek().type == T::integer) {  // x.0 is x[0]
          a->kind = Expr::Kind::item;
          a->args.push_back(std::move(e));
          const std::string digits = next().text;
          int64_t index = 0;
          const auto r = std::from_chars(digits.data(), digits.data() + digits.size(), index);
          if (r.ec != std::errc()) fail("chat template line {}: index {} is out of range", line, digits);
          a->args.push_back(literal(Value(index), line));
        } else {
          a->name = expect_name();
          a->args.push_back(std::move(e));
        }
        e = std::move(a);
      } else if (is_op("[")) {
        e = subscript(std::move(e));
      } else if (is_op("(")) {
        e = call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr subscript(ExprPtr e) {
    const int line = next().line;
    ExprPtr parts[3];
    int colons = 0;
    while (!is_op("]")) {
      if (is_op(":")) {
        ++i_;
        if (++colons > 2) error("too many ':' in a slice");
        continue;
      }
      if (parts[colons]) error("expected ':' or ']'");
      parts[colons] = expression();
    }
    ++i_;
    if (colons == 0) {
      if (!parts[0]) error("empty subscript");
      auto item = make(Expr::Kind::item, line);
      item->args.push_back(std::move(e));
      item->args.push_back(std::move(parts[0]));
      return item;
    }
    auto s = make(Expr::Kind::slice, line);
    s->args.push_back(std::move(e));
    for (auto& p : parts) s->args.push_back(std::move(p));
    return s;
  }

  // Arguments after '(' (consumed here) up to ')': positional into e->args, keywords into kwargs.
  void arguments(Expr& e) {
    expect_op("(");
    while (!is_op(")")) {
      if (peek().type == T::name && is_op("=", 1)) {
        std::string key = next().text;
        ++i_;
        e.kwargs.emplace_back(std::move(key), expression());
      } else {
        if (!e.kwargs.empty()) error("positional argument after a keyword argument");
        e.args.push_back(expression());
      }
      if (!is_op(")")) expect_op(",");
    }
    ++i_;
  }

  ExprPtr call(ExprPtr callee) {
    auto c = make(Expr::Kind::call, callee->line);
    c->args.push_back(std::move(callee));
    arguments(*c);
    return c;
  }

  ExprPtr filter(ExprPtr value) {
    auto f = make(Expr::Kind::filter, value->line);
    f->name = expect_name();
    while (is_op(".")) {  // dotted filter names
      ++i_;
      f->name += "." + expect_name();
    }
    if (!soft_ && !is_builtin_filter(f->name)) unknown_.push_back(fmt::format("no filter named '{}'", f->name));
    f->args.push_back(std::move(value));
    if (is_op("(")) arguments(*f);
    return f;
  }

  ExprPtr filters_and_tests(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        ++i_;
        e = filter(std::move(e));
      } else if (is_name("is")) {
        const int line = next().line;
        auto t = make(Expr::Kind::test, line);
        if (is_name("not")) {
          ++i_;
          t->negated = true;
        }
        t->name = expect_name();
        while (is_op(".")) {
          ++i_;
          t->name += "." + expect_name();
        }
        if (!soft_ && !is_builtin_test(t->name)) unknown_.push_back(fmt::format("no test named '{}'", t->name));
        t->args.push_back(std::move(e));
        if (is_op("(")) {
          arguments(*t);
        } else if ((peek().type == T::name || peek().type == T::string || peek().type == T::integer ||
                    peek().type == T::real || is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and")) {
          if (is_name("is")) error("tests cannot be chained with 'is'");
          t->args.push_back(postfix(primary()));
        }
        e = std::move(t);
      } else if (is_op("(")) {
        e = call(std::move(e));
      } else {
        return e;
      }
    }
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  std::vector<std::string> literals_;
  bool has_generation_ = false;
  bool soft_ = false;                 // inside an if or a conditional expression (Jinja's soft frame)
  std::vector<std::string> unknown_;  // unknown filters/tests of the expression being parsed
  int expression_depth_ = 0;
  int nesting_ = 0;
  int loop_depth_ = 0;  // for loops around the statement being parsed
};

}  // namespace

namespace {

bool mark_purity(Expr& e) {
  bool pure = e.kind != Expr::Kind::call;
  for (auto& a : e.args)
    if (a && !mark_purity(*a)) pure = false;
  for (auto& [name, a] : e.kwargs)
    if (a && !mark_purity(*a)) pure = false;
  e.pure = pure;
  return pure;
}

void mark_purity(Body& body) {
  for (Node& n : body) {
    for (Expr* e : {n.expr.get(), n.condition.get()})
      if (e) mark_purity(*e);
    for (auto& [name, e] : n.params)
      if (e) mark_purity(*e);
    mark_purity(n.body);
    mark_purity(n.else_body);
  }
}

// Gives every name a symbol (TemplateAst::symbols), "loop" and "caller" first.
class SymbolResolver {
 public:
  explicit SymbolResolver(TemplateAst& ast) : ast_(ast) {
    intern("loop");
    intern("caller");
  }
  void resolve(Body& body) {
    for (Node& n : body) {
      for (Expr* e : {n.expr.get(), n.condition.get()})
        if (e) resolve(*e);
      n.target_symbols.clear();
      for (const std::string& t : n.targets) n.target_symbols.push_back(intern(t));
      n.param_symbols.clear();
      for (auto& [name, e] : n.params) {
        n.param_symbols.push_back(intern(name));
        if (e) resolve(*e);
      }
      if (n.kind == Node::Kind::macro) n.symbol = intern(n.text);
      resolve(n.body);
      resolve(n.else_body);
    }
  }

 private:
  void resolve(Expr& e) {
    if (e.kind == Expr::Kind::name) e.symbol = intern(e.name);
    for (auto& a : e.args)
      if (a) resolve(*a);
    for (auto& [name, a] : e.kwargs)
      if (a) resolve(*a);
  }
  int intern(const std::string& name) {
    const auto [it, added] = ast_.symbol_index.emplace(name, int(ast_.symbols.size()));
    if (added) ast_.symbols.push_back(name);
    return it->second;
  }
  TemplateAst& ast_;
};

}  // namespace

Op operator_of(std::string_view text) {
  static constexpr std::pair<std::string_view, Op> kOperators[] = {
      {"+", Op::add},  {"-", Op::sub},    {"*", Op::mul}, {"/", Op::div},       {"//", Op::floordiv}, {"%", Op::mod},
      {"**", Op::pow}, {"~", Op::concat}, {"==", Op::eq}, {"!=", Op::ne},       {"<", Op::lt},        {">", Op::gt},
      {"<=", Op::le},  {">=", Op::ge},    {"in", Op::in}, {"notin", Op::not_in}};
  for (const auto& [t, op] : kOperators)
    if (t == text) return op;
  return Op::none;
}

std::string_view operator_text(Op op) {
  switch (op) {
    case Op::add: return "+";
    case Op::sub: return "-";
    case Op::mul: return "*";
    case Op::div: return "/";
    case Op::floordiv: return "//";
    case Op::mod: return "%";
    case Op::pow: return "**";
    case Op::concat: return "~";
    case Op::eq: return "==";
    case Op::ne: return "!=";
    case Op::lt: return "<";
    case Op::gt: return ">";
    case Op::le: return "<=";
    case Op::ge: return ">=";
    case Op::in: return "in";
    case Op::not_in: return "not in";
    case Op::none: break;
  }
  return "?";
}

TemplateAst parse_template(std::string_view source) {
  TemplateAst ast = Parser(tokenize_template(source)).run();
  mark_purity(ast.body);
  SymbolResolver(ast).resolve(ast.body);
  return ast;
}

}  // namespace keel::data::jinja
