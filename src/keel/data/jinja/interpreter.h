// The tree-walking interpreter behind Template::render, and what the built-in filters, tests and
// methods (builtin_*.cpp, builtins.h) need from it.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "keel/data/jinja/ast.h"
#include "keel/data/jinja/template.h"
#include "keel/data/jinja/value.h"

namespace keel::data::jinja {

// A call's positional arguments, in one contiguous array: calls in templates pass none, one or
// two (s.startswith('x'), namespace(...)'s none), so two are held in place and only a third moves
// them all to the heap.
class Arguments {
 public:
  Arguments() = default;
  Arguments(const Arguments&) = default;
  Arguments& operator=(const Arguments&) = default;
  // A moved-from list is empty (its count would otherwise still cover the moved-out values).
  Arguments(Arguments&& other) noexcept : size_(std::exchange(other.size_, 0)), heap_(std::move(other.heap_)) {
    for (size_t i = 0; i < kInPlace; ++i) in_place_[i] = std::move(other.in_place_[i]);
  }
  Arguments& operator=(Arguments&& other) noexcept {
    for (size_t i = 0; i < kInPlace; ++i) in_place_[i] = std::move(other.in_place_[i]);
    size_ = std::exchange(other.size_, 0);
    heap_ = std::move(other.heap_);
    other.heap_.clear();
    return *this;
  }

  Value* begin() { return heap_.empty() ? in_place_ : heap_.data(); }
  Value* end() { return begin() + size_; }
  const Value* begin() const { return heap_.empty() ? in_place_ : heap_.data(); }
  const Value* end() const { return begin() + size_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  Value& operator[](size_t i) { return begin()[i]; }
  const Value& operator[](size_t i) const { return begin()[i]; }
  void push_back(Value v) {
    if (heap_.empty() && size_ < kInPlace) {
      in_place_[size_++] = std::move(v);
      return;
    }
    if (heap_.empty()) {
      heap_.reserve(2 * kInPlace);
      for (Value& x : in_place_) heap_.push_back(std::move(x));
    }
    heap_.push_back(std::move(v));
    ++size_;
  }

 private:
  static constexpr size_t kInPlace = 2;
  Value in_place_[kInPlace];
  size_t size_ = 0;
  std::vector<Value> heap_;  // every argument once there are more than kInPlace
};

struct CallArgs {
  Arguments positional;
  // Keyword names are the template's own text (its syntax tree outlives the call) or literals.
  std::vector<std::pair<std::string_view, Value>> keywords;
  // argument `index`, else keyword `name`, else `fallback`
  Value get(size_t index, std::string_view name, Value fallback = Value()) const;
  const Value* keyword(std::string_view name) const;
};

class Recorder;

class Interpreter {
 public:
  Interpreter(const TemplateAst& ast, const std::string& origin, const RenderLimits& limits);
  Rendered run(const Dict& variables);
  // Tells `recorder` what the rendering observes of the data (replay.h); null: nothing watched.
  void watch(Recorder* recorder) { recorder_ = recorder; }
  Recorder* recorder() const { return recorder_; }

  Value call(const Value& callee, CallArgs& args, int line);
  Value apply_filter(const std::string& name, const Value& subject, CallArgs& args, int line);
  bool apply_test(const std::string& name, const Value& subject, CallArgs& args, int line);
  // `name_in_template`: `name` is the template's own text (an Expr's), so an undefined result may
  // borrow it rather than copy it.
  Value attribute(const Value& object, const std::string& name, int line, bool name_in_template = false);
  Value item(const Value& object, const Value& key, int line);
  // What attribute() and item() would return when it is a value held inside `object` (a dict's
  // key, a namespace's attribute, a list's element), else null: read where it is, not copied.
  static const Value* attribute_in_place(const Value& object, std::string_view name);
  static const Value* item_in_place(const Value& object, const Value& key);
  // counts one unit of work against the limit
  void step() {
    if (++steps_ > limits_.max_steps) too_many_steps();
  }
  [[noreturn]] void error(int line, const std::string& what) const;
  const std::string& origin() const { return origin_; }
  int line() const { return line_; }  // of the expression evaluated last

 private:
  enum class Flow { normal, break_loop, continue_loop };
  // A scope's names, by symbol (TemplateAst::symbols). Scopes hold few (a loop's target and
  // `loop`, a macro's parameters, the template's variables), so a flat list searched in order
  // beats a tree, and clear() keeps the storage for the next loop iteration: no allocation per
  // name set.
  class Frame {
   public:
    // Room for a loop's or a macro's few names, or the template's variables: no growth as they come.
    explicit Frame(size_t capacity = 4) { items_.reserve(capacity); }
    void reserve(size_t capacity) { items_.reserve(capacity); }
    Value& operator[](int symbol) {  // the name's value, undefined when new
      for (auto& [k, v] : items_)
        if (k == symbol) return v;
      return items_.emplace_back(symbol, Value()).second;
    }
    const Value* find(int symbol) const {
      for (const auto& [k, v] : items_)
        if (k == symbol) return &v;
      return nullptr;
    }
    void clear() { items_.clear(); }

   private:
    std::vector<std::pair<int, Value>> items_;
  };

  // What a for loop reuses from the last loop at its depth (for_loop).
  struct LoopState {
    std::shared_ptr<Frame> frame;
    Value loop;
    std::shared_ptr<int64_t> index;  // the iteration loop.cycle reads
  };

  [[noreturn]] void too_many_steps() const;
  Flow exec(const Body& body);
  Flow exec(const Node& node);
  Flow for_loop(const Node& node);
  void define_macro(const Node& node);
  Value eval(const Expr& e);
  // eval() without the copy where the value already exists (a literal, a variable, a dict's key or
  // a namespace's attribute): a reference to it, else the value computed into `scratch`. Valid
  // until the next call runs: expressions assign no variable, but a macro's `set ns.x` replaces
  // namespace attributes, so a caller that evaluates an impure sibling (Expr::pure) after taking
  // the reference copies it first (keep_across in interpreter.cpp).
  const Value& ref(const Expr& e, Value& scratch) {
    // A literal or a bound name, most of what a template reads, here; the rest out of line.
    if (e.kind == Expr::Kind::literal) {
      step();
      return e.value;
    }
    if (e.kind == Expr::Kind::name)
      if (const Value* v = find(e.symbol)) {
        step();
        return *v;
      }  // else undefined: eval names it
    return ref_compound(e, scratch);
  }
  const Value& ref_compound(const Expr& e, Value& scratch);  // ref() of anything else
  CallArgs arguments(const Expr& e);
  Value binary(const Expr& e);
  Value binary(Op op, Value a, Value b, int line);
  // a + b + c ... and a ~ b ~ c ...: the left-leaning chain of one operator built in one string, or
  // (print) appended to the output as it goes, instead of a new string value at every operator.
  Value concat(const Expr& e);
  void print_concat(const Expr& e);
  struct Chain;
  void chain(const Expr& e, Op op, Chain& c);
  bool compare(const Expr& e);
  const Value* find(int symbol) const {
    for (auto it = frames_.rbegin(); it != frames_.rend(); ++it)
      if (const Value* found = (*it)->find(symbol)) return found;
    return nullptr;
  }
  Value lookup(int symbol) const;  // undefined, naming it, when no scope has it
  void assign(int symbol, Value v);
  void emit(const Str& s);
  void emit(std::string_view template_text);
  // Renders `body` into a string instead of the output (macros, set blocks, filter blocks).
  Str capture(const Body& body);
  // A set block's or filter block's body, rendered and passed through its filters.
  Value filtered_body(const Node& n);

  const TemplateAst& ast_;
  const std::string& origin_;
  RenderLimits limits_;
  uint64_t steps_ = 0;
  int line_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;                          // for loops running (for_loop's pool)
  Frame top_{0};                                // the template's scope (run)
  // [0] &top_, then the locals (loops, macros, with blocks), innermost last; each frame is owned by
  // whoever pushed it, for as long as it is here.
  std::vector<Frame*> frames_;
  Recorder* recorder_ = nullptr;
  Str output_;           // the rendering
  Str* out_ = &output_;  // where output goes now: output_, or the string a capture builds
  std::vector<std::pair<size_t, size_t>> generation_;
};

// `left op right` for ==, !=, <, <=, >, >=, in and not in, as Python compares.
bool compare_values(Interpreter& in, Op op, const Value& left, const Value& right, int line);

// What `for` and the filters iterate (Python's iter()): a list's items, a dict's keys, a string's
// characters; nothing for undefined; keel::Error naming the line for anything else.
List iteration_items(Interpreter& in, const Value& v, int line);

// builtin_filters.cpp, builtin_tests.cpp
Value builtin_filter(Interpreter& in, const std::string& name, const Value& subject, CallArgs& args, int line);
bool builtin_test(Interpreter& in, const std::string& name, const Value& subject, CallArgs& args, int line);

// builtin_methods.cpp
// A method of a str, list or dict ("strip", "items", ...) bound to `object`; an unnamed
// undefined if none (callers name it: most lookups are dict keys, which must not allocate a name).
Value builtin_method(const Value& object, const std::string& name);
// A name dict has a method of (items, keys, values, copy, get): Python's getattr finds it first.
// Inline, by length: every attribute read of a dict (message.role) asks it first.
inline bool is_dict_method(std::string_view n) {
  switch (n.size()) {
    case 3: return same_name(n, "get");
    case 4: return same_name(n, "keys") || same_name(n, "copy");
    case 5: return same_name(n, "items");
    case 6: return same_name(n, "values");
    default: return false;
  }
}
// `self.name(args)` for a str method, called without building a bound callable; false when str
// has no such method.
bool call_string_method(Interpreter& in, const Value& self, const std::string& name, CallArgs& args, Value& result);

// builtin_format.cpp
// Markup.escape (the escape filter): HTML-escaped, as Markup; Markup itself unchanged.
Value html_escape(const Value& v);
// Python's `format % args` (the % operator on a string and the format filter).
Str python_percent_format(Interpreter& in, const Str& format, const Value& args, int line);

// builtin_globals.cpp
// raise_exception, strftime_now, namespace, dict, range, cycler-free globals transformers sets.
void add_builtin_globals(Dict& globals);

}  // namespace keel::data::jinja
