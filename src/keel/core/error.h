// keel::Error: the one exception type for bad input and failed operations.
// Every message names the file (or key), the place in it, and what was expected,
// so a user can fix the input without reading keel's source. The CLI maps it to exit code 2.
#pragma once
#include <fmt/format.h>
#include <stdexcept>
#include <string>

namespace keel {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

// Checks an invariant of input data; on failure throws keel::Error with the message.
template <typename... Args>
void require(bool condition, fmt::format_string<Args...> format, Args&&... args) {
  if (!condition) throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace keel
