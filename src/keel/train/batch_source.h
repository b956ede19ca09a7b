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

#include "keel/data/shard_loader.h"
#include "keel/model/config.h"
#include "keel/recipe/recipe.h"

namespace keel::train {

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // This rank's micro-batches of optimizer step `step` (1-based); valid until the next call.
  virtual std::span<const data::PackedMicroBatch> step_batches(int64_t step) = 0;
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

// The id padding gets in a run of this model: its pad_token_id when it has one in its vocabulary, else 0.
int32_t model_pad_id(const model::ModelConfig& config);

// Opens `path` as the recipe says (tokenizer, packing, chat template, loader threads).
std::unique_ptr<BatchSource> open_batch_source(const std::string& path, const recipe::Recipe& recipe,
                                               const BatchSourceOptions& options, std::ostream& log);

}  // namespace keel::train
