// Shared by the libFuzzer targets: a per-process scratch directory on tmpfs (/dev/shm, so that
// writing the input for parsers that take a path costs no disk I/O), and the rule every target
// checks: bad input may only end in keel::Error. Any other exception escapes the target, and
// libFuzzer reports it as a crash (an uncaught exception aborts), as it does sanitizer reports.
#pragma once
#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>

#include "keel/core/error.h"

namespace keel::fuzz {

// Removed at exit; one per process so that parallel fuzzing jobs (-jobs=N) do not collide. Never
// destroyed: the atexit handler that removes it runs after static destructors would have.
inline const std::string& scratch_dir() {
  static const std::string* dir = [] {
    const char* base = std::getenv("KEEL_FUZZ_TMP");
    auto* d =
        new std::string(std::string(base ? base : (std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : "/tmp")) +
                        "/keel-fuzz-" + std::to_string(::getpid()));
    std::filesystem::create_directories(*d);
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(scratch_dir(), ignored);
    });
    return d;
  }();
  return *dir;
}

// Plain write (not keel's atomic writer: the input must land exactly, with no fsync per run).
inline void write_bytes(const std::string& path, const void* data, size_t size) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) std::abort();
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, p, size);
    if (n <= 0) std::abort();
    p += n;
    size -= size_t(n);
  }
  ::close(fd);
}
inline void write_bytes(const std::string& path, std::string_view bytes) {
  write_bytes(path, bytes.data(), bytes.size());
}

// The input split at the first NUL byte: a main part and the rest (e.g. recipe text and --set
// overrides, tokenizer.json and text to encode). Seeds are written the same way.
inline std::pair<std::string_view, std::string_view> split_at_nul(const uint8_t* data, size_t size) {
  std::string_view all(reinterpret_cast<const char*>(data), size);
  size_t nul = all.find('\0');
  if (nul == std::string_view::npos) return {all, {}};
  return {all.substr(0, nul), all.substr(nul + 1)};
}

// A property the fuzzer found violated (a round trip that does not hold, ...): a crash libFuzzer
// saves the input of.
[[noreturn]] inline void property_failed(const char* what, const std::string& detail = {}) {
  std::fprintf(stderr, "keel fuzz: property violated: %s\n%s\n", what, detail.c_str());
  std::abort();
}

}  // namespace keel::fuzz
