// The pieces of keel's GGUF export around the file format: llama.cpp's names for keel's families
// (model/gguf_names.h), the destination rules (gguf_export.h) and the SHA-256 the pre-tokenizer
// lookup hashes with (core/sha256.h). That whole files equal llama.cpp's converter's is
// tests/reference/gguf_reference.py's.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "keel/checkpoint/gguf_export.h"
#include "keel/model/gguf_names.h"
#include "keel/core/file_io.h"
#include "keel/core/sha256.h"
#include "keel/data/llama_cpp_vocab.h"
#include "keel/formats/gguf_writer.h"
#include "test_support.h"

namespace keel::checkpoint {
namespace {

using formats::GgmlType;
using testing::expect_keel_error;
using testing::TempDir;

TEST(Sha256, KnownDigests) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  // 56 bytes: the padding needs a second block.
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex(std::string(1000000, 'a')), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

model::ModelConfig config_of(model::Family family);
const model::ModelConfig kLlama = config_of(model::Family::Llama);

TEST(GgufNames, HfTensorsGetLlamaCppNames) {
  EXPECT_EQ(model::gguf_tensor_name(kLlama, "model.embed_tokens.weight"), "token_embd.weight");
  EXPECT_EQ(model::gguf_tensor_name(kLlama, "lm_head.weight"), "output.weight");
  EXPECT_EQ(model::gguf_tensor_name(kLlama, "model.norm.weight"), "output_norm.weight");
  EXPECT_EQ(model::gguf_tensor_name(kLlama, "model.layers.12.self_attn.k_proj.bias"), "blk.12.attn_k.bias");
  EXPECT_EQ(model::gguf_tensor_name(kLlama, "model.layers.0.self_attn.q_norm.weight"), "blk.0.attn_q_norm.weight");
  EXPECT_EQ(model::gguf_tensor_name(kLlama, "model.layers.3.post_attention_layernorm.weight"), "blk.3.ffn_norm.weight");
  EXPECT_EQ(model::gguf_tensor_name(kLlama, "model.layers.3.mlp.down_proj.weight"), "blk.3.ffn_down.weight");
  expect_keel_error([] { model::gguf_tensor_name(kLlama, "model.layers.0.mlp.gate_up_proj.weight"); },
                    {"'model.layers.0.mlp.gate_up_proj.weight'", "no name"});
  expect_keel_error([] { model::gguf_tensor_name(kLlama, "model.layers.x.mlp.up_proj.weight"); }, {"model.layers.x"});
  // Gemma's sandwich norms: post_attention_layernorm is on the attention's output there.
  const auto gemma = config_of(model::Family::Gemma3);
  EXPECT_EQ(model::gguf_tensor_name(gemma, "model.layers.1.post_attention_layernorm.weight"), "blk.1.post_attention_norm.weight");
  EXPECT_EQ(model::gguf_tensor_name(gemma, "model.layers.1.pre_feedforward_layernorm.weight"), "blk.1.ffn_norm.weight");
  EXPECT_EQ(model::gguf_tensor_name(gemma, "model.layers.1.post_feedforward_layernorm.weight"), "blk.1.post_ffw_norm.weight");
  EXPECT_EQ(model::gguf_norm_shift(gemma, "model.layers.1.self_attn.q_norm.weight"), 1.0f);
  EXPECT_EQ(model::gguf_norm_shift(gemma, "model.layers.1.self_attn.q_proj.weight"), 0.0f);
  EXPECT_EQ(model::gguf_norm_shift(kLlama, "model.norm.weight"), 0.0f);
  // GLM-4's fused gate and up: llama.cpp's chatglm ffn_up (2 x n_ff rows).
  EXPECT_EQ(model::gguf_tensor_name(config_of(model::Family::Glm), "model.layers.2.mlp.gate_up_proj.weight"),
            "blk.2.ffn_up.weight");
}

model::ModelConfig config_of(model::Family family) {
  model::ModelConfig c;
  c.family = family;
  c.architecture = "X";
  c.num_heads = 2;
  c.num_kv_heads = 1;
  return c;
}

TEST(GgufNames, EveryFamilyHasItsArchitectureAndChatGlmFormatIsRefusedByName) {
  EXPECT_EQ(model::gguf_architecture(config_of(model::Family::Llama)), "llama");
  EXPECT_EQ(model::gguf_architecture(config_of(model::Family::Mistral)), "llama");
  EXPECT_EQ(model::gguf_architecture(config_of(model::Family::Qwen2)), "qwen2");
  EXPECT_EQ(model::gguf_architecture(config_of(model::Family::Qwen3)), "qwen3");
  EXPECT_EQ(model::gguf_architecture(config_of(model::Family::Gemma3)), "gemma3");
  EXPECT_EQ(model::gguf_architecture(config_of(model::Family::Gemma2)), "gemma2");
  EXPECT_EQ(model::gguf_architecture(config_of(model::Family::Glm)), "chatglm");
  expect_keel_error([] { model::gguf_architecture(config_of(model::Family::GlmOriginal)); },
                    {"ChatGLM-format", "--format hf first"});
  EXPECT_EQ(model::gguf_architecture(config_of(model::Family::Glm4Moe)), "glm4moe");
  EXPECT_EQ(model::gguf_architecture(config_of(model::Family::Qwen3Moe)), "qwen3moe");
  EXPECT_EQ(model::gguf_architecture(config_of(model::Family::Mixtral)), "llama");
  for (model::Family f : model::supported_families())  // none falls through to "does not write this family"
    if (f != model::Family::GlmOriginal) EXPECT_FALSE(model::gguf_architecture(config_of(f)).empty());
}

// Llama's rotate_half pairs (i, i + d/2) become ggml's adjacent pairs (2i, 2i + 1), per head.
TEST(GgufNames, QueryAndKeyRowsArePermutedForLlamaOnly) {
  const auto llama = config_of(model::Family::Llama);
  EXPECT_EQ(model::gguf_permuted_heads(llama, "model.layers.0.self_attn.q_proj.weight"), 2);
  EXPECT_EQ(model::gguf_permuted_heads(llama, "model.layers.0.self_attn.k_proj.bias"), 1);
  EXPECT_EQ(model::gguf_permuted_heads(llama, "model.layers.0.self_attn.v_proj.weight"), 0);
  EXPECT_EQ(model::gguf_permuted_heads(config_of(model::Family::Qwen2), "model.layers.0.self_attn.q_proj.weight"), 0);
  // Two heads of four rows (head_dim 4), one column: head 0 rows 0 1 2 3 -> 0 2 1 3.
  const std::vector<float> src = {0, 1, 2, 3, 10, 11, 12, 13};
  std::vector<float> dst(8);
  model::permute_rows_for_gguf(src.data(), dst.data(), 2, 8, 1);
  EXPECT_EQ(dst, (std::vector<float>{0, 2, 1, 3, 10, 12, 11, 13}));
  expect_keel_error([&] { model::permute_rows_for_gguf(src.data(), dst.data(), 3, 8, 1); }, {"8 rows", "3 heads"});
}

// The writer asks for a tensor's values a piece of whole rows at a time; a permuted matrix's pieces
// start and end inside heads. Each piece holds the rows of the whole permutation, read from the
// source a head at a time (never the matrix), the norm shift added to each value.
TEST(GgufExport, FileValuesComeInPiecesOfRowsReadAHeadAtATime) {
  constexpr int64_t heads = 3, rows = 12, cols = 5;  // heads of 4 rows: two rotate_half pairs
  std::vector<float> source(size_t(rows * cols));
  for (size_t i = 0; i < source.size(); ++i) source[i] = float(i);
  std::vector<float> permuted(source.size());
  model::permute_rows_for_gguf(source.data(), permuted.data(), heads, rows, cols);
  ASSERT_NE(permuted, source);
  std::vector<int64_t> reads;  // the values each read asked for
  auto read = [&](int64_t begin, int64_t count, float* dst) {
    reads.push_back(count);
    std::copy(source.begin() + begin, source.begin() + begin + count, dst);
  };
  auto in_pieces = [&](const formats::GgufFill& fill, int64_t piece_rows) {
    std::vector<float> out(source.size(), -1.0f);
    for (int64_t r = 0; r < rows; r += piece_rows)
      fill(r * cols, std::min(piece_rows, rows - r) * cols, out.data() + r * cols);
    return out;
  };
  const formats::GgufFill fill = gguf_file_values(read, heads, rows, cols, 0.0f, false);
  for (const int64_t piece_rows : {1, 3, 5, 12}) EXPECT_EQ(in_pieces(fill, piece_rows), permuted) << piece_rows;
  for (const int64_t n : reads) EXPECT_EQ(n, rows / heads * cols);
  expect_keel_error([&] { std::vector<float> out(static_cast<size_t>(cols)); fill(1, cols, out.data()); },
                    {"values [1, 6)", "not whole rows of 12 x 5"});

  // Not permuted: the pieces as they are, the shift added (Gemma's norms; in f16 where the
  // checkpoint is f16: 0.1 + 1 rounds to the f16 nearest 1.1).
  std::vector<float> plus_one(source.size());
  for (size_t i = 0; i < source.size(); ++i) plus_one[i] = source[i] + 1.0f;
  EXPECT_EQ(in_pieces(gguf_file_values(read, 0, rows, cols, 1.0f, false), 5), plus_one);
  source[0] = 0.1f;
  EXPECT_EQ(in_pieces(gguf_file_values(read, 0, rows, cols, 1.0f, true), 12)[0], f16_to_float(float_to_f16(1.1f)));
  EXPECT_NE(f16_to_float(float_to_f16(1.1f)), 1.1f);
}

TEST(GgufNames, TensorTypesFollowTheConverter) {
  EXPECT_EQ(model::gguf_tensor_type("blk.0.attn_norm.weight", {64}, GgmlType::Q8_0), GgmlType::F32);
  EXPECT_EQ(model::gguf_tensor_type("blk.0.attn_q_norm.weight", {32}, GgmlType::F16), GgmlType::F32);
  EXPECT_EQ(model::gguf_tensor_type("blk.0.attn_q.bias", {64}, GgmlType::BF16), GgmlType::F32);
  EXPECT_EQ(model::gguf_tensor_type("token_embd.weight", {100, 64}, GgmlType::Q8_0), GgmlType::Q8_0);
  bool fallback = false;
  EXPECT_EQ(model::gguf_tensor_type("blk.0.ffn_down.weight", {64, 80}, GgmlType::Q8_0, &fallback), GgmlType::F16);
  EXPECT_TRUE(fallback);
  EXPECT_EQ(model::gguf_tensor_type("blk.0.ffn_down.weight", {64, 80}, GgmlType::BF16, &fallback), GgmlType::BF16);
  EXPECT_FALSE(fallback);
  EXPECT_EQ(model::gguf_outtype_from_name("q8_0"), GgmlType::Q8_0);
  EXPECT_EQ(model::gguf_file_type(GgmlType::BF16), 32u);
  expect_keel_error([] { model::gguf_outtype_from_name("q5_k_m"); },
                    {"--outtype", "f32, f16, bf16, q8_0, q4_0 or q4_k_m", "q5_k_m"});
}

TEST(GgufNames, AdapterMatricesAreQuantizedLikeWeights) {
  bool fallback = false;
  EXPECT_EQ(model::gguf_tensor_type("blk.0.attn_q.weight.lora_a", {4, 64}, GgmlType::Q8_0, &fallback), GgmlType::Q8_0);
  EXPECT_FALSE(fallback);
  // B [out, r]: rows of r = 4 values are not whole q8_0 blocks.
  EXPECT_EQ(model::gguf_tensor_type("blk.0.attn_q.weight.lora_b", {64, 4}, GgmlType::Q8_0, &fallback), GgmlType::F16);
  EXPECT_TRUE(fallback);
  EXPECT_EQ(model::gguf_tensor_type("blk.0.attn_q.weight.lora_b", {64, 4}, GgmlType::BF16), GgmlType::BF16);
}

// llama.cpp takes Gemma 3's attention scale and window pattern from its own tables: a model that
// differs is refused (every token would differ); a window llama.cpp's llama ignores is a note.
TEST(GgufExport, ModelsLlamaCppWouldRunOtherwiseAreRefusedOrNoted) {
  auto gemma = config_of(model::Family::Gemma3);
  gemma.num_layers = 6;
  gemma.head_dim = 16;
  gemma.hidden_size = 64;
  gemma.query_pre_attn_scalar = 16;
  gemma.sliding_window = 4;
  gemma.sliding_layers = {true, true, true, true, true, false};
  EXPECT_TRUE(check_llama_cpp_runs_as_trained(gemma, "gemma3").empty());
  auto scaled = gemma;
  scaled.query_pre_attn_scalar = 24;
  expect_keel_error([&] { check_llama_cpp_runs_as_trained(scaled, "gemma3"); },
                    {"query_pre_attn_scalar", "24", "16", "would not run the model as trained", "--format hf"});
  auto alternating = gemma;
  alternating.sliding_layers = {true, false, true, false, true, false};
  expect_keel_error([&] { check_llama_cpp_runs_as_trained(alternating, "gemma3"); },
                    {"layer 1", "has no", "each sixth"});
  auto mistral = config_of(model::Family::Mistral);
  mistral.sliding_window = 4096;
  const auto notes = check_llama_cpp_runs_as_trained(mistral, "llama");
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("4096 tokens"), std::string::npos);
  EXPECT_TRUE(check_llama_cpp_runs_as_trained(config_of(model::Family::Llama), "llama").empty());
}

// GLM-4 as the converter writes it: heads of hidden / heads channels (llama.cpp's chatglm has no
// head size key) and RoPE base 10000 (the converter's) or refused; another epsilon and the
// context length (the hidden size, the converter's fallback) are notes.
TEST(GgufExport, Glm4ModelsLlamaCppWouldRunOtherwiseAreRefusedOrNoted) {
  auto glm = config_of(model::Family::Glm);
  glm.hidden_size = 64;
  glm.num_heads = 4;
  glm.head_dim = 16;
  glm.rope_theta = 10000.0;
  glm.rms_norm_eps = 1e-5;
  glm.max_position_embeddings = 128;
  const auto notes = check_llama_cpp_runs_as_trained(glm, "chatglm");
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("context_length is the hidden size (64)"), std::string::npos);
  auto eps = glm;
  eps.rms_norm_eps = 1.5625e-07;
  const auto eps_notes = check_llama_cpp_runs_as_trained(eps, "chatglm");
  ASSERT_EQ(eps_notes.size(), 2u);
  EXPECT_NE(eps_notes[0].find("1.5625e-07"), std::string::npos);
  EXPECT_NE(eps_notes[0].find("relative 5e-06"), std::string::npos);
  auto heads = glm;
  heads.head_dim = 32;
  expect_keel_error([&] { check_llama_cpp_runs_as_trained(heads, "chatglm"); },
                    {"4 heads of 32 channels", "hidden / heads = 16", "--format hf"});
  auto base = glm;
  base.rope_theta = 500000.0;
  expect_keel_error([&] { check_llama_cpp_runs_as_trained(base, "chatglm"); },
                    {"RoPE base is 500000", "writes 10000", "--format hf"});
}

// Gemma 2 likewise: llama.cpp's gemma2 scales by 1/sqrt(head_dim), slides every even layer, always
// soft-caps both logits and uses the embedding as the LM head.
TEST(GgufExport, Gemma2ModelsLlamaCppWouldRunOtherwiseAreRefused) {
  auto gemma = config_of(model::Family::Gemma2);
  gemma.num_layers = 4;
  gemma.head_dim = 16;
  gemma.hidden_size = 64;
  gemma.query_pre_attn_scalar = 16;
  gemma.attn_logit_softcap = 50;
  gemma.final_logit_softcap = 30;
  gemma.sliding_window = 4;
  gemma.sliding_layers = {true, false, true, false};
  gemma.tie_word_embeddings = true;
  EXPECT_TRUE(check_llama_cpp_runs_as_trained(gemma, "gemma2").empty());
  auto scaled = gemma;
  scaled.query_pre_attn_scalar = 24;
  expect_keel_error([&] { check_llama_cpp_runs_as_trained(scaled, "gemma2"); },
                    {"Gemma 2", "query_pre_attn_scalar", "24", "16", "would not run the model as trained"});
  auto uncapped = gemma;
  uncapped.attn_logit_softcap = 0;
  expect_keel_error([&] { check_llama_cpp_runs_as_trained(uncapped, "gemma2"); }, {"attention logit soft cap"});
  auto unwindowed = gemma;
  unwindowed.sliding_window = 0;
  expect_keel_error([&] { check_llama_cpp_runs_as_trained(unwindowed, "gemma2"); }, {"no sliding window"});
  auto pattern = gemma;
  pattern.sliding_layers = {true, true, true, false};
  expect_keel_error([&] { check_llama_cpp_runs_as_trained(pattern, "gemma2"); }, {"layer 1", "has a sliding window"});
  auto untied = gemma;
  untied.tie_word_embeddings = false;
  expect_keel_error([&] { check_llama_cpp_runs_as_trained(untied, "gemma2"); }, {"LM head", "tie_word_embeddings"});
  EXPECT_EQ(model::gguf_norm_shift(gemma, "model.layers.0.pre_feedforward_layernorm.weight"), 1.0f);
  EXPECT_EQ(model::gguf_norm_shift(gemma, "model.layers.0.mlp.up_proj.weight"), 0.0f);
}

TEST(GgufExport, DefaultOuttypeIsTheConvertersAuto) {
  std::string reason;
  EXPECT_EQ(default_gguf_outtype(DType::BF16, &reason), GgmlType::BF16);
  EXPECT_EQ(default_gguf_outtype(DType::F32, &reason), GgmlType::F16);
  EXPECT_NE(reason.find("fp32"), std::string::npos);
  EXPECT_EQ(default_gguf_outtype(DType::F16, nullptr), GgmlType::F16);
}

// A file keel did not write may be someone's model: refused unless --overwrite. One keel wrote
// (general.quantized_by = "keel") is replaced.
TEST(GgufExport, DestinationRefusesFilesKeelDidNotWrite) {
  TempDir dir;
  const std::string foreign = dir / "theirs.gguf";
  write_file_atomic(foreign, "GGUF and more bytes of somebody's model");
  expect_keel_error([&] { check_gguf_destination(foreign, false); }, {foreign, "keel did not write it", "--overwrite"});
  check_gguf_destination(foreign, true);

  const std::string ours = dir / "ours.gguf";
  formats::GgufMetadata kv;
  kv.add_string("general.architecture", "llama");
  kv.add_string("general.type", "model");
  kv.add_string("general.name", "m");
  kv.add_string("general.quantized_by", kGgufWriterName);
  formats::write_gguf(ours, kv, {{"t", {1}, GgmlType::F32, [](int64_t, int64_t, float* d) { d[0] = 1; }}});
  check_gguf_destination(ours, false);
  check_gguf_destination(dir / "new.gguf", false);

  expect_keel_error([&] { check_gguf_destination(dir / "model.bin", false); }, {"ending in .gguf", "model.bin"});
  expect_keel_error([&] { check_gguf_destination(dir / "missing/m.gguf", false); }, {"does not exist"});
}

// A tokenizer llama.cpp's table does not know cannot be tokenized there as it was trained: refused.
TEST(GgufExport, UnknownPreTokenizerAndSentencePieceAreRefused) {
  TempDir dir;
  write_file_atomic(dir / "tokenizer.json",
                    R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
                        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false},
                        "added_tokens": []})");
  expect_keel_error([&] { data::llama_cpp_vocab(dir.path(), 3, "{}"); },
                    {"tokenizer.json", "llama.cpp does not know this tokenizer's pre-tokenizer"});
  TempDir sp;
  write_file_atomic(sp / "tokenizer.model", "x");  // not a SentencePiece model (tiktoken's is text too)
  expect_keel_error([&] { data::llama_cpp_vocab(sp.path(), 3, "{}"); }, {"tokenizer.json", "no such file"});
  expect_keel_error([&] { data::llama_cpp_vocab(sp.path(), 3, "{}", true); },
                    {"no SentencePiece tokenizer.model", "this family"});
  EXPECT_EQ(data::llama_cpp_pre_tokenizer_name({1, 2, 3}), "");
}

// keel's one rule beside the converter's hash table: a GLM-4 tokenizer.json (GLM-4's Split regex,
// then ByteLevel; [gMASK] and <sop> added) whose hash the table lacks is llama.cpp's "glm4".
TEST(GgufExport, Glm4TokenizersWithoutAKnownHashAreNamedByTheirPreTokenizer) {
  const std::string regex =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+)";
  auto tokenizer = [&](const std::string& pattern, const std::string& second_marker) {
    return R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
               "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                 {"type": "Split", "pattern": {"Regex": ")" + pattern + R"("}, "behavior": "Isolated", "invert": false},
                 {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]},
               "added_tokens": [{"id": 3, "content": "[gMASK]", "special": true},
                                {"id": 4, "content": ")" + second_marker + R"(", "special": true}]})";
  };
  TempDir glm;
  write_file_atomic(glm / "tokenizer.json", tokenizer(regex, "<sop>"));
  const auto v = data::llama_cpp_vocab(glm.path(), 5, "{}");
  EXPECT_EQ(v.pre, "glm4");
  EXPECT_TRUE(v.pre_by_glm4_rule);
  TempDir other_regex, no_sop;  // another regex, or no <sop>: not GLM-4's tokenizer, refused as before
  write_file_atomic(other_regex / "tokenizer.json", tokenizer(R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|\\p{N})", "<sop>"));
  expect_keel_error([&] { data::llama_cpp_vocab(other_regex.path(), 5, "{}"); }, {"does not know this tokenizer"});
  write_file_atomic(no_sop / "tokenizer.json", tokenizer(regex, "<eop>"));
  expect_keel_error([&] { data::llama_cpp_vocab(no_sop.path(), 5, "{}"); }, {"does not know this tokenizer"});
}

// A fine-tuned model that never stops in llama.cpp is what a lost end-of-turn token gives: llama.cpp
// stops on EOS and on the tokens it knows by their text, nothing else.
TEST(GgufExport, LlamaCppEndsGenerationOnEosAndTheTokensItKnowsByName) {
  data::LlamaCppVocab v;
  v.tokens = {"a", "<|im_end|>", "<|turn_end|>", "<end_of_turn>", "</s>"};
  v.special_ids = {{"bos", 0}, {"eos", 2}};
  EXPECT_FALSE(data::llama_cpp_ends_generation(v, 0));
  EXPECT_TRUE(data::llama_cpp_ends_generation(v, 1));
  EXPECT_TRUE(data::llama_cpp_ends_generation(v, 2));  // unknown by name, but EOS
  EXPECT_TRUE(data::llama_cpp_ends_generation(v, 3));
  EXPECT_TRUE(data::llama_cpp_ends_generation(v, 4));
  EXPECT_FALSE(data::llama_cpp_ends_generation(v, 5));
  v.special_ids = {{"bos", 2}};
  EXPECT_FALSE(data::llama_cpp_ends_generation(v, 2));
}

}  // namespace
}  // namespace keel::checkpoint
