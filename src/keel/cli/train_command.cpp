// keel train RECIPE.toml [--set key=value ...] [--print-recipe]
#include <fmt/format.h>

#include <functional>
#include <iostream>
#include <map>

#include "keel/cli/commands.h"
#include "keel/train/demo.h"
#include "keel/train/recipe.h"
#include "keel/train/trainer.h"

namespace keel::cli {
namespace {

struct TrainOptions {
  std::string recipe;
  std::vector<std::string> overrides;
  bool print_recipe = false;
};

std::map<CLI::App*, std::function<int()>>& actions() {
  static std::map<CLI::App*, std::function<int()>> table;
  return table;
}

}  // namespace

void add_train_command(CLI::App& app) {
  auto options = std::make_shared<TrainOptions>();
  auto* cmd = app.add_subcommand("train", "Train (fine-tune or pre-train) a model from a TOML recipe");
  cmd->add_option("recipe", options->recipe, "Recipe file (TOML)")->required();
  cmd->add_option("--set", options->overrides, "Override a recipe key: --set key=value (repeatable)");
  cmd->add_flag("--print-recipe", options->print_recipe, "Print the fully resolved recipe and exit");
  actions()[cmd] = [options] {
    auto recipe = train::load_recipe(options->recipe, options->overrides);
    if (options->print_recipe) {
      fmt::print("{}", train::recipe_to_toml(recipe));
      return 0;
    }
    train::run_training(recipe, std::cout);
    return 0;
  };
}

void add_demo_command(CLI::App& app) {
  auto options = std::make_shared<train::DemoOptions>();
  auto* cmd = app.add_subcommand("demo", "Train a tiny model from scratch on generated data and show what it learned");
  cmd->add_option("--work", options->work_dir, "Directory for the demo's data, recipe and run")->capture_default_str();
  cmd->add_option("--steps", options->max_steps, "Optimizer steps")->capture_default_str();
  actions()[cmd] = [options] {
    train::run_demo(*options, std::cout);
    return 0;
  };
}

int run_selected(CLI::App& app) {
  for (auto& [cmd, action] : actions())
    if (cmd->parsed()) return action();
  return 0;
}

}  // namespace keel::cli
