// Turns records into fixed-shape micro-batches [batch, seq]: truncate to seq, right-pad with
// ignored labels, shift labels by one (position t predicts token t+1, as HF causal LMs do), and
// restart rotary positions at 0 for every sequence.
#pragma once
#include <cstdint>
#include <vector>

#include "keel/data/token_records.h"

namespace keel::data {

// The order in which samples are consumed: epoch after epoch, each epoch a permutation of all
// records (Fisher-Yates with a counter-based generator seeded by (seed, epoch), so the order does
// not depend on thread count, platform or standard library) or file order when not shuffling.
class SampleOrder {
 public:
  SampleOrder(int64_t records, bool shuffle, uint64_t seed);
  // Record index of the k-th sample of the stream (k counts across epochs).
  int64_t record_at(int64_t k);
  int64_t records() const { return records_; }

 private:
  int64_t records_;
  bool shuffle_;
  uint64_t seed_;
  int64_t epoch_ = -1;
  std::vector<int64_t> permutation_;
};

struct MicroBatchData {
  int64_t batch = 0, seq = 0;
  std::vector<int32_t> input_ids, targets, positions;  // [batch*seq]
  int64_t input_tokens = 0;                            // non-padding tokens
  int64_t target_tokens = 0;                           // tokens that carry loss
};

// Fills `out` (already sized, reused every step) from samples [first_sample, first_sample + batch).
// segments (optional, [batch*seq]): each token's document id as the packed loaders write them
// (shard_loader.h): 0 for a record's tokens, 2 (one past the next document's) for the padding.
void fill_micro_batch(const TokenRecords& records, SampleOrder& order, int64_t first_sample, int32_t pad_id,
                      MicroBatchData& out, int32_t* segments = nullptr);
MicroBatchData make_micro_batch_buffers(int64_t batch, int64_t seq);

}  // namespace keel::data
