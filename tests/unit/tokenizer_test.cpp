// Tokenizer unit tests: the BPE merge loop against a naive reference, pre-tokenizer pieces, the
// tokenizer.json features, and every kind of bad input becoming a keel::Error with a clear message.
// Conformance with tiktoken and Hugging Face is tests/reference/tokenizer_conformance.mjs.
#include <gtest/gtest.h>

#include <fstream>
#include <limits>
#include <random>

#include "keel/core/json_text.h"
#include "keel/core/error.h"
#include "keel/data/bpe.h"
#include "keel/data/bpe_trainer.h"
#include "keel/data/byte_level.h"
#include "keel/data/hf_tokenizer_json.h"
#include "keel/data/pretokenizer.h"
#include "keel/data/tiktoken.h"
#include "keel/data/tokenizer.h"

using namespace keel::data;
using keel::json_quoted;

namespace {

// Expects `fn` to throw keel::Error whose message contains `fragment`.
template <typename Fn>
void expect_error(Fn fn, const std::string& fragment) {
  try {
    fn();
    ADD_FAILURE() << "expected keel::Error containing '" << fragment << "'";
  } catch (const keel::Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << "message: " << e.what();
  }
}

// The 256 single bytes in byte order, then `extra` (ranks 256, 257, ...).
std::vector<std::string> byte_ranks(std::vector<std::string> extra) {
  std::vector<std::string> ranks;
  for (int b = 0; b < 256; ++b) ranks.emplace_back(1, char(b));
  ranks.insert(ranks.end(), extra.begin(), extra.end());
  return ranks;
}

// tiktoken's merge loop as written in its educational Python: merge the lowest-ranked adjacent
// pair (leftmost on ties) until none is left. O(n^2), obviously right.
std::vector<int32_t> naive_bpe(const std::vector<std::string>& ranks, const std::string& piece) {
  std::map<std::string, int32_t> rank_of;
  for (size_t r = 0; r < ranks.size(); ++r) rank_of[ranks[r]] = int32_t(r);
  std::vector<std::string> parts;
  for (char c : piece) parts.emplace_back(1, c);
  while (parts.size() > 1) {
    int32_t best = std::numeric_limits<int32_t>::max();
    size_t at = 0;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      auto it = rank_of.find(parts[i] + parts[i + 1]);
      if (it != rank_of.end() && it->second < best) best = it->second, at = i;
    }
    if (best == std::numeric_limits<int32_t>::max()) break;
    parts[at] += parts[at + 1];
    parts.erase(parts.begin() + at + 1);
  }
  std::vector<int32_t> ids;
  for (auto& p : parts) ids.push_back(rank_of.at(p));
  return ids;
}

// A byte-level tokenizer.json: the 256 bytes (ids 0..255), then `extra` tokens (raw bytes) and
// `merges` (pairs of raw byte strings); the rest of the top level is spliced in verbatim.
std::string tokenizer_json(const std::vector<std::string>& extra,
                           const std::vector<std::pair<std::string, std::string>>& merges, const std::string& rest) {
  std::string vocab;
  int id = 0;
  for (int b = 0; b < 256; ++b)
    vocab += fmt::format("{}{}: {}", id ? ", " : "", json_quoted(byte_level_spelling(std::string(1, char(b)))), id),
        ++id;
  for (const auto& t : extra) vocab += fmt::format(", {}: {}", json_quoted(byte_level_spelling(t)), id++);
  std::string merge_list;
  for (size_t i = 0; i < merges.size(); ++i)
    merge_list +=
        fmt::format("{}{}", i ? ", " : "",
                    json_quoted(byte_level_spelling(merges[i].first) + " " + byte_level_spelling(merges[i].second)));
  return fmt::format(R"({{"model": {{"type": "BPE", "vocab": {{{}}}, "merges": [{}]}}, {}}})", vocab, merge_list, rest);
}

const std::string kByteLevelDecoder = R"("decoder": {"type": "ByteLevel"})";

std::string write_temp(const std::string& text, const std::string& suffix = "") {
  char name[] = "/tmp/keel_tokenizer_XXXXXX";
  int fd = mkstemp(name);
  close(fd);
  std::string path = std::string(name) + suffix;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

std::string tiktoken_text(const std::vector<std::string>& ranks) {
  static const char* alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const std::string& s = ranks[r];
    std::string b64;
    for (size_t i = 0; i < s.size(); i += 3) {
      uint32_t v = uint32_t(uint8_t(s[i])) << 16;
      if (i + 1 < s.size()) v |= uint32_t(uint8_t(s[i + 1])) << 8;
      if (i + 2 < s.size()) v |= uint8_t(s[i + 2]);
      b64 += alphabet[(v >> 18) & 63];
      b64 += alphabet[(v >> 12) & 63];
      b64 += i + 1 < s.size() ? alphabet[(v >> 6) & 63] : '=';
      b64 += i + 2 < s.size() ? alphabet[v & 63] : '=';
    }
    out += fmt::format("{} {}\n", b64, r);
  }
  return out;
}

}  // namespace

TEST(ByteLevel, SpellsEveryByteAndBack) {
  EXPECT_EQ(byte_level_spelling(" the\n"), "\xC4\xA0the\xC4\x8A");  // "Ġthe" + "Ċ"
  std::string all;
  for (int b = 0; b < 256; ++b) all += char(b);
  std::string back;
  ASSERT_TRUE(bytes_from_byte_level(byte_level_spelling(all), back));
  EXPECT_EQ(back, all);
  EXPECT_FALSE(bytes_from_byte_level("\xE4\xB8\xAD", back));  // 中 is not in the alphabet
}

TEST(Utf8, FindsMalformedSequences) {
  EXPECT_EQ(find_invalid_utf8("plain ascii, ünïcödé, 中文, 👍"), std::string_view::npos);
  EXPECT_EQ(find_invalid_utf8(std::string_view("ab\xC0\x80", 4)), 2u);  // overlong NUL
  EXPECT_EQ(find_invalid_utf8("x\xED\xA0\x80"), 1u);                    // surrogate
  EXPECT_EQ(find_invalid_utf8("\xF4\x90\x80\x80"), 0u);                 // past U+10FFFF
  EXPECT_EQ(find_invalid_utf8("abcdefgh\xE4\xB8"), 8u);                 // truncated
  EXPECT_EQ(find_invalid_utf8("\x80"), 0u);                             // stray continuation
}

TEST(Pretokenizer, WhitespaceIsUnicodeWhiteSpace) {
  // \s as White_Space: U+0085 splits like a space, U+FEFF and U+180E do not (tiktoken's rules).
  PretokenizerRegex regex(named_pattern("cl100k"), RegexDialect::tiktoken, "test");
  auto pieces = [&](std::string_view text) {
    std::vector<std::string> out;
    regex.split(text, [&](size_t b, size_t e) { out.emplace_back(text.substr(b, e - b)); });
    return out;
  };
  EXPECT_EQ(pieces("Hello world's 12345"), (std::vector<std::string>{"Hello", " world", "'s", " ", "123", "45"}));
  // As whitespace, the first of two leading U+0085 stands alone (\s+(?!\S) backs off one); as
  // punctuation, both U+FEFF form one piece.
  EXPECT_EQ(pieces("\xC2\x85\xC2\x85x"), (std::vector<std::string>{"\xC2\x85", "\xC2\x85x"}));
  EXPECT_EQ(pieces("\xEF\xBB\xBF\xEF\xBB\xBFx"), (std::vector<std::string>{"\xEF\xBB\xBF\xEF\xBB\xBF", "x"}));
  EXPECT_EQ(pieces("\xE1\xA0\x8E\xE1\xA0\x8Ex"), (std::vector<std::string>{"\xE1\xA0\x8E\xE1\xA0\x8E", "x"}));
  EXPECT_EQ(pieces("x   \n"), (std::vector<std::string>{"x", "   \n"}));
  EXPECT_EQ(translate_pattern("[^\\s]\\s", RegexDialect::tiktoken, "t").find("\\s"), std::string::npos);
}

TEST(Pretokenizer, BadPatternsAreErrors) {
  expect_error([] { named_pattern("cl200k"); }, "expected one of gpt2, cl100k, o200k, glm4");
  expect_error([] { PretokenizerRegex("(unclosed", RegexDialect::tiktoken, "my.json"); }, "my.json");
  expect_error([] { translate_pattern("[\\S]", RegexDialect::oniguruma, "my.json"); }, "\\S inside a character class");
}

TEST(BytePair, MergesLowestRankFirst) {
  auto model = BytePairModel::from_ranks(byte_ranks({"ab", "bc", "abc"}), "test");
  std::vector<int32_t> ids;
  model.encode("abc", ids);  // a token itself: whole
  EXPECT_EQ(ids, (std::vector<int32_t>{258}));
  ids.clear();
  model.encode("abcd", ids);  // ab (256) before bc (257), then ab+c = abc
  EXPECT_EQ(ids, (std::vector<int32_t>{258, 'd'}));
}

TEST(BytePair, MatchesNaiveReferenceOnShortAndLongPieces) {
  // Overlapping tokens over a 3-letter alphabet force many ties and competing merges; pieces up
  // to 300 bytes exercise both the rescan (<= 32 symbols) and the heap merge loop.
  const std::vector<std::string> extra{"aa", "ab", "ba",  "aaa", "bc",   "cab", "abab", "aab",
                                       "ca", "cc", "ccc", "bca", "aaaa", "abc", "cabab"};
  const auto ranks = byte_ranks(extra);
  auto model = BytePairModel::from_ranks(ranks, "test");
  std::mt19937 rng(7);
  for (int trial = 0; trial < 400; ++trial) {
    std::string piece;
    const int n = 1 + int(rng() % (trial < 200 ? 40 : 300));
    for (int i = 0; i < n; ++i) piece += "abc"[rng() % 3];
    std::vector<int32_t> ids;
    model.encode(piece, ids);
    ASSERT_EQ(ids, naive_bpe(ranks, piece)) << piece;
    ids.clear();
    model.encode(piece, ids);  // second time from the piece cache
    ASSERT_EQ(ids, naive_bpe(ranks, piece)) << piece;
  }
}

TEST(Tiktoken, RankFileErrorsNameTheLine) {
  const std::string good = tiktoken_text(byte_ranks({}));
  EXPECT_EQ(parse_tiktoken_ranks(good, "r").size(), 256u);
  expect_error([&] { parse_tiktoken_ranks(good + "@@@@ 256\n", "r.tiktoken"); },
               "r.tiktoken:257: '@@@@' is not valid base64");
  expect_error([&] { parse_tiktoken_ranks(good + "YWJ 256\n", "r"); }, "not valid base64");
  expect_error([&] { parse_tiktoken_ranks(good + "YWI=\n", "r"); }, "r:257: expected 'base64-token rank'");
  expect_error([&] { parse_tiktoken_ranks(good + "YWI= x1\n", "r"); }, "rank 'x1' is not a non-negative integer");
  expect_error([&] { parse_tiktoken_ranks(good + "YWI= 3\n", "r"); }, "rank 3 was already given on line 4");
  expect_error([&] { parse_tiktoken_ranks(good + "YWI= 300\n", "r"); }, "rank 300 leaves a gap");
  expect_error([&] { parse_tiktoken_ranks(good + "YWI= 4000000000\n", "r"); }, "leaves a gap");
  expect_error([&] { parse_tiktoken_ranks("YQ== 0\n\nYg== 2\n", "r"); }, "rank 1 is missing");
  expect_error([&] { parse_tiktoken_ranks("", "r"); }, "no ranks");
  // Structurally fine but not byte-level: a byte without a token, or two ranks with one token.
  expect_error([&] { tiktoken_tokenizer(parse_tiktoken_ranks("YQ== 0\n", "r"), "cl100k", "r"); },
               "byte 0x00 has no token");
  expect_error(
      [&] {
        tiktoken_tokenizer(byte_ranks({"ab", "ab"}), "cl100k", "r");
      },
      "tokens 256 and 257 have the same bytes");
  expect_error([&] { load_tiktoken(write_temp(good), ""); }, "256 ranks match no known encoding");
  expect_error([&] { load_tiktoken("/nonexistent/cl100k.tiktoken", "cl100k"); }, "/nonexistent/cl100k.tiktoken");
}

TEST(Tiktoken, SpecialTokensAndRoundTrip) {
  auto ranks = byte_ranks({"He", "ll", "llo", "Hello", " w", " wor", "ld", " world"});
  TokenizerParts parts;
  auto tokenizer = tiktoken_tokenizer(ranks, "glm4", "test");  // no GLM-4 specials at this size
  EXPECT_TRUE(tokenizer.added_tokens().empty());
  EXPECT_EQ(tokenizer.encode("Hello world"), (std::vector<int32_t>{259, 263}));
  const std::string text = "Hello world, ünïcödé 中文 👍\n\n  x";
  EXPECT_EQ(tokenizer.decode(tokenizer.encode(text)), text);
  EXPECT_EQ(tokenizer.token_to_id("Hello"), 259);
  EXPECT_EQ(tokenizer.id_to_token(263), " world");
  expect_error([&] { tokenizer.decode(std::vector<int32_t>{99999}); }, "cannot decode id 99999");
  expect_error([&] { tokenizer.encode("ok \xFF\xFE bad"); }, "not valid UTF-8: byte 0xFF at offset 3");
}

TEST(HfTokenizerJson, SplitBehaviors) {
  // Tokens "a-", "-b" and "--" show where the pieces were cut.
  const std::vector<std::string> extra{"a-", "-b", "--"};
  const std::vector<std::pair<std::string, std::string>> merges{{"a", "-"}, {"-", "b"}, {"-", "-"}};
  auto ids_for = [&](const std::string& behavior, const std::string& text) {
    auto json = tokenizer_json(extra, merges,
                               R"("pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Split", )"
                               R"("pattern": {"String": "-"}, "behavior": ")" +
                                   behavior +
                                   R"("}, )"
                                   R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]}, )" +
                                   kByteLevelDecoder);
    return hf_tokenizer_from_json(json, "t.json").encode(text);
  };
  const int32_t a = 'a', b = 'b', dash = '-', a_dash = 256, dash_b = 257, dash_dash = 258;
  EXPECT_EQ(ids_for("Isolated", "a-b"), (std::vector<int32_t>{a, dash, b}));
  EXPECT_EQ(ids_for("Removed", "a-b"), (std::vector<int32_t>{a, b}));
  EXPECT_EQ(ids_for("MergedWithPrevious", "a-b"), (std::vector<int32_t>{a_dash, b}));
  EXPECT_EQ(ids_for("MergedWithNext", "a-b"), (std::vector<int32_t>{a, dash_b}));
  EXPECT_EQ(ids_for("Contiguous", "a--b"), (std::vector<int32_t>{a, dash_dash, b}));
  EXPECT_EQ(ids_for("Isolated", "a--b"), (std::vector<int32_t>{a, dash, dash, b}));
}

TEST(HfTokenizerJson, TemplateNormalizerDigitsPrefixSpace) {
  const std::string added =
      R"("added_tokens": [{"id": 300, "content": "<s>", "special": true}, {"id": 301, "content": "</s>", "special": true}])";
  const std::string post =
      R"("post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},)"
      R"( {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "</s>", "type_id": 0}}],)"
      R"( "special_tokens": {"<s>": {"id": "<s>", "ids": [300], "tokens": ["<s>"]}, "</s>": {"id": "</s>", "ids": [301], "tokens": ["</s>"]}}})";
  const std::string pre =
      R"("pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true},)"
      R"( {"type": "ByteLevel", "add_prefix_space": true, "use_regex": true}]})";
  const std::string json =
      tokenizer_json({" h", " hi", "\xC3\xA9", "12"}, {{" ", "h"}, {" h", "i"}, {"\xC3", "\xA9"}, {"1", "2"}},
                     added + ", " + post + ", " + pre + R"(, "normalizer": {"type": "NFC"}, )" + kByteLevelDecoder);
  auto tokenizer = hf_tokenizer_from_json(json, "t.json");
  EXPECT_EQ(tokenizer.encode("hi", {.add_special_tokens = true}), (std::vector<int32_t>{300, 257, 301}));
  EXPECT_EQ(tokenizer.bos_id(), 300);
  EXPECT_EQ(tokenizer.eos_id(), 301);
  // NFC: e + combining acute becomes é (one token); digits stay single despite the "12" merge.
  EXPECT_EQ(tokenizer.encode("e\xCC\x81"), tokenizer.encode("\xC3\xA9"));
  auto digits = tokenizer.encode("12");
  // ByteLevel's add_prefix_space applies to every piece it is given (Hugging Face does the same).
  EXPECT_EQ(digits, (std::vector<int32_t>{' ', '1', ' ', '2'}));
  // Special tokens are cut out before normalizing and pre-tokenizing, unless split.
  EXPECT_EQ(tokenizer.encode("<s>hi"), (std::vector<int32_t>{300, 257}));
  EXPECT_NE(tokenizer.encode("<s>hi", {.split_special_tokens = true}).front(), 300);
  EXPECT_EQ(tokenizer.decode(std::vector<int32_t>{300, 257, 301}, true), " hi");
  EXPECT_EQ(tokenizer.token_to_id("\xC4\xA0hi"), 257);  // "Ġhi"
}

// encode_spelled says when the ids spell the text byte for byte (chat templates then take each
// token's offsets as a running sum instead of walking the text): never wrongly true, and false
// where a normalizer changed the text, an added token took whitespace or a pre-tokenizer added a
// space.
TEST(HfTokenizerJson, EncodeSpelledIsTrueOnlyWhenTheSurfacesAreTheText) {
  const std::string added = R"("added_tokens": [{"id": 300, "content": "<x>", "special": true, "lstrip": true},)"
                            R"( {"id": 301, "content": "<y>", "special": true}])";
  const std::string byte_level_pre = R"("pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false})";
  const std::string json =
      tokenizer_json({" h", " hi", "\xC3\xA9"}, {{" ", "h"}, {" h", "i"}, {"\xC3", "\xA9"}},
                     added + ", " + byte_level_pre + R"(, "normalizer": {"type": "NFC"}, )" + kByteLevelDecoder);
  const Tokenizer tok = hf_tokenizer_from_json(json, "t.json");
  auto spelled = [&](std::string_view text) {
    std::vector<int32_t> ids{7};  // appends, as encode does
    const bool said = tok.encode_spelled(text, ids);
    EXPECT_EQ(std::vector<int32_t>(ids.begin() + 1, ids.end()), tok.encode(text)) << text;
    std::string surfaces, scratch;
    for (size_t k = 1; k < ids.size(); ++k) surfaces += tok.token_surface(ids[k], scratch);
    if (said) EXPECT_EQ(surfaces, text);  // never wrongly true
    return said;
  };
  EXPECT_TRUE(spelled("hi hi caf\xC3\xA9<y> hi"));
  EXPECT_TRUE(spelled(""));
  EXPECT_FALSE(spelled("caf\x65\xCC\x81"));  // NFC made "e" + U+0301 one character
  EXPECT_FALSE(spelled("hi  <x>hi"));        // <x> took the spaces before it (lstrip)
  EXPECT_TRUE(spelled("hi<x>hi"));           // nothing to take
  std::vector<int32_t> ids;
  EXPECT_FALSE(tok.encode_spelled("hi", ids, {.add_special_tokens = true}));  // not when a template adds ids

  // A space the pre-tokenizer adds to every piece: never spelled as is.
  std::string prefixed = json;
  prefixed.replace(prefixed.find(R"("add_prefix_space": false)"), 25, R"("add_prefix_space": true)");
  EXPECT_FALSE(hf_tokenizer_from_json(prefixed, "t.json").encode_spelled("hi", ids));
}

TEST(HfTokenizerJson, MergesAsPairsAndIgnoreMerges) {
  // ["a", "b"] merges; with ignore_merges a piece in the vocabulary wins over the merge order.
  std::string json = tokenizer_json({"ab", "bc", "abc"}, {}, kByteLevelDecoder);
  const std::string merges = R"("merges": [["b", "c"], ["a", "bc"], ["a", "b"]])";
  json.replace(json.find(R"("merges": [])"), std::string(R"("merges": [])").size(), merges);
  auto plain = hf_tokenizer_from_json(json, "t.json");
  EXPECT_EQ(plain.encode("abc"), (std::vector<int32_t>{258}));
  EXPECT_EQ(plain.encode("abcab"), (std::vector<int32_t>{258, 256}));
}

// SentencePiece-style BPE as Llama 2 ships it: no ByteLevel anywhere, tokens in plain UTF-8 with
// U+2581 for the space, Prepend + Replace normalizers, byte fallback for characters without a
// token, and the Replace / ByteFallback / Fuse / Strip decoder chain. (The real Llama 2, Gemma 3
// and Gemini directories are compared with the Rust tokenizers library by
// tests/reference/tokenizer_native.py.)
TEST(HfTokenizerJson, SentencePieceStyleBpe) {
  std::string vocab = R"("<unk>": 0, "<s>": 1, "\u2581": 2, "a": 3, "b": 4, "\u2581a": 5, "\u2581ab": 6)";
  for (int b = 0; b < 256; ++b) vocab += fmt::format(R"(, "<0x{:02X}>": {})", b, 7 + b);
  const std::string json = fmt::format(R"({{
    "added_tokens": [{{"id": 1, "content": "<s>", "special": true}}],
    "normalizer": {{"type": "Sequence", "normalizers": [
      {{"type": "Prepend", "prepend": "\u2581"}},
      {{"type": "Replace", "pattern": {{"String": " "}}, "content": "\u2581"}}]}},
    "pre_tokenizer": null,
    "decoder": {{"type": "Sequence", "decoders": [
      {{"type": "Replace", "pattern": {{"String": "\u2581"}}, "content": " "}},
      {{"type": "ByteFallback"}}, {{"type": "Fuse"}},
      {{"type": "Strip", "content": " ", "start": 1, "stop": 0}}]}},
    "model": {{"type": "BPE", "unk_token": "<unk>", "fuse_unk": true, "byte_fallback": true,
              "vocab": {{{}}}, "merges": ["\u2581 a", "\u2581a b"]}}}})",
                                       vocab);
  const Tokenizer tok = hf_tokenizer_from_json(json, "sp.json");
  // "ab a" -> "\u2581ab\u2581a"; "\u00e9" has no token: its two bytes' fallback tokens.
  EXPECT_EQ(tok.encode("ab a"), (std::vector<int32_t>{6, 5}));
  EXPECT_EQ(tok.encode("a\xC3\xA9"), (std::vector<int32_t>{5, 7 + 0xC3, 7 + 0xA9}));
  // Each stretch between added tokens is normalized on its own: the Prepend comes back after <s>.
  EXPECT_EQ(tok.encode("a<s>b"), (std::vector<int32_t>{5, 1, 2, 4}));
  EXPECT_EQ(tok.decode(tok.encode("ab a\xC3\xA9")), "ab a\xC3\xA9");           // the leading space stripped
  EXPECT_EQ(tok.decode(std::vector<int32_t>{7 + 0xC3, 5}), "\xEF\xBF\xBD a");  // a lone byte: U+FFFD
  EXPECT_EQ(tok.token_to_id("\xE2\x96\x81"
                            "ab"),
            6);  // split: a hex escape would swallow "ab"
  // The added-token table by id: inside, below and above its range.
  EXPECT_TRUE(tok.is_added(1));
  EXPECT_TRUE(tok.is_special(1));
  EXPECT_EQ(tok.id_to_token(1), "<s>");
  for (int32_t id : {-1, 0, 2, 6, 1 << 30}) EXPECT_FALSE(tok.is_added(id)) << id;
  std::string scratch;
  EXPECT_EQ(tok.token_surface(1, scratch), "<s>");
  EXPECT_EQ(tok.token_surface(6, scratch), " ab");  // the decoder chain's Replace
}

TEST(HfTokenizerJson, BadFilesNameThePlace) {
  const std::string ok_rest = kByteLevelDecoder;
  expect_error([] { hf_tokenizer_from_json("{not json", "bad.json"); }, "bad.json: not valid JSON");
  expect_error([] { hf_tokenizer_from_json("[]", "bad.json"); }, "the top level: expected an object");
  expect_error([] { hf_tokenizer_from_json(R"({"decoder": {"type": "ByteLevel"}})", "bad.json"); },
               "missing field 'model'");
  expect_error(
      [&] {
        hf_tokenizer_from_json(tokenizer_json({}, {{"a", "q"}}, ok_rest), "bad.json");
      },
      "merge 0 joins tokens 97 and 113 into bytes that are not in the vocabulary");
  expect_error([&] { hf_tokenizer_from_json(tokenizer_json({}, {}, R"("decoder": {"type": "CTC"})"), "bad.json"); },
               "decoder 'CTC' is not supported");
  expect_error(
      [&] {
        hf_tokenizer_from_json(
            tokenizer_json({}, {}, R"("normalizer": {"type": "Replace", "pattern": {"Regex": "( +"}, "content": "_"})"),
            "bad.json");
      },
      "bad.json: normalizer.pattern");
  expect_error(
      [&] {
        hf_tokenizer_from_json(tokenizer_json({}, {}, ok_rest + R"(, "pre_tokenizer": {"type": "BertPreTokenizer"})"),
                               "bad.json");
      },
      "pre-tokenizer 'BertPreTokenizer' is not supported");
  expect_error(
      [&] {
        hf_tokenizer_from_json(tokenizer_json({}, {}, ok_rest + R"(, "normalizer": {"type": "BertNormalizer"})"),
                               "bad.json");
      },
      "normalizer: normalizer 'BertNormalizer' is not supported");
  expect_error(
      [&] {
        hf_tokenizer_from_json(
            tokenizer_json(
                {}, {},
                ok_rest + R"(, "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "("}, "behavior": "Isolated"})"),
            "bad.json");
      },
      "cannot compile pre-tokenizer pattern");
  expect_error(
      [&] {
        hf_tokenizer_from_json(
            tokenizer_json(
                {}, {},
                ok_rest + R"(, "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "x"}, "behavior": "Sideways"})"),
            "bad.json");
      },
      "pre_tokenizer.behavior: expected one of Removed");
  // A vocabulary claiming an id far beyond its size.
  std::string huge = tokenizer_json({}, {}, ok_rest);
  huge.replace(huge.find("\"!\": 33"), 7, "\"!\": 2000000000");
  expect_error([&] { hf_tokenizer_from_json(huge, "bad.json"); }, "id 2000000000 is outside [0, ");
  std::string bad_merge = tokenizer_json({}, {}, ok_rest);
  bad_merge.replace(bad_merge.find(R"("merges": [])"), 12, R"("merges": ["ab"])");
  expect_error([&] { hf_tokenizer_from_json(bad_merge, "bad.json"); }, "model.merges[0]: expected \"left right\"");
  std::string unknown = tokenizer_json({}, {}, ok_rest);
  unknown.replace(unknown.find(R"("merges": [])"), 12, R"("merges": [["a", "zz"]])");
  expect_error([&] { hf_tokenizer_from_json(unknown, "bad.json"); }, "token \"zz\" is not in model.vocab");
  // The places of the errors the loader formats only when an entry is bad (not for every entry).
  std::string short_pair = tokenizer_json({}, {}, ok_rest);
  short_pair.replace(short_pair.find(R"("merges": [])"), 12, R"("merges": [["a", "b"], ["a"]])");
  expect_error([&] { hf_tokenizer_from_json(short_pair, "bad.json"); }, "model.merges[1]: expected a pair");
  std::string string_id = tokenizer_json({}, {}, ok_rest);
  string_id.replace(string_id.find("\"!\": 33"), 7, "\"!\": \"33\"");
  expect_error([&] { hf_tokenizer_from_json(string_id, "bad.json"); }, "model.vocab[\"!\"]: expected an integer");
  // Added tokens by id: one id twice, and ids spread too far apart to table.
  const std::string added =
      ok_rest + R"(, "added_tokens": [{"id": 300, "content": "<a>"}, {"id": 300, "content": "<b>"}])";
  expect_error([&] { hf_tokenizer_from_json(tokenizer_json({}, {}, added), "bad.json"); },
               "two added tokens have id 300");
  const std::string spread =
      ok_rest + R"(, "added_tokens": [{"id": 256, "content": "<a>"}, {"id": 200000000, "content": "<b>"}])";
  expect_error([&] { hf_tokenizer_from_json(tokenizer_json({}, {}, spread), "bad.json"); },
               "added token ids span 256..200000000");
  std::string not_byte_level = tokenizer_json({}, {}, ok_rest);
  not_byte_level.replace(not_byte_level.find("\"!\": 33"), 7, "\"中\": 33");
  expect_error([&] { hf_tokenizer_from_json(not_byte_level, "bad.json"); }, "not in the byte-level alphabet");
  expect_error([] { load_tokenizer("/nonexistent/dir/tokenizer.json"); }, "/nonexistent/dir/tokenizer.json");
}

TEST(BpeTrainer, TrainsLoadableTokenizer) {
  BpeTrainingOptions options;
  options.vocab_size = 300;
  options.special_tokens = {"<|endoftext|>", "<|pad|>"};
  BpeTrainer trainer(options);
  for (int i = 0; i < 50; ++i) trainer.add_text("the quick brown fox jumps over the lazy dog<|endoftext|> the end\n");
  auto tokenizer = hf_tokenizer_from_json(trainer.tokenizer_json(), "trained.json");
  EXPECT_LE(tokenizer.vocab_size(), 300);  // fewer when pairs run out of repeats
  EXPECT_GT(tokenizer.vocab_size(), 280);
  EXPECT_EQ(tokenizer.token_to_id("<|endoftext|>"), 0);
  EXPECT_EQ(tokenizer.token_to_id("<|pad|>"), 1);
  const std::string text = "the quick brown fox<|endoftext|>, and 中文 too";
  auto ids = tokenizer.encode(text);
  EXPECT_EQ(tokenizer.decode(ids), text);
  EXPECT_LT(tokenizer.encode("the quick brown fox").size(), 8u);  // merges learned
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 0), 1);
  BpeTrainingOptions small;
  small.vocab_size = 100;
  expect_error([&] { BpeTrainer{small}; }, "vocabulary size 100 is too small");
  expect_error([&] { trainer.add_text("bad \xC3"); }, "not valid UTF-8");
  expect_error([&] { train_tokenizer_json_from_jsonl(write_temp("{\"text\": \"ok\"}\n{\"txt\": 1}\n"), options); },
               ":2: expected an object with a string field \"text\"");
}

TEST(LoadTokenizer, ModelDirectories) {
  char dir_template[] = "/tmp/keel_tokdir_XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  // GLM-4's original layout: tokenizer.model holds tiktoken ranks, the pattern defaults to glm4.
  std::ofstream(dir + "/tokenizer.model") << tiktoken_text(byte_ranks({"ab"}));
  auto glm = load_tokenizer(dir);
  EXPECT_EQ(glm.encode("ab"), (std::vector<int32_t>{256}));
  // tokenizer.json wins over tokenizer.model; tokenizer_config.json names BOS/EOS.
  const std::string added =
      R"("added_tokens": [{"id": 256, "content": "<s>", "special": true}, {"id": 257, "content": "</s>", "special": true}], )";
  std::ofstream(dir + "/tokenizer.json") << tokenizer_json({}, {}, added + kByteLevelDecoder);
  std::ofstream(dir + "/tokenizer_config.json") << R"({"bos_token": {"content": "<s>"}, "eos_token": "</s>"})";
  auto hf = load_tokenizer(dir);
  EXPECT_EQ(hf.bos_id(), 256);
  EXPECT_EQ(hf.eos_id(), 257);
  std::ofstream(dir + "/tokenizer_config.json") << R"({"eos_token": "<nope>"})";
  expect_error([&] { load_tokenizer(dir); }, "eos_token '<nope>' is not a token of the tokenizer");
  expect_error([&] { load_tokenizer(dir, "cl100k"); }, "--pattern applies to tiktoken rank files");
  expect_error([] { load_tokenizer("/tmp"); }, "no tokenizer.json or tokenizer.model");
}

// The length each id stands for in text it spells (chat templates map a conversation's tokens to
// offsets with it): a vocabulary token's bytes; an added token's content, whether its id is also a
// vocabulary id or lies past them; nothing for an id that is neither.
TEST(Tokenizer, SpelledLengthOfVocabularyAndAddedTokens) {
  const std::string json =
      R"({"added_tokens": [{"id": 2, "content": "<sep>", "special": true}, {"id": 40, "content": "<|end|>", "special": true}],)"
      R"( "model": {"type": "BPE", "vocab": {"a": 0, "bc": 1, "<s>": 2, "def": 3}, "merges": []}})";
  const keel::data::Tokenizer tok = keel::data::hf_tokenizer_from_json(json, "tokenizer.json");
  EXPECT_EQ(tok.spelled_length(0), 1u);
  EXPECT_EQ(tok.spelled_length(1), 2u);
  EXPECT_EQ(tok.spelled_length(2), 5u);  // the added token's "<sep>", not the vocabulary's "<s>"
  EXPECT_EQ(tok.spelled_length(3), 3u);
  EXPECT_EQ(tok.spelled_length(40), 7u);
  EXPECT_EQ(tok.spelled_length(20), 0u);
}
