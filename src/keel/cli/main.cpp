// keel: the command line. One file per subcommand; this one only dispatches and maps errors to
// exit codes (2 for bad input: keel::Error; 1 for anything unexpected).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <iostream>

#include "keel/cli/commands.h"
#include "keel/core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"keel: fine-tune decoder-only LLMs (GLM-4, Llama, Qwen2) end to end on the CPU"};
  app.require_subcommand(1);
  keel::cli::add_registered_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return keel::cli::run_selected(app);
  } catch (const keel::Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "internal error: {}\n", e.what());
    return 1;
  }
}
