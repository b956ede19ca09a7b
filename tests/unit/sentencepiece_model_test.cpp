// SentencePiece's tokenizer.model read for its pieces (data/sentencepiece_model.h), and the "llama"
// vocabulary llama.cpp's converter makes of it with the directory's other files
// (data::llama_cpp_sentencepiece_vocab). Files here are written byte by byte in protobuf's wire
// format; that keel reads a file sentencepiece itself trained as SentencePieceProcessor does, and
// writes what the converter writes, is tests/reference/gguf_reference.py's (its gemma2 case).
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "keel/core/error.h"
#include "keel/data/llama_cpp_vocab.h"
#include "keel/data/sentencepiece_model.h"
#include "test_support.h"

namespace keel::data {
namespace {

using testing::expect_keel_error;

std::string varint(uint64_t v) {
  std::string out;
  do {
    uint8_t byte = uint8_t(v & 0x7f);
    v >>= 7;
    out.push_back(char(byte | (v ? 0x80 : 0)));
  } while (v);
  return out;
}

std::string field(uint32_t number, const std::string& payload) {
  return varint(number << 3 | 2) + varint(payload.size()) + payload;
}

// ModelProto.SentencePiece: piece = 1, score = 2 (fixed32), type = 3 (varint; omitted: NORMAL).
std::string piece(const std::string& text, float score, int type = 0) {
  std::string out = field(1, text);
  char bytes[4];
  std::memcpy(bytes, &score, 4);
  out += varint(2 << 3 | 5) + std::string(bytes, 4);
  if (type) out += varint(3 << 3 | 0) + varint(uint64_t(type));
  return out;
}

std::string model(const std::vector<std::string>& pieces) {
  std::string out;
  for (const auto& p : pieces) out += field(1, p);
  out += field(2, field(1, "trainer spec's input"));  // trainer_spec, skipped
  out += varint(100 << 3 | 0) + varint(300);           // a field of a later proto version, skipped
  return out;
}

const std::string kModel = model({piece("<pad>", 0, 3), piece("<eos>", 0, 3), piece("<bos>", 0, 3),
                                  piece("<unk>", 0, 2), piece("<start_of_turn>", 0, 4), piece("<0x41>", 0, 6),
                                  piece("\xe2\x96\x81the", -1.5f), piece("ab", -2.25f, 1), piece("zz", 0, 5)});

TEST(SentencePieceModel, PiecesTheirScoresAndTypesInIdOrder) {
  ASSERT_TRUE(looks_like_sentencepiece_model(kModel));
  EXPECT_FALSE(looks_like_sentencepiece_model("IQ== 0\n"));  // tiktoken ranks, also named tokenizer.model
  const auto pieces = read_sentencepiece_model(kModel, "m/tokenizer.model");
  ASSERT_EQ(pieces.size(), 9u);
  EXPECT_EQ(pieces[3].piece, "<unk>");
  EXPECT_EQ(pieces[3].type, SentencePieceType::Unknown);
  EXPECT_EQ(pieces[4].type, SentencePieceType::UserDefined);
  EXPECT_EQ(pieces[6].piece, "\xe2\x96\x81the");
  EXPECT_EQ(pieces[6].score, -1.5f);
  EXPECT_EQ(pieces[6].type, SentencePieceType::Normal);  // omitted: the proto's default
  EXPECT_EQ(pieces[7].score, -2.25f);
  EXPECT_EQ(pieces[8].type, SentencePieceType::Unused);
}

TEST(SentencePieceModel, MalformedFilesAreErrorsNamingTheFileAndByte) {
  const std::string path = "m/tokenizer.model";
  expect_keel_error([&] { read_sentencepiece_model(kModel.substr(0, 20), path); }, {path, "runs past the end"});
  expect_keel_error([&] { read_sentencepiece_model(field(1, piece("a", 0, 9)), path); },
                    {path, "piece 0 ('a')", "type 9", "expected 1 to 6"});
  expect_keel_error([&] { read_sentencepiece_model(varint(1 << 3 | 3), path); }, {path, "byte 1", "wire type 3"});
  expect_keel_error([&] { read_sentencepiece_model(field(2, "x"), path); }, {path, "without pieces"});
  expect_keel_error([&] { read_sentencepiece_model(std::string(11, '\xff'), path); }, {path, "varint"});
}

// _create_vocab_sentencepiece: the pieces (user-defined ones normal), added tokens over them at
// score -1000, [PAD<id>] up to the model's vocabulary; SpecialVocab(n_vocab) for the ids.
TEST(SentencePieceVocab, TheConvertersLlamaVocabulary) {
  LlamaCppVocabFiles files;
  files.origin = "m";
  files.sentencepiece_model = kModel;
  files.tokenizer_json = R"({"model": {"type": "BPE", "vocab": {}}, "added_tokens": [
      {"id": 1, "content": "<eos>", "special": true}, {"id": 2, "content": "<bos>", "special": true},
      {"id": 3, "content": "<unk>", "special": true}, {"id": 40, "content": "<far>", "special": true}],
    "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<bos>"}},
      {"Sequence": {"id": "A"}}]}})";
  files.tokenizer_config_json = R"({"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
    "pad_token": "<far>", "chat_template": "{{ x }}",
    "added_tokens_decoder": {"7": {"content": "my\u2581tok", "special": false},
                             "10": {"content": "<x>", "special": true}, "99": {"content": "far", "special": false}}})";
  files.added_tokens_json = R"({"<extra>": 11})";
  files.config_json = R"({"eos_token_id": 1, "pad_token_id": 0})";
  const LlamaCppVocab v = llama_cpp_sentencepiece_vocab(files, 12);
  EXPECT_EQ(v.model, "llama");
  EXPECT_EQ(v.pre, "default");
  ASSERT_EQ(v.tokens.size(), 12u);
  ASSERT_EQ(v.scores.size(), 12u);
  ASSERT_EQ(v.token_types.size(), 12u);
  EXPECT_EQ(v.tokens[4], "<start_of_turn>");
  EXPECT_EQ(v.token_types[4], int32_t(LlamaCppTokenType::Normal));
  EXPECT_EQ(v.token_types[3], int32_t(LlamaCppTokenType::Unknown));
  EXPECT_EQ(v.token_types[0], int32_t(LlamaCppTokenType::Control));
  EXPECT_EQ(v.token_types[5], int32_t(LlamaCppTokenType::Byte));
  EXPECT_EQ(v.token_types[8], int32_t(LlamaCppTokenType::Unused));
  EXPECT_EQ(v.scores[6], -1.5f);
  EXPECT_EQ(v.tokens[7], "my tok");  // a user-defined added token's spaces pre-normalized
  EXPECT_EQ(v.scores[7], -1000.0f);
  EXPECT_EQ(v.token_types[7], int32_t(LlamaCppTokenType::UserDefined));
  EXPECT_EQ(v.tokens[9], "[PAD9]");
  EXPECT_EQ(v.scores[9], -10000.0f);
  EXPECT_EQ(v.token_types[9], int32_t(LlamaCppTokenType::Unused));
  EXPECT_EQ(v.tokens[10], "<x>");
  EXPECT_EQ(v.token_types[10], int32_t(LlamaCppTokenType::Control));
  EXPECT_EQ(v.tokens[11], "<extra>");
  EXPECT_EQ(v.token_types[11], int32_t(LlamaCppTokenType::UserDefined));
  EXPECT_TRUE(v.merges.empty());
  // <far> (id 40) is past the vocabulary: skipped, so pad falls back to config.json's 0.
  const std::vector<std::pair<std::string, int64_t>> ids = {{"bos", 2}, {"eos", 1}, {"unk", 3}, {"pad", 0}};
  EXPECT_EQ(v.special_ids, ids);
  const std::vector<std::pair<std::string, bool>> add = {{"bos", true}};
  EXPECT_EQ(v.add_special, add);
  EXPECT_EQ(v.chat_template, "{{ x }}");
  // Pieces past a smaller model vocabulary are left out.
  EXPECT_EQ(llama_cpp_sentencepiece_vocab(files, 3).tokens, (std::vector<std::string>{"<pad>", "<eos>", "<bos>"}));
  files.tokenizer_config_json = R"({"added_tokens_decoder": {"seven": {"content": "x"}}})";
  expect_keel_error([&] { llama_cpp_sentencepiece_vocab(files, 12); }, {"m/tokenizer_config.json", "'seven'"});
}

}  // namespace
}  // namespace keel::data
