#include "keel/data/pair_source.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <chrono>

#include "keel/core/checksum.h"
#include "keel/core/error.h"
#include "keel/data/batch_builder.h"
#include "keel/data/prepare.h"
#include "keel/data/tokenizer.h"

namespace keel::data {
namespace {

constexpr int32_t kIgnore = -100;

// One row: prompt + answer, the answer's tokens the targets of the positions before them.
void fill_row(std::span<const int32_t> prompt, std::span<const int32_t> answer, int64_t T, int32_t pad_id,
              bool prompt_targets, int32_t* in, int32_t* tg, int32_t* pos, int32_t* seg, int64_t& input_tokens,
              int64_t& target_tokens) {
  const int64_t P = int64_t(prompt.size()), len = P + int64_t(answer.size());  // <= T: cut when read
  for (int64_t t = 0; t < len; ++t) in[t] = t < P ? prompt[size_t(t)] : answer[size_t(t - P)];
  for (int64_t t = 0; t < T; ++t) {
    if (t >= len) in[t] = pad_id;
    // The token at t + 1 is a target when it is an answer token (TRL's shifted completion mask).
    tg[t] = t + 1 < len && (prompt_targets || t + 1 >= P) ? in[t + 1] : kIgnore;
    pos[t] = int32_t(t < len ? t : t - len);
    seg[t] = t < len ? 0 : 1;
    target_tokens += tg[t] != kIgnore;
  }
  input_tokens += len;
}

}  // namespace

PairSource::PairSource(PreferencePairs pairs, const BatchSourceOptions& o, std::string fingerprint,
                       bool prompt_targets)
    : pairs_(std::move(pairs)),
      o_(o),
      prompt_targets_(prompt_targets),
      order_(pairs_.size(), o.shuffle, o.seed),
      fingerprint_(std::move(fingerprint)) {
  for (int64_t i = 0; i < o.micro_batches_per_step; ++i) micro_.push_back(make_pair_batch(o.batch_size));
}

PackedMicroBatch PairSource::make_pair_batch(int64_t pairs) const {
  PackedMicroBatch mb = make_packed_micro_batch_buffers(2 * pairs, o_.seq_len);
  mb.pairs.resize(size_t(pairs));
  mb.answer_starts.resize(size_t(2 * pairs));
  return mb;
}

void PairSource::fill(std::span<const int64_t> which, PackedMicroBatch& mb) const {
  const int64_t B = int64_t(which.size()), T = mb.seq;
  require(mb.batch == 2 * B && int64_t(mb.pairs.size()) == B, "pair source: a micro-batch of {} rows for {} pairs",
          mb.batch, B);
  mb.input_tokens = mb.target_tokens = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p = which[size_t(b)];
    mb.pairs[size_t(b)] = p;
    for (int side = 0; side < 2; ++side) {
      const int64_t row = side * B + b;
      mb.answer_starts[size_t(row)] = int32_t(pairs_.prompt(p).size());
      fill_row(pairs_.prompt(p), side == 0 ? pairs_.chosen(p) : pairs_.rejected(p), T, o_.pad_id, prompt_targets_,
               mb.input_ids.data() + row * T, mb.targets.data() + row * T, mb.positions.data() + row * T,
               mb.segments.data() + row * T, mb.input_tokens, mb.target_tokens);
    }
  }
}

std::span<const PackedMicroBatch> PairSource::step_batches(int64_t step) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t first = (step - 1) * samples_per_step();
  std::vector<int64_t>& which = which_;
  which.resize(size_t(o_.batch_size));
  for (int64_t i = 0; i < o_.micro_batches_per_step; ++i) {
    for (int64_t b = 0; b < o_.batch_size; ++b)
      which[size_t(b)] = order_.record_at(first + (i * o_.ranks + o_.rank) * o_.batch_size + b);
    fill(which, micro_[size_t(i)]);
  }
  wait_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return micro_;
}

std::unique_ptr<PairSource> open_pair_source(const TrainingDataRequest& q, bool prompt_targets,
                                             const BatchSourceOptions& o, std::ostream& log) {
  const std::string& path = q.data_path;
  const std::string tokenizer_path = training_tokenizer_path(q.tokenizer_path);
  require(!tokenizer_path.empty(), "{}: preference pairs are text, and this run has no tokenizer (set 'tokenizer')",
          path);
  const Tokenizer tokenizer = load_tokenizer(tokenizer_path);
  DocumentEncoder chooser;  // prepare's choice of template, for the same names
  chooser.tokenizer = &tokenizer;
  chooser.special_tokens_in_messages = q.special_tokens_in_messages;
  std::string why;
  const std::string chosen_template = choose_chat_template(chooser, q.chat_template, tokenizer_path, &why);
  if (chooser.model_template) fmt::print(log, "keel: conversational pairs through {}\n", why);
  require(o.vocab_size <= 0 || tokenizer.vocab_size() <= o.vocab_size,
          "{}: the tokenizer has a {}-token vocabulary, larger than the model's {}", tokenizer_path,
          tokenizer.vocab_size(), o.vocab_size);
  PreferencePairs pairs = read_preference_pairs(path, {&tokenizer, chooser.model_template, q.max_seq_len, o.vocab_size},
                                                q.max_bad_fraction, log);
  // The pairs' ids are what the run sees: a resume must see the same.
  const std::string fingerprint = fmt::format("pairs:{}:{}", checksum_hex(pairs.checksum()), chosen_template);
  return std::make_unique<PairSource>(std::move(pairs), o, fingerprint, prompt_targets);
}

}  // namespace keel::data
