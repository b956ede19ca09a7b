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

#include "keel/data/batch_source.h"
#include "keel/data/preference_pairs.h"

namespace keel::data {

class PairSource final : public BatchSource {
 public:
  // prompt_targets: every token of a row is a target, the prompt's too (ORPO's NLL term covers the
  // whole chosen sequence); the answers' log-probabilities still count their own tokens only.
  PairSource(PreferencePairs pairs, const BatchSourceOptions& options, std::string fingerprint,
             bool prompt_targets = false);

  std::span<const PackedMicroBatch> step_batches(int64_t step) override;
  int64_t sequences() const override { return pairs_.size(); }
  int64_t samples_per_step() const override { return o_.micro_batches_per_step * o_.ranks * o_.batch_size; }
  std::string fingerprint() const override { return fingerprint_; }
  bool packed() const override { return false; }
  double last_wait_seconds() const override { return wait_s_; }

  const PreferencePairs& pairs() const { return pairs_; }
  // Fills `mb` (2 x which.size() rows, as make_pair_batch sized it) with the pairs `which`.
  void fill(std::span<const int64_t> which, PackedMicroBatch& mb) const;
  // A micro-batch's buffers for `pairs` pairs.
  PackedMicroBatch make_pair_batch(int64_t pairs) const;

 private:
  PreferencePairs pairs_;
  BatchSourceOptions o_;
  bool prompt_targets_;
  SampleOrder order_;
  std::vector<PackedMicroBatch> micro_;
  std::string fingerprint_;
  double wait_s_ = 0;
  std::vector<int64_t> which_;  // scratch: a micro-batch's pairs
};

// Reads the pairs of request.data_path with its tokenizer and chat template, cut at its
// max_seq_len, skipping bad records up to its max_bad_fraction (data/preference_pairs.h).
// prompt_targets as PairSource's.
std::unique_ptr<PairSource> open_pair_source(const TrainingDataRequest& request, bool prompt_targets,
                                             const BatchSourceOptions& options, std::ostream& log);

}  // namespace keel::data
