// Small helpers shared by the unit tests: a temporary directory removed at the end of the test,
// and an assertion that a call throws keel::Error with given fragments in its message.
#pragma once
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <functional>
#include <initializer_list>
#include <string>

#include "keel/core/error.h"

namespace keel::testing {

class TempDir {
 public:
  TempDir() {
    char pattern[] = "/tmp/keel_test_XXXXXX";
    if (!mkdtemp(pattern)) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// fn must throw keel::Error whose message contains every one of `parts`.
inline void expect_keel_error(const std::function<void()>& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "expected keel::Error";
  } catch (const Error& e) {
    for (const auto& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

}  // namespace keel::testing
