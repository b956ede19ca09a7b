// llama.cpp names a byte-level BPE tokenizer's pre-tokenizer in `tokenizer.ggml.pre` ("llama-bpe",
// "qwen2", "glm4", ...) and its runtime picks the regexes by that name. Its converter does not read
// the name from tokenizer.json: it tokenizes a fixed text and looks the hash of the ids up in a
// table. keel does the same with its own tokenizer, from the same text and table.
#pragma once
#include <span>
#include <string_view>

namespace keel::data {

struct LlamaCppPreTokenizer {
  std::string_view sha256;  // of str(ids) as Python prints a list: "[1, 2, 3]"
  std::string_view name;
};

// The text the converter tokenizes (chktxt).
std::string_view llama_cpp_pre_tokenizer_text();
// Its table, in its order.
std::span<const LlamaCppPreTokenizer> llama_cpp_pre_tokenizers();

}  // namespace keel::data
