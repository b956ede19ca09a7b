// keel demo [--work DIR] [--steps N]: the README's first command ends here.
#include <iostream>
#include <memory>

#include "keel/cli/commands.h"
#include "keel/cli/demo.h"

namespace keel::cli {
namespace {

const CommandRegistration kDemo{
    "demo", "Train a tiny model from scratch on generated data and show what it learned",
    [](CLI::App& cmd) -> CommandAction {
      auto options = std::make_shared<cli::DemoOptions>();
      cmd.add_option("--work", options->work_dir, "Directory for the demo's data, recipe and run")
          ->capture_default_str();
      cmd.add_option("--steps", options->max_steps, "Optimizer steps")->capture_default_str();
      cmd.add_flag("--dpo", options->dpo, "Then a preference stage: DPO on right/wrong answer pairs from the trained model");
      cmd.add_option("--dpo-steps", options->dpo_steps, "Steps of the preference stage (with --dpo)")->capture_default_str();
      return [options] {
        cli::run_demo(*options, std::cout);
        return 0;
      };
    }};

}  // namespace
}  // namespace keel::cli
