// A tokenizer directory read as llama.cpp's converter would put it into GGUF
// (data::llama_cpp_bpe_vocab: tokenizer.json, tokenizer_config.json, the model's config.json).
// Input: tokenizer.json, then after a NUL byte tokenizer_config.json (absent when empty), then after
// another the model's config.json. Properties: one token and one type per id of the vocabulary,
// special ids inside it.
#include "fuzz_support.h"
#include "keel/data/llama_cpp_vocab.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel;
  constexpr int64_t kVocabSize = 512;
  auto [tokenizer_json, rest] = fuzz::split_at_nul(data, size);
  auto [config, model_config] =
      fuzz::split_at_nul(reinterpret_cast<const uint8_t*>(rest.data()), rest.size());
  data::LlamaCppVocabFiles files;
  files.origin = "fuzz";
  files.tokenizer_json = std::string(tokenizer_json);
  if (!config.empty()) files.tokenizer_config_json = std::string(config);
  files.config_json = std::string(model_config);
  try {
    const data::LlamaCppVocab v = data::llama_cpp_bpe_vocab(files, kVocabSize);
    if (int64_t(v.tokens.size()) != kVocabSize || v.token_types.size() != v.tokens.size())
      fuzz::property_failed("expected one token and one token type per id of the vocabulary");
    for (const auto& [type, id] : v.special_ids)
      if (id < 0) fuzz::property_failed("a special token id is negative", type);
  } catch (const Error&) {}
  return 0;
}
