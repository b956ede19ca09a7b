// GGUF in: a model's config from a GGUF file's metadata (model/gguf_config.h), its weights
// dequantized with the Q/K permutation undone (model/gguf_weights.h), and its tokenizer as
// Hugging Face files (data/llama_cpp_vocab_hf.h, checkpoint/gguf_tokenizer.h), on small files
// keel's writer makes. That training from converter-made files equals training from
// transformers' directories of them is tests/reference/gguf_input_reference.py's.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "keel/checkpoint/gguf_tokenizer.h"
#include "keel/core/file_io.h"
#include "keel/data/byte_level.h"
#include "keel/data/hf_tokenizer_json.h"
#include "keel/data/llama_cpp_vocab_hf.h"
#include "keel/data/tokenizer.h"
#include "keel/formats/gguf_dequantize.h"
#include "keel/formats/gguf_reader.h"
#include "keel/formats/gguf_writer.h"
#include "keel/model/decoder.h"
#include "keel/model/gguf_config.h"
#include "keel/model/gguf_names.h"
#include "keel/model/gguf_weights.h"
#include "keel/model/hf_weights.h"
#include "keel/data/llama_cpp_vocab.h"
#include "test_support.h"

namespace keel {
namespace {

using formats::GgmlType;
using formats::GgufMetadata;
using formats::GgufTensor;
using testing::expect_keel_error;
using testing::TempDir;

// A tiny Llama's metadata as llama.cpp's converter writes it (LlamaModel.set_gguf_parameters).
GgufMetadata llama_metadata(const std::string& arch = "llama", const std::string& type = "model", uint32_t blocks = 1) {
  GgufMetadata kv;
  kv.add_string("general.architecture", arch);
  kv.add_string("general.type", type);
  kv.add_uint32(arch + ".block_count", blocks);
  kv.add_uint32(arch + ".context_length", 128);
  kv.add_uint32(arch + ".embedding_length", 32);
  kv.add_uint32(arch + ".feed_forward_length", 64);
  kv.add_uint32(arch + ".attention.head_count", 4);
  kv.add_uint32(arch + ".attention.head_count_kv", 2);
  kv.add_float32(arch + ".rope.freq_base", 500000.0f);
  kv.add_float32(arch + ".attention.layer_norm_rms_epsilon", 1e-5f);
  kv.add_uint32("tokenizer.ggml.bos_token_id", 1);
  kv.add_uint32("tokenizer.ggml.eos_token_id", 2);
  return kv;
}

// Values i * scale + offset, distinct per tensor, that Q8_0 keeps exactly enough to compare.
GgufTensor tensor(const std::string& name, std::vector<int64_t> shape, GgmlType type = GgmlType::F32,
                  float offset = 0) {
  return {name, shape, type, [offset](int64_t begin, int64_t count, float* dst) {
            for (int64_t i = 0; i < count; ++i) dst[i] = offset + 0.001f * float((begin + i) % 97);
          }};
}

std::vector<GgufTensor> llama_tensors(bool with_output, int64_t vocab = 40) {
  std::vector<GgufTensor> t = {
      tensor("token_embd.weight", {vocab, 32}, GgmlType::Q8_0, 0.1f),
      tensor("blk.0.attn_norm.weight", {32}, GgmlType::F32, 1.0f),
      tensor("blk.0.attn_q.weight", {32, 32}, GgmlType::F16, 0.2f),
      tensor("blk.0.attn_k.weight", {16, 32}, GgmlType::F32, 0.3f),
      tensor("blk.0.attn_v.weight", {16, 32}, GgmlType::F32, 0.4f),
      tensor("blk.0.attn_output.weight", {32, 32}, GgmlType::F32, 0.5f),
      tensor("blk.0.ffn_norm.weight", {32}, GgmlType::F32, 1.1f),
      tensor("blk.0.ffn_gate.weight", {64, 32}, GgmlType::F32, 0.6f),
      tensor("blk.0.ffn_up.weight", {64, 32}, GgmlType::F32, 0.7f),
      tensor("blk.0.ffn_down.weight", {32, 64}, GgmlType::Q4_0, 0.8f),
      tensor("output_norm.weight", {32}, GgmlType::F32, 1.2f),
  };
  if (with_output) t.push_back(tensor("output.weight", {vocab, 32}, GgmlType::F32, 0.9f));
  return t;
}

std::string written(const GgufMetadata& kv, const std::vector<GgufTensor>& tensors) {
  TempDir dir;
  formats::write_gguf(dir / "m.gguf", kv, tensors);
  return read_file(dir / "m.gguf");
}

TEST(GgufInput, ConfigFromTheMetadata) {
  const std::string bytes = written(llama_metadata(), llama_tensors(true));
  const auto c = model::gguf_model_config(formats::GgufFile(bytes, "m.gguf"));
  EXPECT_EQ(c.family, model::Family::Llama);
  EXPECT_EQ(c.architecture, "LlamaForCausalLM");
  EXPECT_EQ(c.num_layers, 1);
  EXPECT_EQ(c.hidden_size, 32);
  EXPECT_EQ(c.intermediate_size, 64);
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 8);  // no key_length: hidden / heads
  EXPECT_EQ(c.vocab_size, 40);
  EXPECT_EQ(c.max_position_embeddings, 128);
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rms_norm_eps, double(1e-5f));  // the file's float32, widened exactly
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{2}));
  EXPECT_EQ(c.pad_token_id, -1);
  EXPECT_NE(c.config_json.find("\"LlamaForCausalLM\""), std::string::npos);
  // No output.weight: the converter dropped a tied head.
  const std::string tied = written(llama_metadata(), llama_tensors(false));
  EXPECT_TRUE(model::gguf_model_config(formats::GgufFile(tied, "t.gguf")).tie_word_embeddings);
  // qwen2: q/k/v biases, from the family.
  auto qwen = llama_metadata("qwen2");
  qwen.add_uint32("qwen2.attention.key_length", 16);
  qwen.add_uint32("qwen2.attention.value_length", 16);
  const auto q = model::gguf_model_config(formats::GgufFile(written(qwen, llama_tensors(false)), "q.gguf"));
  EXPECT_EQ(q.family, model::Family::Qwen2);
  EXPECT_TRUE(q.qkv_bias);
  EXPECT_EQ(q.head_dim, 16);
}

TEST(GgufInput, MetadataKeelCannotTrainIsRefusedByName) {
  const auto refused = [](const GgufMetadata& kv, const std::vector<GgufTensor>& tensors,
                          std::initializer_list<std::string> words) {
    const std::string bytes = written(kv, tensors);
    expect_keel_error([&] { model::gguf_model_config(formats::GgufFile(bytes, "bad.gguf")); }, words);
  };
  refused(llama_metadata("phi3"), llama_tensors(true),
          {"bad.gguf", "'phi3'", "llama, qwen2, qwen3, gemma2, gemma3, chatglm, qwen3moe, glm4moe"});
  GgufMetadata missing;
  missing.add_string("general.architecture", "llama");
  refused(missing, llama_tensors(true), {"bad.gguf", "'llama.embedding_length' is missing"});
  auto scaled = llama_metadata();
  scaled.add_string("llama.rope.scaling.type", "yarn");
  refused(scaled, llama_tensors(true), {"bad.gguf", "rope.scaling.type", "yarn"});
  auto freqs = llama_tensors(true);
  freqs.push_back(tensor("rope_freqs.weight", {4}));
  refused(llama_metadata(), freqs, {"bad.gguf", "rope_freqs.weight"});
  refused(llama_metadata("llama", "adapter"), llama_tensors(true), {"bad.gguf", "general.type"});
  refused(llama_metadata(), {tensor("output_norm.weight", {32})}, {"bad.gguf", "token_embd.weight"});
}

TEST(GgufInput, PermutationUndoneIsTheInverse) {
  // Two heads of eight rows, three columns: undo(permute(x)) == x, and undo moves rows back
  // from ggml's adjacent pairs (2i, 2i + 1) to rotate_half's (i, i + 4).
  std::vector<float> x(16 * 3);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(i);
  std::vector<float> permuted(x.size()), back(x.size());
  model::permute_rows_for_gguf(x.data(), permuted.data(), 2, 16, 3);
  model::permute_rows_for_gguf(permuted.data(), back.data(), 2, 16, 3, /*undo=*/true);
  EXPECT_EQ(back, x);
  EXPECT_NE(permuted, x);
  const std::vector<float> ggml_rows = {0, 1, 2, 3, 4, 5, 6, 7};  // one head, one column
  std::vector<float> hf_rows(8);
  model::permute_rows_for_gguf(ggml_rows.data(), hf_rows.data(), 1, 8, 1, true);
  EXPECT_EQ(hf_rows, (std::vector<float>{0, 2, 4, 6, 1, 3, 5, 7}));
}

TEST(GgufInput, WeightsDequantizedAndUnpermuted) {
  const std::string bytes = written(llama_metadata(), llama_tensors(true));
  const formats::GgufFile file(bytes, "m.gguf");
  model::Decoder decoder(model::gguf_model_config(file), model::Precision::F32, 1, 4, model::DecoderOptions{});
  const auto loaded = model::load_gguf_weights(decoder, file);
  EXPECT_EQ(loaded.permuted, 2);  // attn_q and attn_k
  EXPECT_TRUE(loaded.unused.empty());
  EXPECT_EQ(loaded.types, (std::vector<std::string>{"Q8_0", "F32", "F16", "Q4_0"}));
  // Each tensor as the decoder holds it, against the file's values dequantized (and un-permuted).
  const auto weights = model::hf_weight_tensors(decoder);
  for (const auto& info : file.tensors()) {
    std::vector<float> expected(size_t(info.elements()));
    formats::ggml_dequantize(info.type, file.tensor_bytes(info).data(), info.elements(), expected.data());
    const int64_t heads = info.name == "blk.0.attn_q.weight" ? 4 : info.name == "blk.0.attn_k.weight" ? 2 : 0;
    if (heads) {
      std::vector<float> unpermuted(expected.size());
      model::permute_rows_for_gguf(expected.data(), unpermuted.data(), heads, info.shape[0], info.shape[1], true);
      expected = unpermuted;
    }
    bool found = false;
    for (const auto& w : weights)
      if (model::gguf_tensor_name(decoder.config(), w.name) == info.name) {
        found = true;
        const float* got = static_cast<const float*>(w.data);
        EXPECT_TRUE(std::equal(expected.begin(), expected.end(), got)) << info.name;
      }
    EXPECT_TRUE(found) << info.name;
  }
}

// A tiny GLM-4.5 as llama.cpp's converter writes it (Glm4MoeModel): layer 0 dense, layer 1 a mixture
// of 4 experts in 2 groups with a shared expert, one MTP layer counted in block_count and absent.
GgufMetadata glm4moe_metadata(uint32_t gating = 2) {
  GgufMetadata kv = llama_metadata("glm4moe", "model", 3);
  kv.add_uint32("glm4moe.expert_count", 4);
  kv.add_uint32("glm4moe.expert_used_count", 2);
  kv.add_uint32("glm4moe.expert_group_count", 2);
  kv.add_uint32("glm4moe.expert_group_used_count", 1);
  kv.add_uint32("glm4moe.rope.dimension_count", 4);
  kv.add_uint32("glm4moe.expert_feed_forward_length", 32);
  kv.add_uint32("glm4moe.expert_shared_count", 1);
  kv.add_uint32("glm4moe.leading_dense_block_count", 1);
  kv.add_uint32("glm4moe.expert_gating_func", gating);  // 2: sigmoid
  kv.add_float32("glm4moe.expert_weights_scale", 2.5f);
  kv.add_bool("glm4moe.expert_weights_norm", true);
  kv.add_uint32("glm4moe.nextn_predict_layers", 1);
  return kv;
}

std::vector<GgufTensor> glm4moe_tensors() {
  std::vector<GgufTensor> t = {tensor("token_embd.weight", {40, 32}, GgmlType::Q8_0, 0.1f),
                               tensor("output_norm.weight", {32}, GgmlType::F32, 1.2f),
                               tensor("output.weight", {40, 32}, GgmlType::F32, 0.9f)};
  for (int layer = 0; layer < 2; ++layer) {
    const std::string b = "blk." + std::to_string(layer) + ".";
    const float o = 0.01f * float(layer);
    for (auto [name, shape] : {std::pair<std::string, std::vector<int64_t>>{"attn_norm.weight", {32}},
                               {"attn_q.weight", {32, 32}}, {"attn_q.bias", {32}}, {"attn_k.weight", {16, 32}},
                               {"attn_k.bias", {16}}, {"attn_v.weight", {16, 32}}, {"attn_v.bias", {16}},
                               {"attn_output.weight", {32, 32}}, {"post_attention_norm.weight", {32}}})
      t.push_back(tensor(b + name, shape, GgmlType::F32, o + 0.2f));
    if (layer == 0) {
      t.push_back(tensor(b + "ffn_gate.weight", {64, 32}, GgmlType::F32, 0.6f));
      t.push_back(tensor(b + "ffn_up.weight", {64, 32}, GgmlType::F32, 0.7f));
      t.push_back(tensor(b + "ffn_down.weight", {32, 64}, GgmlType::F32, 0.8f));
      continue;
    }
    t.push_back(tensor(b + "ffn_gate_inp.weight", {4, 32}, GgmlType::F32, 0.3f));
    t.push_back(tensor(b + "exp_probs_b.bias", {4}, GgmlType::F32, 0.05f));
    // Each stack distinct per expert (the pattern's period, 97, is not a multiple of an expert's 1,024).
    t.push_back(tensor(b + "ffn_gate_exps.weight", {4, 32, 32}, GgmlType::Q8_0, 0.4f));
    t.push_back(tensor(b + "ffn_up_exps.weight", {4, 32, 32}, GgmlType::F16, 0.5f));
    t.push_back(tensor(b + "ffn_down_exps.weight", {4, 32, 32}, GgmlType::Q4_0, 0.6f));
    t.push_back(tensor(b + "ffn_gate_shexp.weight", {32, 32}, GgmlType::F32, 0.7f));
    t.push_back(tensor(b + "ffn_up_shexp.weight", {32, 32}, GgmlType::F32, 0.75f));
    t.push_back(tensor(b + "ffn_down_shexp.weight", {32, 32}, GgmlType::F32, 0.8f));
  }
  return t;
}

// Mixtures as llama.cpp runs them: GLM-4.5's keys, Qwen3-MoE's and Mixtral's experts on every layer
// with their top-k renormalised (llama.cpp's qwen3moe and llama always do).
TEST(GgufInput, MixturesConfigAsLlamaCppRunsIt) {
  const auto glm = model::gguf_model_config(formats::GgufFile(written(glm4moe_metadata(), glm4moe_tensors()), "g.gguf"));
  EXPECT_EQ(glm.family, model::Family::Glm4Moe);
  EXPECT_EQ(glm.num_layers, 2);  // block_count 3 less the MTP layer
  EXPECT_EQ(glm.nextn_predict_layers, 1);
  EXPECT_EQ(glm.moe.sparse_layers, (std::vector<bool>{false, true}));
  EXPECT_EQ(glm.moe.experts, 4);
  EXPECT_EQ(glm.moe.experts_per_token, 2);
  EXPECT_EQ(glm.moe.intermediate_size, 32);
  EXPECT_EQ(glm.moe.shared_intermediate_size, 32);
  EXPECT_EQ(glm.moe.groups, 2);
  EXPECT_EQ(glm.moe.topk_groups, 1);
  EXPECT_TRUE(glm.moe.sigmoid_router);
  EXPECT_TRUE(glm.moe.norm_topk_prob);
  EXPECT_EQ(glm.moe.routed_scaling_factor, 2.5);
  EXPECT_EQ(glm.rotary_dim, 4);
  EXPECT_TRUE(glm.qkv_bias);
  EXPECT_FALSE(glm.qk_norm);  // no attn_q_norm: the GLM-4.5 355B layout
  EXPECT_FALSE(glm.rope_interleaved);
  const auto softmax = glm4moe_metadata(1);
  expect_keel_error(
      [&] { model::gguf_model_config(formats::GgufFile(written(softmax, glm4moe_tensors()), "s.gguf")); },
      {"s.gguf", "expert_gating_func is 1", "sigmoid"});

  auto qwen = llama_metadata("qwen3moe", "model", 1);
  qwen.add_uint32("qwen3moe.expert_count", 4);
  qwen.add_uint32("qwen3moe.expert_used_count", 2);
  qwen.add_uint32("qwen3moe.expert_feed_forward_length", 32);
  const auto q = model::gguf_model_config(formats::GgufFile(written(qwen, llama_tensors(true)), "q.gguf"));
  EXPECT_EQ(q.family, model::Family::Qwen3Moe);
  EXPECT_TRUE(q.moe.norm_topk_prob);
  EXPECT_EQ(q.moe.sparse_layers, (std::vector<bool>{true}));
  EXPECT_EQ(q.moe.intermediate_size, 32);
  EXPECT_EQ(model::gguf_config_notes(q).size(), 1u);  // transformers' loader reads it otherwise: said
  auto mixtral = llama_metadata();
  mixtral.add_uint32("llama.expert_count", 4);
  mixtral.add_uint32("llama.expert_used_count", 2);
  const auto m = model::gguf_model_config(formats::GgufFile(written(mixtral, llama_tensors(true)), "x.gguf"));
  EXPECT_EQ(m.family, model::Family::Mixtral);
  EXPECT_EQ(m.moe.intermediate_size, 64);  // feed_forward_length: Mixtral's experts' width
  EXPECT_TRUE(m.moe.norm_topk_prob);
}

// Each expert's projections are its slice of the layer's stack (any type), the router's bias and the
// shared expert by their own names.
TEST(GgufInput, ExpertsAreTheirSlicesOfTheStacks) {
  const std::string bytes = written(glm4moe_metadata(), glm4moe_tensors());
  const formats::GgufFile file(bytes, "g.gguf");
  model::Decoder decoder(model::gguf_model_config(file), model::Precision::F32, 1, 4, model::DecoderOptions{});
  const auto loaded = model::load_gguf_weights(decoder, file);
  EXPECT_TRUE(loaded.unused.empty());
  int64_t experts_checked = 0;
  for (const auto& w : model::hf_weight_tensors(decoder)) {
    const auto slice = model::gguf_expert_slice(decoder.config(), w.name);
    const std::string name = slice ? slice->stack : model::gguf_tensor_name(decoder.config(), w.name);
    const formats::GgufTensorInfo* info = nullptr;
    for (const auto& t : file.tensors())
      if (t.name == name) info = &t;
    ASSERT_NE(info, nullptr) << w.name;
    std::vector<float> all(size_t(info->elements()));
    formats::ggml_dequantize(info->type, file.tensor_bytes(*info).data(), info->elements(), all.data());
    int64_t n = 1;
    for (int64_t d : w.shape) n *= d;
    const int64_t first = slice ? slice->expert * n : 0;
    EXPECT_TRUE(std::equal(all.begin() + first, all.begin() + first + n, static_cast<const float*>(w.data))) << w.name;
    experts_checked += slice ? 1 : 0;
  }
  EXPECT_EQ(experts_checked, 12);  // 4 experts x gate, up, down
}

TEST(GgufInput, WeightErrorsNameTheTensor) {
  auto wrong_shape = llama_tensors(true);
  wrong_shape[3] = tensor("blk.0.attn_k.weight", {8, 32});
  const std::string bytes = written(llama_metadata(), wrong_shape);
  const formats::GgufFile file(bytes, "m.gguf");
  model::Decoder decoder(model::gguf_model_config(file), model::Precision::F32, 1, 4, model::DecoderOptions{});
  expect_keel_error([&] { model::load_gguf_weights(decoder, file); },
                    {"m.gguf", "blk.0.attn_k.weight", "[8, 32]", "[16, 32]"});
  auto missing = llama_tensors(true);
  missing.erase(missing.begin() + 5);  // attn_output
  const std::string bytes2 = written(llama_metadata(), missing);
  const formats::GgufFile file2(bytes2, "n.gguf");
  model::Decoder decoder2(model::gguf_model_config(file2), model::Precision::F32, 1, 4, model::DecoderOptions{});
  expect_keel_error([&] { model::load_gguf_weights(decoder2, file2); },
                    {"n.gguf", "blk.0.attn_output.weight", "missing"});
}

// A byte-level vocabulary: the 256 single bytes (their byte-level spellings), merges of "h e" and
// "he llo"... as a GGUF file carries it.
data::LlamaCppVocab small_vocab() {
  data::LlamaCppVocab v;
  v.model = "gpt2";
  v.pre = "llama-bpe";
  for (int b = 0; b < 256; ++b) v.tokens.push_back(data::byte_level_spelling(std::string(1, char(b))));
  v.token_types.assign(256, 1);
  for (const auto& [merge, token] : {std::pair{"h e", "he"}, {"l l", "ll"}, {"he ll", "hell"}, {"hell o", "hello"},
                                     {"\xc4\xa0 w", "\xc4\xa0w"}}) {
    v.merges.push_back(merge);
    v.tokens.push_back(token);
    v.token_types.push_back(1);
  }
  v.tokens.push_back("<|eot|>");
  v.token_types.push_back(int32_t(data::LlamaCppTokenType::Control));
  v.tokens.push_back("<think>");
  v.token_types.push_back(int32_t(data::LlamaCppTokenType::UserDefined));
  v.special_ids = {{"bos", 261}, {"eos", 261}, {"pad", 33}};  // pad '!' (a normal token)
  v.add_special = {{"bos", true}};
  v.chat_template = "{{ messages[0]['content'] }}";
  return v;
}

TEST(GgufInput, TokenizerFilesAsTransformersBuildsThem) {
  const auto files = data::hf_tokenizer_files(small_vocab(), "m.gguf");
  const data::Tokenizer t = data::hf_tokenizer_from_json(files.tokenizer_json, "m.gguf", files.tokenizer_config_json);
  EXPECT_EQ(t.vocab_size(), 263);
  // BPE with the merges, the Llama 3 regex splitting " world" off; no BOS added for all add_bos_token says.
  // "hello" merged whole; " world" split off by the regex, "\u0120w" merged. Token ids: the bytes
  // 0-255, then the merges' tokens 256-260, <|eot|> 261, <think> 262.
  EXPECT_EQ(t.encode("hello world", {.add_special_tokens = true}),
            (std::vector<int32_t>{259, 260, 'o', 'r', 'l', 'd'}));
  EXPECT_TRUE(t.is_special(261));   // control
  EXPECT_FALSE(t.is_special(262));  // user-defined: added, not special
  EXPECT_TRUE(t.is_special(33));    // the pad token, special as transformers makes the tokens its config names
  EXPECT_EQ(t.encode("a<|eot|>b<think>"),
            (std::vector<int32_t>{*t.token_to_id("a"), 261, *t.token_to_id("b"), 262}));
  EXPECT_EQ(t.bos_id(), 261);
  EXPECT_EQ(files.chat_template, "{{ messages[0]['content'] }}");
  ASSERT_EQ(files.notes.size(), 1u);
  EXPECT_NE(files.notes[0].find("add_bos_token"), std::string::npos);
  // A pre-tokenizer transformers has no regex for: GPT-2's, said.
  auto other = small_vocab();
  other.pre = "made-up";
  EXPECT_NE(data::hf_tokenizer_files(other, "m.gguf").notes.at(0).find("'made-up'"), std::string::npos);
  auto spm = small_vocab();
  spm.model = "llama";
  expect_keel_error([&] { data::hf_tokenizer_files(spm, "m.gguf", "phi3"); },
                    {"m.gguf", "SentencePiece", "architecture 'phi3'", "Llama-style and Gemma files"});
  auto other_model = small_vocab();
  other_model.model = "t5";
  expect_keel_error([&] { data::hf_tokenizer_files(other_model, "m.gguf"); }, {"m.gguf", "'t5'"});
}

// Gemma 2 as llama.cpp runs the file: the soft caps and window from it, the scale (head_dim) and
// the windowed layers (every even one) from llama.cpp's tables; the differences from transformers'
// loader said. No window key: llama.cpp's 4096.
TEST(GgufInput, Gemma2ConfigAsLlamaCppRunsIt) {
  auto kv = llama_metadata("gemma2");
  kv.add_uint32("gemma2.attention.key_length", 16);
  kv.add_uint32("gemma2.attention.value_length", 16);
  kv.add_float32("gemma2.attn_logit_softcapping", 1.5f);
  kv.add_float32("gemma2.final_logit_softcapping", 3.0f);
  kv.add_uint32("gemma2.attention.sliding_window", 5);
  const auto c = model::gguf_model_config(formats::GgufFile(written(kv, llama_tensors(false)), "g.gguf"));
  EXPECT_EQ(c.family, model::Family::Gemma2);
  EXPECT_EQ(c.query_pre_attn_scalar, 16.0);
  EXPECT_EQ(c.attn_logit_softcap, 1.5);
  EXPECT_EQ(c.final_logit_softcap, 3.0);
  EXPECT_EQ(c.sliding_window, 5);
  EXPECT_EQ(c.sliding_layers, (std::vector<bool>{true}));
  EXPECT_EQ(c.norm_weight_offset, 1.0);
  const auto notes = model::gguf_config_notes(c);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("transformers' GGUF loader reads none of them"), std::string::npos);
  auto bare = llama_metadata("gemma2");
  bare.add_uint32("gemma2.attention.key_length", 256);
  const auto d = model::gguf_model_config(formats::GgufFile(written(bare, llama_tensors(false)), "g.gguf"));
  EXPECT_EQ(d.attn_logit_softcap, 50.0);
  EXPECT_EQ(d.final_logit_softcap, 30.0);
  EXPECT_EQ(d.sliding_window, 4096);
  EXPECT_TRUE(model::gguf_config_notes(d).empty());  // what transformers takes too
}

// Gemma 3 as llama.cpp runs the file: the window from it, every layer but each sixth windowed, the
// global RoPE base from rope.freq_base and the windowed layers' from rope.freq_base_swa (said:
// transformers reads 10000), no final cap where the key is absent. No window key: no window (said:
// transformers windows all but each sixth layer).
TEST(GgufInput, Gemma3ConfigAsLlamaCppRunsIt) {
  auto kv = llama_metadata("gemma3", "model", 7);
  kv.add_uint32("gemma3.attention.key_length", 256);
  kv.add_uint32("gemma3.attention.value_length", 256);
  kv.add_uint32("gemma3.attention.sliding_window", 5);
  kv.add_float32("gemma3.rope.freq_base_swa", 20000.0f);
  const auto c = model::gguf_model_config(formats::GgufFile(written(kv, llama_tensors(false)), "g.gguf"));
  EXPECT_EQ(c.family, model::Family::Gemma3);
  EXPECT_EQ(c.sliding_window, 5);
  EXPECT_EQ(c.sliding_layers, (std::vector<bool>{true, true, true, true, true, false, true}));
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_local_theta, 20000.0);
  EXPECT_EQ(c.final_logit_softcap, 0.0);
  EXPECT_EQ(c.query_pre_attn_scalar, 256.0);
  EXPECT_EQ(c.norm_weight_offset, 1.0);
  const auto notes = model::gguf_config_notes(c);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("rope.freq_base_swa"), std::string::npos);
  auto bare = llama_metadata("gemma3", "model", 7);
  bare.add_uint32("gemma3.attention.key_length", 256);
  const auto d = model::gguf_model_config(formats::GgufFile(written(bare, llama_tensors(false)), "g.gguf"));
  EXPECT_EQ(d.sliding_window, 0);  // no key: no window (was refused: sliding_layers of a model without one)
  EXPECT_TRUE(d.sliding_layers.empty());
  EXPECT_EQ(d.rope_local_theta, 10000.0);
  const auto bare_notes = model::gguf_config_notes(d);
  ASSERT_EQ(bare_notes.size(), 1u);
  EXPECT_NE(bare_notes[0].find("no attention.sliding_window"), std::string::npos);
}

// Gemma's norms are stored as 1 + w: read back as w, in fp32, as transformers' Gemma2TensorProcessor.
TEST(GgufInput, GemmaNormsAreReadBackLessOne) {
  auto kv = llama_metadata("gemma2");
  kv.add_uint32("gemma2.attention.key_length", 8);
  auto tensors = llama_tensors(false);
  tensors.push_back(tensor("blk.0.post_attention_norm.weight", {32}, GgmlType::F32, 1.3f));
  tensors.push_back(tensor("blk.0.post_ffw_norm.weight", {32}, GgmlType::F32, 1.4f));
  const std::string bytes = written(kv, tensors);  // the file views these bytes: they must outlive it
  const formats::GgufFile file(bytes, "g.gguf");
  model::Decoder decoder(model::gguf_model_config(file), model::Precision::F32, 1, 4, model::DecoderOptions{});
  const auto summary = model::load_gguf_weights(decoder, file);
  EXPECT_EQ(summary.shifted, 5);  // attn, post-attention, pre- and post-feedforward, output norms
  bool seen = false;
  for (const auto& t : model::hf_weight_tensors(decoder))
    if (t.name == "model.layers.0.post_attention_layernorm.weight") {
      seen = true;
      EXPECT_EQ(t.data[0], 1.3f - 1.0f);
      EXPECT_EQ(t.data[3], (1.3f + 0.001f * 3.0f) - 1.0f);
    }
  EXPECT_TRUE(seen);
}

// transformers' gemma_tokenizer: merges generate_merges derives from the vocabulary, ranked by the
// tokens' order in the file (later first); GemmaTokenizer's special tokens, the file's control
// tokens; BOS added as add_bos_token is absent (true).
TEST(GgufInput, GemmaSentencePieceTokenizerAsTransformersBuildsIt) {
  data::LlamaCppVocab v;
  v.model = "llama";
  v.pre = "default";
  v.tokens = {"<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<ctl>", "a", "b", "\xe2\x96\x81", "ab", "\xe2\x96\x81" "a",
              "abb", "  "};
  v.scores.assign(v.tokens.size(), 0.0f);
  v.token_types = {3, 3, 3, 2, 1, 3, 1, 1, 1, 1, 1, 1, 1};
  v.special_ids = {{"bos", 2}, {"eos", 1}, {"unk", 3}, {"pad", 0}};
  const auto files = data::hf_tokenizer_files(v, "g.gguf", "gemma2");
  const data::Tokenizer t = data::hf_tokenizer_from_json(files.tokenizer_json, "g.gguf", files.tokenizer_config_json);
  // "abb": "ab" + "b" (rank of abb) and "a" + "bb" (no "bb"); "ab" = "a" + "b"; "\u2581a"; "  " as U+2581 U+2581.
  EXPECT_EQ(t.encode("abb ab a<ctl>", {.add_special_tokens = true}),
            (std::vector<int32_t>{2, 11, 8, 9, 10, 5}));
  EXPECT_TRUE(t.is_special(5));
  EXPECT_TRUE(t.is_special(4));  // <mask>: GemmaTokenizer's own
  EXPECT_EQ(t.encode("  "), (std::vector<int32_t>{12}));
  EXPECT_NE(files.tokenizer_config_json.find("\"mask_token\":\"<mask>\""), std::string::npos);
  EXPECT_NE(files.tokenizer_json.find(R"(["a","b"])"), std::string::npos);
}

// transformers' sentencepiece_tokenizer for a Llama file (Llama 2, Mistral v0.1, TinyLlama):
// LlamaTokenizer's Metaspace (U+2581 prepended where the text does not start with one), merges
// ranked by the file's scores (not by the tokens' order, as Gemma's), byte fallback, its
// special tokens and BOS as add_bos_token is absent (true); the file's merges where it has them.
TEST(GgufInput, LlamaSentencePieceTokenizerAsTransformersBuildsIt) {
  data::LlamaCppVocab v;
  v.model = "llama";
  v.pre = "default";
  // "ab" before "\u2581a" in the file, "\u2581a" scored higher: the scores decide.
  v.tokens = {"<unk>", "<s>", "</s>", "<0x0A>", "<ctl>", "\xe2\x96\x81", "a", "b", "ab", "\xe2\x96\x81" "a"};
  v.scores = {0, 0, 0, 0, 0, -1, -2, -3, -5, -4};
  v.token_types = {2, 3, 3, 6, 3, 1, 1, 1, 1, 1};
  v.special_ids = {{"bos", 1}, {"eos", 2}, {"unk", 0}};
  const auto files = data::hf_tokenizer_files(v, "l.gguf", "llama");
  const data::Tokenizer t = data::hf_tokenizer_from_json(files.tokenizer_json, "l.gguf", files.tokenizer_config_json);
  // "ab" -> "\u2581ab": (\u2581, a) outranks (a, b); "\n" by its byte; " a" already starts with U+2581.
  EXPECT_EQ(t.encode("ab", {.add_special_tokens = true}), (std::vector<int32_t>{1, 9, 7}));
  EXPECT_EQ(t.encode("a\n"), (std::vector<int32_t>{9, 3}));
  EXPECT_EQ(t.encode(" a"), (std::vector<int32_t>{9}));
  EXPECT_EQ(t.encode("a<ctl>b"), (std::vector<int32_t>{9, 4, 7}));  // no U+2581 after the control token
  EXPECT_TRUE(t.is_special(0));  // <unk>: LlamaTokenizer's own
  EXPECT_TRUE(t.is_special(4));
  EXPECT_NE(files.tokenizer_config_json.find(R"("tokenizer_class":"LlamaTokenizer")"), std::string::npos);
  EXPECT_NE(files.tokenizer_config_json.find(R"("add_bos_token":true)"), std::string::npos);
  EXPECT_TRUE(files.notes.empty());
  // The file's merges, when it has them, instead of the scores'.
  auto merged = v;
  merged.merges = {"a b"};
  const auto m = data::hf_tokenizer_files(merged, "l.gguf", "llama");
  EXPECT_EQ(data::hf_tokenizer_from_json(m.tokenizer_json, "l.gguf", m.tokenizer_config_json).encode("ab"),
            (std::vector<int32_t>{5, 8}));
  // add_bos_token false, and a file that says llama.cpp prepends no space: said.
  auto plain = v;
  plain.add_special = {{"bos", false}};
  plain.add_prefix_space = false;
  const auto p = data::hf_tokenizer_files(plain, "l.gguf", "llama");
  EXPECT_EQ(data::hf_tokenizer_from_json(p.tokenizer_json, "l.gguf", p.tokenizer_config_json)
                .encode("ab", {.add_special_tokens = true}),
            (std::vector<int32_t>{9, 7}));
  ASSERT_EQ(p.notes.size(), 1u);
  EXPECT_NE(p.notes[0].find("add_space_prefix is false"), std::string::npos);
  // Without merges the scores rank them: one per token, finite.
  auto unscored = v;
  unscored.scores.pop_back();
  expect_keel_error([&] { data::hf_tokenizer_files(unscored, "l.gguf", "llama"); },
                    {"l.gguf", "tokenizer.ggml.scores has 9 entries for 10 tokens"});
  auto nan = v;
  nan.scores[6] = std::numeric_limits<float>::quiet_NaN();
  expect_keel_error([&] { data::hf_tokenizer_files(nan, "l.gguf", "llama"); },
                    {"l.gguf", "tokenizer.ggml.scores[6]", "finite"});
}

TEST(GgufInput, TokenizerDirectoryFromAFile) {
  TempDir dir;
  GgufMetadata kv = llama_metadata();
  const auto v = small_vocab();
  kv.add_string("tokenizer.ggml.model", v.model);
  kv.add_string("tokenizer.ggml.pre", v.pre);
  kv.add_strings("tokenizer.ggml.tokens", v.tokens);
  kv.add_int32s("tokenizer.ggml.token_type", v.token_types);
  kv.add_strings("tokenizer.ggml.merges", v.merges);
  kv.add_bool("tokenizer.ggml.add_bos_token", true);
  kv.add_string("tokenizer.chat_template", *v.chat_template);
  formats::write_gguf(dir / "m.gguf", kv, llama_tensors(true));
  const auto read = checkpoint::read_gguf_vocab(formats::GgufFile(dir / "m.gguf"));
  EXPECT_EQ(read.tokens, v.tokens);
  EXPECT_EQ(read.merges, v.merges);
  EXPECT_EQ(read.token_types, v.token_types);
  EXPECT_EQ(read.special_ids, (std::vector<std::pair<std::string, int64_t>>{{"bos", 1}, {"eos", 2}}));
  checkpoint::write_gguf_tokenizer_dir(dir / "m.gguf", dir / "tok", nullptr);
  const data::Tokenizer t = data::load_tokenizer(dir / "tok");
  EXPECT_EQ(t.encode("hello"), (std::vector<int32_t>{259}));
  // In memory (keel tokenize --tokenizer x.gguf) as from the files.
  const data::Tokenizer in_memory = checkpoint::gguf_tokenizer(dir / "m.gguf");
  EXPECT_EQ(in_memory.encode("hello world<|eot|>"), t.encode("hello world<|eot|>"));
  EXPECT_EQ(read_file(dir / "tok/chat_template.jinja"), *v.chat_template);
  GgufMetadata bare = llama_metadata();
  formats::write_gguf(dir / "bare.gguf", bare, llama_tensors(true));
  expect_keel_error([&] { checkpoint::write_gguf_tokenizer_dir(dir / "bare.gguf", dir / "t2", nullptr); },
                    {"bare.gguf", "tokenizer.ggml.model", "missing"});
}

}  // namespace
}  // namespace keel
