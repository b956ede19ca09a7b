#include "keel/core/json_text.h"
#include "keel/data/bpe_trainer.h"

#include <simdjson.h>

#include <algorithm>
#include <map>
#include <queue>

#include "keel/core/error.h"
#include "keel/data/byte_level.h"
#include "keel/data/hf_tokenizer_json.h"
#include "keel/data/pretokenizer.h"

namespace keel::data {
namespace {

uint64_t pair_key(int32_t left, int32_t right) { return (uint64_t(uint32_t(left)) << 32) | uint32_t(right); }
int32_t left_of(uint64_t key) { return int32_t(key >> 32); }
int32_t right_of(uint64_t key) { return int32_t(key & 0xFFFFFFFFu); }

struct Word {
  std::vector<int32_t> symbols;
  int64_t count;
};

}  // namespace

BpeTrainer::BpeTrainer(BpeTrainingOptions options) : options_(std::move(options)) {
  pattern_text_ = std::string(named_pattern(options_.pattern));
  require(options_.vocab_size >= int32_t(options_.special_tokens.size()) + 256,
          "vocabulary size {} is too small: {} special tokens and 256 bytes need at least {}", options_.vocab_size,
          options_.special_tokens.size(), options_.special_tokens.size() + 256);
  for (const auto& s : options_.special_tokens) {
    require(!s.empty(), "a special token is empty");
    require(find_invalid_utf8(s) == std::string_view::npos, "special token '{}' is not valid UTF-8", s);
  }
  require(options_.min_frequency >= 1, "minimum pair frequency must be at least 1, not {}", options_.min_frequency);
}

void BpeTrainer::add_text(std::string_view text) {
  const size_t bad = find_invalid_utf8(text);
  require(bad == std::string_view::npos, "text is not valid UTF-8 at byte offset {}", bad);
  // The pattern object is per call so that a trainer can be moved between threads; compiling is
  // cheap next to counting a record.
  thread_local std::string cached_pattern;
  thread_local std::unique_ptr<PretokenizerRegex> regex;
  if (!regex || cached_pattern != pattern_text_) {
    regex = std::make_unique<PretokenizerRegex>(pattern_text_, RegexDialect::oniguruma, "tokenizer training");
    cached_pattern = pattern_text_;
  }
  // Special tokens are cut out first, as the trained tokenizer will do when encoding.
  auto count_pieces = [&](std::string_view segment) {
    regex->split(segment, [&](size_t b, size_t e) { ++piece_counts_[std::string(segment.substr(b, e - b))]; });
  };
  size_t pos = 0;
  while (pos < text.size()) {
    size_t best = std::string_view::npos, best_len = 0;
    for (const auto& s : options_.special_tokens) {
      size_t at = text.find(s, pos);
      if (at < best || (at == best && s.size() > best_len)) best = at, best_len = s.size();
    }
    if (best == std::string_view::npos) break;
    count_pieces(text.substr(pos, best - pos));
    pos = best + best_len;
  }
  count_pieces(text.substr(pos));
}

std::string BpeTrainer::tokenizer_json() const {
  // Sorted pieces: the result must not depend on hash-map order.
  std::vector<std::pair<std::string_view, int64_t>> pieces(piece_counts_.begin(), piece_counts_.end());
  std::sort(pieces.begin(), pieces.end());
  std::vector<Word> words;
  words.reserve(pieces.size());
  for (auto [piece, count] : pieces) {
    Word w{{}, count};
    for (unsigned char c : piece) w.symbols.push_back(c);
    words.push_back(std::move(w));
  }

  // Symbols 0..255 are the bytes; merges add 256, 257, ... (final ids add the special count).
  std::vector<std::string> tokens(256);
  for (int b = 0; b < 256; ++b) tokens[b] = std::string(1, char(b));
  std::map<std::string, int32_t> id_of_bytes;
  for (int b = 0; b < 256; ++b) id_of_bytes[tokens[b]] = b;

  std::unordered_map<uint64_t, int64_t> pair_counts;
  std::unordered_map<uint64_t, std::vector<int32_t>> pair_words;  // may list a word twice or stale
  for (int32_t w = 0; w < int32_t(words.size()); ++w) {
    const auto& s = words[w].symbols;
    for (size_t i = 0; i + 1 < s.size(); ++i) {
      const uint64_t key = pair_key(s[i], s[i + 1]);
      pair_counts[key] += words[w].count;
      pair_words[key].push_back(w);
    }
  }
  // Most frequent first; among equals the smallest (left, right), so the result is deterministic.
  struct Candidate {
    int64_t count;
    uint64_t key;
    bool operator<(const Candidate& o) const { return count != o.count ? count < o.count : key > o.key; }
  };
  std::priority_queue<Candidate> heap;
  for (auto [key, count] : pair_counts) heap.push({count, key});

  std::vector<std::pair<int32_t, int32_t>> merges;
  const int32_t specials = int32_t(options_.special_tokens.size());
  std::vector<int32_t> stamp(words.size(), -1);
  std::vector<uint64_t> changed;
  while (specials + int32_t(tokens.size()) < options_.vocab_size && !heap.empty()) {
    const Candidate top = heap.top();
    heap.pop();
    auto current = pair_counts.find(top.key);
    if (current == pair_counts.end() || current->second != top.count) continue;  // stale entry
    if (top.count < options_.min_frequency) break;
    const int32_t a = left_of(top.key), b = right_of(top.key);
    const std::string joined = tokens[a] + tokens[b];
    int32_t merged;
    if (auto existing = id_of_bytes.find(joined); existing != id_of_bytes.end()) {
      merged = existing->second;
    } else {
      merged = int32_t(tokens.size());
      tokens.push_back(joined);
      id_of_bytes[joined] = merged;
    }
    merges.emplace_back(a, b);
    pair_counts.erase(current);

    changed.clear();
    const int32_t merge_index = int32_t(merges.size());
    auto words_with_pair = std::move(pair_words[top.key]);
    pair_words.erase(top.key);
    for (int32_t w : words_with_pair) {
      if (stamp[w] == merge_index) continue;
      stamp[w] = merge_index;
      auto& s = words[w].symbols;
      const int64_t count = words[w].count;
      bool has_pair = false;
      for (size_t i = 0; i + 1 < s.size(); ++i) has_pair |= s[i] == a && s[i + 1] == b;
      if (!has_pair) continue;
      // Words are a few symbols long: retract all their pairs, merge, count them again.
      for (size_t i = 0; i + 1 < s.size(); ++i) {
        const uint64_t key = pair_key(s[i], s[i + 1]);
        if (key == top.key) continue;
        pair_counts[key] -= count;
        changed.push_back(key);
      }
      std::vector<int32_t> merged_symbols;
      merged_symbols.reserve(s.size());
      for (size_t i = 0; i < s.size(); ++i) {
        if (i + 1 < s.size() && s[i] == a && s[i + 1] == b) {
          merged_symbols.push_back(merged);
          ++i;
        } else {
          merged_symbols.push_back(s[i]);
        }
      }
      s = std::move(merged_symbols);
      for (size_t i = 0; i + 1 < s.size(); ++i) {
        const uint64_t key = pair_key(s[i], s[i + 1]);
        pair_counts[key] += count;
        changed.push_back(key);
        if (s[i] == merged || s[i + 1] == merged) pair_words[key].push_back(w);
      }
    }
    std::sort(changed.begin(), changed.end());
    changed.erase(std::unique(changed.begin(), changed.end()), changed.end());
    for (uint64_t key : changed) {
      auto it = pair_counts.find(key);
      if (it == pair_counts.end()) continue;
      if (it->second <= 0)
        pair_counts.erase(it);
      else
        heap.push({it->second, key});
    }
  }

  std::string json;
  json += "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n  \"added_tokens\": [";
  for (int32_t i = 0; i < specials; ++i)
    json += fmt::format(
        "{}\n    {{\"id\": {}, \"content\": {}, \"single_word\": false, \"lstrip\": false, \"rstrip\": false, "
        "\"normalized\": false, \"special\": true}}",
        i ? "," : "", i, json_quoted(options_.special_tokens[i]));
  json += specials ? "\n  ],\n" : "],\n";
  json += "  \"normalizer\": null,\n";
  json += fmt::format(
      "  \"pre_tokenizer\": {{\"type\": \"Sequence\", \"pretokenizers\": [\n"
      "    {{\"type\": \"Split\", \"pattern\": {{\"Regex\": {}}}, \"behavior\": \"Isolated\", \"invert\": false}},\n"
      "    {{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, \"use_regex\": "
      "false}}]}},\n",
      json_quoted(pattern_text_));
  json += "  \"post_processor\": null,\n";
  json +=
      "  \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, \"trim_offsets\": true, "
      "\"use_regex\": true},\n";
  json +=
      "  \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, \"continuing_subword_prefix\": "
      "null, \"end_of_word_suffix\": null, \"fuse_unk\": false, \"byte_fallback\": false, \"ignore_merges\": "
      "false,\n    \"vocab\": {";
  for (int32_t i = 0; i < specials; ++i)
    json += fmt::format("{}\n      {}: {}", i ? "," : "", json_quoted(options_.special_tokens[i]), i);
  for (int32_t t = 0; t < int32_t(tokens.size()); ++t)
    json += fmt::format("{}\n      {}: {}", specials + t ? "," : "", json_quoted(byte_level_spelling(tokens[t])),
                        specials + t);
  json += "\n    },\n    \"merges\": [";
  for (size_t m = 0; m < merges.size(); ++m)
    json += fmt::format("{}\n      [{}, {}]", m ? "," : "", json_quoted(byte_level_spelling(tokens[merges[m].first])),
                        json_quoted(byte_level_spelling(tokens[merges[m].second])));
  json += "\n    ]\n  }\n}\n";
  return json;
}

std::string train_tokenizer_json_from_jsonl(const std::string& path, const BpeTrainingOptions& options) {
  BpeTrainer trainer(options);
  simdjson::padded_string text;
  auto error = simdjson::padded_string::load(path).get(text);
  require(error == simdjson::SUCCESS, "{}: cannot read the training data ({})", path, simdjson::error_message(error));
  simdjson::dom::parser parser;
  std::string_view all(text.data(), text.size());
  size_t records = 0;
  for (size_t pos = 0, line_no = 1; pos < all.size(); ++line_no) {
    size_t end = all.find('\n', pos);
    if (end == std::string_view::npos) end = all.size();
    std::string_view line = all.substr(pos, end - pos);
    pos = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    simdjson::dom::element doc;
    error = parser.parse(line.data(), line.size()).get(doc);
    require(error == simdjson::SUCCESS, "{}:{}: invalid JSON ({})", path, line_no, simdjson::error_message(error));
    std::string_view record_text;
    require(doc["text"].get_string().get(record_text) == simdjson::SUCCESS,
            "{}:{}: expected an object with a string field \"text\"", path, line_no);
    trainer.add_text(record_text);
    ++records;
  }
  require(records > 0, "{}: no records (expected JSONL lines with \"text\")", path);
  return trainer.tokenizer_json();
}

}  // namespace keel::data
