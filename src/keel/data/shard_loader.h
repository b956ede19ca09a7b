// The training data loader over prepared shards (shard_format.h).
//
// Samples are the prepared sequences, consumed as one stream across epochs in the order of
// SampleOrder (batch_builder.h: a seeded Fisher-Yates permutation per epoch, the same generator
// as the in-memory path), so the order depends only on (seed, epoch), never on threads or ranks.
//
// A training step consumes samples_per_step() = micro_batches_per_step x ranks x batch_size
// samples. Micro-batch i of rank r in a step is the step's (i * ranks + r)-th block of batch_size
// samples, exactly as the trainer's in-memory path: ranks read disjoint parts of every global
// batch, together all of it, and dp=N sees the same samples as dp=1 with N times the accumulation.
//
// Background workers fill whole steps (this rank's micro-batches) into a ring of
// prefetch_factor + 1 step buffers allocated once; the trainer takes the next step and measures
// how long it waited (last_wait_seconds). The position (samples consumed) is a plain number kept
// in the training state: seek(position) after a resume continues at the exact next sample.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "keel/data/batch_builder.h"
#include "keel/data/shard_format.h"

namespace keel::data {

// A micro-batch with the document id of every token, for the block-diagonal causal mask of
// packed rows (kernels/attention.h `segments`); pass segments.data() as model::MicroBatch::segments.
struct PackedMicroBatch : MicroBatchData {
  std::vector<int32_t> segments;  // [batch*seq]; padding gets an id of its own
  // Preference data (data/pair_source.h): the pair whose chosen answer is row b and whose rejected
  // answer is row batch/2 + b, for b < batch/2; empty for other data.
  std::vector<int64_t> pairs;
  std::vector<int32_t> answer_starts;  // [batch] preference rows: where the answer starts (its first token)
};
PackedMicroBatch make_packed_micro_batch_buffers(int64_t batch, int64_t seq);

// One row from one prepared sequence: tokens then padding; targets are the next token when it is
// in the same document and carries loss (else -100); positions restart at 0 at every document.
// Adds the row's non-padding and target tokens to the counts. keel::Error for an id >= vocab_size.
void fill_packed_row(const ShardFile::SequenceView& sequence, int64_t seq, int32_t pad_id, int64_t vocab_size,
                     int32_t* input_ids, int32_t* targets, int32_t* positions, int32_t* segments, int64_t& input_tokens,
                     int64_t& target_tokens);

struct ShardLoaderOptions {
  int64_t batch_size = 1;              // sequences per micro-batch per rank
  int64_t seq_len = 0;                 // row length: the recipe's max_seq_len (>= the manifest's)
  int64_t micro_batches_per_step = 1;  // gradient_accumulation_steps
  int rank = 0, ranks = 1;
  bool shuffle = true;
  uint64_t seed = 42;
  int num_workers = 1;      // 0: fill on the calling thread, nothing in the background
  int prefetch_factor = 2;  // steps kept ready ahead of the one in use
  int64_t vocab_size = 0;   // the model's; 0 = the manifest's
  int32_t pad_id = -1;      // -1 = the manifest's
  bool verify_checksums = true;
};

class ShardLoader {
 public:
  ShardLoader(const std::string& dir, const ShardLoaderOptions& options);
  ~ShardLoader();
  ShardLoader(const ShardLoader&) = delete;
  ShardLoader& operator=(const ShardLoader&) = delete;

  // Continues at global sample `samples_consumed` (a resume's TrainingState::samples_consumed).
  void seek(int64_t samples_consumed);
  // This rank's micro-batches of the next step (micro_batches_per_step of them), valid until the
  // next call; position() advances by samples_per_step().
  std::span<const PackedMicroBatch> next_step();
  // The same for step `step` (1-based, starting at sample (step-1) * samples_per_step()): seeks
  // first when that is not where the loader stands, so calling it for step, step+1, ... streams.
  std::span<const PackedMicroBatch> step_batches(int64_t step);
  const PackedMicroBatch& micro_batch(int64_t step, int64_t micro_index) { return step_batches(step)[micro_index]; }

  int64_t position() const { return position_; }  // global samples consumed by the steps handed out
  int64_t samples_per_step() const { return samples_per_step_; }
  int64_t sequences() const { return data_->sequences(); }
  // The global sample index of row b of micro-batch i of `rank` in the step starting at `first`.
  int64_t sample_index(int64_t first, int64_t micro, int rank, int64_t row) const {
    return first + (micro * o_.ranks + rank) * o_.batch_size + row;
  }
  double last_wait_seconds() const { return last_wait_s_; }  // the last next_step()'s blocking time
  double total_wait_seconds() const { return total_wait_s_; }
  const ShardManifest& manifest() const { return data_->manifest(); }
  std::string fingerprint() const { return data_->fingerprint(); }

 private:
  struct Slot {
    std::vector<PackedMicroBatch> micro;
    int64_t unit = -1;  // the step unit it holds when ready
  };
  void fill(int64_t first_sample, SampleOrder& order, Slot& slot) const;
  void worker_loop();

  ShardLoaderOptions o_;
  std::unique_ptr<PreparedData> data_;
  int64_t samples_per_step_ = 0;
  int64_t vocab_size_ = 0;
  int32_t pad_id_ = 0;
  int64_t position_ = 0;
  double last_wait_s_ = 0, total_wait_s_ = 0;

  // Prefetch ring: unit n (the n-th step since the last seek, starting at sample origin_ +
  // n * samples_per_step_) lives in slot n % slots_.size().
  std::vector<Slot> slots_;
  std::unique_ptr<SampleOrder> caller_order_;  // num_workers == 0
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t origin_ = 0;
  int64_t handed_ = 0;     // units given to the caller; unit handed_ - 1 is in use
  int64_t next_fill_ = 0;  // next unit a worker claims
  int filling_ = 0;
  int64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr failure_;
  std::vector<std::thread> workers_;
};

}  // namespace keel::data
