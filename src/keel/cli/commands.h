// Subcommands register themselves on the CLI11 app; run_selected runs whichever was chosen.
#pragma once
#include <CLI/CLI.hpp>

namespace keel::cli {

void add_train_command(CLI::App& app);
void add_demo_command(CLI::App& app);
int run_selected(CLI::App& app);

}  // namespace keel::cli
