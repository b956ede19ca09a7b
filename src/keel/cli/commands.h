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

namespace keel::cli {

using CommandAction = std::function<int()>;
using CommandSetup = std::function<CommandAction(CLI::App& subcommand)>;

struct CommandRegistration {
  CommandRegistration(std::string name, std::string description, CommandSetup setup);
};

// Adds every registered subcommand (sorted by name) to the app.
void add_registered_commands(CLI::App& app);
// Runs the action of the subcommand the user chose.
int run_selected(CLI::App& app);

}  // namespace keel::cli
