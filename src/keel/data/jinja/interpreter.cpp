#include "keel/data/jinja/interpreter.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <optional>

#include "keel/core/error.h"
#include "keel/data/jinja/replay.h"

namespace keel::data::jinja {

Value CallArgs::get(size_t index, std::string_view name, Value fallback) const {
  if (index < positional.size()) return positional[index];
  if (const Value* v = keyword(name)) return *v;
  return fallback;
}

const Value* CallArgs::keyword(std::string_view name) const {
  for (const auto& [k, v] : keywords)
    if (k == name) return &v;
  return nullptr;
}

Interpreter::Interpreter(const TemplateAst& ast, const std::string& origin, const RenderLimits& limits)
    : ast_(ast), origin_(origin), limits_(limits) {}

void Interpreter::error(int line, const std::string& what) const {
  fail("{} line {}: {}", origin_, line > 0 ? line : line_, what);
}

void Interpreter::too_many_steps() const {
  fail("{}: rendering stopped after {} steps (a template must finish in bounded work)", origin_, limits_.max_steps);
}

Rendered Interpreter::run(const Dict& variables) {
  // The template's scope: the variables it names (one it never names cannot be read by it: not
  // bound), then the defaults and built-in globals it names that the variables do not
  // (TemplateAst::globals): a variable shadows a default, a default a global.
  top_.reserve(variables.items.size() + ast_.globals.size());
  for (const auto& [k, v] : variables.items)
    if (const int symbol = ast_.symbol(k); symbol >= 0) top_[symbol] = v;
  for (const auto& [symbol, v] : ast_.globals)
    if (!top_.find(symbol)) top_[symbol] = v;
  frames_.reserve(8);
  frames_.assign(1, &top_);
  // A conversation renders to a few kilobytes: grown from there, not from nothing byte-doubling.
  output_.text.reserve(4096);
  output_.runs.reserve(16);
  exec(ast_.body);
  return Rendered{std::move(output_), std::move(generation_)};
}

// The output is bounded by ValueSizeLimit, which every string's growth checks (Template::render).
void Interpreter::emit(std::string_view template_text) { out_->append(template_text); }
void Interpreter::emit(const Str& s) { out_->append(s); }

Value Interpreter::filtered_body(const Node& n) {
  // The parser wrote the filters as applied to a variable named "caller": bind it to the body.
  Frame frame;
  frame[TemplateAst::kCaller] = Value(capture(n.body));
  frames_.push_back(&frame);
  Value v = eval(*n.expr);
  frames_.pop_back();
  return v;
}

Str Interpreter::capture(const Body& body) {
  Str out;
  Str* const outer = std::exchange(out_, &out);
  try {
    exec(body);
  } catch (...) {
    out_ = outer;
    throw;
  }
  out_ = outer;
  return out;
}

Value Interpreter::lookup(int symbol) const {
  if (const Value* found = find(symbol)) return *found;
  return Value::undefined_borrowing(ast_.symbols[size_t(symbol)]);
}

void Interpreter::assign(int symbol, Value v) { (*frames_.back())[symbol] = std::move(v); }

namespace {

// `+` and `~` are built by chain() (concat, print_concat); the other operators by binary().
bool is_chain(const Expr& e) { return e.kind == Expr::Kind::binary && (e.op == Op::add || e.op == Op::concat); }

}  // namespace

Interpreter::Flow Interpreter::exec(const Body& body) {
  for (const Node& n : body) {
    const Flow f = exec(n);
    if (f != Flow::normal) return f;
  }
  return Flow::normal;
}

Interpreter::Flow Interpreter::exec(const Node& n) {
  step();
  switch (n.kind) {
    case Node::Kind::text: emit(std::string_view(n.text)); return Flow::normal;
    case Node::Kind::print: {
      if (is_chain(*n.expr)) {
        print_concat(*n.expr);
        return Flow::normal;
      }
      Value scratch;
      const Value& v = ref(*n.expr, scratch);
      if (v.is_string()) {
        emit(v.as_str());  // no copy of the string on its way out
      } else {
        if (recorder_) recorder_->stringified(v);
        emit(to_str(v));
      }
      return Flow::normal;
    }
    case Node::Kind::if_block: {
      Value scratch;
      return exec(ref(*n.expr, scratch).truthy() ? n.body : n.else_body);
    }
    case Node::Kind::for_loop: return for_loop(n);
    case Node::Kind::set: {
      Value v = eval(*n.expr);
      if (!n.attribute.empty()) {
        Value target = lookup(n.target_symbols[0]);
        if (target.kind() != Value::Kind::ns)
          error(n.line, fmt::format("cannot assign attribute '{}' on {}: only a namespace() takes attributes",
                                    n.attribute, target.type_name()));
        if (!n.attribute.empty() && n.attribute[0] == '_')
          error(n.line, "a namespace cannot store underscore-prefixed attributes");
        target.ns_dict().set(n.attribute, std::move(v));
      } else if (n.targets.size() == 1) {
        assign(n.target_symbols[0], std::move(v));
      } else {
        const List items = iteration_items(*this, v, n.line);  // a list, a string's characters, ...
        if (items.size() != n.targets.size())
          error(n.line, fmt::format("cannot unpack {} into {} names", v.type_name(), n.targets.size()));
        for (size_t i = 0; i < n.targets.size(); ++i) assign(n.target_symbols[i], items[i]);
      }
      return Flow::normal;
    }
    case Node::Kind::set_block: assign(n.target_symbols[0], filtered_body(n)); return Flow::normal;
    case Node::Kind::filter_block: {
      const Value v = filtered_body(n);
      if (recorder_) recorder_->stringified(v);
      emit(to_str(v));
      return Flow::normal;
    }
    case Node::Kind::macro: define_macro(n); return Flow::normal;
    case Node::Kind::call_block: {
      const Body* body = &n.body;
      Value caller = Value::macro("caller", [body](Interpreter& in, CallArgs&) { return Value(in.capture(*body)); });
      const Expr& call = *n.expr;
      Value callee = eval(*call.args[0]);
      CallArgs args = arguments(call);
      args.keywords.emplace_back("caller", caller);
      const Value v = this->call(callee, args, n.line);
      if (recorder_) recorder_->stringified(v);
      emit(to_str(v));
      return Flow::normal;
    }
    case Node::Kind::with_block: {
      Frame frame;
      for (size_t p = 0; p < n.params.size(); ++p)  // evaluated outside the new scope
        frame[n.param_symbols[p]] = eval(*n.params[p].second);
      frames_.push_back(&frame);
      const Flow f = exec(n.body);
      frames_.pop_back();
      return f;
    }
    case Node::Kind::break_loop: return Flow::break_loop;
    case Node::Kind::continue_loop: return Flow::continue_loop;
    case Node::Kind::generation: {
      // transformers records where the block's output lands in the whole rendering.
      const bool top = out_ == &output_;
      const size_t begin = out_->text.size();
      const Flow f = exec(n.body);
      if (top) generation_.emplace_back(begin, out_->text.size());
      return f;
    }
  }
  return Flow::normal;
}

// interpreter.h
List iteration_items(Interpreter& in, const Value& v, int line) {
  switch (v.kind()) {
    case Value::Kind::list: return v.as_list();
    case Value::Kind::dict: {
      List keys;
      for (const auto& [k, x] : v.as_dict().items) keys.push_back(key_value(k));
      return keys;
    }
    case Value::Kind::string: {
      if (in.recorder() && v.as_str().marked()) in.recorder()->refuse("data iterated character by character");
      List chars;
      const Str& s = v.as_str();
      for (size_t pos = 0; pos < s.text.size();) {
        size_t len;
        decode_code_point(s.text, pos, len);
        chars.emplace_back(s.substr(pos, pos + len));
        pos += len;
      }
      return chars;
    }
    case Value::Kind::undefined: return {};
    default: in.error(line, fmt::format("'{}' object is not iterable", v.type_name()));
  }
}

Interpreter::Flow Interpreter::for_loop(const Node& n) {
  // A list is iterated where it is (held by `iterable`: the body may reassign what held it); other
  // iterables become a list first.
  const Value iterable = eval(*n.expr);
  List converted;
  if (!iterable.is_list()) converted = iteration_items(*this, iterable, n.line);
  const List& all = iterable.is_list() ? iterable.as_list() : converted;
  // The frame and `loop` object of the last loop that ran at this depth on this thread: a loop
  // then allocates neither its scope nor its 12 fields. Only a loop nothing kept goes back to the
  // pool (the end of this function), so what is taken from it is this loop's alone. Moved out
  // while the loop runs, so that a loop nested in the body (or in a macro it calls) takes the
  // next depth's, and an exception leaves nothing half-used behind.
  thread_local std::vector<LoopState> pool;
  const size_t depth = size_t(loop_depth_);
  if (pool.size() <= depth) pool.resize(depth + 1);
  LoopState state = std::move(pool[depth]);
  if (!state.frame) {  // an empty slot: a new scope and loop object
    state.frame = std::make_shared<Frame>();
    // loop.cycle reads the iteration through a shared counter: one function per loop object.
    auto counter = std::make_shared<int64_t>(0);
    const Value cycle = Value::function("cycle", [counter](Interpreter& in, CallArgs& args) {
      if (args.positional.empty()) in.error(0, "loop.cycle() needs at least one argument");
      return args.positional[size_t(*counter) % args.positional.size()];
    });
    // One `loop` object whose fields each iteration updates in place, as Jinja's LoopContext is
    // one object: nothing is built per iteration (a dict of 12 fields was).
    Dict fields;
    const Value zero(int64_t(0)), no(false);
    fields.items = {{"index", zero},  {"index0", zero}, {"revindex", zero}, {"revindex0", zero},
                    {"first", no},    {"last", no},     {"length", zero},   {"depth", Value(int64_t(1))},
                    {"depth0", zero}, {"previtem", {}}, {"nextitem", {}},   {"cycle", cycle}};
    state.loop = Value(std::move(fields));
    state.index = std::move(counter);
  }
  const std::shared_ptr<Frame> frame = state.frame;
  frames_.push_back(frame.get());
  auto bind = [&](const Value& item) {
    if (n.targets.size() == 1) {
      (*frame)[n.target_symbols[0]] = item;
      return;
    }
    if (!item.is_list() || item.as_list().size() != n.targets.size())
      error(n.line, fmt::format("cannot unpack {} into {} loop variables", item.type_name(), n.targets.size()));
    for (size_t i = 0; i < n.targets.size(); ++i) (*frame)[n.target_symbols[i]] = item.as_list()[i];
  };
  List filtered;
  if (n.condition) {
    for (const Value& item : all) {
      bind(item);
      Value scratch;
      if (ref(*n.condition, scratch).truthy()) filtered.push_back(item);
    }
  }
  const List& items = n.condition ? filtered : all;
  const int64_t length = int64_t(items.size());
  static const Value no_previtem = Value::undefined("previtem"), no_nextitem = Value::undefined("nextitem");
  const Value& loop = state.loop;
  int64_t* const index = state.index.get();
  auto& field = loop.ns_dict().items;
  field[6].second.set_number(length);
  // Nested loops (in the body, or in the macros it calls) take the next depth's state; undone on
  // the way out, an exception included.
  struct Deeper {
    int& depth;
    explicit Deeper(int& d) : depth(++d) {}
    ~Deeper() { --depth; }
  } deeper(loop_depth_);
  for (int64_t i = 0; i < length; ++i) {
    *index = i;
    step();          // an iteration is work even when its body is empty
    frame->clear();  // a loop body's `set`s do not outlive the iteration
    bind(items[size_t(i)]);
    field[0].second.set_number(i + 1);
    field[1].second.set_number(i);
    field[2].second.set_number(length - i);
    field[3].second.set_number(length - i - 1);
    field[4].second.set_bool(i == 0);
    field[5].second.set_bool(i == length - 1);
    field[9].second = i > 0 ? items[size_t(i - 1)] : no_previtem;
    field[10].second = i + 1 < length ? items[size_t(i + 1)] : no_nextitem;
    (*frame)[TemplateAst::kLoop] = loop;
    const Flow f = exec(n.body);
    if (f == Flow::break_loop) break;
  }
  frames_.pop_back();
  // Back to the pool, holding nothing of this rendering's data, unless the template kept the loop
  // object or its cycle: then it is theirs as the loop left it (a kept loop's previtem is still
  // the item before the last), and the next loop at this depth builds its own.
  frame->clear();
  if (!state.loop.shared() && !field[11].second.shared() && frame.use_count() == 2) {
    field[9].second = field[10].second = Value();
    pool[depth] = std::move(state);
  }
  if (length == 0) return exec(n.else_body);
  return Flow::normal;
}

void Interpreter::define_macro(const Node& n) {
  const Node* node = &n;
  assign(n.symbol, Value::macro(n.text, [node](Interpreter& in, CallArgs& args) {
           if (++in.depth_ > in.limits_.max_call_depth) {
             --in.depth_;
             in.error(node->line, fmt::format("macro calls nested deeper than {}", in.limits_.max_call_depth));
           }
           // A macro sees the template's scope and its own, not its caller's.
           const auto saved = in.frames_;
           Frame frame;
           in.frames_ = {saved[0], &frame};
           for (size_t p = 0; p < node->params.size(); ++p) {
             const auto& [name, def] = node->params[p];
             Value v = p < args.positional.size()      ? args.positional[p]
                       : args.keyword(name) != nullptr ? *args.keyword(name)
                       : def                           ? in.eval(*def)
                                                       : Value::undefined(name);
             frame[node->param_symbols[p]] = std::move(v);
           }
           if (args.positional.size() > node->params.size())
             in.error(node->line, fmt::format("macro '{}' takes {} arguments, {} given", node->text,
                                              node->params.size(), args.positional.size()));
           for (const auto& [k, v] : args.keywords) {
             bool known = k == "caller";
             for (const auto& [name, def] : node->params) known = known || name == k;
             if (!known) in.error(node->line, fmt::format("macro '{}' has no argument '{}'", node->text, k));
             if (k == "caller") frame[TemplateAst::kCaller] = v;
           }
           Str out;
           try {
             out = in.capture(node->body);
           } catch (...) {
             in.frames_ = saved;
             --in.depth_;
             throw;
           }
           in.frames_ = saved;
           --in.depth_;
           return Value(std::move(out));
         }));
}

Value Interpreter::call(const Value& callee, CallArgs& args, int line) {
  if (callee.kind() == Value::Kind::callable) {
    const Callable& c = callee.as_callable();
    if (recorder_ && !c.macro) recorder_->native_call(c.name, args);
    return c.call(*this, args);
  }
  if (callee.is_undefined()) error(line, fmt::format("'{}' is undefined", callee.undefined_name()));
  error(line, fmt::format("'{}' object is not callable", callee.type_name()));
}

Value Interpreter::apply_filter(const std::string& name, const Value& subject, CallArgs& args, int line) {
  if (!recorder_) return builtin_filter(*this, name, subject, args, line);
  Value result = builtin_filter(*this, name, subject, args, line);
  recorder_->filter(name, subject, args, result);
  return result;
}

bool Interpreter::apply_test(const std::string& name, const Value& subject, CallArgs& args, int line) {
  const bool result = builtin_test(*this, name, subject, args, line);
  if (recorder_) recorder_->test(name, subject, args, result);
  return result;
}

namespace {

// A method as a value, or an undefined that names it. Bound to data (a string's or a list's), it
// could observe the data when called: a recording cannot follow it.
Value named_method(Interpreter& in, const Value& object, const std::string& name) {
  if (in.recorder() && Recorder::deep_marked(object)) in.recorder()->refuse("a method bound to data");
  Value method = builtin_method(object, name);
  return method.is_undefined() ? Value::undefined(name) : method;
}

}  // namespace

Value Interpreter::attribute(const Value& object, const std::string& name, int line, bool name_in_template) {
  auto missing = [&] { return name_in_template ? Value::undefined_borrowing(name) : Value::undefined(name); };
  switch (object.kind()) {
    case Value::Kind::undefined:
      error(line, fmt::format("'{}' is undefined (reading its attribute '{}')", object.undefined_name(), name));
    case Value::Kind::ns: {
      const Value* v = static_cast<const Dict&>(object.ns_dict()).find(name);
      return v ? *v : missing();
    }
    case Value::Kind::dict: {
      // Python's getattr first: a dict's methods shadow its keys (message.items is the method).
      Value method = builtin_method(object, name);
      if (!method.is_undefined()) return method;
      const Value* v = object.as_dict().find(name);
      return v ? *v : missing();
    }
    default: return named_method(*this, object, name);
  }
}

const Value* Interpreter::attribute_in_place(const Value& object, std::string_view name) {
  switch (object.kind()) {
    case Value::Kind::ns: return static_cast<const Dict&>(object.ns_dict()).find(name);
    case Value::Kind::dict: return is_dict_method(name) ? nullptr : object.as_dict().find(name);
    default: return nullptr;
  }
}

const Value* Interpreter::item_in_place(const Value& object, const Value& key) {
  switch (object.kind()) {
    case Value::Kind::dict:
    case Value::Kind::ns: {
      if (!key.is_string()) return nullptr;
      const std::string& k = key.as_str().text;
      if (!k.empty() && k[0] == '\0') return nullptr;  // dict_key escapes it
      return (object.kind() == Value::Kind::ns ? object.ns_dict() : object.as_dict()).find(k);
    }
    case Value::Kind::list: {
      if (!key.is_number() || key.kind() == Value::Kind::real) return nullptr;
      const List& l = object.as_list();
      int64_t i = key.as_int();
      if (i < 0) i += int64_t(l.size());
      return i < 0 || i >= int64_t(l.size()) ? nullptr : &l[size_t(i)];
    }
    default: return nullptr;
  }
}

Value Interpreter::item(const Value& object, const Value& key, int line) {
  switch (object.kind()) {
    case Value::Kind::undefined:
      error(line, fmt::format("'{}' is undefined (reading its item {})", object.undefined_name(), repr(key)));
    case Value::Kind::dict:
    case Value::Kind::ns: {
      const Dict& d = object.kind() == Value::Kind::ns ? object.ns_dict() : object.as_dict();
      if (recorder_ && Recorder::deep_marked(key)) recorder_->refuse("data looked up as a key");
      if (key.is_list() || key.is_dict()) return Value::undefined();  // unhashable: a failed lookup
      if (const Value* v = d.find(dict_key(key))) return *v;
      if (key.is_string()) return attribute(object, key.as_str().text, line);  // Jinja falls back to getattr
      return Value::undefined();
    }
    case Value::Kind::list: {
      if (!key.is_number() || key.kind() == Value::Kind::real) {
        if (key.is_string()) return named_method(*this, object, key.as_str().text);
        return Value::undefined();  // Jinja: a failed lookup is undefined (l[1.5], l[none])
      }
      const List& l = object.as_list();
      int64_t i = key.as_int();
      if (i < 0) i += int64_t(l.size());
      if (i < 0 || i >= int64_t(l.size())) return Value::undefined();
      return l[size_t(i)];
    }
    case Value::Kind::string: {
      if (recorder_ && (object.as_str().marked() || Recorder::deep_marked(key))) recorder_->refuse("data indexed");
      if (!key.is_number() || key.kind() == Value::Kind::real)
        return key.is_string() ? named_method(*this, object, key.as_str().text) : Value::undefined();
      const Str& s = object.as_str();
      const int64_t n = int64_t(code_point_count(s.text));
      int64_t i = key.as_int();
      if (i < 0) i += n;
      if (i < 0 || i >= n) return Value::undefined();
      const size_t b = byte_offset(s.text, size_t(i)), e = byte_offset(s.text, size_t(i + 1));
      return Value(s.substr(b, e));
    }
    default: return Value::undefined();
  }
}

namespace {

// Python's slice of a sequence of n items: `count` indices from `first`, `step` apart. Counted,
// not listed: `messages[::-1]` runs per conversation.
struct SliceRange {
  int64_t first = 0, step = 1, count = 0;
  size_t operator[](int64_t k) const { return size_t(first + k * step); }
};

SliceRange slice_range(int64_t n, const Value& start, const Value& stop, const Value& step_v, Interpreter& in,
                       int line) {
  auto as_index = [&](const Value& v) -> std::optional<int64_t> {
    if (v.is_undefined() || v.is_none()) return std::nullopt;
    if (!v.is_number()) in.error(line, "slice indices must be integers or None");
    return v.as_int();
  };
  const int64_t step = as_index(step_v).value_or(1);
  if (step == 0) in.error(line, "slice step cannot be zero");
  auto clamp = [&](std::optional<int64_t> v, int64_t fallback) {
    if (!v) return fallback;
    int64_t x = *v;
    if (x < 0) x += n;
    if (step > 0) return std::clamp<int64_t>(x, 0, n);
    return std::clamp<int64_t>(x, -1, n - 1);
  };
  const int64_t b = clamp(as_index(start), step > 0 ? 0 : n - 1);
  const int64_t e = clamp(as_index(stop), step > 0 ? n : -1);
  SliceRange r{b, step, 0};
  if (step > 0 && e > b) r.count = (e - b - 1) / step + 1;
  if (step < 0 && b > e) r.count = step == INT64_MIN ? 1 : (b - e - 1) / -step + 1;
  return r;
}

}  // namespace

namespace {

// Whether a call's, filter's or test's arguments (args[1..], keywords) are all pure.
bool arguments_pure(const Expr& e) {
  for (size_t i = 1; i < e.args.size(); ++i)
    if (!e.args[i]->pure) return false;
  for (const auto& [k, x] : e.kwargs)
    if (!x->pure) return false;
  return true;
}

// `held` as a value of its own (copied into `scratch`) when what is evaluated next may run a macro:
// a `set ns.x` there could replace or move what the reference points into.
const Value& keep_across(const Value& held, Value& scratch, bool next_is_pure) {
  if (next_is_pure || &held == &scratch) return held;
  scratch = held;
  return scratch;
}

}  // namespace

// A call's, filter's or test's arguments: args[1..] and the keywords, evaluated in order.
CallArgs Interpreter::arguments(const Expr& e) {
  CallArgs args;
  for (size_t i = 1; i < e.args.size(); ++i) args.positional.push_back(eval(*e.args[i]));
  for (const auto& [k, x] : e.kwargs) args.keywords.emplace_back(k, eval(*x));
  return args;
}

Value Interpreter::eval(const Expr& e) {
  step();
  line_ = e.line;
  switch (e.kind) {
    case Expr::Kind::literal: return e.value;
    case Expr::Kind::name: return lookup(e.symbol);
    case Expr::Kind::list:
    case Expr::Kind::tuple: {
      List items;
      for (const auto& a : e.args) items.push_back(eval(*a));
      return Value(std::move(items), e.kind == Expr::Kind::tuple);
    }
    case Expr::Kind::dict: {
      Dict d;
      for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
        Value k = eval(*e.args[i]);
        if (recorder_ && Recorder::deep_marked(k)) recorder_->refuse("data as a dict key");
        if (k.is_list() || k.is_dict() || k.is_undefined())
          error(e.line, fmt::format("unhashable type: '{}' as a dict key", k.type_name()));
        d.set(dict_key(k), eval(*e.args[i + 1]));
      }
      return Value(std::move(d));
    }
    case Expr::Kind::attribute: {
      Value scratch;
      return attribute(ref(*e.args[0], scratch), e.name, e.line, true);
    }
    case Expr::Kind::item: {
      Value object_scratch, key_scratch;
      const Value& object = keep_across(ref(*e.args[0], object_scratch), object_scratch, e.args[1]->pure);
      return item(object, ref(*e.args[1], key_scratch), e.line);
    }
    case Expr::Kind::slice: {
      Value object = eval(*e.args[0]);
      Value parts[3];
      for (int k = 0; k < 3; ++k)
        if (e.args[size_t(k) + 1]) parts[k] = eval(*e.args[size_t(k) + 1]);
      if (object.is_list()) {
        const List& l = object.as_list();
        const SliceRange picked = slice_range(int64_t(l.size()), parts[0], parts[1], parts[2], *this, e.line);
        List out;
        out.reserve(size_t(picked.count));
        for (int64_t k = 0; k < picked.count; ++k) out.push_back(l[picked[k]]);
        return Value(std::move(out), object.is_tuple());
      }
      if (object.is_string()) {
        const Str& s = object.as_str();
        if (recorder_ && s.marked()) recorder_->refuse("data sliced");
        std::vector<size_t> starts;  // byte offset of each code point
        for (size_t pos = 0; pos < s.text.size();) {
          size_t len;
          decode_code_point(s.text, pos, len);
          starts.push_back(pos);
          pos += len;
        }
        starts.push_back(s.text.size());
        Str out;
        const SliceRange picked = slice_range(int64_t(starts.size() - 1), parts[0], parts[1], parts[2], *this, e.line);
        for (int64_t k = 0; k < picked.count; ++k) out.append(s.substr(starts[picked[k]], starts[picked[k] + 1]));
        return Value(std::move(out));
      }
      if (object.is_undefined()) error(e.line, fmt::format("'{}' is undefined", object.undefined_name()));
      error(e.line, fmt::format("'{}' object is not subscriptable", object.type_name()));
    }
    case Expr::Kind::call: {
      const Expr& target = *e.args[0];
      if (target.kind != Expr::Kind::attribute) {
        Value callee = eval(target);
        CallArgs args = arguments(e);
        return call(callee, args, e.line);
      }
      // `object.name(...)`. A str method is called at once: templates call them per message, and
      // binding one first built a callable (two allocations) each time.
      Value object_scratch;
      const Value& object = keep_across(ref(*target.args[0], object_scratch), object_scratch, arguments_pure(e));
      step();  // the attribute's own evaluation
      Value callee = object.is_string() ? Value() : attribute(object, target.name, target.line, true);
      CallArgs args = arguments(e);
      Value result;
      if (object.is_string() && call_string_method(*this, object, target.name, args, result)) {
        if (recorder_) recorder_->method(target.name, object, args, result);
        return result;
      }
      if (callee.is_undefined())
        error(e.line, fmt::format("'{}' has no method '{}'", repr(object).substr(0, 60), target.name));
      return call(callee, args, e.line);
    }
    case Expr::Kind::filter: {
      Value scratch;
      const Value& subject = keep_across(ref(*e.args[0], scratch), scratch, arguments_pure(e));
      CallArgs args = arguments(e);
      return apply_filter(e.name, subject, args, e.line);
    }
    case Expr::Kind::test: {
      Value scratch;
      const Value& subject = keep_across(ref(*e.args[0], scratch), scratch, arguments_pure(e));
      CallArgs args = arguments(e);
      return Value(apply_test(e.name, subject, args, e.line) != e.negated);
    }
    case Expr::Kind::logical_not: {
      Value scratch;
      return Value(!ref(*e.args[0], scratch).truthy());
    }
    case Expr::Kind::negate:
    case Expr::Kind::plus: {
      Value v = eval(*e.args[0]);
      if (!v.is_number()) error(e.line, fmt::format("bad operand type for unary -: '{}'", v.type_name()));
      if (e.kind == Expr::Kind::plus) return v.kind() == Value::Kind::real ? v : Value(v.as_int());
      if (v.kind() != Value::Kind::real && v.as_int() == INT64_MIN) error(e.line, "integer overflow (64 bits)");
      return v.kind() == Value::Kind::real ? Value(-v.as_real()) : Value(-v.as_int());
    }
    case Expr::Kind::binary: return is_chain(e) ? concat(e) : binary(e);
    case Expr::Kind::compare: return Value(compare(e));
    case Expr::Kind::logical_and: {
      Value a = eval(*e.args[0]);
      return a.truthy() ? eval(*e.args[1]) : a;
    }
    case Expr::Kind::logical_or: {
      Value a = eval(*e.args[0]);
      return a.truthy() ? a : eval(*e.args[1]);
    }
    case Expr::Kind::conditional: {
      Value scratch;
      if (ref(*e.args[1], scratch).truthy()) return eval(*e.args[0]);
      return e.args[2] ? eval(*e.args[2]) : Value::undefined();
    }
  }
  return Value::undefined();
}

const Value& Interpreter::ref_compound(const Expr& e, Value& scratch) {
  switch (e.kind) {
    case Expr::Kind::attribute: {
      Value object_scratch;
      const Value& object = ref(*e.args[0], object_scratch);
      step();
      line_ = e.line;
      // A value inside the object outlives this call only when the object does.
      if (&object != &object_scratch)
        if (const Value* v = attribute_in_place(object, e.name)) return *v;
      scratch = attribute(object, e.name, e.line, true);
      return scratch;
    }
    case Expr::Kind::item: {
      Value object_scratch, key_scratch;
      const Value& object = keep_across(ref(*e.args[0], object_scratch), object_scratch, e.args[1]->pure);
      const Value& key = ref(*e.args[1], key_scratch);
      step();
      line_ = e.line;
      if (recorder_ && (object.is_dict() || object.kind() == Value::Kind::ns) && Recorder::deep_marked(key))
        recorder_->refuse("data looked up as a key");
      if (&object != &object_scratch)
        if (const Value* v = item_in_place(object, key)) return *v;
      scratch = item(object, key, e.line);
      return scratch;
    }
    default: break;
  }
  scratch = eval(e);
  return scratch;
}

// The state of a chain: `building` while everything so far was a plain str, appended to `out` from
// `start` on; `value` once an operand was anything else (the operator's own rules take over).
struct Interpreter::Chain {
  Str& out;
  size_t start;
  bool building = false;
  Value value;
};

void Interpreter::chain(const Expr& e, Op op, Chain& c) {
  auto plain = [](const Value& v) { return v.is_string() && !v.is_markup(); };
  if (e.kind != Expr::Kind::binary || e.op != op) {  // the leftmost operand
    Value scratch;
    const Value& v = ref(e, scratch);
    if (plain(v) || op == Op::concat) {
      if (recorder_) recorder_->stringified(v);
      c.out.append(v.is_string() ? v.as_str() : to_str(v));
      c.building = true;
    } else {
      c.value = v;
    }
    return;
  }
  chain(*e.args[0], op, c);
  step();
  line_ = e.line;
  Value scratch;
  const Value& b = ref(*e.args[1], scratch);
  if (op == Op::concat) {  // str() of anything, appended: the chain never leaves `building`
    if (recorder_) recorder_->stringified(b);
    c.out.append(b.is_string() ? b.as_str() : to_str(b));
    return;
  }
  if (c.building && plain(b)) {
    c.out.append(b.as_str());
    return;
  }
  if (c.building) {  // str + something else: the str so far becomes the left operand
    c.value = Value(c.out.substr(c.start, c.out.text.size()));
    c.out.truncate(c.start);
    c.building = false;
  }
  c.value = binary(op, std::move(c.value), b, e.line);
}

Value Interpreter::concat(const Expr& e) {
  Str out;
  Chain c{out, 0, false, Value()};
  chain(e, e.op, c);
  return c.building ? Value(std::move(out)) : std::move(c.value);
}

void Interpreter::print_concat(const Expr& e) {
  Chain c{*out_, out_->text.size(), false, Value()};
  chain(e, e.op, c);
  if (!c.building) {
    if (recorder_) recorder_->stringified(c.value);
    emit(c.value.is_string() ? c.value.as_str() : to_str(c.value));
  }
}

namespace {

bool contains(Interpreter& in, const Value& container, const Value& item, int line) {
  switch (container.kind()) {
    case Value::Kind::string:
      if (!item.is_string())
        in.error(line, fmt::format("'in <string>' requires string as left operand, not {}", item.type_name()));
      return container.as_str().text.find(item.as_str().text) != std::string::npos;
    case Value::Kind::list:
      for (const Value& x : container.as_list())
        if (equal(x, item)) return true;
      return false;
    case Value::Kind::dict:
    case Value::Kind::ns:
      if (item.is_list() || item.is_dict()) in.error(line, fmt::format("unhashable type: '{}'", item.type_name()));
      return (container.kind() == Value::Kind::ns ? container.ns_dict() : container.as_dict()).find(dict_key(item)) !=
             nullptr;
    case Value::Kind::undefined: return false;
    default: in.error(line, fmt::format("argument of type '{}' is not iterable", container.type_name()));
  }
}

// seq * times; the caller has checked the result's size. An empty sequence gives an empty one at
// once, however large `times` is ("" * 7776077760 was 7.7 billion appends: a fuzzer timeout).
Value repeat(const Value& seq, int64_t times) {
  const bool empty = seq.is_string() ? seq.as_str().text.empty() : seq.as_list().empty();
  if (empty || times <= 0) return seq.is_string() ? Value(Str()) : Value(List{});
  if (seq.is_string()) {
    Str out;
    for (int64_t i = 0; i < times; ++i) out.append(seq.as_str());
    return Value(std::move(out));
  }
  List out;
  for (int64_t i = 0; i < times; ++i) out.insert(out.end(), seq.as_list().begin(), seq.as_list().end());
  return Value(std::move(out));
}

}  // namespace

bool compare_values(Interpreter& in, Op op, const Value& left, const Value& right, int line) {
  switch (op) {
    case Op::eq: return equal(left, right);
    case Op::ne: return !equal(left, right);
    case Op::lt: return less(left, right);
    case Op::gt: return less(right, left);
    case Op::le: return !less(right, left);
    case Op::ge: return !less(left, right);
    case Op::in: return contains(in, right, left, line);
    default: return !contains(in, right, left, line);  // not in
  }
}

bool Interpreter::compare(const Expr& e) {
  // Operand k is evaluated into scratch[k % 2] when it is not a value that exists already: the
  // previous operand (the left one now) is in the other.
  Value scratch[2];
  const Value* left_ref = &ref(*e.args[0], scratch[0]);
  for (size_t k = 0; k < e.ops.size(); ++k) {
    const Value& left = keep_across(*left_ref, scratch[k % 2], e.args[k + 1]->pure);
    const Value& right = ref(*e.args[k + 1], scratch[(k + 1) % 2]);
    bool ok;
    try {
      ok = compare_values(*this, e.ops[k], left, right, e.line);
    } catch (const Error& x) {
      if (std::string_view(x.what()).find(" line ") != std::string_view::npos) throw;
      error(e.line, x.what());
    }
    if (recorder_) recorder_->compare(e.ops[k], left, right, ok);
    if (!ok) return false;
    left_ref = &right;
  }
  return true;
}

Value Interpreter::binary(const Expr& e) { return binary(e.op, eval(*e.args[0]), eval(*e.args[1]), e.line); }

Value Interpreter::binary(Op op, Value a, Value b, int line) {
  // `~` never comes here: chain() builds it (eval and print route `+` and `~` to concat).
  if (recorder_) recorder_->binary(op, a, b);
  for (const Value* v : {&a, &b})
    if (v->is_undefined()) error(line, fmt::format("'{}' is undefined", v->undefined_name()));
  const bool numbers = a.is_number() && b.is_number();
  const bool real = numbers && (a.kind() == Value::Kind::real || b.kind() == Value::Kind::real);
  // The message only: error() itself is [[noreturn]], so the compiler sees every path end.
  auto unsupported = [&]() {
    return fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", operator_text(op), a.type_name(),
                       b.type_name());
  };
  // Python's integers have no limit; keel's are 64-bit and say so rather than wrap.
  auto integer = [&](int64_t x, int64_t y) {
    int64_t r = 1;
    bool overflow = false;
    if (op == Op::add) overflow = __builtin_add_overflow(x, y, &r);
    if (op == Op::sub) overflow = __builtin_sub_overflow(x, y, &r);
    if (op == Op::mul) overflow = __builtin_mul_overflow(x, y, &r);
    if (op == Op::pow)  // by squaring: bounded work for any exponent
      for (int64_t base = x, exponent = y; exponent > 0 && !overflow; exponent >>= 1) {
        if (exponent & 1) overflow = __builtin_mul_overflow(r, base, &r);
        if ((exponent >> 1) && !overflow) overflow = __builtin_mul_overflow(base, base, &base);
      }
    if (overflow) error(line, fmt::format("integer overflow in {} (keel's integers are 64-bit)", operator_text(op)));
    return Value(r);
  };
  if (op == Op::mod && a.is_string()) return Value(python_percent_format(*this, a.as_str(), b, line));
  if (op == Op::add) {
    if (numbers) return real ? Value(a.as_real() + b.as_real()) : integer(a.as_int(), b.as_int());
    if (a.is_list() && b.is_list()) ValueSizeLimit::check((a.as_list().size() + b.as_list().size()) * sizeof(Value));
    if (a.is_string() && b.is_string()) {
      // Markup + str escapes the str; so does str + Markup (Markup's __radd__ goes first).
      const bool markup = a.is_markup() || b.is_markup();
      Str s = markup ? html_escape(a).as_str() : std::move(a).take_str();
      s.append(markup ? html_escape(b).as_str() : b.as_str());
      return markup ? Value::markup(std::move(s)) : Value(std::move(s));
    }
    if (a.is_list() && b.is_list()) {
      List l = a.as_list();
      l.insert(l.end(), b.as_list().begin(), b.as_list().end());
      return Value(std::move(l));
    }
    error(line, unsupported());
  }
  if (op == Op::mul) {
    if (numbers) return real ? Value(a.as_real() * b.as_real()) : integer(a.as_int(), b.as_int());
    for (const auto& [seq, n] : {std::pair{&a, &b}, std::pair{&b, &a}})
      if ((seq->is_string() || seq->is_list()) && n->kind() == Value::Kind::integer) {
        const uint64_t unit = seq->is_string() ? seq->as_str().text.size() : seq->as_list().size() * sizeof(Value);
        if (n->as_int() > 0 && unit > 0)
          ValueSizeLimit::check(n->as_int() > int64_t(1) << 40 ? UINT64_MAX : unit * uint64_t(n->as_int()));
        return repeat(*seq, n->as_int());
      }
    error(line, unsupported());
  }
  if (!numbers) error(line, unsupported());
  if (op == Op::sub) return real ? Value(a.as_real() - b.as_real()) : integer(a.as_int(), b.as_int());
  if (op == Op::pow) {
    if (!real && b.as_int() >= 0) return integer(a.as_int(), b.as_int());
    return Value(std::pow(a.as_real(), b.as_real()));
  }
  if ((op == Op::div || op == Op::floordiv || op == Op::mod) && b.as_real() == 0) error(line, "division by zero");
  if (op == Op::div) return Value(a.as_real() / b.as_real());
  if (op == Op::floordiv) {
    if (real) return Value(std::floor(a.as_real() / b.as_real()));
    const int64_t x = a.as_int(), y = b.as_int(), q = x / y;
    return Value((x % y != 0 && ((x < 0) != (y < 0))) ? q - 1 : q);
  }
  if (op == Op::mod) {
    if (real) {
      const double r = std::fmod(a.as_real(), b.as_real());
      return Value((r != 0 && ((r < 0) != (b.as_real() < 0))) ? r + b.as_real() : r);
    }
    const int64_t x = a.as_int(), y = b.as_int(), r = x % y;
    return Value((r != 0 && ((r < 0) != (y < 0))) ? r + y : r);
  }
  error(line, unsupported());
}

Template::Template(std::string source, std::string origin, const Dict& defaults)
    : source_(std::move(source)), origin_(std::move(origin)) {
  try {
    ast_ = std::make_unique<TemplateAst>(parse_template(source_));
  } catch (const Error& e) {
    fail("{}: {}", origin_, e.what());
  }
  // The built-in globals are stateless functions: the ones this template names, resolved once.
  static const Dict builtins = [] {
    Dict d;
    add_builtin_globals(d);
    return d;
  }();
  for (const Dict* d : {&defaults, &builtins})
    for (const auto& [name, v] : d->items)
      if (const int symbol = ast_->symbol(name); symbol >= 0) ast_->globals.emplace_back(symbol, v);
}

Template::~Template() = default;
Template::Template(Template&&) noexcept = default;

Rendered Template::render(const Dict& variables, const RenderLimits& limits, Recorder* recorder) const {
  Interpreter in(*ast_, origin_, limits);
  in.watch(recorder);
  const ValueSizeLimit value_limit(limits.max_output_bytes);
  try {
    return in.run(variables);
  } catch (const Error& e) {
    // A value's own check (a filter given the wrong kind of value) names no template: name it.
    if (std::string_view(e.what()).rfind(origin_, 0) == 0) throw;
    fail("{} line {}: {}", origin_, in.line(), e.what());
  }
}

bool Template::has_generation() const { return ast_->has_generation; }
const std::vector<std::string>& Template::literals() const { return ast_->literals; }

}  // namespace keel::data::jinja
