#include "keel/data/bpe.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <queue>

#include "keel/core/error.h"
#include "keel/data/pretokenizer.h"

namespace keel::data {
namespace {

constexpr uint64_t kNoPair = ~uint64_t(0);
constexpr uint32_t kNoRank = std::numeric_limits<uint32_t>::max();
// Up to this many symbols the rank array rescan beats the heap (measured: pieces are rarely longer).
constexpr size_t kShortPiece = 32;
// Pieces longer than this are rare enough that caching them only evicts useful entries.
constexpr size_t kMaxCachedPiece = 64;
constexpr size_t kCacheEntries = 1 << 13;

uint64_t mix(uint64_t h) {
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 33;
  return h;
}

// A fast hash for short byte strings: eight bytes per multiply, then a full avalanche (murmur3's
// finalizer) so that the low bits used for table slots depend on every byte.
// The first (up to) eight bytes, zero-padded: most tokens fit, so a table slot holding this
// compares them without touching the arena.
uint64_t head_of(std::string_view s) {
  uint64_t w = 0;
  std::memcpy(&w, s.data(), s.size() < 8 ? s.size() : 8);
  return w;
}

uint64_t hash_bytes(std::string_view s) {
  const char* p = s.data();
  size_t n = s.size();
  if (n <= 8) return mix(head_of(s) ^ (n * 0x9E3779B97F4A7C15ull));
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0x100000001b3ull);
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = (h ^ w) * 0x87c37b91114253d5ull;
    h ^= h >> 31;
    p += 8;
    n -= 8;
  }
  uint64_t w = 0;
  std::memcpy(&w, p, n);
  return mix(h ^ w);
}

uint64_t pair_key(int32_t left, int32_t right) { return (uint64_t(uint32_t(left)) << 32) | uint32_t(right); }

size_t table_size_for(size_t count) {
  size_t size = 16;
  while (size < count * 2) size <<= 1;
  return size;
}

struct CacheEntry {
  uint64_t owner = 0;
  uint64_t hash = 0;
  std::string piece;
  std::vector<int32_t> ids;
};

// Per-thread so encoding threads never contend; direct-mapped so a lookup is one probe. Entries
// carry their model's id, so several models used from one thread do not see each other's pieces.
std::vector<CacheEntry>& piece_cache() {
  thread_local std::vector<CacheEntry> cache(kCacheEntries);
  return cache;
}

std::atomic<uint64_t> next_cache_owner{1};

}  // namespace

void BytePairModel::add_token(std::string_view bytes, int32_t id, std::string_view origin) {
  require(!bytes.empty(), "{}: token {} is empty", origin, id);
  require(id >= 0, "{}: token id {} is negative", origin, id);
  if (size_t(id) >= lengths_.size()) {
    offsets_.resize(size_t(id) + 1, 0);
    lengths_.resize(size_t(id) + 1, 0);
  }
  require(lengths_[id] == 0, "{}: id {} is given to two tokens", origin, id);
  require(arena_.size() + bytes.size() < std::numeric_limits<uint32_t>::max(), "{}: vocabulary too large", origin);
  offsets_[id] = uint32_t(arena_.size());
  lengths_[id] = uint32_t(bytes.size());
  arena_.append(bytes);
  ++token_count_;
}

void BytePairModel::build_token_table(std::string_view origin) {
  token_table_.assign(table_size_for(token_count_), TokenSlot{0, 0, -1});
  const size_t mask = token_table_.size() - 1;
  for (int32_t id = 0; id < id_limit(); ++id) {
    if (lengths_[id] == 0) continue;
    std::string_view bytes = token_bytes(id);
    const uint64_t h = hash_bytes(bytes);
    size_t slot = h & mask;
    while (token_table_[slot].id >= 0) {
      if (token_bytes(token_table_[slot].id) == bytes)
        fail("{}: tokens {} and {} have the same bytes", origin, token_table_[slot].id, id);
      slot = (slot + 1) & mask;
    }
    token_table_[slot] = {head_of(bytes), lengths_[id], id};
  }
  for (int b = 0; b < 256; ++b) {
    const char c = char(b);
    byte_ids_[b] = find(std::string_view(&c, 1)).value_or(-1);
  }
  cache_owner_ = next_cache_owner.fetch_add(1);
}

void BytePairModel::add_merge(int32_t left, int32_t right, Merge merge) {
  const size_t mask = pair_table_.size() - 1;
  const uint64_t key = pair_key(left, right);
  size_t slot = mix(key) & mask;
  while (pair_table_[slot].key != kNoPair && pair_table_[slot].key != key) slot = (slot + 1) & mask;
  if (pair_table_[slot].key == kNoPair) ++merge_count_;
  // A repeated merge keeps its last rank, as Hugging Face's merges map (and Tokenizers.js) do.
  pair_table_[slot] = {key, merge};
}

std::optional<BytePairModel::Merge> BytePairModel::merge_of(int32_t left, int32_t right) const {
  if (pair_table_.empty()) return std::nullopt;
  const size_t mask = pair_table_.size() - 1;
  const uint64_t key = pair_key(left, right);
  for (size_t slot = mix(key) & mask;; slot = (slot + 1) & mask) {
    const PairSlot& s = pair_table_[slot];
    if (s.key == key) return s.merge;
    if (s.key == kNoPair) return std::nullopt;
  }
}

std::optional<int32_t> BytePairModel::find(std::string_view bytes) const {
  if (token_table_.empty()) return std::nullopt;
  const size_t mask = token_table_.size() - 1;
  const uint64_t head = head_of(bytes);
  for (size_t slot = hash_bytes(bytes) & mask;; slot = (slot + 1) & mask) {
    const TokenSlot& s = token_table_[slot];
    if (s.id < 0) return std::nullopt;
    if (s.head == head && s.length == bytes.size() &&
        (bytes.size() <= 8 || std::memcmp(arena_.data() + offsets_[s.id] + 8, bytes.data() + 8, bytes.size() - 8) == 0))
      return s.id;
  }
}

BytePairModel BytePairModel::from_ranks(std::vector<std::string> tokens, std::string_view origin) {
  BytePairModel model;
  for (size_t rank = 0; rank < tokens.size(); ++rank) model.add_token(tokens[rank], int32_t(rank), origin);
  model.build_token_table(origin);
  for (int b = 0; b < 256; ++b)
    require(model.byte_ids_[b] >= 0, "{}: byte 0x{:02X} has no token (a byte-level rank file has all 256)", origin, b);
  // tiktoken merges any two adjacent parts whose concatenation is a token, ranked by that token:
  // every split of every token into two tokens is such a pair.
  size_t pairs = 0;
  for (const auto& t : tokens) pairs += t.size() > 1 ? t.size() - 1 : 0;
  model.pair_table_.assign(table_size_for(pairs), PairSlot{kNoPair, {}});
  for (size_t rank = 0; rank < tokens.size(); ++rank) {
    std::string_view t = tokens[rank];
    for (size_t k = 1; k < t.size(); ++k) {
      auto left = model.find(t.substr(0, k));
      if (!left) continue;
      auto right = model.find(t.substr(k));
      if (right) model.add_merge(*left, *right, {uint32_t(rank), int32_t(rank)});
    }
  }
  model.options_.ignore_merges = true;
  std::fill(std::begin(model.fallback_ids_), std::end(model.fallback_ids_), -1);  // byte-level: never needed
  return model;
}

BytePairModel BytePairModel::from_merges(const std::vector<std::pair<std::string, int32_t>>& vocab,
                                         const std::vector<std::pair<int32_t, int32_t>>& merges, MergeOptions options,
                                         std::string_view origin) {
  BytePairModel model;
  for (const auto& [bytes, id] : vocab) model.add_token(bytes, id, origin);
  model.build_token_table(origin);
  model.pair_table_.assign(table_size_for(merges.size()), PairSlot{kNoPair, {}});
  std::string joined;
  const size_t prefix = options.continuing_subword_prefix.size();
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    auto [left, right] = merges[rank];
    require(!model.token_bytes(left).empty() && !model.token_bytes(right).empty(),
            "{}: merge {} joins tokens {} and {}, which are not both byte-level vocabulary tokens", origin, rank, left,
            right);
    // With a continuing_subword_prefix the right token's first prefix-length bytes go, whatever
    // they are (Hugging Face's BPE builder slices them off).
    require(model.token_bytes(right).size() > prefix,
            "{}: merge {}: token {} is not longer than the continuing_subword_prefix", origin, rank, right);
    joined.assign(model.token_bytes(left)).append(model.token_bytes(right).substr(prefix));
    auto merged = model.find(joined);
    require(merged.has_value(), "{}: merge {} joins tokens {} and {} into bytes that are not in the vocabulary", origin,
            rank, left, right);
    model.add_merge(left, right, {uint32_t(rank), *merged});
  }
  model.options_ = options;
  for (int b = 0; b < 256; ++b)
    model.fallback_ids_[b] = options.byte_fallback ? model.find(fmt::format("<0x{:02X}>", b)).value_or(-1) : -1;
  return model;
}

void BytePairModel::encode(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  if (piece.size() == 1) {
    encode_uncached(piece, out);
    return;
  }
  if (options_.ignore_merges) {
    if (auto id = find(piece)) {
      out.push_back(*id);
      return;
    }
  }
  if (piece.size() > kMaxCachedPiece) {
    encode_uncached(piece, out);
    return;
  }
  const uint64_t h = hash_bytes(piece);
  CacheEntry& entry = piece_cache()[h & (kCacheEntries - 1)];
  if (entry.owner == cache_owner_ && entry.hash == h && entry.piece == piece) {
    out.insert(out.end(), entry.ids.begin(), entry.ids.end());
    return;
  }
  const size_t begin = out.size();
  encode_uncached(piece, out);
  entry.owner = cache_owner_;
  entry.hash = h;
  entry.piece.assign(piece);
  entry.ids.assign(out.begin() + begin, out.end());
}

// A character without a token, as Hugging Face's BPE does: its bytes' "<0xXX>" tokens when the
// model falls back to bytes and has all of them, else unk (fused with an unk before it), else
// nothing.
void BytePairModel::push_unknown(std::string_view bytes, std::vector<int32_t>& symbols) const {
  if (options_.byte_fallback) {
    bool all = true;
    for (unsigned char c : bytes) all = all && fallback_ids_[c] >= 0;
    if (all) {
      for (unsigned char c : bytes) symbols.push_back(fallback_ids_[c]);
      return;
    }
  }
  if (!options_.unk_id) return;
  if (options_.fuse_unk && !symbols.empty() && symbols.back() == *options_.unk_id) return;
  symbols.push_back(*options_.unk_id);
}

// The first symbols of a piece when the model marks word pieces: each unit (a UTF-8 character, or a
// byte for byte-level BPE) but the first as prefix + unit, the last as unit + suffix, looked up as
// such; a marked unit without a token falls back (bytes, unk) with its marks, as Hugging Face's BPE.
void BytePairModel::push_marked_symbols(std::string_view piece, std::vector<int32_t>& symbols) const {
  thread_local std::string marked;
  for (size_t i = 0; i < piece.size();) {
    const size_t length = options_.char_level ? utf8_length(static_cast<unsigned char>(piece[i])) : 1;
    marked.assign(i > 0 ? options_.continuing_subword_prefix : std::string()).append(piece.substr(i, length));
    if (i + length >= piece.size()) marked.append(options_.end_of_word_suffix);
    if (auto id = find(marked))
      symbols.push_back(*id);
    else
      push_unknown(marked, symbols);
    i += length;
  }
}

void BytePairModel::encode_uncached(std::string_view piece, std::vector<int32_t>& out) const {
  thread_local std::vector<int32_t> symbols;
  symbols.clear();
  const bool marked = !options_.continuing_subword_prefix.empty() || !options_.end_of_word_suffix.empty();
  if (marked) {
    push_marked_symbols(piece, symbols);
  } else if (options_.char_level) {
    // One symbol per UTF-8 character (the text was checked to be valid UTF-8).
    for (size_t i = 0; i < piece.size();) {
      const size_t length = utf8_length(static_cast<unsigned char>(piece[i]));
      const std::string_view character = piece.substr(i, length);
      if (auto id = find(character))
        symbols.push_back(*id);
      else
        push_unknown(character, symbols);
      i += length;
    }
  }
  for (unsigned char c : options_.char_level || marked ? std::string_view() : piece) {
    int32_t id = byte_ids_[c];
    if (id < 0) {
      // Hugging Face BPE: an unknown symbol becomes unk_token, or vanishes when there is none.
      if (!options_.unk_id) continue;
      if (options_.fuse_unk && !symbols.empty() && symbols.back() == *options_.unk_id) continue;
      id = *options_.unk_id;
    }
    symbols.push_back(id);
  }
  if (symbols.size() <= kShortPiece) {
    merge_short(symbols);
    out.insert(out.end(), symbols.begin(), symbols.end());
  } else {
    merge_long(symbols, out);
  }
}

// O(n^2) in symbols, but with n <= kShortPiece everything stays in a few cache lines.
void BytePairModel::merge_short(std::vector<int32_t>& symbols) const {
  size_t n = symbols.size();
  if (n < 2) return;
  uint32_t ranks[kShortPiece];
  int32_t merged[kShortPiece];
  auto rank_pair = [&](size_t i) {
    auto m = merge_of(symbols[i], symbols[i + 1]);
    ranks[i] = m ? m->rank : kNoRank;
    merged[i] = m ? m->merged : -1;
  };
  for (size_t i = 0; i + 1 < n; ++i) rank_pair(i);
  while (n > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < n; ++i)
      if (ranks[i] < ranks[best]) best = i;  // strict: the leftmost of equal ranks wins
    if (ranks[best] == kNoRank) break;
    symbols[best] = merged[best];
    // Drop symbol best+1 and the pair that started at it.
    for (size_t i = best + 1; i + 1 < n; ++i) {
      symbols[i] = symbols[i + 1];
      ranks[i] = ranks[i + 1];
      merged[i] = merged[i + 1];
    }
    --n;
    if (best > 0) rank_pair(best - 1);
    if (best + 1 < n) rank_pair(best);
  }
  symbols.resize(n);
}

// Symbols in a doubly linked list over their original positions; candidate pairs in a min-heap
// ordered by (rank, position). Entries made stale by a neighbouring merge are skipped when popped:
// a pair is still valid when both symbols are alive and adjacent and still merge with that rank.
void BytePairModel::merge_long(std::vector<int32_t>& symbols, std::vector<int32_t>& out) const {
  const int32_t n = int32_t(symbols.size());
  thread_local std::vector<int32_t> prev, next;
  prev.resize(n);
  next.resize(n);
  for (int32_t i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Candidate {
    uint32_t rank;
    int32_t pos;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  thread_local std::vector<Candidate> heap_storage;
  heap_storage.clear();
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap(std::greater<Candidate>{},
                                                                                       std::move(heap_storage));
  for (int32_t i = 0; i + 1 < n; ++i)
    if (auto m = merge_of(symbols[i], symbols[i + 1])) heap.push({m->rank, i});
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    const int32_t left = c.pos;
    if (symbols[left] < 0 || next[left] < 0) continue;
    const int32_t right = next[left];
    auto m = merge_of(symbols[left], symbols[right]);
    if (!m || m->rank != c.rank) continue;
    symbols[left] = m->merged;
    symbols[right] = -1;
    next[left] = next[right];
    if (next[right] >= 0) prev[next[right]] = left;
    if (prev[left] >= 0)
      if (auto p = merge_of(symbols[prev[left]], symbols[left])) heap.push({p->rank, prev[left]});
    if (next[left] >= 0)
      if (auto q = merge_of(symbols[left], symbols[next[left]])) heap.push({q->rank, left});
  }
  for (int32_t i = 0; i >= 0; i = next[i]) out.push_back(symbols[i]);
}

}  // namespace keel::data
