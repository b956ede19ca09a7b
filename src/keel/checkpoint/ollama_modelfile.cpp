#include "keel/checkpoint/ollama_modelfile.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "keel/core/error.h"

namespace keel::checkpoint {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kHeader = "# Ollama Modelfile written by keel export";

// A Modelfile argument: "..." unless the text holds a quote or a line break, then """...""" (the
// Modelfile parser's multi-line form), which only a text holding """ cannot be.
std::string quoted(const std::string& text) {
  if (text.find_first_of("\"\n") == std::string::npos) return fmt::format("\"{}\"", text);
  require(text.find("\"\"\"") == std::string::npos,
          "Modelfile: the stop string '{}' contains \"\"\", which a Modelfile cannot quote", text);
  return fmt::format("\"\"\"{}\"\"\"", text);
}

}  // namespace

std::string ollama_modelfile_path(const std::string& gguf_path) {
  return fs::path(gguf_path).replace_extension(".Modelfile").string();
}

std::string ollama_modelfile(const std::string& gguf_path, const std::vector<std::string>& stops) {
  const std::string file = fs::path(gguf_path).filename().string();
  std::string out = fmt::format("{}: ollama create NAME -f {}\n", kHeader,
                                fs::path(ollama_modelfile_path(gguf_path)).filename().string());
  out += "# No TEMPLATE: Ollama derives the prompt template from the file's tokenizer.chat_template.\n";
  out += fmt::format("FROM ./{}\n", file);
  std::vector<std::string> seen;
  for (const auto& stop : stops) {
    if (stop.empty() || std::find(seen.begin(), seen.end(), stop) != seen.end()) continue;
    seen.push_back(stop);
    out += fmt::format("PARAMETER stop {}\n", quoted(stop));
  }
  return out;
}

void check_modelfile_destination(const std::string& gguf_path, bool overwrite) {
  const std::string path = ollama_modelfile_path(gguf_path);
  std::error_code ec;
  if (overwrite || !fs::exists(path, ec)) return;
  std::ifstream in(path, std::ios::binary);
  std::string first;
  std::getline(in, first);
  require(first.starts_with(kHeader),
          "{}: a Modelfile keel did not write is there, and keel writes the export's Modelfile (for Ollama) beside "
          "the .gguf file under that name; choose another --to, or pass --overwrite to replace it",
          path);
}

}  // namespace keel::checkpoint
