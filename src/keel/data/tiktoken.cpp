#include "keel/data/tiktoken.h"

#include <array>
#include <charconv>

#include "keel/core/error.h"
#include "keel/core/file_io.h"

namespace keel::data {
namespace {

// Strict standard base64 (RFC 4648 section 4, padded): what tiktoken writes. Returns false on
// any other character, a bad length or bits set past the end.
bool decode_base64(std::string_view in, std::string& out) {
  static const std::array<int8_t, 256> table = [] {
    std::array<int8_t, 256> t{};
    t.fill(-1);
    const char* alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int i = 0; i < 64; ++i) t[static_cast<unsigned char>(alphabet[i])] = int8_t(i);
    return t;
  }();
  out.clear();
  if (in.empty() || in.size() % 4 != 0) return false;
  size_t padding = 0;
  if (in.back() == '=') padding = in[in.size() - 2] == '=' ? 2 : 1;
  const size_t data = in.size() - padding;
  uint32_t bits = 0;
  int count = 0;
  for (size_t i = 0; i < data; ++i) {
    const int8_t v = table[static_cast<unsigned char>(in[i])];
    if (v < 0) return false;
    bits = (bits << 6) | uint32_t(v);
    count += 6;
    if (count >= 8) {
      count -= 8;
      out += char((bits >> count) & 0xFF);
    }
  }
  // The leftover bits must be zero padding of the last byte, as a canonical encoder writes them.
  return (bits & ((1u << count) - 1)) == 0;
}

struct KnownEncoding {
  std::string_view pattern;
  size_t rank_count;
  std::vector<std::pair<std::string_view, int32_t>> special;
};

const std::vector<KnownEncoding>& known_encodings() {
  // tiktoken_ext/openai_public.py; GLM-4's specials are numbered from the rank count, so their
  // ids below are offsets.
  static const std::vector<KnownEncoding> table{
      {"cl100k",
       100256,
       {{"<|endoftext|>", 100257},
        {"<|fim_prefix|>", 100258},
        {"<|fim_middle|>", 100259},
        {"<|fim_suffix|>", 100260},
        {"<|endofprompt|>", 100276}}},
      {"o200k", 199998, {{"<|endoftext|>", 199999}, {"<|endofprompt|>", 200018}}},
      {"gpt2", 50256, {{"<|endoftext|>", 50256}}},
      {"glm4",
       151329,
       {{"<|endoftext|>", 0},
        {"[MASK]", 1},
        {"[gMASK]", 2},
        {"[sMASK]", 3},
        {"<sop>", 4},
        {"<eop>", 5},
        {"<|system|>", 6},
        {"<|user|>", 7},
        {"<|assistant|>", 8},
        {"<|observation|>", 9},
        {"<|begin_of_image|>", 10},
        {"<|end_of_image|>", 11},
        {"<|begin_of_video|>", 12},
        {"<|end_of_video|>", 13}}},
  };
  return table;
}

}  // namespace

std::vector<std::string> parse_tiktoken_ranks(std::string_view text, std::string_view origin) {
  size_t lines = 0;
  for (char c : text) lines += c == '\n';
  lines += !text.empty() && text.back() != '\n';
  std::vector<std::string> tokens;
  std::vector<size_t> line_of_rank;
  size_t line_no = 0, pos = 0, filled = 0;
  std::string bytes;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const size_t space = line.find(' ');
    require(space != std::string_view::npos, "{}:{}: expected 'base64-token rank', found no space", origin, line_no);
    std::string_view token = line.substr(0, space), rank_text = line.substr(space + 1);
    require(decode_base64(token, bytes), "{}:{}: '{}' is not valid base64", origin, line_no, token);
    uint64_t rank = 0;
    auto [ptr, ec] = std::from_chars(rank_text.data(), rank_text.data() + rank_text.size(), rank);
    require(ec == std::errc() && ptr == rank_text.data() + rank_text.size() && !rank_text.empty(),
            "{}:{}: rank '{}' is not a non-negative integer", origin, line_no, rank_text);
    // Ranks must be 0..N-1 for N tokens, so a rank of N or more (however large) is a gap: checking
    // it here also keeps a bogus huge rank from sizing an allocation.
    require(rank < lines, "{}:{}: rank {} leaves a gap: a file of {} lines holds ranks 0 to {}", origin, line_no, rank,
            lines, lines - 1);
    if (tokens.size() <= rank) {
      tokens.resize(rank + 1);
      line_of_rank.resize(rank + 1, 0);
    }
    require(line_of_rank[rank] == 0, "{}:{}: rank {} was already given on line {}", origin, line_no, rank,
            line_of_rank[rank]);
    require(!bytes.empty(), "{}:{}: empty token", origin, line_no);
    tokens[rank] = bytes;
    line_of_rank[rank] = line_no;
    ++filled;
  }
  require(filled > 0, "{}: no ranks (expected 'base64-token rank' lines)", origin);
  for (size_t r = 0; r < tokens.size(); ++r)
    require(line_of_rank[r] != 0, "{}: rank {} is missing (ranks must run from 0 to {} without gaps)", origin, r,
            tokens.size() - 1);
  return tokens;
}

std::string_view tiktoken_pattern_for(size_t rank_count) {
  for (const auto& e : known_encodings())
    if (e.rank_count == rank_count) return e.pattern;
  return {};
}

std::vector<AddedToken> tiktoken_special_tokens(std::string_view pattern, size_t rank_count) {
  std::vector<AddedToken> out;
  for (const auto& e : known_encodings()) {
    if (e.pattern != pattern || e.rank_count != rank_count) continue;
    for (auto [content, id] : e.special) {
      AddedToken t;
      t.content = content;
      t.id = pattern == "glm4" ? int32_t(rank_count) + id : id;
      t.special = true;
      out.push_back(std::move(t));
    }
  }
  return out;
}

Tokenizer tiktoken_tokenizer(std::vector<std::string> ranks, std::string_view pattern, std::string origin) {
  TokenizerParts parts;
  parts.origin = origin;
  parts.added_tokens = tiktoken_special_tokens(pattern, ranks.size());
  PreTokenizerStep split;
  split.regex = std::make_shared<PretokenizerRegex>(named_pattern(pattern), RegexDialect::tiktoken, origin);
  parts.pre_tokenizer.push_back(std::move(split));
  parts.model = BytePairModel::from_ranks(std::move(ranks), origin);
  for (const auto& t : parts.added_tokens)
    if (t.content == "<|endoftext|>") parts.eos_id = t.id;
  return Tokenizer(std::move(parts));
}

Tokenizer load_tiktoken(const std::string& path, std::string_view pattern) {
  auto ranks = parse_tiktoken_ranks(read_file(path), path);
  if (pattern.empty()) {
    pattern = tiktoken_pattern_for(ranks.size());
    require(!pattern.empty(),
            "{}: {} ranks match no known encoding; name the pre-tokenizer pattern (gpt2, cl100k, o200k, glm4, qwen2)",
            path, ranks.size());
  }
  return tiktoken_tokenizer(std::move(ranks), pattern, path);
}

}  // namespace keel::data
