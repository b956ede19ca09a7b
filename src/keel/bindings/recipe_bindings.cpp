// The recipe's keys for keel.TrainingConfig: their defaults (as TOML, from which Python takes
// names and types), the article's aliases, and validation by the same parser as recipe files.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <filesystem>

#include "keel/bindings/bindings.h"
#include "keel/recipe/recipe.h"

namespace nb = nanobind;

namespace keel::bindings {

void bind_recipe(nb::module_& m) {
  m.def(
      "default_recipe",
      [] {
        recipe::Recipe defaults;
        defaults.model_config = recipe::ScratchModel{};  // so that [model_config]'s keys are listed too
        return recipe::recipe_to_toml(defaults);
      },
      "Every recipe key with its default, as TOML (with a [model_config] table of a new model's keys).");
  m.def("recipe_key_aliases", &recipe::recipe_key_aliases, "(alias, key) pairs: cann-recipes-train's second names.");
  m.def(
      "resolve_recipe",
      [](const std::string& toml_text, const std::string& source, const std::vector<std::string>& overrides,
         const std::string& override_label, const std::string& base_dir) {
        const std::string base = base_dir.empty() ? std::filesystem::current_path().string() : base_dir;
        return recipe::recipe_to_toml(recipe::resolve_recipe(toml_text, source, base, overrides, override_label));
      },
      nb::arg("toml_text"), nb::arg("source"), nb::arg("overrides") = std::vector<std::string>{},
      nb::arg("override_label") = "--set", nb::arg("base_dir") = "",
      "Parses and validates a recipe exactly as `keel train` does; returns the resolved recipe (every key, "
      "paths absolute) as TOML, or raises keel.Error with the CLI's message.");
}

}  // namespace keel::bindings
