// Preference pairs as TRL's DPOTrainer tokenizes them (data/preference_pairs.h): the three record
// forms, EOS on plain-string answers, the common-prefix rule, truncation, and bad pairs by line.
#include <gtest/gtest.h>

#include <sstream>

#include "keel/core/file_io.h"
#include "keel/data/bpe_trainer.h"
#include "keel/data/chat_encoding.h"
#include "keel/data/model_chat_template.h"
#include "keel/data/preference_pairs.h"
#include "keel/data/tokenizer.h"
#include "test_support.h"

namespace keel::data {
namespace {

using keel::testing::expect_keel_error;
using keel::testing::TempDir;

// A tokenizer directory: keel-trained BPE with </s> as EOS and a ChatML template.
struct PairFixture {
  TempDir dir;
  std::optional<Tokenizer> tokenizer;
  std::shared_ptr<const ChatTemplateEncoder> chat;
  PairEncoding encoding(int64_t max_seq_len = 64) const { return {&*tokenizer, chat, max_seq_len, 0}; }
  std::vector<int32_t> ids(const std::string& text) const { return tokenizer->encode(text); }

  PairFixture() {
    BpeTrainingOptions t;
    t.vocab_size = 300;
    t.special_tokens = {"</s>", "<|im_start|>", "<|im_end|>"};
    BpeTrainer trainer(t);
    trainer.add_text("the sky is blue red green where what user assistant hello world answer question");
    write_file_atomic(dir / "tokenizer.json", trainer.tokenizer_json());
    write_file_atomic(dir / "tokenizer_config.json",
                      R"({"eos_token": "</s>", "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n)"
                      R"({{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %})"
                      R"(<|im_start|>assistant\n{% endif %}"})");
    tokenizer.emplace(load_tokenizer(dir.path()));
    auto templ = find_model_chat_template(dir.path());
    chat = std::make_shared<ChatTemplateEncoder>(std::move(*templ), &*tokenizer);
  }
};

std::vector<int32_t> tail(const std::vector<int32_t>& ids, size_t from) { return {ids.begin() + long(from), ids.end()}; }

TEST(PreferencePairs, PlainStringsGetEosAndSplitWhereThePromptEnds) {
  PairFixture f;
  TokenizedPair p;
  ASSERT_EQ(tokenize_pair(R"({"prompt": "where is the sky", "chosen": " blue", "rejected": " red</s>"})",
                          f.encoding(), p),
            "");
  const auto prompt = f.ids("where is the sky");
  EXPECT_EQ(p.prompt, prompt);
  EXPECT_EQ(p.chosen, tail(f.ids("where is the sky blue</s>"), prompt.size()));
  EXPECT_EQ(p.rejected, tail(f.ids("where is the sky red</s>"), prompt.size()));  // not a second </s>
  EXPECT_EQ(p.chosen.back(), *f.tokenizer->eos_id());
}

TEST(PreferencePairs, ImplicitPromptIsTheCommonStartLeavingTheSpaceToTheAnswers) {
  PairFixture f;
  TokenizedPair p;
  ASSERT_EQ(tokenize_pair(R"({"chosen": "the sky is blue", "rejected": "the sky is red"})", f.encoding(), p), "");
  EXPECT_EQ(p.prompt, f.ids("the sky is"));
  EXPECT_EQ(f.tokenizer->decode(p.chosen), " blue</s>");
  EXPECT_EQ(f.tokenizer->decode(p.rejected), " red</s>");
}

TEST(PreferencePairs, ConversationsGoThroughTheTemplate) {
  PairFixture f;
  TokenizedPair explicit_prompt, implicit;
  ASSERT_EQ(tokenize_pair(R"({"prompt": [{"role": "user", "content": "hello"}],
                              "chosen": [{"role": "assistant", "content": "world"}],
                              "rejected": [{"role": "assistant", "content": "answer"}], "system": "question"})",
                          f.encoding(), explicit_prompt),
            "");
  EXPECT_EQ(f.tokenizer->decode(explicit_prompt.prompt),
            "<|im_start|>system\nquestion<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(f.tokenizer->decode(explicit_prompt.chosen), "world<|im_end|>\n");
  EXPECT_EQ(f.tokenizer->decode(explicit_prompt.rejected), "answer<|im_end|>\n");
  ASSERT_EQ(tokenize_pair(R"({"chosen": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}],
                              "rejected": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the sky"}]})",
                          f.encoding(), implicit),
            "");
  EXPECT_EQ(f.tokenizer->decode(implicit.prompt), "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(f.tokenizer->decode(implicit.rejected), "the sky<|im_end|>\n");
}

TEST(PreferencePairs, BadPairsSayWhy) {
  PairFixture f;
  TokenizedPair p;
  const auto why = [&](const std::string& line) { return tokenize_pair(line, f.encoding(), p); };
  EXPECT_NE(why("{broken").find("not valid JSON"), std::string::npos);
  EXPECT_NE(why(R"({"prompt": "a", "rejected": "b"})").find("missing field 'chosen'"), std::string::npos);
  EXPECT_NE(why(R"({"prompt": "where", "chosen": " blue", "rejected": " blue"})").find("the same answer"),
            std::string::npos);
  EXPECT_NE(why(R"({"prompt": "where", "chosen": " blue", "rejected": [{"role": "assistant", "content": "x"}]})")
                .find("both be strings or both lists"),
            std::string::npos);
  EXPECT_NE(why(R"({"prompt": "", "chosen": " blue", "rejected": " red"})").find("empty prompt"), std::string::npos);
  PairEncoding no_template = f.encoding();
  no_template.model_template = nullptr;
  EXPECT_NE(tokenize_pair(R"({"prompt": [{"role": "user", "content": "hello"}],
                              "chosen": [{"role": "assistant", "content": "world"}],
                              "rejected": [{"role": "assistant", "content": "answer"}]})",
                          no_template, p)
                .find("model's chat template"),
            std::string::npos);
}

TEST(PreferencePairs, ReadCountsTruncatesAndDropsAsTrlDoes) {
  PairFixture f;
  const size_t prompt = f.ids("where is the sky").size();
  write_file_atomic(f.dir / "pairs.jsonl",
                    "{\"prompt\": \"where is the sky\", \"chosen\": \" blue blue blue blue\", \"rejected\": \" red\"}\n"
                    "\n"
                    "{\"prompt\": \"where is the sky where is the sky where is the sky\", \"chosen\": \" a\", "
                    "\"rejected\": \" b\"}\n");
  std::ostringstream log;
  const PreferencePairs pairs =
      read_preference_pairs(f.dir / "pairs.jsonl", f.encoding(int64_t(prompt) + 2), 0.0, log);
  ASSERT_EQ(pairs.size(), 1);
  EXPECT_EQ(pairs.records, 2);
  EXPECT_EQ(pairs.truncated, 1);  // the chosen answer cut at max_seq_len
  EXPECT_EQ(pairs.dropped, 1);    // the prompt alone fills the row
  EXPECT_EQ(pairs.prompt(0).size() + pairs.chosen(0).size(), prompt + 2);
  EXPECT_EQ(pairs.line(0), 1);
  EXPECT_NE(log.str().find("1 of 2 preference pairs"), std::string::npos) << log.str();
}

TEST(PreferencePairs, TooManyBadPairsNameTheFirstLine) {
  PairFixture f;
  write_file_atomic(f.dir / "pairs.jsonl",
                    "{\"prompt\": \"where\", \"chosen\": \" blue\", \"rejected\": \" red\"}\n"
                    "{\"prompt\": \"where\", \"chosen\": \" blue\"}\n");
  std::ostringstream log;
  expect_keel_error([&] { read_preference_pairs(f.dir / "pairs.jsonl", f.encoding(), 0.01, log); },
                    {"pairs.jsonl:2", "missing field 'rejected'", "1 of 2 pairs are bad"});
}

TEST(PreferencePairs, SupervisedFineTuningRecognisesPairs) {
  EXPECT_TRUE(is_preference_record(R"({"prompt": "a", "chosen": "b", "rejected": "c"})"));
  EXPECT_FALSE(is_preference_record(R"({"prompt": "a", "response": "b"})"));
  EXPECT_FALSE(is_preference_record("{broken"));
}

}  // namespace
}  // namespace keel::data
