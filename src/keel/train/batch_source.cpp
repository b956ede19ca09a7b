#include "keel/train/batch_source.h"

#include <chrono>
#include <fstream>

#include "keel/core/checksum.h"
#include "keel/core/file_io.h"
#include "keel/data/batch_builder.h"
#include "keel/data/prepare.h"
#include "keel/data/token_records.h"

namespace keel::train {
namespace {

class RecordsSource final : public BatchSource {
 public:
  RecordsSource(const std::string& path, const BatchSourceOptions& o)
      : o_(o), records_(data::read_token_records(path, o.vocab_size)),
        order_(records_.size(), o.shuffle, o.seed) {
    for (int64_t i = 0; i < o.micro_batches_per_step; ++i) {
      data::PackedMicroBatch mb;
      static_cast<data::MicroBatchData&>(mb) = data::make_micro_batch_buffers(o.batch_size, o.seq_len);
      micro_.push_back(std::move(mb));
    }
    const uint64_t parts[3] = {
        checksum(records_.input_ids.data(), records_.input_ids.size() * sizeof(int32_t)),
        checksum(records_.labels.data(), records_.labels.size() * sizeof(int32_t)),
        checksum(records_.offsets.data(), records_.offsets.size() * sizeof(int64_t))};
    fingerprint_ = checksum_hex(checksum(parts, sizeof(parts)));
  }

  std::span<const data::PackedMicroBatch> step_batches(int64_t step) override {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t first = (step - 1) * samples_per_step();
    for (int64_t i = 0; i < o_.micro_batches_per_step; ++i) {
      const int64_t block = i * o_.ranks + o_.rank;
      data::fill_micro_batch(records_, order_, first + block * o_.batch_size, o_.pad_id, micro_[i]);
    }
    wait_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return micro_;
  }
  int64_t sequences() const override { return records_.size(); }
  int64_t samples_per_step() const override { return o_.micro_batches_per_step * o_.ranks * o_.batch_size; }
  std::string fingerprint() const override { return fingerprint_; }
  bool packed() const override { return false; }
  double last_wait_seconds() const override { return wait_s_; }

 private:
  BatchSourceOptions o_;
  data::TokenRecords records_;
  data::SampleOrder order_;
  std::vector<data::PackedMicroBatch> micro_;
  std::string fingerprint_;
  double wait_s_ = 0;
};

class ShardSource final : public BatchSource {
 public:
  ShardSource(const std::string& dir, const data::ShardLoaderOptions& o) : loader_(dir, o) {}
  std::span<const data::PackedMicroBatch> step_batches(int64_t step) override { return loader_.step_batches(step); }
  int64_t sequences() const override { return loader_.sequences(); }
  int64_t samples_per_step() const override { return loader_.samples_per_step(); }
  std::string fingerprint() const override { return loader_.fingerprint(); }
  bool packed() const override { return loader_.manifest().packing == data::Packing::pack; }
  double last_wait_seconds() const override { return loader_.last_wait_seconds(); }

 private:
  data::ShardLoader loader_;
};

// A JSONL file whose first record carries "input_ids": already tokenized.
bool is_pretokenized_jsonl(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line))
    if (line.find_first_not_of(" \t\r") != std::string::npos) return line.find("\"input_ids\"") != std::string::npos;
  return false;
}

}  // namespace

std::unique_ptr<BatchSource> open_batch_source(const std::string& path, const Recipe& r, const BatchSourceOptions& o,
                                               std::ostream& log) {
  const bool plain_jsonl = path.size() >= 6 && path.compare(path.size() - 6, 6, ".jsonl") == 0;
  if (plain_jsonl && path_exists(path) && is_pretokenized_jsonl(path) && r.packing == "pad")
    return std::make_unique<RecordsSource>(path, o);
  data::TrainingDataRequest q;
  q.data_path = path;
  q.tokenizer_path = recipe_tokenizer_path(r);
  q.max_seq_len = r.max_seq_len;
  q.vocab_size = o.vocab_size;
  q.pad_id = o.pad_id;
  q.packing = r.packing == "pack" ? data::Packing::pack : data::Packing::pad;
  q.chat_template = r.chat_template;
  const std::string dir = data::resolve_training_data(q, &log);
  return std::make_unique<ShardSource>(
      dir, data::ShardLoaderOptions{.batch_size = o.batch_size, .seq_len = o.seq_len,
                                    .micro_batches_per_step = o.micro_batches_per_step, .rank = o.rank,
                                    .ranks = o.ranks, .shuffle = o.shuffle, .seed = o.seed,
                                    .num_workers = int(r.num_workers), .prefetch_factor = int(r.prefetch_factor),
                                    .vocab_size = o.vocab_size, .pad_id = o.pad_id});
}

}  // namespace keel::train
