// Where a training step's micro-batches come from. Two sources, one interface:
//  - pre-tokenized JSONL ({"input_ids", "labels"}): read into memory and batched on the training
//    thread with Hugging Face semantics exactly (any label values, records without targets kept),
//    which is what the PyTorch reference comparisons rely on;
//  - everything else (text, prompt/response, messages; or a directory made by `keel prepare`):
//    prepared once into memory-mapped shards and fed by the prefetching ShardLoader.
// Both give micro-batch i of rank r the step's (i * ranks + r)-th block of samples.
#pragma once
#include <cstdint>
#include <memory>
#include <ostream>
#include <span>
#include <string>

#include "keel/data/prepare.h"
#include "keel/data/shard_loader.h"

namespace keel::data {

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // This rank's micro-batches of optimizer step `step` (1-based); valid until the next call.
  virtual std::span<const PackedMicroBatch> step_batches(int64_t step) = 0;
  virtual int64_t sequences() const = 0;         // samples in one epoch
  virtual int64_t samples_per_step() const = 0;  // global, all ranks
  virtual std::string fingerprint() const = 0;   // of the data: a resume must see the same
  virtual bool packed() const = 0;               // rows hold several documents (segments matter)
  virtual double last_wait_seconds() const = 0;  // time the last step_batches() blocked
};

struct BatchSourceOptions {
  int64_t batch_size = 1, seq_len = 0, micro_batches_per_step = 1;
  int rank = 0, ranks = 1;
  bool shuffle = true;
  uint64_t seed = 42;
  int64_t vocab_size = 0;
  int32_t pad_id = 0;
};

// What to read and how: the data and its encoding (request.data_path: pre-tokenized JSONL, raw
// JSONL, or a prepared directory), and how to feed it.
struct BatchSourceRequest {
  TrainingDataRequest data;
  bool on_the_fly = false;  // data_pipeline = "on_the_fly": tokenized on the training thread, step by step
  int num_workers = 0, prefetch_factor = 2;  // the shard loader's threads and the steps they read ahead
};

// Opens request.data.data_path as the request says (tokenizer, packing, chat template, loader threads).
std::unique_ptr<BatchSource> open_batch_source(const BatchSourceRequest& request, const BatchSourceOptions& options,
                                               std::ostream& log);

}  // namespace keel::data
