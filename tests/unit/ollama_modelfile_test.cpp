// The Ollama Modelfile keel export writes beside a GGUF model (checkpoint/ollama_modelfile.h), parsed
// back as Ollama's parser reads it: FROM the file beside it, one PARAMETER stop per stop string.
#include <gtest/gtest.h>

#include <filesystem>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "keel/checkpoint/gguf_export.h"
#include "keel/checkpoint/ollama_modelfile.h"
#include "keel/core/file_io.h"
#include "test_support.h"

namespace keel::checkpoint {
namespace {

using testing::expect_keel_error;

// The instructions of a Modelfile: (instruction, argument), comments skipped, a PARAMETER's name
// kept with its value ("stop <|im_end|>"), quotes ("..." and """...""") removed.
std::vector<std::pair<std::string, std::string>> parse_modelfile(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.find(' ');
    std::string instruction = line.substr(0, space), argument = line.substr(space + 1);
    if (instruction == "PARAMETER") {
      const size_t name_end = argument.find(' ');
      std::string value = argument.substr(name_end + 1);
      if (value.starts_with("\"\"\"")) {
        while (!value.ends_with("\"\"\"") || value.size() < 6) {
          std::string more;
          if (!std::getline(in, more)) break;
          value += "\n" + more;
        }
        value = value.substr(3, value.size() - 6);
      } else if (value.size() >= 2 && value.front() == '"' && value.back() == '"') {
        value = value.substr(1, value.size() - 2);
      }
      argument = argument.substr(0, name_end) + " " + value;
    }
    out.emplace_back(instruction, argument);
  }
  return out;
}

TEST(OllamaModelfile, FromTheFileBesideItAndAStopPerToken) {
  EXPECT_EQ(ollama_modelfile_path("out/qwen-q4.gguf"), "out/qwen-q4.Modelfile");
  const std::string text = ollama_modelfile("out/qwen-q4.gguf", {"<|im_end|>", "<|endoftext|>", "<|im_end|>", ""});
  EXPECT_TRUE(text.starts_with("# Ollama Modelfile written by keel export")) << text;
  const auto parsed = parse_modelfile(text);
  const std::vector<std::pair<std::string, std::string>> expected = {
      {"FROM", "./qwen-q4.gguf"}, {"PARAMETER", "stop <|im_end|>"}, {"PARAMETER", "stop <|endoftext|>"}};
  EXPECT_EQ(parsed, expected) << text;
  // A stop string with a quote in it takes the multi-line quotes.
  const auto odd = parse_modelfile(ollama_modelfile("m.gguf", {"say \"end\""}));
  ASSERT_EQ(odd.size(), 2u);
  EXPECT_EQ(odd[1].second, "stop say \"end\"");
  expect_keel_error([] { ollama_modelfile("m.gguf", {"a\"\"\"b"}); }, {"a\"\"\"b"});
}

// A Modelfile keel did not write is not replaced (as with the .gguf itself), one it wrote is.
TEST(OllamaModelfile, DestinationRefusesAModelfileKeelDidNotWrite) {
  const testing::TempDir dir;
  const std::string gguf = dir / "model.gguf";
  check_gguf_destination(gguf, false);
  write_file_atomic(dir / "model.Modelfile", "FROM llama3\nSYSTEM mine\n");
  expect_keel_error([&] { check_gguf_destination(gguf, false); }, {"model.Modelfile", "--overwrite"});
  check_gguf_destination(gguf, true);
  write_file_atomic(dir / "model.Modelfile", ollama_modelfile(gguf, {"</s>"}));
  check_gguf_destination(gguf, false);
}

}  // namespace
}  // namespace keel::checkpoint
