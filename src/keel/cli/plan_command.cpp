// keel plan RECIPE.toml [--dp N] [--zero 0|1|2] [--device-memory 64GB] [--set key=value ...] [--json]
// The per-rank memory plan of a training run, from config.json alone (no weights), with a verdict
// against the device memory and what to change when it does not fit.
#include <fmt/format.h>

#include <memory>

#include "keel/cli/commands.h"
#include "keel/report/memory_report.h"
#include "keel/recipe/recipe.h"

namespace keel::cli {
namespace {

struct PlanOptions {
  std::string recipe;
  std::vector<std::string> overrides;
  int64_t dp = 0;
  int zero = -1;  // not given: the recipe's zero_stage
  std::string device_memory;
  bool json = false;
};

const CommandRegistration kPlan{
    "plan", "Print the per-rank memory plan of a recipe and whether it fits the device",
    [](CLI::App& cmd) -> CommandAction {
      auto options = std::make_shared<PlanOptions>();
      cmd.add_option("recipe", options->recipe, "Recipe file (TOML)")->required();
      cmd.add_option("--dp", options->dp, "Data-parallel ranks (default: the recipe's dp_degree)")
          ->check(CLI::PositiveNumber);
      cmd.add_option("--zero", options->zero,
                     "ZeRO stage: 0 (replicated), 1 (AdamW moments, and in bf16 the fp32 masters, sharded over "
                     "the ranks), 2 (and the gradients) or 3 (and the weights); default: the recipe's zero_stage")
          ->check(CLI::IsMember({0, 1, 2, 3}));
      cmd.add_option("--device-memory", options->device_memory,
                     "Memory per rank to check against, e.g. 64GB (binary units: 1 GB = 1 GiB)");
      cmd.add_option("--set", options->overrides, "Override a recipe key: --set key=value (repeatable)");
      cmd.add_flag("--json", options->json, "Print the plan's totals and categories as one JSON object");
      return [options] {
        const auto recipe = recipe::load_recipe(options->recipe, options->overrides);
        report::PlanRequest request;
        request.dp = options->dp;
        request.zero_stage = options->zero;
        if (!options->device_memory.empty())
          request.device_memory_bytes = report::parse_memory_size(options->device_memory);
        const auto report =
            options->json ? report::memory_report_json(recipe, request) : report::memory_report(recipe, request);
        fmt::print("{}", report.text);
        // Scripts can act on the verdict: 3 when the plan does not fit (2 stays "bad input").
        return report.fits && !*report.fits ? kExitDoesNotFit : 0;
      };
    }};

}  // namespace
}  // namespace keel::cli
