// A preference pair record (stage = "dpo" data: JSONL from anywhere) through the tokenization
// training uses: any line must either be a usable pair — a prompt, two non-empty answers that
// differ, every id in the vocabulary — or a reason it is not, never a crash or an escaped
// exception. The tokenizer and ChatML template are built once, by keel, in the scratch directory.
#include <memory>
#include <optional>
#include <string>

#include "fuzz_support.h"
#include "keel/core/file_io.h"
#include "keel/data/bpe_trainer.h"
#include "keel/data/chat_encoding.h"
#include "keel/data/model_chat_template.h"
#include "keel/data/preference_pairs.h"
#include "keel/data/tokenizer.h"

namespace {

struct Setup {
  std::optional<keel::data::Tokenizer> tokenizer;
  std::shared_ptr<const keel::data::ChatTemplateEncoder> chat;
};

const Setup& setup() {
  static const Setup* s = [] {
    using namespace keel::data;
    auto* out = new Setup;
    const std::string dir = keel::fuzz::scratch_dir() + "/pair-tokenizer";
    std::filesystem::create_directories(dir);
    BpeTrainingOptions o;
    o.vocab_size = 300;
    o.special_tokens = {"</s>", "<|im_start|>", "<|im_end|>"};
    BpeTrainer trainer(o);
    trainer.add_text("the sky is blue where what user assistant hello world answer question 123 café");
    keel::write_file_atomic(dir + "/tokenizer.json", trainer.tokenizer_json());
    keel::write_file_atomic(dir + "/tokenizer_config.json",
                            R"({"eos_token": "</s>", "chat_template": "{% for m in messages %}<|im_start|>)"
                            R"({{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt )"
                            R"(%}<|im_start|>assistant\n{% endif %}"})");
    out->tokenizer.emplace(load_tokenizer(dir));
    out->chat = std::make_shared<ChatTemplateEncoder>(std::move(*find_model_chat_template(dir)), &*out->tokenizer);
    return out;
  }();
  return *s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel;
  const Setup& s = setup();
  const std::string line(reinterpret_cast<const char*>(data), size);
  const int64_t vocab = s.tokenizer->vocab_size();
  const data::PairEncoding encoding{&*s.tokenizer, s.chat, 64, vocab};
  data::TokenizedPair pair;
  std::string why;
  try {
    why = data::tokenize_pair(line, encoding, pair);
  } catch (const Error& e) {
    fuzz::property_failed("a bad pair is a reason, not an error", e.what());
  }
  if (!why.empty()) return 0;
  if (pair.prompt.empty() || pair.chosen.empty() || pair.rejected.empty() || pair.chosen == pair.rejected)
    fuzz::property_failed("an accepted pair is usable", "an empty part, or chosen equal to rejected");
  for (const auto* part : {&pair.prompt, &pair.chosen, &pair.rejected})
    for (int32_t id : *part)
      if (id < 0 || id >= vocab) fuzz::property_failed("ids are in the vocabulary", std::to_string(id));
  (void)data::is_preference_record(line);
  return 0;
}
