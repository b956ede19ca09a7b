// Preference pairs (data/preference_pairs.h) as a step's micro-batches, in TRL's layout: a
// micro-batch of batch_size pairs is 2 x batch_size rows, the pairs' chosen answers first, then
// their rejected answers in the same order (DataCollatorForPreference), each row prompt + answer
// with targets on the answer's tokens only, padded to max_seq_len. Both answers of a pair are in
// the same micro-batch: the pair's loss needs both log-probabilities before either's gradient.
// batch_size counts pairs, and so do sequences() and samples_per_step().
#pragma once
#include <memory>
#include <ostream>
#include <span>
#include <string>

#include "keel/data/preference_pairs.h"
#include "keel/train/batch_source.h"

namespace keel::train {

class PairSource final : public BatchSource {
 public:
  // prompt_targets: every token of a row is a target, the prompt's too (ORPO's NLL term covers the
  // whole chosen sequence); the answers' log-probabilities still count their own tokens only.
  PairSource(data::PreferencePairs pairs, const BatchSourceOptions& options, std::string fingerprint,
             bool prompt_targets = false);

  std::span<const data::PackedMicroBatch> step_batches(int64_t step) override;
  int64_t sequences() const override { return pairs_.size(); }
  int64_t samples_per_step() const override { return o_.micro_batches_per_step * o_.ranks * o_.batch_size; }
  std::string fingerprint() const override { return fingerprint_; }
  bool packed() const override { return false; }
  double last_wait_seconds() const override { return wait_s_; }

  const data::PreferencePairs& pairs() const { return pairs_; }
  // Fills `mb` (2 x which.size() rows, as make_pair_batch sized it) with the pairs `which`.
  void fill(std::span<const int64_t> which, data::PackedMicroBatch& mb) const;
  // A micro-batch's buffers for `pairs` pairs.
  data::PackedMicroBatch make_pair_batch(int64_t pairs) const;

 private:
  data::PreferencePairs pairs_;
  BatchSourceOptions o_;
  bool prompt_targets_;
  data::SampleOrder order_;
  std::vector<data::PackedMicroBatch> micro_;
  std::string fingerprint_;
  double wait_s_ = 0;
  std::vector<int64_t> which_;  // scratch: a micro-batch's pairs
};

// Reads the pairs of `path` with the recipe's tokenizer and chat template (data/preference_pairs.h).
std::unique_ptr<PairSource> open_pair_source(const std::string& path, const recipe::Recipe& recipe,
                                             const BatchSourceOptions& options, std::ostream& log);

}  // namespace keel::train
