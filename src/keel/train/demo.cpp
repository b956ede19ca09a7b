#include "keel/train/demo.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <fstream>
#include <random>
#include <set>

#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/model/hf_weights.h"
#include "keel/train/model_setup.h"
#include "keel/train/recipe.h"
#include "keel/train/trainer.h"

namespace keel::train {
namespace {

// A 16-symbol vocabulary: digits, '+', '=', end of answer, padding.
constexpr int32_t kPlus = 10, kEquals = 11, kEnd = 12, kVocab = 16;
constexpr int64_t kSeq = 12;

struct Problem {
  int a, b;
};

std::vector<int32_t> digits(int v) {
  std::vector<int32_t> out;
  for (char c : std::to_string(v)) out.push_back(c - '0');
  return out;
}

std::vector<int32_t> prompt_of(const Problem& p) {
  auto ids = digits(p.a);
  ids.push_back(kPlus);
  for (int32_t d : digits(p.b)) ids.push_back(d);
  ids.push_back(kEquals);
  return ids;
}

std::string text_of(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += id < 10 ? char('0' + id) : id == kPlus ? '+' : id == kEquals ? '=' : id == kEnd ? '$' : '_';
  return s;
}

// Held-out problems are those whose (a, b) hash lands in one bucket of ten: never seen in
// training. The hash must mix well: a linear one such as (a + b) % 10 would hold out exactly the
// sums ending in one digit, which the model could then never learn to write.
bool is_held_out(const Problem& p) {
  uint64_t h = uint64_t(p.a * 100 + p.b + 1) * 0x9e3779b97f4a7c15ull;
  h ^= h >> 29;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 32;
  return h % 10 == 3;
}

// One record: the question without loss, then the answer and the end mark with loss.
std::string record_of(const Problem& p) {
  auto ids = prompt_of(p);
  std::vector<int32_t> labels(ids.size(), -100);
  for (int32_t d : digits(p.a + p.b)) ids.push_back(d), labels.push_back(d);
  ids.push_back(kEnd);
  labels.push_back(kEnd);
  return fmt::format("{{\"input_ids\": [{}], \"labels\": [{}]}}\n", fmt::join(ids, ", "), fmt::join(labels, ", "));
}

void write_training_data(const std::string& path, int64_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> operand(0, 99);
  std::string out;
  for (int64_t n = 0; n < count;) {
    Problem p{operand(rng), operand(rng)};
    if (is_held_out(p)) continue;
    out += record_of(p);
    ++n;
  }
  write_file_atomic(path, out);
}

std::vector<Problem> held_out_problems(int64_t count) {
  std::vector<Problem> out;
  std::mt19937_64 rng(5);
  std::uniform_int_distribution<int> operand(0, 99);
  std::set<std::pair<int, int>> seen;
  while (int64_t(out.size()) < count) {
    Problem p{operand(rng), operand(rng)};
    if (is_held_out(p) && seen.insert({p.a, p.b}).second) out.push_back(p);
  }
  return out;
}

// Greedy answers for all problems at once: one batch row per problem, re-running the forward pass
// for each new token (the prompts are 4-6 tokens; a KV cache buys nothing at this size).
std::vector<std::vector<int32_t>> greedy_answers(model::Decoder& decoder, const std::vector<Problem>& problems) {
  const int64_t B = int64_t(problems.size());
  std::vector<std::vector<int32_t>> seqs, answers(B);
  for (const auto& p : problems) seqs.push_back(prompt_of(p));
  std::vector<int32_t> ids(B * kSeq), targets(B * kSeq, -100), positions(B * kSeq);
  std::vector<int64_t> rows(B);
  std::vector<float> logits(B * kVocab);
  std::vector<bool> done(B, false);
  for (int step = 0; step < 4; ++step) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < kSeq; ++t) {
        ids[b * kSeq + t] = t < int64_t(seqs[b].size()) ? seqs[b][t] : 0;
        positions[b * kSeq + t] = int32_t(t);
      }
      rows[b] = b * kSeq + int64_t(seqs[b].size()) - 1;
    }
    model::MicroBatch mb{B, kSeq, ids.data(), targets.data(), positions.data(), nullptr};
    decoder.logits_at(mb, rows.data(), B, logits.data());
    for (int64_t b = 0; b < B; ++b) {
      if (done[b]) continue;
      const float* row = logits.data() + b * kVocab;
      int32_t best = int32_t(std::max_element(row, row + kVocab) - row);
      seqs[b].push_back(best);
      if (best == kEnd) done[b] = true; else answers[b].push_back(best);
    }
  }
  return answers;
}

double accuracy(model::Decoder& decoder, const std::vector<Problem>& problems, std::ostream* show, int shown) {
  auto answers = greedy_answers(decoder, problems);
  int64_t correct = 0;
  for (size_t i = 0; i < problems.size(); ++i) {
    const bool ok = answers[i] == digits(problems[i].a + problems[i].b);
    correct += ok;
    if (show && int(i) < shown)
      fmt::print(*show, "    {:>6} {:<4} {}\n", text_of(prompt_of(problems[i])), text_of(answers[i]),
                 ok ? "correct" : fmt::format("wrong (expected {})", problems[i].a + problems[i].b));
  }
  return double(correct) / double(problems.size());
}

std::string demo_recipe(const std::string& work, int64_t steps) {
  return fmt::format(R"(# keel demo: a tiny Llama-architecture model learns two-digit addition from scratch.
data_path = "{0}/train.jsonl"
eval_data_path = "{0}/eval.jsonl"
eval_interval = 200
output_dir = "{0}/run"
dtype = "fp32"
max_seq_len = {1}
batch_size = 64
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
                     work, kSeq, steps, kVocab);
}

}  // namespace

DemoResult run_demo(const DemoOptions& o, std::ostream& log) {
  make_dirs(o.work_dir);
  const std::string recipe_path = o.work_dir + "/recipe.toml";
  write_file_atomic(recipe_path, demo_recipe(o.work_dir, o.max_steps));
  write_training_data(o.work_dir + "/train.jsonl", 20000, 11);
  const auto problems = held_out_problems(o.held_out);
  std::string eval_records;
  for (const auto& p : problems) eval_records += record_of(p);
  write_file_atomic(o.work_dir + "/eval.jsonl", eval_records);
  fmt::print(log, "keel demo: learning two-digit addition ({} held-out problems never seen in training)\n",
             problems.size());
  const auto recipe = load_recipe(recipe_path);
  fmt::print(log, "  recipe: {}\n", recipe_path);

  DemoResult result;
  {
    auto before = setup_model(recipe);  // the same seeded initialisation training starts from
    auto eval = model::Decoder(before.decoder->config(), model::Precision::F32, int64_t(problems.size()), kSeq);
    std::copy_n(before.decoder->params().weights(), before.decoder->params().total(), eval.params().weights());
    result.accuracy_before = accuracy(eval, problems, nullptr, 0);
  }
  fmt::print(log, "  accuracy before training: {:.1f}%\n\n", 100 * result.accuracy_before);

  const auto trained_run = run_training(recipe, log);
  result.final_loss = trained_run.summary.final_loss;

  // Evaluate the exported model, as a user would load it: this also exercises export + reload.
  const std::string final_dir = recipe.output_dir + "/final";
  auto config = model::load_model_config(final_dir + "/config.json");
  model::Decoder trained(config, model::Precision::F32, int64_t(problems.size()), kSeq);
  model::load_hf_weights(trained, final_dir);
  fmt::print(log, "\n  held-out examples after training:\n");
  result.accuracy_after = accuracy(trained, problems, &log, 8);
  fmt::print(log, "\n  accuracy on {} held-out problems: {:.1f}% before training -> {:.1f}% after\n", problems.size(),
             100 * result.accuracy_before, 100 * result.accuracy_after);
  return result;
}

}  // namespace keel::train
