#include "keel/cli/demo.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <random>
#include <set>

#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/core/json_text.h"
#include "keel/data/bpe_trainer.h"
#include "keel/data/chat_template.h"
#include "keel/data/tokenizer.h"
#include "keel/model/generator.h"
#include "keel/model/hf_weights.h"
#include "keel/recipe/model_setup.h"
#include "keel/recipe/recipe.h"
#include "keel/train/trainer.h"

namespace keel::cli {
namespace {

constexpr int64_t kSeq = 64;
constexpr int32_t kMerges = 48;  // few merges: "What", " is", " plus" ... become tokens; digits stay single
const std::vector<std::string> kSpecialTokens{"<|endoftext|>", "<|im_start|>", "<|im_end|>"};

struct Problem {
  int a, b, phrasing;
  std::string question() const {
    switch (phrasing) {
      case 0: return fmt::format("What is {} + {}?", a, b);
      case 1: return fmt::format("Add {} and {}.", a, b);
      default: return fmt::format("{} plus {} equals what?", a, b);
    }
  }
  // The answer restates the sum before giving it: the model copies the operands (easy for
  // attention) and then writes the result next to them, which a tiny model learns in minutes.
  std::string answer() const { return fmt::format("{} + {} = {}", a, b, a + b); }
};

// Held-out problems are those whose (a, b) hash lands in one bucket of ten: never seen in
// training, in any phrasing. The hash must mix well: a linear one such as (a + b) % 10 would hold
// out exactly the sums ending in one digit, which the model could then never learn to write.
bool is_held_out(int a, int b) {
  uint64_t h = uint64_t(a * 100 + b + 1) * 0x9e3779b97f4a7c15ull;
  h ^= h >> 29;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 32;
  return h % 10 == 3;
}

// One conversation in the OpenAI/ShareGPT "messages" form keel prepare reads.
std::string record_of(const Problem& p) {
  return fmt::format(R"({{"messages": [{{"role": "user", "content": {}}}, {{"role": "assistant", "content": {}}}]}})"
                     "\n",
                     json_quoted(p.question()), json_quoted(p.answer()));
}

// A preference pair: the answer against a plausible wrong one (the sum off by one or by ten, as a
// missed carry leaves it), as conversations.
std::string pair_record_of(const Problem& p, std::mt19937_64& rng) {
  static constexpr int kSlips[] = {-10, -1, 1, 10};
  int wrong = p.a + p.b + kSlips[rng() % 4];
  if (wrong < 0) wrong = p.a + p.b + 1;
  const std::string rejected = fmt::format("{} + {} = {}", p.a, p.b, wrong);
  return fmt::format(R"({{"prompt": [{{"role": "user", "content": {}}}], "chosen": [{{"role": "assistant", )"
                     R"("content": {}}}], "rejected": [{{"role": "assistant", "content": {}}}]}})"
                     "\n",
                     json_quoted(p.question()), json_quoted(p.answer()), json_quoted(rejected));
}

std::vector<Problem> problems(int64_t count, uint64_t seed, bool held_out) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> operand(0, 99), phrasing(0, 2);
  std::set<std::pair<int, int>> seen;
  std::vector<Problem> out;
  while (int64_t(out.size()) < count) {
    const int a = operand(rng), b = operand(rng), f = phrasing(rng);
    if (is_held_out(a, b) != held_out) continue;
    if (held_out && !seen.insert({a, b}).second) continue;  // each held-out problem once
    out.push_back({a, b, f});
  }
  return out;
}

// A byte-level BPE tokenizer trained by keel on the training conversations (as `keel tokenizer
// train` does), with ChatML's special tokens, plus a tokenizer_config.json that names the ChatML
// template, so the exported model chats with `keel generate --chat` as a Qwen2 model would.
void write_tokenizer(const std::string& dir, const std::vector<Problem>& train) {
  data::BpeTrainingOptions o;
  o.special_tokens = kSpecialTokens;
  o.vocab_size = int32_t(kSpecialTokens.size()) + 256 + kMerges;
  o.pattern = "qwen2";  // numbers split into single digits, so sums are written digit by digit
  data::BpeTrainer trainer(o);
  for (const auto& p : train) {
    trainer.add_text("user\n" + p.question());
    trainer.add_text("assistant\n" + p.answer());
  }
  make_dirs(dir);
  write_file_atomic(dir + "/tokenizer.json", trainer.tokenizer_json());
  // ChatML in Jinja, as a Qwen2 directory ships it: `keel generate --chat` renders it (the demo's
  // recipe names the built-in chatml, which renders the same text).
  write_file_atomic(
      dir + "/tokenizer_config.json",
      R"({"chat_template": "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",)"
      "\n"
      R"( "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})"
      "\n");
}

// Greedy chat answers with the KV-cache generator, as `keel generate --chat` produces them.
class ChatEvaluator {
 public:
  ChatEvaluator(const data::Tokenizer& tokenizer) : tokenizer_(tokenizer) {
    for (const auto& stop : data::chat_stop_tokens(data::ChatFormat::chatml))
      if (auto id = tokenizer.token_to_id(stop)) sampling_.stop_ids.push_back(*id);
    sampling_.max_new_tokens = 16;
  }

  std::string answer(const model::Decoder& decoder, const Problem& p) {
    const std::string prompt = data::render_chat_text(data::ChatFormat::chatml, {{"user", p.question()}}, true);
    const std::vector<int32_t> ids = tokenizer_.encode(prompt);
    model::Generator generator(decoder, kSeq);
    std::vector<int32_t> out = generator.generate(ids, sampling_);
    std::erase_if(out, [&](int32_t id) { return tokenizer_.is_special(id); });
    return tokenizer_.decode(out);
  }

  double accuracy(const model::Decoder& decoder, const std::vector<Problem>& held_out, std::ostream* show, int shown) {
    int64_t correct = 0;
    for (size_t i = 0; i < held_out.size(); ++i) {
      const std::string got = answer(decoder, held_out[i]);
      const bool ok = got == held_out[i].answer();
      correct += ok;
      if (show && int(i) < shown)
        fmt::print(*show, "    user: {:<26} assistant: {:<14} {}\n", held_out[i].question(), got,
                   ok ? "correct" : fmt::format("wrong (expected {})", held_out[i].answer()));
    }
    return double(correct) / double(held_out.size());
  }

 private:
  const data::Tokenizer& tokenizer_;
  model::SamplingOptions sampling_;
};

// The held-out accuracy of an exported model as a user would load it (config, weights and tokenizer
// from the directory): this also exercises export and reload. `show`: the first 8 answers there.
double exported_accuracy(const std::string& dir, const std::vector<Problem>& held_out, std::ostream* show) {
  auto config = model::load_model_config(dir + "/config.json");
  model::Decoder model(config, model::Precision::F32, 1, 2);
  model::load_hf_weights(model, dir);
  const data::Tokenizer tokenizer = data::load_tokenizer(dir);
  ChatEvaluator evaluator(tokenizer);
  return evaluator.accuracy(model, held_out, show, 8);
}

std::string demo_recipe(const std::string& work, int64_t steps, int64_t vocab) {
  return fmt::format(R"(# keel demo: a tiny Llama-architecture model learns two-digit addition, asked in chat form,
# from scratch. data_path is raw JSONL of conversations: keel prepares it once into packed shards
# (ChatML template, loss on the assistant's answers only) in .keel-cache next to it. Paths are
# relative to this file's directory ({0}), so the recipe moves with its data.
data_path = "train.jsonl"
eval_data_path = "eval.jsonl"
tokenizer = "tokenizer"
chat_template = "chatml"
packing = "pack"
eval_interval = 200
output_dir = "run"
dtype = "fp32"
max_seq_len = {1}
batch_size = 32
gradient_accumulation_steps = 1
learning_rate = 3e-3
weight_decay = 0.01
warmup_steps = 30
lr_scheduler = "cosine"
max_steps = {2}
max_grad_norm = 1.0
seed = 7
log_interval = 100

[model_config]
family = "llama"
vocab_size = {3}
hidden_size = 128
intermediate_size = 384
num_layers = 3
num_heads = 4
num_kv_heads = 2
max_position_embeddings = {1}
)",
                     work, kSeq, steps, vocab);
}

// The preference stage: DPO from the SFT run's exported model, its tokenizer and ChatML template.
std::string dpo_recipe(const std::string& work, int64_t steps) {
  return fmt::format(R"(# keel demo, preference stage ({0}): DPO from the supervised model in run/final on pairs of a
# correct answer and a wrong one. The pairs are conversations, rendered with the model's template.
model_name = "run/final"
data_path = "pairs.jsonl"
eval_data_path = "eval_pairs.jsonl"
chat_template = "model"
stage = "dpo"
pref_loss = "sigmoid"
pref_beta = 0.1
output_dir = "dpo"
dtype = "fp32"
max_seq_len = {1}
batch_size = 16
learning_rate = 2e-4
warmup_steps = 10
lr_scheduler = "cosine"
max_steps = {2}
eval_interval = {2}
max_grad_norm = 1.0
seed = 7
log_interval = 25
)",
                     work, kSeq, steps);
}

// Writes the pairs, trains DPO, and answers the held-out problems with its model.
void run_preference_stage(const DemoOptions& o, const std::vector<Problem>& train, const std::vector<Problem>& held_out,
                          DemoResult& result, std::ostream& log) {
  std::mt19937_64 rng(13);
  std::string records;
  // One epoch's worth: each pair seen once (batch_size 16 pairs a step).
  for (int64_t i = 0; i < int64_t(train.size()) && i < 16 * o.dpo_steps; ++i) records += pair_record_of(train[size_t(i)], rng);
  write_file_atomic(o.work_dir + "/pairs.jsonl", records);
  records.clear();
  for (const auto& p : held_out) records += pair_record_of(p, rng);
  write_file_atomic(o.work_dir + "/eval_pairs.jsonl", records);
  const std::string recipe_path = o.work_dir + "/dpo.toml";
  write_file_atomic(recipe_path, dpo_recipe(o.work_dir, o.dpo_steps));
  fmt::print(log,
             "\nkeel demo, preference stage: DPO on pairs of the right answer and a wrong one (a sum off by one or "
             "ten), from the model above; recipe: {}\n",
             recipe_path);
  const auto dpo_run = train::run_training(recipe::load_recipe(recipe_path), log);
  result.reward_accuracy = dpo_run.summary.final_preference.rewards_accuracies;
  result.held_out_reward_accuracy = dpo_run.summary.eval_preference.rewards_accuracies;
  result.accuracy_after_dpo = exported_accuracy(o.work_dir + "/dpo/final", held_out, nullptr);
  fmt::print(log,
             "\n  preference stage: the right answer preferred (reward accuracy) on {:.1f}% of the last step's pairs "
             "and {:.1f}% of {} held-out pairs; held-out chat accuracy {:.1f}% after SFT -> {:.1f}% after DPO\n",
             100 * result.reward_accuracy, 100 * result.held_out_reward_accuracy, held_out.size(),
             100 * result.accuracy_after, 100 * result.accuracy_after_dpo);
}

}  // namespace

DemoResult run_demo(const DemoOptions& o, std::ostream& log) {
  make_dirs(o.work_dir);
  const auto train_problems = problems(30000, 11, false);
  const auto held_out = problems(o.held_out, 5, true);
  std::string records;
  for (const auto& p : train_problems) records += record_of(p);
  write_file_atomic(o.work_dir + "/train.jsonl", records);
  records.clear();
  for (const auto& p : held_out) records += record_of(p);
  write_file_atomic(o.work_dir + "/eval.jsonl", records);
  write_tokenizer(o.work_dir + "/tokenizer", train_problems);
  const data::Tokenizer tokenizer = data::load_tokenizer(o.work_dir + "/tokenizer");

  const std::string recipe_path = o.work_dir + "/recipe.toml";
  write_file_atomic(recipe_path, demo_recipe(o.work_dir, o.max_steps, tokenizer.vocab_size()));
  fmt::print(log,
             "keel demo: a model learns two-digit addition in chat form ({} held-out problems never seen in "
             "training)\n",
             held_out.size());
  fmt::print(log,
             "  data: {0}/train.jsonl ({1} conversations), tokenizer: {0}/tokenizer ({2} tokens, trained by "
             "keel), recipe: {3}\n",
             o.work_dir, train_problems.size(), tokenizer.vocab_size(), recipe_path);
  const auto recipe = recipe::load_recipe(recipe_path);

  DemoResult result;
  ChatEvaluator evaluator(tokenizer);
  {
    auto before = recipe::setup_model(recipe);  // the same seeded initialisation training starts from
    result.accuracy_before = evaluator.accuracy(*before.decoder, held_out, nullptr, 0);
  }
  fmt::print(log, "  accuracy before training: {:.1f}%\n\n", 100 * result.accuracy_before);

  const auto trained_run = train::run_training(recipe, log);
  result.final_loss = trained_run.summary.final_loss;

  const std::string final_dir = recipe.output_dir + "/final";
  fmt::print(log, "\n  held-out conversations after training (keel generate --model {} --chat --prompt ...):\n",
             final_dir);
  result.accuracy_after = exported_accuracy(final_dir, held_out, &log);
  fmt::print(log, "\n  accuracy on {} held-out problems: {:.1f}% before training -> {:.1f}% after\n", held_out.size(),
             100 * result.accuracy_before, 100 * result.accuracy_after);
  if (o.dpo) run_preference_stage(o, train_problems, held_out, result, log);
  return result;
}

}  // namespace keel::cli
