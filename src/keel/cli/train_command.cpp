// keel train RECIPE.toml [--set key=value ...] [--print-recipe]
#include <fmt/format.h>

#include <iostream>
#include <memory>

#include "keel/cli/commands.h"
#include "keel/train/recipe.h"
#include "keel/train/trainer.h"

namespace keel::cli {
namespace {

struct TrainOptions {
  std::string recipe;
  std::vector<std::string> overrides;
  bool print_recipe = false;
};

const CommandRegistration kTrain{
    "train", "Train (fine-tune or pre-train) a model from a TOML recipe", [](CLI::App& cmd) -> CommandAction {
      auto options = std::make_shared<TrainOptions>();
      cmd.add_option("recipe", options->recipe, "Recipe file (TOML)")->required();
      cmd.add_option("--set", options->overrides, "Override a recipe key: --set key=value (repeatable)");
      cmd.add_flag("--print-recipe", options->print_recipe, "Print the fully resolved recipe and exit");
      return [options] {
        auto recipe = train::load_recipe(options->recipe, options->overrides);
        if (options->print_recipe) {
          fmt::print("{}", train::recipe_to_toml(recipe));
          return 0;
        }
        train::run_training(recipe, std::cout);
        return 0;
      };
    }};

}  // namespace
}  // namespace keel::cli
