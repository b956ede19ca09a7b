// tokenizer.json (byte-level BPE): hf_tokenizer_from_json; a tokenizer it builds then encodes and
// decodes a text. Input: tokenizer.json, then after a NUL byte the text to encode (defaults to a
// fixed sample with special-token-like pieces, digits and non-ASCII letters).
#include "fuzz_support.h"
#include "keel/data/hf_tokenizer_json.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel;
  auto [json, text] = fuzz::split_at_nul(data, size);
  if (text.empty()) text = "Hello, world! 12345 <|endoftext|> naïve café 你好 \n\n  x";
  try {
    data::Tokenizer tokenizer = data::hf_tokenizer_from_json(json, "tokenizer.json");
    for (bool special : {false, true}) {
      std::vector<int32_t> ids = tokenizer.encode(text, {.add_special_tokens = special});
      for (int32_t id : ids) {
        if (id < 0 || id >= tokenizer.vocab_size())
          fuzz::property_failed("encode returned an id outside the vocabulary");
      }
      (void)tokenizer.decode(ids, special);
    }
  } catch (const Error&) {}
  return 0;
}
