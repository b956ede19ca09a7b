#include "keel/data/batch_source.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <chrono>
#include <fstream>
#include <optional>

#include "keel/core/checksum.h"
#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/data/batch_builder.h"
#include "keel/data/preference_pairs.h"
#include "keel/data/prepare.h"
#include "keel/data/token_records.h"
#include "keel/data/tokenizer.h"

namespace keel::data {
namespace {

class RecordsSource final : public BatchSource {
 public:
  RecordsSource(const std::string& path, const BatchSourceOptions& o)
      : o_(o), records_(read_token_records(path, o.vocab_size)), order_(records_.size(), o.shuffle, o.seed) {
    for (int64_t i = 0; i < o.micro_batches_per_step; ++i) {
      PackedMicroBatch mb;
      static_cast<MicroBatchData&>(mb) = make_micro_batch_buffers(o.batch_size, o.seq_len);
      mb.segments.resize(size_t(o.batch_size * o.seq_len));  // where the padding is (not packed: one record a row)
      micro_.push_back(std::move(mb));
    }
    const uint64_t parts[3] = {checksum(records_.input_ids.data(), records_.input_ids.size() * sizeof(int32_t)),
                               checksum(records_.labels.data(), records_.labels.size() * sizeof(int32_t)),
                               checksum(records_.offsets.data(), records_.offsets.size() * sizeof(int64_t))};
    fingerprint_ = checksum_hex(checksum(parts, sizeof(parts)));
  }

  std::span<const PackedMicroBatch> step_batches(int64_t step) override {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t first = (step - 1) * samples_per_step();
    for (int64_t i = 0; i < o_.micro_batches_per_step; ++i) {
      const int64_t block = i * o_.ranks + o_.rank;
      fill_micro_batch(records_, order_, first + block * o_.batch_size, o_.pad_id, micro_[i],
                             micro_[i].segments.data());
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
  TokenRecords records_;
  SampleOrder order_;
  std::vector<PackedMicroBatch> micro_;
  std::string fingerprint_;
  double wait_s_ = 0;
};

class ShardSource final : public BatchSource {
 public:
  // fingerprint: of the JSONL the shards were prepared from (training_data_fingerprint), or ""
  // for a directory given as data_path (then the shards' own).
  ShardSource(const std::string& dir, const ShardLoaderOptions& o, std::string fingerprint)
      : loader_(dir, o), fingerprint_(fingerprint.empty() ? loader_.fingerprint() : std::move(fingerprint)) {}
  std::span<const PackedMicroBatch> step_batches(int64_t step) override { return loader_.step_batches(step); }
  int64_t sequences() const override { return loader_.sequences(); }
  int64_t samples_per_step() const override { return loader_.samples_per_step(); }
  std::string fingerprint() const override { return fingerprint_; }
  bool packed() const override { return loader_.manifest().packing == Packing::pack; }
  double last_wait_seconds() const override { return loader_.last_wait_seconds(); }

 private:
  ShardLoader loader_;
  std::string fingerprint_;
};

// data_pipeline = "on_the_fly": the naive loader prepared data replaces. Every step_batches()
// reads its records from the file, parses and tokenizes them on the calling thread with
// prepare's DocumentEncoder and pads each to a row of its own, exactly as the loader builds a row
// of `packing = "pad"` shards; nothing runs in the background, and the time it takes is the
// step's data wait. Opening the file makes one pass over it to find the samples: the records
// prepare would keep (not bad, some target left after truncation), so that sample k is the same
// document under both pipelines. The pass tokenizes too (whether a target survives truncation
// depends on the token count) but keeps only each record's place in the file.
class OnTheFlySource final : public BatchSource {
 public:
  OnTheFlySource(const TrainingDataRequest& q, const BatchSourceOptions& o, std::ostream& log)
      : o_(o), log_(log), path_(q.data_path), order_(0, false, 0) {
    const std::string& path = q.data_path;
    require(!is_prepared_dir(path),
            "{}: data_pipeline = \"on_the_fly\" tokenizes raw JSONL during training; this is prepared data (give the "
            "JSONL it was prepared from, or use data_pipeline = \"prepared\")",
            path);
    for (const char* suffix : {".gz", ".zst"})
      require(!path.ends_with(suffix),
              "{}: data_pipeline = \"on_the_fly\" reads plain .jsonl files (decompress it, or use data_pipeline = "
              "\"prepared\")",
              path);
    require(path_exists(path), "{}: no such file", path);
    const std::string tokenizer_path = training_tokenizer_path(q.tokenizer_path);
    if (!tokenizer_path.empty()) tokenizer_.emplace(load_tokenizer(tokenizer_path));
    encoder_.tokenizer = tokenizer_ ? &*tokenizer_ : nullptr;
    encoder_.train_on_prompt = q.train_on_prompt;
    encoder_.special_tokens_in_messages = q.special_tokens_in_messages;
    choose_chat_template(encoder_, q.chat_template, tokenizer_path);
    parser_ = encoder_.record_parser();
    encoder_.max_seq_len = q.max_seq_len;
    encoder_.vocab_size = tokenizer_ ? tokenizer_->vocab_size() : q.vocab_size;
    encoder_.data_path = path;
    require(o.vocab_size <= 0 || encoder_.vocab_size <= o.vocab_size,
            "{}: the tokenizer has a {}-token vocabulary, larger than the model's {}", tokenizer_path,
            encoder_.vocab_size, o.vocab_size);
    index_records(q.max_bad_fraction);
    order_ = SampleOrder(int64_t(records_.size()), o.shuffle, o.seed);
    for (int64_t i = 0; i < o.micro_batches_per_step; ++i)
      micro_.push_back(make_packed_micro_batch_buffers(o.batch_size, o.seq_len));
    fingerprint_ = training_data_fingerprint(q);
  }

  std::span<const PackedMicroBatch> step_batches(int64_t step) override {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t first = (step - 1) * samples_per_step();
    for (int64_t i = 0; i < o_.micro_batches_per_step; ++i) {
      PackedMicroBatch& mb = micro_[size_t(i)];
      mb.input_tokens = mb.target_tokens = 0;
      const int64_t T = mb.seq;
      for (int64_t b = 0; b < o_.batch_size; ++b) {
        const int64_t sample = first + (i * o_.ranks + o_.rank) * o_.batch_size + b;
        fill_row(order_.record_at(sample), T, mb.input_ids.data() + b * T, mb.targets.data() + b * T,
                 mb.positions.data() + b * T, mb.segments.data() + b * T, mb.input_tokens, mb.target_tokens);
      }
    }
    wait_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return micro_;
  }
  int64_t sequences() const override { return int64_t(records_.size()); }
  int64_t samples_per_step() const override { return o_.micro_batches_per_step * o_.ranks * o_.batch_size; }
  std::string fingerprint() const override { return fingerprint_; }
  bool packed() const override { return false; }
  double last_wait_seconds() const override { return wait_s_; }

 private:
  struct Place {
    int64_t offset, bytes, line;
  };

  // One pass over the file: where each record prepare would keep is. Bad records are counted,
  // listed and dropped under prepare's threshold (max_bad_fraction), records without targets
  // dropped and counted.
  void index_records(double max_bad_fraction) {
    std::ifstream in(path_, std::ios::binary);
    require(bool(in), "{}: cannot open", path_);
    std::string line;
    int64_t offset = 0, number = 0, nonblank = 0, bad = 0;
    std::string first_bad;
    while (std::getline(in, line)) {
      const int64_t start = offset;
      offset += int64_t(line.size()) + (in.eof() ? 0 : 1);
      ++number;
      if (!line.empty() && line.back() == '\r') line.pop_back();  // CRLF files, as prepare reads them
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      ++nonblank;
      const std::string why = encode(line, number);
      if (!why.empty()) {
        if (bad < 10) fmt::print(log_, "  {}:{}: {}\n", path_, number, why);
        if (first_bad.empty()) first_bad = fmt::format("{}:{}: {}", path_, number, why);
        ++bad;
        continue;
      }
      if (!document_.document_ends.empty()) records_.push_back({start, int64_t(line.size()), number});
    }
    require(double(bad) <= max_bad_fraction * double(nonblank),
            "{}: {} of {} records are bad ({:.2f}%, above the {}% allowed); the first: {}", path_, bad, nonblank,
            100.0 * double(bad) / double(nonblank), 100 * max_bad_fraction, first_bad);
    require(!records_.empty(), "{}: no usable records (nothing to train on)", path_);
    fmt::print(log_,
               "keel: {} of {} records of {} kept ({} bad, {} without targets, {} truncated); each step reads "
               "and tokenizes its records on the training thread (data_pipeline = \"on_the_fly\")\n",
               records_.size(), nonblank, path_, bad, document_.no_target, document_.truncated);
  }

  // Parses and encodes one line into document_ (cleared first): prepare's reason when it is bad.
  std::string encode(std::string_view line, int64_t number) {
    document_.tokens.clear();
    document_.mask.clear();
    document_.document_ends.clear();
    std::string why = parser_.parse(line, record_);
    if (!why.empty()) return why;
    std::string fatal;
    why = encoder_.encode(record_, number, document_, ids_, fatal);
    require(fatal.empty(), "{}", fatal);
    return why;
  }

  // One row from record r: its document padded to T tokens, as fill_packed_row builds a row of
  // padded shards.
  void fill_row(int64_t r, int64_t T, int32_t* in, int32_t* tg, int32_t* pos, int32_t* seg, int64_t& input_tokens,
                int64_t& target_tokens) {
    const Place& place = records_[size_t(r)];
    if (!file_.is_open()) file_.open(path_, std::ios::binary);
    line_.resize(size_t(place.bytes));
    file_.seekg(place.offset);
    file_.read(line_.data(), std::streamsize(place.bytes));
    require(bool(file_), "{}: cannot read line {} (has the file changed since training started?)", path_, place.line);
    const std::string why = encode(line_, place.line);
    require(why.empty() && !document_.document_ends.empty(),
            "{}:{}: the record no longer gives a document ({}); has the file changed since training started?", path_,
            place.line, why.empty() ? "no target token left" : why);
    const size_t n = document_.tokens.size();
    mask_bits_.assign((n + 7) / 8, 0);
    for (size_t t = 0; t < n; ++t)
      if (document_.mask[t]) mask_bits_[t >> 3] |= uint8_t(1u << (t & 7));
    const uint64_t documents[2] = {0, n};
    const ShardFile::SequenceView view{document_.tokens, mask_bits_.data(), 0, documents, 0};
    fill_packed_row(view, T, o_.pad_id, o_.vocab_size, in, tg, pos, seg, input_tokens, target_tokens);
  }

  BatchSourceOptions o_;
  std::ostream& log_;
  std::string path_;
  std::optional<Tokenizer> tokenizer_;
  DocumentEncoder encoder_;
  std::vector<Place> records_;
  SampleOrder order_;
  std::vector<PackedMicroBatch> micro_;
  std::string fingerprint_;
  double wait_s_ = 0;
  // Scratch, reused.
  std::ifstream file_;
  std::string line_;
  RecordParser parser_;
  Record record_;
  EncodedDocuments document_;
  std::vector<int32_t> ids_;
  std::vector<uint8_t> mask_bits_;
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

std::unique_ptr<BatchSource> open_batch_source(const BatchSourceRequest& request, const BatchSourceOptions& o,
                                               std::ostream& log) {
  const TrainingDataRequest& q = request.data;
  const std::string& path = q.data_path;
  const bool plain_jsonl = path.size() >= 6 && path.compare(path.size() - 6, 6, ".jsonl") == 0;
  require(!holds_preference_pairs(path),
          "{}: the records are preference pairs ('chosen' and 'rejected'), which supervised fine-tuning cannot "
          "train on; set stage = \"dpo\" to tune on them (or give SFT records: text, messages, prompt/response)",
          path);
  if (plain_jsonl && path_exists(path) && is_pretokenized_jsonl(path) && q.packing == Packing::pad)
    return std::make_unique<RecordsSource>(path, o);
  if (request.on_the_fly) return std::make_unique<OnTheFlySource>(q, o, log);
  const std::string dir = resolve_training_data(q, &log);
  // Raw JSONL: the data is identified by its content and settings, whichever pipeline reads it.
  std::string fingerprint = dir == path ? "" : training_data_fingerprint(q);
  return std::make_unique<ShardSource>(dir,
                                       ShardLoaderOptions{.batch_size = o.batch_size,
                                                          .seq_len = o.seq_len,
                                                          .micro_batches_per_step = o.micro_batches_per_step,
                                                          .rank = o.rank,
                                                          .ranks = o.ranks,
                                                          .shuffle = o.shuffle,
                                                          .seed = o.seed,
                                                          .num_workers = request.num_workers,
                                                          .prefetch_factor = request.prefetch_factor,
                                                          .vocab_size = o.vocab_size,
                                                          .pad_id = o.pad_id},
                                       std::move(fingerprint));
}

}  // namespace keel::data
