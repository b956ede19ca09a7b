// Byte-level byte-pair encoding (Sennrich et al. 2016; the byte-level variant of GPT-2): a piece of
// text starts as one symbol per byte, and the adjacent pair with the lowest merge rank is merged
// until no adjacent pair has a rank. Ties go to the leftmost pair, as in tiktoken and Hugging Face.
//
// Two ways to rank a pair, one engine:
//   - tiktoken rank files: a pair's rank is the rank of the token its concatenation forms
//     (from_ranks); a piece that is itself a token is emitted whole.
//   - tokenizer.json: a pair's rank is its index in the merges list (from_merges); a piece is
//     emitted whole first only with `ignore_merges` (Llama 3).
// Both become one table (left id, right id) -> (rank, merged id), so the merge loop does integer
// hashing only. Short pieces use a rank array rescanned per merge (fastest at that size); long
// pieces a symbol list with a min-heap of candidate pairs, O(n log n) instead of O(n^2). Pieces a
// thread has encoded recently are remembered in a small per-thread cache.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace keel::data {

class BytePairModel {
 public:
  struct MergeOptions {
    bool ignore_merges = false;     // emit a piece that is in the vocabulary whole, before merging
    std::optional<int32_t> unk_id;  // the symbol for a byte without a token (else the byte is dropped)
    bool fuse_unk = false;          // consecutive unknown bytes become one unk
    // SentencePiece-style BPE (Llama 2, Gemma, Mistral): a piece starts as one symbol per UTF-8
    // character, not per byte, and the vocabulary spells tokens in plain UTF-8 (with U+2581 for
    // the space). A character without a token becomes its bytes' "<0xXX>" tokens with
    // `byte_fallback`, else unk.
    bool char_level = false;
    bool byte_fallback = false;
    // Word-piece marks some BPE files carry (Hugging Face's BPE model, in the vocabulary's bytes):
    // every symbol of a piece but the first starts as prefix + symbol, the last one as symbol +
    // suffix (CLIP's "</w>"); a merge of (a, b) forms a + b without b's first prefix.size() bytes.
    std::string continuing_subword_prefix, end_of_word_suffix;
  };

  // tiktoken: tokens[rank] holds the bytes of the token with that rank (= id). Every one of the
  // 256 single bytes must be a token. keel::Error naming `origin` otherwise.
  static BytePairModel from_ranks(std::vector<std::string> tokens, std::string_view origin);

  // tokenizer.json: vocab of (bytes, id) and merges of (left id, right id) in rank order; each
  // merge's concatenation must be in the vocabulary.
  static BytePairModel from_merges(const std::vector<std::pair<std::string, int32_t>>& vocab,
                                   const std::vector<std::pair<int32_t, int32_t>>& merges, MergeOptions options,
                                   std::string_view origin);

  // Appends the ids of one pre-tokenized piece.
  void encode(std::string_view piece, std::vector<int32_t>& out) const;

  std::optional<int32_t> find(std::string_view bytes) const;
  // The bytes of each token by id (empty for an id that is not a token of this model), through
  // plain pointers: a loop over many ids that stores size_t values (offsets) takes the table once,
  // where through the members the stores' possible aliasing of the vectors' and string's sizes
  // would reload them for every id.
  struct TokenBytesTable {
    const char* bytes;
    const uint32_t* offsets;
    const uint32_t* lengths;
    size_t count;
    std::string_view operator()(int32_t id) const {
      if (id < 0 || size_t(id) >= count) return {};
      return {bytes + offsets[id], lengths[id]};
    }
  };
  TokenBytesTable token_bytes_table() const {
    return {arena_.data(), offsets_.data(), lengths_.data(), lengths_.size()};
  }
  // The bytes of token `id`; empty when `id` is not a token of this model.
  std::string_view token_bytes(int32_t id) const { return token_bytes_table()(id); }
  // Their length alone (0 when `id` is not a token of this model).
  size_t token_length(int32_t id) const { return size_t(id) < lengths_.size() ? lengths_[size_t(id)] : 0; }
  const MergeOptions& options() const { return options_; }
  // One past the largest id.
  int32_t id_limit() const { return int32_t(lengths_.size()); }
  size_t token_count() const { return token_count_; }
  size_t merge_count() const { return merge_count_; }

  struct Merge {
    uint32_t rank;
    int32_t merged;
  };
  // The merge of adjacent tokens (left, right), if they have one.
  std::optional<Merge> merge_of(int32_t left, int32_t right) const;

 private:
  void add_token(std::string_view bytes, int32_t id, std::string_view origin);
  void build_token_table(std::string_view origin);
  void add_merge(int32_t left, int32_t right, Merge merge);
  void encode_uncached(std::string_view piece, std::vector<int32_t>& out) const;
  void push_unknown(std::string_view bytes, std::vector<int32_t>& symbols) const;
  void push_marked_symbols(std::string_view piece, std::vector<int32_t>& symbols) const;
  void merge_short(std::vector<int32_t>& symbols) const;
  void merge_long(std::vector<int32_t>& symbols, std::vector<int32_t>& out) const;

  struct TokenSlot {
    uint64_t head;  // the token's first eight bytes, zero-padded
    uint32_t length;
    int32_t id;  // -1: empty
  };
  struct PairSlot {
    uint64_t key;  // kNoPair: empty
    Merge merge;
  };

  std::string arena_;              // the bytes of every token, back to back
  std::vector<uint32_t> offsets_;  // by id
  std::vector<uint32_t> lengths_;  // by id; 0 = no token with this id
  std::vector<TokenSlot> token_table_;
  std::vector<PairSlot> pair_table_;
  size_t token_count_ = 0;
  size_t merge_count_ = 0;
  int32_t byte_ids_[256];
  int32_t fallback_ids_[256];  // byte_fallback: the id of "<0xXX>" for each byte, -1 if none
  MergeOptions options_;
  uint64_t cache_owner_ = 0;  // distinguishes this model's entries in the per-thread piece cache
};

}  // namespace keel::data
