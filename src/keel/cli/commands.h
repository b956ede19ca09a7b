// Subcommand registry. Each cli/*_command.cpp registers its subcommands with a static
// CommandRegistration, so adding a command touches no other file:
//
//   static const CommandRegistration kTrain{"train", [](CLI::App& app) { ...; return action; }};
//
// The setup function adds options to the subcommand and returns the action run when it is chosen.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace keel::cli {

// Exit codes, for every command: 0 success, 1 an internal error, 2 bad input or usage (a
// keel::Error, a wrong option), 3 `keel plan`: the plan does not fit the given memory; 128 + N
// stopped by signal N (e.g. 130 for Ctrl-C).
inline constexpr int kExitInternalError = 1;
inline constexpr int kExitBadInput = 2;
inline constexpr int kExitDoesNotFit = 3;

// `keel --version`, e.g. "keel 0.3.0 (commit 480dcc42a5; Release, GNU 12.2.0, OpenMP, oneDNN 2.6.3,
// kernels chosen per CPU at run time)": generated at build time (cmake/version.cmake) from git and
// the CMake configuration.
std::string version_text();

using CommandAction = std::function<int()>;
using CommandSetup = std::function<CommandAction(CLI::App& subcommand)>;

struct CommandRegistration {
  CommandRegistration(std::string name, std::string description, CommandSetup setup);
};

// The registered subcommands' names, sorted.
std::vector<std::string> registered_command_names();
// Adds every registered subcommand (sorted by name) to the app.
void add_registered_commands(CLI::App& app);
// Runs the action of the subcommand the user chose.
int run_selected(CLI::App& app);

}  // namespace keel::cli
