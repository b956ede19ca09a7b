// keel plot RUN_DIR: (re)draws RUN_DIR/loss.svg from RUN_DIR/metrics.jsonl, also while a run is
// still going.
#include <fmt/format.h>

#include <memory>

#include "keel/cli/commands.h"
#include "keel/report/loss_plot.h"

namespace keel::cli {
namespace {

const CommandRegistration kPlot{
    "plot", "Draw loss (training and eval) and learning rate against steps as RUN_DIR/loss.svg",
    [](CLI::App& cmd) -> CommandAction {
      auto run_dir = std::make_shared<std::string>();
      cmd.add_option("run_dir", *run_dir, "A training output_dir (holding metrics.jsonl)")->required();
      return [run_dir] {
        fmt::print("{}\n", report::write_loss_plot(*run_dir));
        return 0;
      };
    }};

}  // namespace
}  // namespace keel::cli
