#include "keel/data/control_strings.h"

#include <algorithm>
#include <cstring>

namespace keel::data {

ControlStrings::ControlStrings(std::vector<std::string> strings) {
  std::erase_if(strings, [](const std::string& s) { return s.empty(); });
  std::stable_sort(strings.begin(), strings.end(),
                   [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
  strings_ = std::move(strings);
  for (size_t i = 0; i < strings_.size(); ++i) {
    const auto first = static_cast<unsigned char>(strings_[i][0]);
    if (by_first_byte_[first].empty()) first_bytes_ += char(first);
    by_first_byte_[first].push_back(uint32_t(i));
    if (strings_[i].size() == 1) {  // a one-byte string follows any byte: every second byte passes
      second_bytes_[first].fill(~uint64_t(0));
    } else {
      const auto second = static_cast<unsigned char>(strings_[i][1]);
      second_bytes_[first][second / 64] |= uint64_t(1) << (second % 64);
    }
  }
}

const std::string* ControlStrings::at(std::string_view text, size_t pos, size_t limit) const {
  const auto first = static_cast<unsigned char>(text[pos]);
  const auto& seconds = second_bytes_[first];
  if (pos + 1 < limit) {
    const auto second = static_cast<unsigned char>(text[pos + 1]);
    if ((seconds[second / 64] >> (second % 64) & 1) == 0) return nullptr;
  }
  for (uint32_t i : by_first_byte_[first]) {
    const std::string& s = strings_[i];
    if (s.size() <= limit - pos && std::memcmp(text.data() + pos, s.data(), s.size()) == 0) return &s;
  }
  return nullptr;
}

size_t ControlStrings::next_start(std::string_view text, size_t pos, size_t end) const {
  if (first_bytes_.empty()) return end;
  if (first_bytes_.size() == 1) {
    const void* hit = pos < end ? std::memchr(text.data() + pos, first_bytes_[0], end - pos) : nullptr;
    return hit ? size_t(static_cast<const char*>(hit) - text.data()) : end;
  }
  // Several first bytes: a table lookup per byte (find_first_of would run memchr over the set for
  // every byte of the text).
  for (; pos < end; ++pos)
    if (!by_first_byte_[static_cast<unsigned char>(text[pos])].empty()) return pos;
  return end;
}

const std::string* ControlStrings::first_in(std::string_view text) const {
  for (size_t pos = next_start(text, 0, text.size()); pos < text.size(); pos = next_start(text, pos + 1, text.size()))
    if (const std::string* s = at(text, pos, text.size())) return s;
  return nullptr;
}

}  // namespace keel::data
