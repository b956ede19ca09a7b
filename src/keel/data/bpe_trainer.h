// Trains a byte-level BPE tokenizer (Sennrich et al. 2016, with GPT-2's byte alphabet) and writes
// it as a Hugging Face tokenizer.json: special tokens first (ids 0..k-1), then the 256 bytes, then
// one token per merge, most frequent pair first. The file uses only what every Hugging Face
// implementation reads (Split regex + ByteLevel without regex, BPE with ["a", "b"] merges,
// ByteLevel decoder), so @huggingface/tokenizers gives the same ids as keel.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace keel::data {

struct BpeTrainingOptions {
  int32_t vocab_size = 0;                   // specials + 256 bytes + merges
  std::vector<std::string> special_tokens;  // ids 0.. in this order
  std::string pattern = "cl100k";           // named pre-tokenizer pattern (pretokenizer.h)
  int64_t min_frequency = 2;                // a pair seen fewer times is never merged
};

class BpeTrainer {
 public:
  explicit BpeTrainer(BpeTrainingOptions options);
  // Pre-tokenizes `text` (valid UTF-8; keel::Error otherwise) and counts its pieces.
  void add_text(std::string_view text);
  // Runs the merges and returns the tokenizer.json text.
  std::string tokenizer_json() const;
  size_t distinct_pieces() const { return piece_counts_.size(); }

 private:
  BpeTrainingOptions options_;
  std::string pattern_text_;
  std::unordered_map<std::string, int64_t> piece_counts_;
};

// Trains from a JSONL file of {"text": ...} records; a bad line is a keel::Error naming path:line.
std::string train_tokenizer_json_from_jsonl(const std::string& path, const BpeTrainingOptions& options);

}  // namespace keel::data
