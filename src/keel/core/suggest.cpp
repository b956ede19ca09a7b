#include "keel/core/suggest.h"

#include <fmt/format.h>

#include <algorithm>

namespace keel {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string nearest_name(const std::string& word, const std::vector<std::string>& valid) {
  std::string best;
  size_t best_distance = ~size_t(0);
  for (const auto& v : valid) {
    const size_t d = edit_distance(word, v);
    if (d < best_distance) best_distance = d, best = v;
  }
  return best_distance <= std::max<size_t>(2, word.size() / 3) ? best : "";
}

std::string did_you_mean(const std::string& word, const std::vector<std::string>& valid) {
  const std::string name = nearest_name(word, valid);
  return name.empty() ? "" : fmt::format(" (did you mean '{}'?)", name);
}

}  // namespace keel
