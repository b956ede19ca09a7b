// A SentencePiece tokenizer.model (data/sentencepiece_model.h) read as llama.cpp's converter would
// put it into GGUF (data::llama_cpp_sentencepiece_vocab, with a fixed tokenizer.json and
// tokenizer_config.json beside it). Input: the file's bytes. Properties: every piece's type is one
// of the enum's; one token, score and type per id of the vocabulary; special ids inside it.
#include "fuzz_support.h"
#include "keel/data/llama_cpp_vocab.h"
#include "keel/data/sentencepiece_model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel;
  constexpr int64_t kVocabSize = 64;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    for (const auto& p : data::read_sentencepiece_model(bytes, "fuzz/tokenizer.model"))
      if (int32_t(p.type) < 1 || int32_t(p.type) > 6) fuzz::property_failed("a piece type outside the enum", p.piece);
    data::LlamaCppVocabFiles files;
    files.origin = "fuzz";
    files.sentencepiece_model = std::string(bytes);
    files.tokenizer_json = R"({"model": {"type": "BPE", "vocab": {}}, "added_tokens": [
        {"id": 2, "content": "<bos>", "special": true}, {"id": 100, "content": "<eos>", "special": true}]})";
    files.tokenizer_config_json = R"({"bos_token": "<bos>", "eos_token": "<eos>",
        "added_tokens_decoder": {"5": {"content": "<start_of_turn>", "special": true}}})";
    const data::LlamaCppVocab v = data::llama_cpp_sentencepiece_vocab(files, kVocabSize);
    if (int64_t(v.tokens.size()) != kVocabSize || v.scores.size() != v.tokens.size() ||
        v.token_types.size() != v.tokens.size())
      fuzz::property_failed("expected one token, one score and one type per id of the vocabulary");
    for (const auto& [type, id] : v.special_ids)
      if (id < 0 || id >= kVocabSize) fuzz::property_failed("a special token id outside the vocabulary", type);
  } catch (const Error&) {}
  return 0;
}
