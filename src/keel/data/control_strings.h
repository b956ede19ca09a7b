// A set of control-token strings (a tokenizer's special tokens, a template's markers) found in
// text by their first bytes. Conversations are scanned for them byte by byte on every record, so
// the scan jumps between the bytes that can start one (memchr when all start alike, as
// "<|im_end|>" and Llama 3's 256 "<|...|>" do) and compares, at such a byte, only the strings
// that start with it and whose second byte follows: searching the text once per string (256
// times for Llama 3) cost 12% of `keel prepare` on long conversations.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace keel::data {

class ControlStrings {
 public:
  ControlStrings() = default;
  explicit ControlStrings(std::vector<std::string> strings);  // empty strings are dropped

  bool empty() const { return strings_.empty(); }
  // The longest string starting at text[pos] and ending within [pos, limit), or null.
  const std::string* at(std::string_view text, size_t pos, size_t limit) const;
  // The first byte in [pos, end) that can start a string, or end.
  size_t next_start(std::string_view text, size_t pos, size_t end) const;
  // The string that occurs first in `text` (the longest at that place), or null.
  const std::string* first_in(std::string_view text) const;

 private:
  std::vector<std::string> strings_;
  std::array<std::vector<uint32_t>, 256> by_first_byte_;     // indices into strings_, longest first
  std::array<std::array<uint64_t, 4>, 256> second_bytes_{};  // per first byte: the second bytes that follow it
  std::string first_bytes_;                                  // the distinct first bytes
};

}  // namespace keel::data
