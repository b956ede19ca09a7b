#include "keel/data/jinja/replay.h"

#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>

#include "keel/core/error.h"
#include "keel/data/jinja/interpreter.h"

namespace keel::data::jinja {
namespace {

// A datum's text goes into the shape key too when it is this short (roles, names): the guards on
// such datums alone are then decided by the key and not kept.
constexpr size_t kKeyedDatumBytes = 16;
// Bounds on what a template keeps: shapes, variants of one shape (conversations of a shape whose
// guards differ: '</think>' in one content and not another), refusals before a shape stops being
// recorded.
constexpr size_t kMaxShapes = 4096;
constexpr int kMaxRefusals = 16;

// The shape of the variables: everything but the datums' text, in one string, and the datums
// (each string of the conversation marked whole as one source) in the order met. False when a
// string is marked in part (never from a conversation: then the variables are rendered).
// Whether all of `s` is one run: a datum's text, whole.
bool whole_run(const Str& s) {
  return s.runs.size() == 1 && s.runs.front().begin == 0 && s.runs.front().end == s.text.size();
}

class ShapeWalk {
 public:
  std::string key;
  std::vector<const Value*> datums;  // strings
  std::vector<uint8_t> keyed;

  // Every conversation is walked: the buffers of the last walk on this thread are reused.
  static ShapeWalk& reused() {
    thread_local ShapeWalk w;
    w.key.clear();
    w.datums.clear();
    w.keyed.clear();
    return w;
  }

  bool walk(const Value& v) {
    using K = Value::Kind;
    switch (v.kind()) {
      case K::undefined: key += 'u'; return true;
      case K::none: key += 'n'; return true;
      case K::boolean: key += v.as_bool() ? 'T' : 'F'; return true;
      case K::integer: {
        key += 'i';
        const int64_t i = v.as_int();
        key.append(reinterpret_cast<const char*>(&i), sizeof i);
        return true;
      }
      case K::real: {
        key += 'r';
        const double d = v.as_real();
        key.append(reinterpret_cast<const char*>(&d), sizeof d);
        return true;
      }
      case K::string: {
        const Str& s = v.as_str();
        if (v.is_markup()) return false;
        if (s.runs.empty()) {
          key += 's';
          text(s.text);
          return true;
        }
        if (!whole_run(s)) return false;
        const bool short_text = s.text.size() <= kKeyedDatumBytes;
        key += short_text ? 'K' : 'D';
        if (short_text) text(s.text);
        datums.push_back(&v);
        keyed.push_back(short_text);
        return true;
      }
      case K::list: {
        key += v.is_tuple() ? 't' : 'l';
        size(v.as_list().size());
        for (const Value& x : v.as_list())
          if (!walk(x)) return false;
        return true;
      }
      case K::dict: return dict(v.as_dict());
      default: return false;  // namespaces and functions are not conversation data
    }
  }

  bool dict(const Dict& d) {
    key += 'd';
    size(d.items.size());
    for (const auto& [k, x] : d.items) {
      text(k);
      if (!walk(x)) return false;
    }
    return true;
  }

 private:
  void size(size_t n) {
    const uint32_t k = uint32_t(n);  // sizes past 4 GiB never reach a template (the output limit)
    key.append(reinterpret_cast<const char*>(&k), sizeof k);
  }
  void text(std::string_view t) {
    size(t.size());
    key += t;
  }
};

// A copy of `v` whose datums (in ShapeWalk's order) are marked with their index as the source.
Value tagged(const Value& v, int& next) {
  switch (v.kind()) {
    case Value::Kind::string:
      if (v.as_str().runs.empty()) return v;
      return Value(Str(v.as_str().text, next++));
    case Value::Kind::list: {
      List items;
      items.reserve(v.as_list().size());
      for (const Value& x : v.as_list()) items.push_back(tagged(x, next));
      return Value(std::move(items), v.is_tuple());
    }
    case Value::Kind::dict: {
      Dict d;
      d.items.reserve(v.as_dict().items.size());
      for (const auto& [k, x] : v.as_dict().items) d.items.emplace_back(k, tagged(x, next));
      return Value(std::move(d));
    }
    default: return v;
  }
}

// Where a generation block starts or ends: `offset` bytes into piece `piece` (a literal's inside,
// or 0: the piece's start; pieces.size(): the end of the output).
struct Position {
  size_t piece, offset;
};

}  // namespace

struct ReplayCache::Recording {
  std::vector<Guard> guards;
  struct Piece {
    std::string literal;
    int datum = -1;  // else the piece is this datum
  };
  std::vector<Piece> pieces;
  std::vector<std::pair<Position, Position>> generation;
};

bool Recorder::deep_marked(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::string: return v.as_str().marked();
    case Value::Kind::list:
      for (const Value& x : v.as_list())
        if (deep_marked(x)) return true;
      return false;
    case Value::Kind::dict:
    case Value::Kind::ns:
      for (const auto& [k, x] : v.as_dict().items)
        if (deep_marked(x)) return true;
      return false;
    default: return false;
  }
}

int Recorder::datum_of(const Value& v) const {
  if (!v.is_string() || v.is_markup()) return -1;
  const Str& s = v.as_str();
  if (!whole_run(s)) return -1;
  const int d = s.runs.front().source;
  if (d < 0 || size_t(d) >= datums_.size() || datums_[size_t(d)]->as_str().text != s.text) return -1;
  return d;
}

bool Recorder::operand(const Value& v, Operand& out) const {
  out.datum = datum_of(v);
  if (out.datum >= 0) return true;
  if (deep_marked(v)) return false;
  out.constant = v;
  return true;
}

bool Recorder::operands(const Value& subject, const CallArgs& args, Guard& g) const {
  if (!operand(subject, g.subject)) return false;
  for (const Value& a : args.positional)
    if (!operand(a, g.positional.emplace_back())) return false;
  for (const auto& [k, a] : args.keywords)
    if (!operand(a, g.keywords.emplace_back(std::string(k), Operand()).second)) return false;
  return true;
}

void Recorder::keep(Guard g) {
  bool unkeyed = false;
  auto check = [&](const Operand& o) { unkeyed = unkeyed || (o.datum >= 0 && !keyed_[size_t(o.datum)]); };
  check(g.subject);
  for (const Operand& o : g.positional) check(o);
  for (const auto& [k, o] : g.keywords) check(o);
  if (unkeyed) guards_.push_back(std::move(g));  // else the shape key decides it
}

namespace {

bool marked_args(const CallArgs& args) {
  for (const Value& a : args.positional)
    if (Recorder::deep_marked(a)) return true;
  for (const auto& [k, a] : args.keywords)
    if (Recorder::deep_marked(a)) return true;
  return false;
}

bool any_marked(const Value& subject, const CallArgs& args) {
  return Recorder::deep_marked(subject) || marked_args(args);
}

}  // namespace

void Recorder::method(const std::string& name, const Value& self, const CallArgs& args, const Value& result) {
  if (!usable_ || !any_marked(self, args)) return;
  Guard g{Guard::Kind::method, Guard::Expect::value, Op::none, name, {}, {}, {}, {}};
  if (!operands(self, args, g)) return refuse("a string method of data that is not one of the conversation's strings");
  if (same_name(name, "startswith") || same_name(name, "endswith")) {
    g.expected = result;
    return keep(std::move(g));
  }
  const int d = datum_of(self);
  if (same_name(name, "strip") || same_name(name, "lstrip") || same_name(name, "rstrip")) {
    if (d < 0 || datum_of(result) != d) return refuse("a strip that changes data");
    g.expect = Guard::Expect::same_datum;
    return keep(std::move(g));
  }
  if (same_name(name, "split") || same_name(name, "rsplit")) {
    if (d < 0 || !result.is_list() || result.as_list().size() != 1 || datum_of(result.as_list()[0]) != d)
      return refuse("a split of data");
    g.expect = Guard::Expect::split_whole;
    return keep(std::move(g));
  }
  refuse("a string method on data other than startswith, endswith, strip and split");
}

void Recorder::filter(const std::string& name, const Value& subject, const CallArgs& args, const Value& result) {
  if (!usable_ || !any_marked(subject, args)) return;
  // What depends on the shape alone (a list's length, its items, undefined or not).
  if (!marked_args(args)) {
    if ((same_name(name, "length") || same_name(name, "count") || same_name(name, "first") || same_name(name, "last") ||
         same_name(name, "list") || same_name(name, "reverse")) &&
        subject.is_list())
      return;
    if ((same_name(name, "length") || same_name(name, "count") || same_name(name, "items")) && subject.is_dict())
      return;
    if (same_name(name, "default") || same_name(name, "d")) return;
    if (same_name(name, "string") && subject.is_string() && !subject.is_markup()) return;
  }
  if (same_name(name, "trim") || same_name(name, "strip")) {
    Guard g{Guard::Kind::filter, Guard::Expect::same_datum, Op::none, name, {}, {}, {}, {}};
    const int d = datum_of(subject);
    if (d < 0 || !operands(subject, args, g) || datum_of(result) != d) return refuse("a trim that changes data");
    return keep(std::move(g));
  }
  refuse("a filter of data other than length, first, last, list, reverse, items, default, string and trim");
}

void Recorder::test(const std::string& name, const Value& subject, const CallArgs& args, bool result) {
  if (!usable_ || !any_marked(subject, args)) return;
  static const char* const kinds[] = {"defined", "undefined", "none",   "boolean", "true",     "false",    "integer",
                                      "float",   "number",    "string", "mapping", "iterable", "sequence", "callable"};
  for (const char* k : kinds)
    if (same_name(name, k)) return;  // the kind of a value: part of the shape
  if (same_name(name, "eq") || same_name(name, "equalto") || same_name(name, "==") || same_name(name, "ne") ||
      same_name(name, "!=")) {
    Guard g{Guard::Kind::test, Guard::Expect::value, Op::none, name, {}, {}, {}, Value(result)};
    if (!operands(subject, args, g))
      return refuse("a comparison of data that is not one of the conversation's strings");
    return keep(std::move(g));
  }
  refuse("a test of data other than its kind and equality");
}

void Recorder::compare(Op op, const Value& left, const Value& right, bool result) {
  if (!usable_) return;
  const bool left_marked = deep_marked(left), right_marked = deep_marked(right);
  if (!left_marked && !right_marked) return;
  Guard g{Guard::Kind::compare, Guard::Expect::value, op, {}, {}, {}, {}, Value(result)};
  const bool equality = op == Op::eq || op == Op::ne;
  const bool membership = op == Op::in || op == Op::not_in;
  if (membership && (right.is_dict() || right.kind() == Value::Kind::ns)) {
    if (!left_marked) return;  // a key looked up: the keys are the shape's
    return refuse("data looked up as a key");
  }
  if (membership && right.is_list() && right_marked) return refuse("data searched in a list of data");
  if (!equality && !membership) return refuse("data ordered with <, <=, > or >=");
  if (!operand(left, g.subject) || !operand(right, g.positional.emplace_back()))
    return refuse("a comparison of data that is not one of the conversation's strings");
  keep(std::move(g));
}

void Recorder::binary(Op op, const Value& a, const Value& b) {
  if (!usable_ || (!deep_marked(a) && !deep_marked(b))) return;
  // str + str and list + list keep every datum as it is (the strings' runs follow it).
  if (op == Op::add && !a.is_markup() && !b.is_markup() &&
      ((a.is_string() && b.is_string()) || (a.is_list() && b.is_list())))
    return;
  refuse("an operator other than + applied to data");
}

void Recorder::native_call(const std::string& name, const CallArgs& args) {
  if (!usable_) return;
  if (same_name(name, "strftime_now")) return refuse("strftime_now (the output depends on the time)");
  bool positional_marked = false, keyword_marked = false;
  for (const Value& a : args.positional) positional_marked = positional_marked || deep_marked(a);
  for (const auto& [k, a] : args.keywords) keyword_marked = keyword_marked || deep_marked(a);
  if (!positional_marked && !keyword_marked) return;
  // namespace(x=...) and dict(x=...) hold values as given; loop.cycle returns one of its arguments.
  if (same_name(name, "cycle") && !keyword_marked) return;
  if ((same_name(name, "namespace") || same_name(name, "dict")) && !positional_marked) return;
  refuse("a function called with data");
}

ReplayCache::ReplayCache() {
  const char* env = std::getenv("KEEL_TEMPLATE_REPLAY");
  const std::string_view v = env ? env : "";
  mode_ = v == "off" ? Mode::off : v == "verify" ? Mode::verify : Mode::on;
}

ReplayCache::ReplayCache(Mode mode) : mode_(mode) {}
ReplayCache::~ReplayCache() = default;

ReplayCache::Stats ReplayCache::stats() const { return Stats{replayed_, rendered_, recorded_, refused_}; }

std::string ReplayCache::first_refusal() const {
  std::lock_guard lock(mutex_);
  return first_refusal_;
}

namespace {

// Whether guard `g` gives its recorded result for this conversation's `datums`: the operation
// run again by the built-in code that ran it while recording (an error: it does not hold).
bool guard_holds(Interpreter& in, const Guard& g, const std::vector<const Value*>& datums) {
  auto value_of = [&](const Operand& o) { return o.datum >= 0 ? *datums[size_t(o.datum)] : o.constant; };
  const Value subject = value_of(g.subject);
  CallArgs args;
  for (const Operand& o : g.positional) args.positional.push_back(value_of(o));
  for (const auto& [k, o] : g.keywords) args.keywords.emplace_back(k, value_of(o));
  Value result;
  try {
    switch (g.kind) {
      case Guard::Kind::method:
        if (!call_string_method(in, subject, g.name, args, result)) return false;
        break;
      case Guard::Kind::filter: result = builtin_filter(in, g.name, subject, args, 0); break;
      case Guard::Kind::test: result = Value(builtin_test(in, g.name, subject, args, 0)); break;
      case Guard::Kind::compare: result = Value(compare_values(in, g.op, subject, args.positional[0], 0)); break;
    }
  } catch (const Error&) {
    return false;  // the rendering will raise it
  }
  const std::string& datum = datums[size_t(std::max(g.subject.datum, 0))]->as_str().text;
  switch (g.expect) {
    case Guard::Expect::value: return result.kind() == g.expected.kind() && equal(result, g.expected);
    case Guard::Expect::same_datum: return result.is_string() && !result.is_markup() && result.as_str().text == datum;
    case Guard::Expect::split_whole:
      return result.is_list() && result.as_list().size() == 1 && result.as_list()[0].is_string() &&
             result.as_list()[0].as_str().text == datum;
  }
  return false;
}

bool same_rendering(const Rendered& a, const Rendered& b) {
  if (a.text.text != b.text.text || a.generation != b.generation || a.text.runs.size() != b.text.runs.size())
    return false;
  for (size_t i = 0; i < a.text.runs.size(); ++i) {
    const Run &x = a.text.runs.begin()[i], &y = b.text.runs.begin()[i];
    if (x.begin != y.begin || x.end != y.end || x.source != y.source) return false;
  }
  return true;
}

using Recording = ReplayCache::Recording;

// Recording `r` with this conversation's `datums` in place; nothing when it would pass the
// output limit (the rendering raises the limit's error).
std::optional<Rendered> assembled(const Recording& r, const std::vector<const Value*>& datums,
                                  const RenderLimits& limits) {
  size_t size = 0;
  for (const auto& p : r.pieces)
    size += p.datum >= 0 ? datums[size_t(p.datum)]->as_str().text.size() : p.literal.size();
  if (size > limits.max_output_bytes) return std::nullopt;
  Rendered out;
  out.text.text.reserve(size);
  out.text.runs.reserve(r.pieces.size());
  std::vector<size_t> starts;  // of each piece, where generation blocks need them
  const bool generation = !r.generation.empty();
  for (const auto& p : r.pieces) {
    if (generation) starts.push_back(out.text.text.size());
    if (p.datum >= 0)
      out.text.append(datums[size_t(p.datum)]->as_str());
    else
      out.text.text += p.literal;
  }
  starts.push_back(out.text.text.size());
  for (const auto& [b, e] : r.generation)
    out.generation.emplace_back(starts[b.piece] + b.offset, starts[e.piece] + e.offset);
  return out;
}

// The first of `variants` whose guards all hold for `datums`, replayed; nothing when none holds
// (or the one that holds would pass the output limit).
std::optional<Rendered> replayed(const Template& t, std::span<const Recording* const> variants,
                                 const std::vector<const Value*>& datums, const RenderLimits& limits) {
  Interpreter in(t.syntax(), t.origin(), limits);
  for (const Recording* r : variants) {
    bool holds = true;
    for (const Guard& g : r->guards)
      if (!(holds = guard_holds(in, g, datums))) break;
    if (holds) return assembled(*r, datums, limits);
  }
  return std::nullopt;
}

// The recorded output `text` as literals and datums, into `recording` (and where each piece
// starts into `starts`): false, refused, when a datum run is not one of the conversation's
// datums, whole.
bool cut_into_pieces(const Str& text, const std::vector<const Value*>& datums, Recording& recording,
                     std::vector<size_t>& starts, Recorder& recorder) {
  size_t at = 0;
  for (const Run& run : text.runs) {
    const int d = run.source;
    if (d < 0 || size_t(d) >= datums.size() ||
        text.text.compare(run.begin, run.end - run.begin, datums[size_t(d)]->as_str().text) != 0) {
      recorder.refuse("data in the output that is not one of the conversation's strings, whole");
      return false;
    }
    if (run.begin > at) {
      starts.push_back(at);
      recording.pieces.push_back({text.text.substr(at, run.begin - at), -1});
    }
    starts.push_back(run.begin);
    recording.pieces.push_back({{}, d});
    at = run.end;
  }
  if (at < text.text.size()) {
    starts.push_back(at);
    recording.pieces.push_back({text.text.substr(at), -1});
  }
  return true;
}

// The generation blocks of `out` as positions in the recording's pieces: false, refused, when
// one starts or ends inside a datum.
bool place_generation(const Rendered& out, const std::vector<size_t>& starts, Recording& recording,
                      Recorder& recorder) {
  auto position = [&](size_t byte, Position& p) {
    for (size_t k = 0; k < starts.size(); ++k) {
      const size_t end = k + 1 < starts.size() ? starts[k + 1] : out.text.text.size();
      if (byte == starts[k] || (byte > starts[k] && byte < end && recording.pieces[k].datum < 0)) {
        p = {k, byte - starts[k]};
        return true;
      }
    }
    if (byte == out.text.text.size()) {
      p = {starts.size(), 0};
      return true;
    }
    return false;  // inside a datum
  };
  for (const auto& [b, e] : out.generation) {
    Position pb, pe;
    if (!position(b, pb) || !position(e, pe)) {
      recorder.refuse("a generation block that starts or ends inside data");
      return false;
    }
    recording.generation.emplace_back(pb, pe);
  }
  return true;
}

// The recorded rendering as the plain one is: each run's source the datum's own (the recording
// marked each datum with its index).
Str untagged(const Str& recorded, const std::vector<const Value*>& datums) {
  Str text;
  text.text.reserve(recorded.text.size());
  size_t at = 0;
  for (const Run& run : recorded.runs) {
    text.text.append(recorded.text, at, run.begin - at);
    const int d = run.source;
    const int source = d >= 0 && size_t(d) < datums.size() ? datums[size_t(d)]->as_str().runs.front().source : d;
    text.append(Str(recorded.text.substr(run.begin, run.end - run.begin), source));
    at = run.end;
  }
  text.text.append(recorded.text, at);
  return text;
}

}  // namespace

Rendered ReplayCache::render(const Template& t, const Dict& variables, const RenderLimits& limits) {
  if (mode_ == Mode::off) return t.render(variables, limits);
  ShapeWalk& shape = ShapeWalk::reused();
  if (!shape.dict(variables)) return t.render(variables, limits);

  Shape known;  // a copy: other threads may add variants meanwhile
  bool record = false;
  {
    std::lock_guard lock(mutex_);
    auto it = shapes_.find(shape.key);
    if (it != shapes_.end()) {
      known = it->second;
      record = known.refused < kMaxRefusals && known.count < kMaxVariants;
    } else {
      record = shapes_.size() < kMaxShapes;
    }
  }

  // Replay: the first recording whose guards all hold.
  if (known.count > 0)
    if (std::optional<Rendered> out = replayed(t, {known.variants.data(), known.count}, shape.datums, limits)) {
      if (mode_ == Mode::verify) {
        const Rendered rendered = t.render(variables, limits);
        require(same_rendering(*out, rendered),
                "{}: a replayed rendering differs from the template's own ({} bytes "
                "against {}): a guard is missing (KEEL_TEMPLATE_REPLAY=off renders every conversation)",
                t.origin(), out->text.text.size(), rendered.text.text.size());
      }
      ++replayed_;
      return std::move(*out);
    }
  if (!record) {
    ++rendered_;
    return t.render(variables, limits);
  }

  // Record: render the variables with each datum marked with its index, watching. (The marked
  // copy's datums have the texts of shape.datums, index for index.)
  int next = 0;
  const Value copy = tagged(Value(variables), next);
  Recorder recorder(shape.datums, shape.keyed);
  Rendered out = t.render(copy.as_dict(), limits, &recorder);
  auto recording = std::make_unique<Recording>();
  std::vector<size_t> starts;
  const bool usable = recorder.usable() && cut_into_pieces(out.text, shape.datums, *recording, starts, recorder) &&
                      place_generation(out, starts, *recording, recorder);
  out.text = untagged(out.text, shape.datums);
  if (mode_ == Mode::verify)
    require(same_rendering(out, t.render(variables, limits)),
            "{}: a recorded rendering differs from the template's own (KEEL_TEMPLATE_REPLAY=off renders every "
            "conversation)",
            t.origin());

  std::lock_guard lock(mutex_);
  Shape& s = shapes_[shape.key];
  if (usable && s.count < kMaxVariants) {
    recording->guards = std::move(recorder.guards());
    s.variants[s.count++] = recording.get();
    recordings_.push_back(std::move(recording));
    ++recorded_;
  } else if (!usable) {
    ++s.refused;
    ++refused_;
    if (first_refusal_.empty()) first_refusal_ = recorder.refusal();
  }
  return out;
}

}  // namespace keel::data::jinja
