// The values a chat template computes with: Python's as Jinja sees them (None, bool, int, float,
// str, list, dict, plus Jinja's undefined, namespaces and callables), with Python's semantics
// for truth, equality, ordering and str()/repr(), because transformers renders templates with
// Python's Jinja and keel must print the same characters.
//
// Strings carry their provenance: `runs` mark the bytes that came from the conversation (a
// message's content, a tool's schema) rather than from the template. Concatenation, slicing and
// the stripping methods keep the marks exact; operations that rebuild text (case changes,
// tojson) mark all of their result when any input byte was marked. The renderer uses the marks
// to encode special-token strings inside data as text and to find each assistant message's turn.
#pragma once
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace keel::data::jinja {

// The largest string a rendering may build, for the thread rendering (Template::render sets it to
// its output limit): every way to grow a string checks it, so that nested filters cannot take the
// memory first ('x' | e | e | e ..., a long separator in join after join).
class ValueSizeLimit {
 public:
  explicit ValueSizeLimit(size_t bytes);
  ~ValueSizeLimit();
  static void check(size_t bytes);  // keel::Error past the limit

 private:
  size_t previous_;
};

// [begin, end) bytes of a string that came from data `source` (>= 0: the message's index in the
// conversation; kOtherData: tools, documents and other inputs).
struct Run {
  size_t begin, end;
  int source;
};
constexpr int kOtherData = -1;

// A string's runs, in one contiguous array. Nearly every string has none or one (a message's
// text, or a template string), so one run is held in place and only a second moves them all to
// the heap: a marked string costs no allocation for its marks, and neither does copying it.
class Runs {
 public:
  Runs() = default;
  Runs(const Runs& other) : one_(other.one_), size_(other.size_), many_(other.many_) {}
  Runs(Runs&& other) noexcept : one_(other.one_), size_(std::exchange(other.size_, 0)), many_(std::move(other.many_)) {}
  Runs& operator=(const Runs& other) {
    one_ = other.one_;
    size_ = other.size_;
    many_ = other.many_;
    return *this;
  }
  Runs& operator=(Runs&& other) noexcept {
    one_ = other.one_;
    size_ = std::exchange(other.size_, 0);
    many_ = std::move(other.many_);
    return *this;
  }

  Run* begin() { return size_ <= 1 ? &one_ : many_.data(); }
  Run* end() { return begin() + size_; }
  const Run* begin() const { return size_ <= 1 ? &one_ : many_.data(); }
  const Run* end() const { return begin() + size_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  Run& front() { return *begin(); }
  const Run& front() const { return *begin(); }
  Run& back() { return begin()[size_ - 1]; }
  const Run& back() const { return begin()[size_ - 1]; }
  void push_back(const Run& r) {
    if (size_ == 0) {
      one_ = r;
    } else {
      if (size_ == 1) many_.assign(1, one_);
      many_.push_back(r);
    }
    ++size_;
  }
  void pop_back() {
    if (--size_ >= 1) {
      many_.pop_back();
      if (size_ == 1) one_ = many_[0];
    }
  }
  void reserve(size_t n) {
    if (n > 1) many_.reserve(n);
  }
  void clear() {
    size_ = 0;
    many_.clear();
  }

 private:
  Run one_{};
  size_t size_ = 0;
  std::vector<Run> many_;  // every run when there are two or more
};

struct Str {
  std::string text;
  Runs runs;  // sorted, disjoint, non-empty

  Str() = default;
  Str(std::string t) : text(std::move(t)) {}
  Str(std::string t, int source);  // all of it from `source`

  void append(const Str& other);
  void append(std::string_view plain) {
    ValueSizeLimit::check(text.size() + plain.size());
    text += plain;
  }
  // bytes [begin, end) with their marks
  Str substr(size_t begin, size_t end) const;
  // the first `size` bytes with their marks
  void truncate(size_t size);
  // the first source any byte came from, or nullopt-like `kNoSource`
  int first_source() const { return runs.empty() ? kNoSource : runs.front().source; }
  bool marked() const { return !runs.empty(); }
  static constexpr int kNoSource = -2;
};

class Value;
using List = std::vector<Value>;

// Whether a name, key or operator equals `b`, compared in line: the length first, then the bytes
// as two overlapping words (names are short and mostly differ in length; a template looks them
// up, and dispatches filters, methods and operators by them, at every step, where a call to
// string_view's compare and memcmp per test cost more than the test, and a byte loop over
// "content" seven compares).
[[gnu::always_inline]] inline bool same_name(std::string_view a, std::string_view b) {
  const size_t n = a.size();
  if (n != b.size()) return false;
  auto word = [](const char* p, auto w) {
    std::memcpy(&w, p, sizeof w);
    return w;
  };
  if (n >= 8 && n <= 16)  // the first 8 bytes and the last 8, which overlap when n < 16
    return word(a.data(), uint64_t()) == word(b.data(), uint64_t()) &&
           word(a.data() + n - 8, uint64_t()) == word(b.data() + n - 8, uint64_t());
  if (n >= 4 && n < 8)
    return word(a.data(), uint32_t()) == word(b.data(), uint32_t()) &&
           word(a.data() + n - 4, uint32_t()) == word(b.data() + n - 4, uint32_t());
  if (n > 16) return std::memcmp(a.data(), b.data(), n) == 0;
  for (size_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// An ordered dict with string keys (JSON's objects, Jinja's dict literals and namespaces).
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* find(std::string_view key) const;
  Value* find(std::string_view key);
  void set(std::string_view key, Value value);  // the key copied only when new
};

class Interpreter;
struct CallArgs;
// A Jinja callable: a macro, a global function such as raise_exception, or a bound method.
using NativeFunction = std::function<Value(Interpreter&, CallArgs&)>;
struct Callable {
  std::string name;
  NativeFunction call;
  bool macro = false;  // a template's macro or caller(): its arguments are bound, not inspected
};

class Value {
 public:
  enum class Kind { undefined, none, boolean, integer, real, string, list, dict, ns, callable };

  Value() = default;  // undefined
  static Value undefined(std::string name = {});
  // An undefined naming a string that outlives it (a name in the template's syntax tree, which
  // outlives every rendering): nothing allocated for a lookup that misses.
  static Value undefined_borrowing(const std::string& name);
  static Value none();
  // Inline: loops and comparisons make numbers and booleans at every step.
  Value(bool b) : kind_(Kind::boolean), i_(b) {}
  Value(int64_t i) : kind_(Kind::integer), i_(i) {}
  Value(int i) : Value(int64_t(i)) {}
  Value(double d) : kind_(Kind::real), d_(d) {}
  Value(Str s);
  Value(std::string s) : Value(Str(std::move(s))) {}
  Value(const char* s) : Value(Str(std::string(s))) {}
  Value(List l, bool tuple = false);
  Value(Dict d);
  static Value namespace_of(Dict d);
  static Value function(std::string name, NativeFunction f);
  // A template's macro (or caller()): a function that binds its arguments without inspecting them.
  static Value macro(std::string name, NativeFunction f);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::undefined; }
  bool is_none() const { return kind_ == Kind::none; }
  bool is_string() const { return kind_ == Kind::string; }
  bool is_number() const { return kind_ == Kind::integer || kind_ == Kind::real || kind_ == Kind::boolean; }
  bool is_list() const { return kind_ == Kind::list; }
  bool is_dict() const { return kind_ == Kind::dict; }
  bool is_tuple() const { return kind_ == Kind::list && tuple_; }
  // Jinja's Markup (a string from `safe` or `escape`): adding a plain string to it escapes that
  // string, and escaping it again changes nothing. Real templates rely on it (functionary's
  // `"..."|safe + tool | tojson` prints the JSON HTML-escaped).
  static Value markup(Str s);
  bool is_markup() const { return kind_ == Kind::string && tuple_; }

  bool as_bool() const { return i_ != 0; }
  int64_t as_int() const {
    expect(is_number(), "number");
    return kind_ == Kind::real ? int64_t(d_) : i_;
  }
  double as_real() const {
    expect(is_number(), "number");
    return kind_ == Kind::real ? d_ : double(i_);
  }
  // The accessors check the kind (keel::Error "expected a str, got bool"): a template hands any value
  // to any filter or method, and a wrong one must be an error, never a misread.
  const Str& as_str() const {
    expect(kind_ == Kind::string, "str");
    return *static_cast<const Str*>(p_.get());
  }
  // The string, moved out when this value is its only owner (a temporary: `a + b + c` then grows
  // one buffer instead of copying the text so far at every +), else copied.
  Str take_str() &&;
  const List& as_list() const {
    expect(kind_ == Kind::list, "list");
    return *static_cast<const List*>(p_.get());
  }
  const Dict& as_dict() const {
    expect(kind_ == Kind::dict || kind_ == Kind::ns, "dict");
    return *static_cast<const Dict*>(p_.get());
  }
  // A namespace's attributes: namespaces are the one mutable value (made non-const in namespace_of).
  Dict& ns_dict() const {
    expect(kind_ == Kind::ns || kind_ == Kind::dict, "namespace");
    return *const_cast<Dict*>(static_cast<const Dict*>(p_.get()));
  }
  const Callable& as_callable() const {
    expect(kind_ == Kind::callable, "function");
    return *static_cast<const Callable*>(p_.get());
  }
  const std::string& undefined_name() const;

  // Overwrites a number or boolean held here with another, in place (a for loop's counters, once
  // per iteration): nothing to construct, move or release.
  void set_number(int64_t i) {
    expect(p_ == nullptr && kind_ != Kind::undefined, "number");
    kind_ = Kind::integer;
    i_ = i;
  }
  void set_bool(bool b) {
    expect(p_ == nullptr && kind_ != Kind::undefined, "bool");
    kind_ = Kind::boolean;
    i_ = b;
  }

  bool truthy() const;
  // The object behind a container or callable (Python's `is`).
  const void* identity() const { return p_.get(); }
  // Whether another value shares this one's object (a copy of a list, dict or namespace).
  bool shared() const { return p_.use_count() > 1; }
  // Python's type name, for messages ("str", "list", "dict", "NoneType", ...)
  std::string type_name() const;

 private:
  void expect(bool ok, const char* wanted) const {
    if (!ok) wrong_kind(wanted);
  }
  [[noreturn]] void wrong_kind(const char* wanted) const;
  static Value callable(Callable c);
  // 32 bytes, one reference count to copy: templates copy values at every lookup.
  Kind kind_ = Kind::undefined;
  bool tuple_ = false;  // list: a tuple; string: Markup
  union {
    int64_t i_ = 0;  // boolean, integer
    double d_;       // real
  };
  // string: Str, list: List, dict/ns: Dict, callable: Callable, undefined: its name (std::string),
  // unless i_ holds the address of a borrowed one (undefined_borrowing)
  std::shared_ptr<const void> p_;
};

// Dict keys are strings; Python's other hashable keys ({0: 0, 512: 128} in real templates: ints,
// None, floats, bools as ints) are written after a NUL byte so that no string key is mistaken for
// one (a string key that starts with NUL is escaped the same way). keel::Error for an unhashable key.
std::string dict_key(const Value& key);
// dict_key of a string key (JSON's object keys), without making it a value first.
std::string string_dict_key(std::string_view key);
Value key_value(const std::string& key);
// The key as json.dumps writes it ("1", "null", "true").
std::string json_key(const std::string& key);

// Python's ==, and <, <=, ... (keel::Error for unorderable types, as Python raises TypeError).
bool equal(const Value& a, const Value& b);
bool less(const Value& a, const Value& b);

// The first data source of any string in `v` (containers searched in order), or Str::kNoSource.
int first_source(const Value& v);
// `text` (rebuilt from `from`: its repr, its JSON) marked whole when anything in `from` was.
Str marked_like(std::string text, const Value& from);

// Python's str() and repr(); Jinja prints str(), undefined as "".
Str to_str(const Value& v);
std::string repr(const Value& v);
// Python's float repr: shortest round trip, "1.0", "1e-05", "1e+16".
std::string float_repr(double d);

// Python's json.dumps as transformers' tojson calls it (ensure_ascii=False by default,
// separators (", ", ": ") or ("," , ": ") with an indent, keys in insertion order unless sorted).
struct JsonOptions {
  bool ensure_ascii = false;
  int indent = -1;  // -1: no newlines
  std::string item_separator = ", ", key_separator = ": ";
  bool sort_keys = false;
};
std::string to_json(const Value& v, const JsonOptions& options);

// Unicode helpers on UTF-8, in code points as Python indexes strings.
size_t code_point_count(std::string_view s);
// byte offset of code point `index` (0 <= index <= count)
size_t byte_offset(std::string_view s, size_t index);
bool is_python_space(uint32_t cp);
uint32_t decode_code_point(std::string_view s, size_t pos, size_t& length);
void append_utf8(std::string& out, uint32_t cp);

}  // namespace keel::data::jinja
