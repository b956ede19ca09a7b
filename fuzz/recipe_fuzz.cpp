// TOML recipes: parse_recipe with --set overrides (the input is the recipe text, then after a NUL
// byte one override per line), and the round trip checkpoints rely on: recipe_to_toml of a valid
// recipe parses back to the same resolved recipe.
#include <fmt/format.h>

#include <vector>

#include "fuzz_support.h"
#include "keel/recipe/recipe.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel;
  auto [text, rest] = fuzz::split_at_nul(data, size);
  std::vector<std::string> overrides;
  for (size_t start = 0; start < rest.size() && overrides.size() < 8;) {
    size_t end = rest.find('\n', start);
    if (end == std::string_view::npos) end = rest.size();
    overrides.emplace_back(rest.substr(start, end - start));
    start = end + 1;
  }
  recipe::Recipe r;
  try {
    r = recipe::parse_recipe(std::string(text), "recipe.toml", overrides);
  } catch (const Error&) {
    return 0;
  }
  (void)recipe::inactive_key_warnings(r);
  const std::string resolved = recipe::recipe_to_toml(r);
  try {
    recipe::Recipe back = recipe::parse_recipe(resolved, "resolved.toml");
    if (recipe::recipe_to_toml(back) != resolved) {
      fuzz::property_failed("recipe_to_toml round trip changes the recipe",
                            fmt::format("first:\n{}\nsecond:\n{}", resolved, recipe::recipe_to_toml(back)));
    }
  } catch (const Error& e) {
    fuzz::property_failed("recipe_to_toml of a valid recipe does not parse", fmt::format("{}\n{}", resolved, e.what()));
  }
  return 0;
}
