// keel train RECIPE.toml [--set key=value ...] [--print-recipe]
#include <fmt/format.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <csignal>
#include <iostream>
#include <memory>

#include "keel/cli/commands.h"
#include "keel/distributed/communicator.h"
#include "keel/report/progress.h"
#include "keel/recipe/recipe.h"
#include "keel/train/trainer.h"

namespace keel::cli {
namespace {

// A rank started by mpirun dies with it. Without this, a double Ctrl-C returned mpirun in 0.1 s
// while both ranks trained on out of sight and moved `latest`, and a resume started at once
// raced them. The kernel sends the signal when the parent goes; a parent already gone before the
// request took effect is seen by getppid(). SIGKILL, not SIGTERM: a rank alone can make no
// collective progress, so there is no step boundary to wait for.
void die_with_launcher() {
  if (!distributed::launched_by_mpi()) return;
  const pid_t launcher = ::getppid();
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) std::_Exit(128 + SIGKILL);
}

struct TrainOptions {
  std::string recipe;
  std::vector<std::string> overrides;
  bool print_recipe = false;
  std::string resume;
  int64_t stop_after = 0;
  bool overwrite = false;
  bool resume_with_new_data = false;
  std::string cache_dir;
};

const CommandRegistration kTrain{
    "train", "Train (fine-tune or pre-train) a model from a TOML recipe", [](CLI::App& cmd) -> CommandAction {
      auto options = std::make_shared<TrainOptions>();
      cmd.add_option("recipe", options->recipe, "Recipe file (TOML)")->required();
      cmd.add_option("--set", options->overrides, "Override a recipe key: --set key=value (repeatable)");
      cmd.add_flag("--print-recipe", options->print_recipe, "Print the fully resolved recipe and exit");
      auto* resume = cmd.add_option("--resume", options->resume,
                                    "Continue from a checkpoint: 'auto' (the latest in checkpoint_dir, if any; the "
                                    "default when no value is given) or a step directory")
                         ->expected(0, 1);
      cmd.add_option("--stop-after", options->stop_after,
                     "Stop after this step, saving a checkpoint as on Ctrl-C (for time-sliced jobs)");
      cmd.add_option("--cache-dir", options->cache_dir,
                     "Where raw JSONL is prepared into shards (the recipe's cache_dir; default: .keel-cache next to "
                     "data_path)");
      cmd.add_flag("--resume-with-new-data", options->resume_with_new_data,
                   "Resume although the training data changed since the checkpoint: step s then reads what the "
                   "new data's order puts at step s (docs/checkpoints.md)");
      cmd.add_flag("--overwrite", options->overwrite,
                   "Start afresh even though checkpoint_dir holds an earlier run's checkpoints (they are deleted)");
      return [options, resume] {
        if (resume->count() > 0 && options->resume.empty()) options->resume = "auto";
        die_with_launcher();
        if (!options->cache_dir.empty()) options->overrides.push_back("cache_dir=" + options->cache_dir);
        auto recipe = recipe::load_recipe(options->recipe, options->overrides);
        if (options->print_recipe) {
          fmt::print("{}", recipe::recipe_to_toml(recipe));
          return 0;
        }
        train::TrainOptions train_options;
        // Under mpirun stdout is a forwarded pseudo-terminal: live lines would interleave.
        train_options.terminal = report::stdout_is_terminal() && !distributed::launched_by_mpi();
        train_options.resume = options->resume;
        train_options.stop_after_step = options->stop_after;
        train_options.overwrite = options->overwrite;
        train_options.resume_with_new_data = options->resume_with_new_data;
        train_options.overrides = options->overrides;
        const auto result = train::run_training(recipe, std::cout, train_options);
        return result.interrupted && result.interrupt_signal ? 128 + result.interrupt_signal : 0;
      };
    }};

}  // namespace
}  // namespace keel::cli
