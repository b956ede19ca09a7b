#include "keel/cli/commands.h"

#include <map>

namespace keel::cli {
namespace {

struct Registered {
  std::string description;
  CommandSetup setup;
};

std::map<std::string, Registered>& registry() {
  static std::map<std::string, Registered> commands;  // sorted: `keel --help` lists them in order
  return commands;
}

std::map<CLI::App*, CommandAction>& actions() {
  static std::map<CLI::App*, CommandAction> table;
  return table;
}

}  // namespace

CommandRegistration::CommandRegistration(std::string name, std::string description, CommandSetup setup) {
  registry()[std::move(name)] = {std::move(description), std::move(setup)};
}

std::vector<std::string> registered_command_names() {
  std::vector<std::string> names;
  for (const auto& [name, command] : registry()) names.push_back(name);
  return names;
}

void add_registered_commands(CLI::App& app) {
  for (auto& [name, command] : registry()) {
    auto* sub = app.add_subcommand(name, command.description);
    actions()[sub] = command.setup(*sub);
  }
}

int run_selected(CLI::App& app) {
  for (auto& [sub, action] : actions())
    if (sub->parsed()) return action();
  return 0;
}

}  // namespace keel::cli
