// keel bench ladder RECIPE [--steps N] [--repeat R] [--set key=value ...]
// The reference article's optimization table on this machine: the recipe trained once per row,
// each row a `keel train` child process (under mpirun, bound as `keel launch` binds, when the
// recipe's dp_degree > 1) with one more optimisation switched on (train/ladder.h).
#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <memory>

#include "keel/cli/child_process.h"
#include "keel/cli/commands.h"
#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/cluster/launch.h"
#include "keel/cluster/topology.h"
#include "keel/cli/ladder.h"
#include "keel/train/sync_overlap.h"
#include "keel/recipe/recipe.h"

namespace keel::cli {
namespace {

struct LadderOptions {
  std::string recipe;
  int64_t steps = 6;
  int64_t repeats = 1;
  std::vector<std::string> overrides;
};

constexpr int64_t kWarmupSteps = 1;

// The last lines of a row's log, for a failed run.
std::string log_tail(const std::string& path, size_t lines) {
  std::string text;
  try {
    text = read_file(path);
  } catch (const Error&) {
    return "";
  }
  size_t at = text.size();
  for (size_t n = 0; n <= lines && at > 0;) {
    at = text.rfind('\n', at - 1);
    if (at == std::string::npos) {
      at = 0;
      break;
    }
    ++n;
  }
  return text.substr(at == 0 ? 0 : at + 1);
}

int run_ladder(const LadderOptions& o) {
  require(o.steps >= 1 && o.steps <= 100000, "--steps must be in [1, 100000], got {}", o.steps);
  require(o.repeats >= 1 && o.repeats <= 100, "--repeat must be in [1, 100], got {}", o.repeats);
  // Checks the recipe and the overrides once, before any row runs.
  const recipe::Recipe recipe = recipe::load_recipe(o.recipe, o.overrides);
  const auto stages = cli::ladder_stages(recipe);
  const std::string out_dir = recipe.output_dir;
  const std::string rows_dir = out_dir + "/ladder";
  make_dirs(rows_dir);
  const std::string exe = this_executable();
  const int ranks = int(recipe.dp_degree);
  std::unique_ptr<cluster::Topology> topology;
  if (ranks > 1) topology = std::make_unique<cluster::Topology>(cluster::detect_topology());

  fmt::print("keel bench ladder: {} on {} rank{}, {} step{} per row (the first {} not timed){}\n", o.recipe, ranks,
             ranks == 1 ? "" : "s", o.steps, o.steps == 1 ? "" : "s", o.steps > kWarmupSteps ? kWarmupSteps : 0,
             recipe.packing == recipe::Packing::Pack ? "; packing = \"pad\" in every row (the on-the-fly baseline pads)"
                                                  : "");
  if (ranks == 1) fmt::print("  one rank: no gradient sync, so rows 2 and 3 run the same code\n");

  // Rows run in turn, and with repeats round after round, so that a load that comes and goes on a
  // shared machine spreads over every row instead of landing on one.
  std::vector<std::vector<cli::LadderResult>> runs(stages.size());
  for (int64_t round = 1; round <= o.repeats; ++round) {
    for (size_t i = 0; i < stages.size(); ++i) {
      const std::string dir = o.repeats == 1 ? fmt::format("{}/row-{}", rows_dir, i + 1)
                                             : fmt::format("{}/row-{}-run-{}", rows_dir, i + 1, round);
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);  // a previous ladder's row: its metrics must not mix in
      make_dirs(dir);
      std::vector<std::string> settings = o.overrides;
      for (const auto& s : cli::ladder_run_settings(o.steps, dir)) settings.push_back(s);
      for (const auto& s : stages[i].settings) settings.push_back(s);
      std::vector<std::string> argv;
      if (ranks > 1) {
        cluster::LaunchRequest request;
        request.world_size = ranks;
        request.recipe = o.recipe;
        request.overrides = settings;
        request.keel_executable = exe;
        request.run_as_root = ::geteuid() == 0;
        argv = cluster::launch_command(*topology, request).argv;
        require_on_path(argv.front());
      } else {
        argv = {exe, "train", o.recipe};
        for (const auto& s : settings) argv.insert(argv.end(), {"--set", s});
      }
      const std::string log = dir + "/train.log";
      write_file_atomic(log, "# " + cluster::shell_command_line(argv) + "\n");
      if (o.repeats == 1)
        fmt::print("row {}/{}: {} ... ", i + 1, stages.size(), stages[i].name);
      else
        fmt::print("round {}/{}, row {}/{}: {} ... ", round, o.repeats, i + 1, stages.size(), stages[i].name);
      std::fflush(stdout);
      const int status = run_and_wait(argv, log);
      if (status != 0) {
        fmt::print("failed\n");
        fail("row {} ({}) failed with exit status {}; the end of {}:\n{}", i + 1, stages[i].name, status, log,
             log_tail(log, 15));
      }
      cli::LadderResult r = cli::read_ladder_result(dir, kWarmupSteps);
      r.stage = stages[i].name;
      fmt::print("{:.1f} tokens/s\n", r.tokens_per_s);
      runs[i].push_back(std::move(r));
    }
  }
  std::vector<cli::LadderResult> results;
  for (auto& row : runs) results.push_back(cli::median_run(std::move(row)));
  cli::use_common_matmul_peak(results);
  fmt::print("\n{}", cli::ladder_table(results));
  if (ranks > 1) {
    // Rows 3 and 4 overlap by force, to measure it; a run with the default decides by the host, and
    // keel launch gives each rank as many compute threads as it has cores.
    train::HostCores host = train::host_cores(ranks);
    host.usable = host.compute_threads = std::max(1, host.online / ranks);
    fmt::print("note: rows 3 and 4 overlap the gradient sync (overlap_grad_sync = true, set by the ladder); with the "
               "default, a run launched so here would decide: {}\n",
               train::decide_overlap(recipe::OverlapGradSync::Auto, host).reason);
  }
  const std::string json_path = out_dir + "/ladder.json";
  write_file_atomic(json_path, cli::ladder_json(o.recipe, o.steps, kWarmupSteps, o.repeats, stages, results));
  fmt::print("keel: the table is in {}; each row's run (log, metrics, summary) in {}/row-N{}\n", json_path, rows_dir,
             o.repeats > 1 ? "-run-K (the table shows each row's median run by throughput)" : "");
  return 0;
}

const CommandRegistration kBench{
    "bench", "Measure keel on this machine", [](CLI::App& cmd) -> CommandAction {
      cmd.require_subcommand(1);
      auto o = std::make_shared<LadderOptions>();
      auto* ladder = cmd.add_subcommand(
          "ladder",
          "The optimization table: a recipe trained with keel's data, sync and memory optimisations switched on one "
          "by one (baseline, + prepared data, + overlapped bucketed sync, + planned memory)");
      ladder->add_option("recipe", o->recipe, "Recipe file (TOML)")->required();
      ladder->add_option("--steps", o->steps, "Training steps per row; the first is warm-up, not timed (default 6)");
      ladder->add_option("--repeat", o->repeats,
                         "Run the four rows this many times, round after round, and show each row's median run "
                         "(for shared, noisy machines; default 1)");
      ladder->add_option("--set", o->overrides, "Override a recipe key: --set key=value (repeatable)");
      return [o, ladder] { return ladder->parsed() ? run_ladder(*o) : 0; };
    }};

}  // namespace
}  // namespace keel::cli
