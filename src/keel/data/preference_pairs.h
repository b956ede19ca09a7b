// Preference pairs (chosen and rejected answers to one prompt) read from JSONL and tokenized as TRL's
// DPOTrainer tokenizes them (trl 1.16, DPOTrainer._prepare_dataset), so that a keel DPO run and a
// TRL one see the same ids:
//
// - Three record forms, TRL's: {"prompt", "chosen", "rejected"} strings; conversational (prompt a
//   list of messages, chosen and rejected lists of assistant messages, optional "system" before the
//   prompt and "tools"); and implicit prompt (only chosen and rejected, the prompt their common
//   start: the longest run of equal messages, or of equal characters for strings, as
//   trl.extract_prompt cuts it).
// - Plain strings: the tokenizer's EOS text is appended to each answer that does not end with it;
//   prompt and prompt + answer are encoded with the tokenizer's special tokens (its BOS).
// - Conversations: the prompt through the model's chat template with the generation prompt, and
//   prompt + answer through it without.
// - The answer's tokens are prompt + answer's beyond their common prefix with the prompt's (TRL's
//   common_prefix_length rule: a template that renders the prompt differently alone, or a token
//   merging across the boundary, moves the answer's start back).
// - Truncation is TRL's keep_start: each row (prompt + answer) is cut to max_seq_len, and a pair
//   whose prompt alone fills the row is dropped. Both are counted and reported.
//
// Bad pairs (not JSON, a missing or mistyped field, an empty answer, chosen equal to rejected, an
// empty prompt, a template error) are counted and listed as prepare lists bad records; above
// max_bad_fraction the whole file is refused.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "keel/data/chat_template.h"

namespace keel::data {

class Tokenizer;
class ChatTemplateEncoder;

struct PairEncoding {
  const Tokenizer* tokenizer = nullptr;                       // required
  std::shared_ptr<const ChatTemplateEncoder> model_template;  // conversational pairs need it
  int64_t max_seq_len = 0;                                    // a row's length (prompt + one answer)
  int64_t vocab_size = 0;                                     // the model's: ids at or above it are refused
};

// Every kept pair's ids, back to back: prompt, chosen answer, rejected answer.
class PreferencePairs {
 public:
  int64_t size() const { return int64_t(pairs_.size()); }
  std::span<const int32_t> prompt(int64_t i) const { return span(i, 0); }
  std::span<const int32_t> chosen(int64_t i) const { return span(i, 1); }
  std::span<const int32_t> rejected(int64_t i) const { return span(i, 2); }
  int64_t line(int64_t i) const { return pairs_[size_t(i)].line; }  // 1-based, in the file

  void add(std::span<const int32_t> prompt, std::span<const int32_t> chosen, std::span<const int32_t> rejected,
           int64_t line);
  // A checksum of every id and length: what a resume, and the reference log-probabilities' cache, key on.
  uint64_t checksum() const;

  int64_t records = 0;    // non-blank lines read
  int64_t bad = 0;        // refused (listed)
  int64_t truncated = 0;  // kept with an answer cut at max_seq_len
  int64_t dropped = 0;    // the prompt alone filled max_seq_len: nothing of the answers left

 private:
  struct Pair {
    int64_t start;       // in ids_
    int64_t lengths[3];  // prompt, chosen, rejected
    int64_t line;
  };
  std::span<const int32_t> span(int64_t i, int part) const;
  std::vector<int32_t> ids_;
  std::vector<Pair> pairs_;
};

// One pair's tokens, before truncation.
struct TokenizedPair {
  std::vector<int32_t> prompt, chosen, rejected;
};

// Tokenizes one JSONL record: "" and `out` filled, or why the record is not a usable pair.
std::string tokenize_pair(std::string_view line, const PairEncoding& encoding, TokenizedPair& out);

// Whether a JSONL record looks like a preference pair (has "chosen" and "rejected"): what lets
// supervised fine-tuning refuse pair data by name instead of calling each record bad.
bool is_preference_record(std::string_view line);
// Whether the first non-blank line of a JSONL file is one (false for a file that cannot be read).
bool holds_preference_pairs(const std::string& path);

// Reads and tokenizes `path`. Prints one line of counts (and the first bad records) to `log`;
// keel::Error when more than max_bad_fraction of the records are bad or none is left.
PreferencePairs read_preference_pairs(const std::string& path, const PairEncoding& encoding, double max_bad_fraction,
                                      std::ostream& log);

}  // namespace keel::data
