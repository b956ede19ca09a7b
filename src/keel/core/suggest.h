// "Did you mean ...?" for a mistyped name: the nearest of the valid names by edit distance, when it
// is near enough to be the likely intent. Recipe keys (recipe/recipe.cpp) and the CLI's subcommands
// (cli/main.cpp) use the same rule, so a typo gets the same kind of answer everywhere.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

namespace keel {

// Levenshtein distance: insertions, deletions and substitutions of one byte each cost 1.
size_t edit_distance(const std::string& a, const std::string& b);

// The valid name nearest to `word` if it is within max(2, |word| / 3) edits, else "" (the first of
// equally near names, in the order given).
std::string nearest_name(const std::string& word, const std::vector<std::string>& valid);

// " (did you mean 'NAME'?)" for nearest_name, or "" when no name is near: appended to a message.
std::string did_you_mean(const std::string& word, const std::vector<std::string>& valid);

}  // namespace keel
