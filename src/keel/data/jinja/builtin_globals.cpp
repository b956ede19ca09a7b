// The globals a template may call, as transformers sets them: raise_exception, strftime_now,
// namespace, dict and range.
#include <ctime>

#include "keel/core/error.h"
#include "keel/data/jinja/builtins.h"

namespace keel::data::jinja {

void add_builtin_globals(Dict& g) {
  g.set("raise_exception", Value::function("raise_exception", [](Interpreter& in, CallArgs& a) -> Value {
          fail("{}: the template refused the conversation: {}", in.origin(), to_str(a.get(0, "message")).text);
        }));
  g.set("strftime_now", Value::function("strftime_now", [](Interpreter&, CallArgs& a) {
          const std::time_t now = std::time(nullptr);
          std::tm local{};
          localtime_r(&now, &local);
          char buf[256];
          const size_t n = std::strftime(buf, sizeof buf, to_str(a.get(0, "format")).text.c_str(), &local);
          return Value(std::string(buf, n));
        }));
  auto make_dict = [](Interpreter& in, CallArgs& a, bool ns) {
    Dict d;
    for (const Value& p : a.positional) {
      if (p.is_list()) {  // dict([("a", 1), ...])
        for (const Value& pair : p.as_list()) {
          if (!pair.is_list() || pair.as_list().size() != 2) in.error(0, "dict() takes pairs of a key and a value");
          d.set(dict_key(pair.as_list()[0]), pair.as_list()[1]);
        }
        continue;
      }
      if (!p.is_dict()) in.error(0, "namespace()/dict() take a mapping or keyword arguments");
      for (const auto& [k, v] : p.as_dict().items) d.set(k, v);
    }
    for (const auto& [k, v] : a.keywords) {
      if (ns && !k.empty() && k[0] == '_') in.error(0, "a namespace cannot store underscore-prefixed attributes");
      d.set(k, v);
    }
    return ns ? Value::namespace_of(std::move(d)) : Value(std::move(d));
  };
  g.set("namespace",
        Value::function("namespace", [make_dict](Interpreter& in, CallArgs& a) { return make_dict(in, a, true); }));
  g.set("dict", Value::function("dict", [make_dict](Interpreter& in, CallArgs& a) { return make_dict(in, a, false); }));
  g.set("range", Value::function("range", [](Interpreter& in, CallArgs& a) {
          int64_t start = 0, stop, step = 1;
          if (a.positional.size() == 1) {
            stop = a.positional[0].as_int();
          } else if (a.positional.size() >= 2) {
            start = a.positional[0].as_int();
            stop = a.positional[1].as_int();
            if (a.positional.size() > 2) step = a.positional[2].as_int();
          } else {
            in.error(0, "range expects 1 to 3 integers");
          }
          if (step == 0) in.error(0, "range() arg 3 must not be zero");
          List out;
          for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
            if (out.size() >= 100'000) in.error(0, "range too big (the sandbox allows 100000 items)");
            out.emplace_back(i);
          }
          return Value(std::move(out));
        }));
}

}  // namespace keel::data::jinja
