// tiktoken rank files ("base64-token rank" lines): parse_tiktoken_ranks, then a tokenizer built
// from the ranks (gpt2 pattern) encodes and decodes a sample; with every single byte in the
// vocabulary, decode(encode(text)) must give the text back.
#include "fuzz_support.h"
#include "keel/data/tiktoken.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    std::vector<std::string> ranks = data::parse_tiktoken_ranks(text, "ranks.tiktoken");
    bool all_bytes = false;
    {
      bool seen[256] = {};
      int count = 0;
      for (const auto& token : ranks) {
        if (token.size() == 1 && !seen[uint8_t(token[0])]) seen[uint8_t(token[0])] = true, ++count;
      }
      all_bytes = count == 256;
    }
    data::Tokenizer tokenizer = data::tiktoken_tokenizer(std::move(ranks), "gpt2", "ranks.tiktoken");
    const std::string sample = "Hello, world! 12345 naïve café 你好\n\n  x";
    std::vector<int32_t> ids = tokenizer.encode(sample);
    std::string back = tokenizer.decode(ids);
    if (all_bytes && back != sample) fuzz::property_failed("decode(encode(text)) != text", back);
  } catch (const Error&) {}
  return 0;
}
