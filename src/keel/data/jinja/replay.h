// Rendering a template by replay: the conversations of a dataset mostly share a few shapes (how
// many messages, which roles and keys, which strings are empty), and a template's work for a
// shape is the same but for the data's own text. So the first conversation of a shape is
// rendered while a Recorder watches: every string of the conversation (a datum) is tagged, every
// observation the template makes of a datum's text (role == "user", '</think>' in content,
// content.startswith(...), content.lstrip('\n') leaving it whole) is kept as a guard with its
// result, and the output is kept as literal text and datum references. A later conversation of
// the same shape whose guards all give the recorded results renders to the same literals with its
// own datums in place: what the interpreter would have produced, without interpreting.
//
// Sound by refusal: an operation that reads a datum's text and is not one of the few whose result
// a guard can check (any other filter, method, test or operator, a datum as a dict key, a datum
// iterated or indexed, printed through str() or tojson, strftime_now) makes the shape's recording
// unusable, and such conversations are rendered. `KEEL_TEMPLATE_REPLAY=verify` renders every
// replayed conversation too and fails on any difference (the tests run with it);
// `KEEL_TEMPLATE_REPLAY=off` renders everything.
#pragma once
#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "keel/data/jinja/ast.h"
#include "keel/data/jinja/template.h"
#include "keel/data/jinja/value.h"

namespace keel::data::jinja {

struct CallArgs;

// An operand of a guarded observation: datum `datum` of the conversation, or a constant.
struct Operand {
  int datum = -1;
  Value constant;
};

// One observation of the data and what it gave: the operation, re-run on the next conversation's
// datums by the same built-in code, must give the same.
struct Guard {
  enum class Kind : uint8_t { method, filter, test, compare };
  // value: the result equals `expected` (and is of its kind); same_datum: the result is the
  // subject datum, whole (strip that strips nothing); split_whole: [the subject datum] (a split
  // that finds no separator).
  enum class Expect : uint8_t { value, same_datum, split_whole };
  Kind kind;
  Expect expect;
  Op op = Op::none;                 // compare
  std::string name;                 // method, filter or test
  Operand subject;                  // compare: the left operand
  std::vector<Operand> positional;  // compare: the right operand
  std::vector<std::pair<std::string, Operand>> keywords;
  Value expected;
};

// What the interpreter tells the recorder (interpreter.cpp calls these where it reads values).
class Recorder {
 public:
  // The datums of the conversation being recorded (their strings' runs carry their index as the
  // source) and which of them the shape key holds whole (guards on those alone are not kept).
  Recorder(std::vector<const Value*> datums, std::vector<uint8_t> keyed)
      : datums_(std::move(datums)), keyed_(std::move(keyed)) {}

  bool usable() const { return usable_; }
  const std::string& refusal() const { return refusal_; }
  std::vector<Guard>& guards() { return guards_; }

  // Whether any string in `v` holds datum text.
  static bool deep_marked(const Value& v);
  // The datum `v` is, whole (its text and nothing else), or -1.
  int datum_of(const Value& v) const;

  void refuse(const char* why) {
    if (usable_) refusal_ = why;
    usable_ = false;
  }
  // `v` reaches the output or a string through str()/repr (print, ~, a block's value).
  void stringified(const Value& v) {
    if (!v.is_string() && deep_marked(v)) refuse("a value holding data printed through str()");
  }
  void method(const std::string& name, const Value& self, const CallArgs& args, const Value& result);
  void filter(const std::string& name, const Value& subject, const CallArgs& args, const Value& result);
  void test(const std::string& name, const Value& subject, const CallArgs& args, bool result);
  void compare(Op op, const Value& left, const Value& right, bool result);
  void binary(Op op, const Value& a, const Value& b);
  // A native function (not a macro) called with `args`.
  void native_call(const std::string& name, const CallArgs& args);

 private:
  bool operand(const Value& v, Operand& out) const;  // false: data that is not a whole datum
  bool operands(const Value& subject, const CallArgs& args, Guard& g) const;
  void keep(Guard g);

  std::vector<const Value*> datums_;
  std::vector<uint8_t> keyed_;
  std::vector<Guard> guards_;
  bool usable_ = true;
  std::string refusal_;
};

// The recordings of one template, shared by the threads rendering with it.
class ReplayCache {
 public:
  enum class Mode { on, off, verify };
  // Mode from KEEL_TEMPLATE_REPLAY ("off", "verify"; anything else: on).
  ReplayCache();
  explicit ReplayCache(Mode mode);
  ~ReplayCache();

  // `variables` rendered with `t`: replayed when a recording of their shape applies, else rendered
  // (and recorded when the shape is new). The same result, and the same errors, as t.render().
  Rendered render(const Template& t, const Dict& variables, const RenderLimits& limits = {});

  struct Stats {
    int64_t replayed = 0, rendered = 0, recorded = 0, refused = 0;
  };
  Stats stats() const;
  std::string first_refusal() const;

  struct Recording;

 private:
  static constexpr size_t kMaxVariants = 8;
  struct Shape {
    std::array<const Recording*, kMaxVariants> variants{};  // different guard results
    size_t count = 0;
    int refused = 0;
  };
  Mode mode_;
  mutable std::mutex mutex_;
  std::unordered_map<std::string, Shape> shapes_;
  std::vector<std::unique_ptr<const Recording>> recordings_;  // what shapes_ points to, never moved
  std::atomic<int64_t> replayed_{0}, rendered_{0}, recorded_{0}, refused_{0};
  std::string first_refusal_;
};

}  // namespace keel::data::jinja
