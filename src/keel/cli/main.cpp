// keel: the command line. One file per subcommand; this one only dispatches and maps errors to
// exit codes (commands.h: 2 for bad input and usage errors, 1 for anything unexpected).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <iostream>
#include <string>
#include <vector>

#include "keel/cli/commands.h"
#include "keel/core/error.h"
#include "keel/core/suggest.h"
#include "keel/model/config.h"

namespace {

// `items` joined by ", " after `head`, wrapped before 100 columns with the lines after the first
// indented.
std::string wrapped_list(const std::string& head, const std::vector<std::string>& items) {
  std::string text = head, line = head;
  for (size_t i = 0; i < items.size(); ++i) {
    const std::string item = items[i] + (i + 1 < items.size() ? "," : "");
    if (line.size() + 1 + item.size() > 100) {
      text += "\n ";
      line = " ";
    }
    text += " " + item;
    line += " " + item;
  }
  return text;
}

// The first screen of `keel --help`: what keel does, for which models (the config loader's own
// table of families, model::supported_families, so the list cannot fall behind it) and how.
std::string overview() {
  namespace model = keel::model;
  std::vector<std::string> families;
  for (auto family : model::supported_families())
    families.push_back(fmt::format("{} ({})", model::family_display_name(family), model::family_name(family)));
  return "keel: fine-tune decoder-only LLMs end to end on the CPU: JSONL data in, a Hugging Face model out\n" +
         wrapped_list("Model families (the [model_config] family name in parentheses):", families) +
         "\nFull fine-tuning, LoRA and QLoRA (4-bit NF4/FP4, as PEFT and bitsandbytes); data parallel over MPI ranks"
         "\n  with ZeRO-1/2/3 (mpirun or keel launch). Python: `pip install .`, then"
         "\n  keel.Trainer(keel.TrainingConfig(...)).train() (docs/python.md). Recipes: docs/recipe.md.";
}

// `keel trian`: CLI11 would only say "A subcommand is required". A first argument that is not an
// option must be a command: name the nearest one and list them all.
bool refuse_unknown_command(int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') return false;
  const std::string word = argv[1];
  const auto names = keel::cli::registered_command_names();
  for (const auto& name : names)
    if (name == word) return false;
  fmt::print(stderr, "error: unknown command '{}'{}\n{}\n", word, keel::did_you_mean(word, names),
             wrapped_list("commands:", names) + " (keel --help describes each)");
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{overview()};
  app.set_version_flag("--version", keel::cli::version_text());
  app.require_subcommand(1);
  keel::cli::add_registered_commands(app);
  if (refuse_unknown_command(argc, argv)) return keel::cli::kExitBadInput;
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
