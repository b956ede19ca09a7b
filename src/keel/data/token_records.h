// Pre-tokenized training records: JSONL lines {"input_ids": [...], "labels": [...]} where labels
// are optional (absent = the input ids themselves) and -100 marks tokens that carry no loss.
// The data issue adds raw-text records, tokenization and memory-mapped shards; this reader is the
// input format those shards reduce to, and the one users with their own tokenizer can feed directly.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace keel::data {

// All records of a file in three flat arrays (no per-record allocation).
struct TokenRecords {
  std::vector<int32_t> input_ids;
  std::vector<int32_t> labels;   // same length as input_ids
  std::vector<int64_t> offsets;  // record r spans [offsets[r], offsets[r+1])
  int64_t size() const { return offsets.empty() ? 0 : int64_t(offsets.size()) - 1; }
  int64_t length(int64_t r) const { return offsets[r + 1] - offsets[r]; }
};

// Reads and validates a JSONL file: every id must be in [0, vocab_size) and every label either in
// that range or -100; a bad line is a keel::Error naming the file, line and field.
TokenRecords read_token_records(const std::string& path, int64_t vocab_size);

}  // namespace keel::data
