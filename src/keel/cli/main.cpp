// keel: the command line. One file per subcommand; this one only dispatches and maps errors to
// exit codes (commands.h: 2 for bad input and usage errors, 1 for anything unexpected).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <iostream>

#include "keel/cli/commands.h"
#include "keel/core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"keel: fine-tune decoder-only LLMs (GLM-4, Llama, Qwen2) end to end on the CPU"};
  app.set_version_flag("--version", keel::cli::version_text());
  app.require_subcommand(1);
  keel::cli::add_registered_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // CLI11 prints the message (or the help/version text); its own exit codes (105, 106, ...) are
    // replaced by keel's: 0 for --help and --version, 2 for every usage error.
    const int code = app.exit(e);
    return code == 0 ? 0 : keel::cli::kExitBadInput;
  }
  try {
    return keel::cli::run_selected(app);
  } catch (const keel::Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return keel::cli::kExitBadInput;
  } catch (const std::exception& e) {
    fmt::print(stderr, "internal error: {}\n", e.what());
    return keel::cli::kExitInternalError;
  }
}
