// ControlStrings against the obvious search (every string at every position, longest first), on
// Llama 3-like sets (one first byte, 256 strings) and mixed sets with one-byte strings.
#include "keel/data/control_strings.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace keel::data {
namespace {

const std::string* longest_at(const std::vector<std::string>& strings, std::string_view text, size_t at, size_t limit) {
  const std::string* best = nullptr;
  for (const std::string& s : strings)
    if (!s.empty() && s.size() <= limit - at && text.substr(at, s.size()) == s && (!best || s.size() > best->size()))
      best = &s;
  return best;
}

void expect_as_obvious_search(const std::vector<std::string>& strings, const std::string& text) {
  const ControlStrings set(strings);
  const std::string* first = nullptr;  // the longest match at the first place anything matches
  for (size_t limit : {text.size(), text.size() / 2}) {
    size_t next = set.next_start(text, 0, limit);
    for (size_t at = 0; at < limit; ++at) {
      const std::string* want = longest_at(strings, text, at, limit);
      const std::string* got = set.at(text, at, limit);
      ASSERT_EQ(want == nullptr, got == nullptr) << "at " << at << " of '" << text << "'";
      if (want) EXPECT_EQ(*want, *got) << "at " << at;
      if (want && !first && limit == text.size()) first = want;
      // next_start may stop at a byte where nothing matches, never skip one where something does.
      if (want) {
        ASSERT_LE(next, at) << "next_start skipped a match at " << at;
      }
      if (next <= at) next = set.next_start(text, at + 1, limit);
    }
  }
  const std::string* got = set.first_in(text);
  ASSERT_EQ(got == nullptr, first == nullptr) << text;
  if (first) EXPECT_EQ(*got, *first) << text;
}

TEST(ControlStrings, LongestMatchAsTheObviousSearch) {
  std::vector<std::string> llama3 = {"<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"};
  for (int i = 0; i < 250; ++i) llama3.push_back("<|reserved_special_token_" + std::to_string(i) + "|>");
  const std::vector<std::string> mixed = {"<|im_end|>", "<|im", "<", "\n\n", "[INST]", "[", "</s>", "▁▁"};
  std::mt19937 rng(7);
  const std::vector<std::string> pieces = {
      "<|eot_id|>", "<|im_end|>", "<|im",   "<", "|",    ">", "a",
      " ",          "\n",         "[INST]", "[", "</s>", "▁", "<|reserved_special_token_12|>",
      "é"};
  for (int round = 0; round < 300; ++round) {
    std::string text;
    const int n = int(rng() % 12);
    for (int i = 0; i < n; ++i) text += pieces[rng() % pieces.size()];
    expect_as_obvious_search(llama3, text);
    expect_as_obvious_search(mixed, text);
  }
}

TEST(ControlStrings, EmptySetAndEmptyStringsFindNothing) {
  const ControlStrings none({"", ""});
  EXPECT_TRUE(none.empty());
  EXPECT_EQ(none.first_in("<|im_end|> anything"), nullptr);
  EXPECT_EQ(none.next_start("abc", 0, 3), 3u);
  const ControlStrings one({"<|im_end|>"});
  EXPECT_EQ(one.first_in("<|im_end|"), nullptr);  // a prefix is not the token
  ASSERT_NE(one.first_in("x<|im_end|>"), nullptr);
  EXPECT_EQ(one.at("<|im_end|>", 0, 9), nullptr);  // the limit cuts it
}

}  // namespace
}  // namespace keel::data
