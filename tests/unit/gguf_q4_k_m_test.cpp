// --outtype q4_k_m's per-tensor types (model/gguf_q4_k_m.h): llama_tensor_get_type's choices for
// LLAMA_FTYPE_MOSTLY_Q4_K_M, on the tensor lists of keel's families. reference.gguf_q4_k_m checks
// the files against llama_model_quantize itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "keel/model/gguf_names.h"
#include "keel/model/gguf_q4_k_m.h"
#include "test_support.h"

namespace keel::model {
namespace {

using formats::GgmlType;
using testing::expect_keel_error;

struct Tensors {
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
};

// A Llama-style model's GGUF tensors (rows, row length), in llama_quantize_order.
Tensors llama_tensors(int64_t layers, int64_t hidden, int64_t ffn, bool tied) {
  Tensors t;
  auto add = [&](std::string name, std::vector<int64_t> shape) {
    t.names.push_back(std::move(name));
    t.shapes.push_back(std::move(shape));
  };
  if (!tied) add("output.weight", {1000, hidden});
  add("output_norm.weight", {hidden});
  add("token_embd.weight", {1000, hidden});
  for (int64_t i = 0; i < layers; ++i) {
    const std::string b = "blk." + std::to_string(i) + ".";
    add(b + "attn_k.weight", {hidden / 2, hidden});
    add(b + "attn_norm.weight", {hidden});
    add(b + "attn_output.weight", {hidden, hidden});
    add(b + "attn_q.weight", {hidden, hidden});
    add(b + "attn_v.weight", {hidden / 2, hidden});
    add(b + "ffn_down.weight", {hidden, ffn});
    add(b + "ffn_gate.weight", {ffn, hidden});
    add(b + "ffn_norm.weight", {hidden});
    add(b + "ffn_up.weight", {ffn, hidden});
  }
  return t;
}

ModelConfig config(int64_t layers, int64_t heads = 4, int64_t kv_heads = 2) {
  ModelConfig c;
  c.num_layers = layers;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  return c;
}

GgmlType type_of(const Tensors& t, const std::vector<Q4KMChoice>& choices, const std::string& name) {
  const auto at = std::find(t.names.begin(), t.names.end(), name);
  EXPECT_NE(at, t.names.end()) << name;
  return choices[size_t(at - t.names.begin())].type;
}

TEST(GgufQ4KM, OuttypeNameAndFileType) {
  EXPECT_EQ(gguf_outtype_from_name("q4_k_m"), GgmlType::Q4_K);
  EXPECT_EQ(gguf_outtype_name(GgmlType::Q4_K), "q4_k_m");
  EXPECT_EQ(gguf_outtype_name(GgmlType::Q8_0), "q8_0");
  EXPECT_EQ(gguf_file_type(GgmlType::Q4_K), 15u);  // LLAMA_FTYPE_MOSTLY_Q4_K_M
  expect_keel_error([] { gguf_outtype_from_name("q4_k_s"); }, {"q4_k_m", "q4_k_s"});
}

// weight_name_comparer: outside layers first, then by layer number (10 after 9), then by name.
TEST(GgufQ4KM, LlamaQuantizeOrder) {
  std::vector<std::string> names = {"blk.10.attn_q.weight", "token_embd.weight", "blk.9.ffn_up.weight",
                                    "blk.9.attn_v.weight", "output.weight"};
  std::sort(names.begin(), names.end(), llama_quantize_order);
  EXPECT_EQ(names, (std::vector<std::string>{"output.weight", "token_embd.weight", "blk.9.attn_v.weight",
                                             "blk.9.ffn_up.weight", "blk.10.attn_q.weight"}));
}

// 16 layers: use_more_bits picks 0, 1 (the first eighth), 4, 7, 10, 13 (every third after it),
// 14, 15 (the last eighth): attn_v and ffn_down there Q6_K, the output Q6_K, everything else Q4_K.
TEST(GgufQ4KM, MoreBitsForAttnVAndFfnDownInTheLayersLlamaCppPicks) {
  const Tensors t = llama_tensors(16, 256, 512, false);
  const auto choices = q4_k_m_tensor_types(config(16), "llama", t.names, t.shapes);
  const std::vector<int> more = {0, 1, 4, 7, 10, 13, 14, 15};
  for (int i = 0; i < 16; ++i) {
    const bool picked = std::find(more.begin(), more.end(), i) != more.end();
    const std::string b = "blk." + std::to_string(i) + ".";
    EXPECT_EQ(type_of(t, choices, b + "attn_v.weight"), picked ? GgmlType::Q6_K : GgmlType::Q4_K) << i;
    EXPECT_EQ(type_of(t, choices, b + "ffn_down.weight"), picked ? GgmlType::Q6_K : GgmlType::Q4_K) << i;
    EXPECT_EQ(type_of(t, choices, b + "attn_q.weight"), GgmlType::Q4_K) << i;
    EXPECT_EQ(type_of(t, choices, b + "ffn_up.weight"), GgmlType::Q4_K) << i;
    EXPECT_EQ(type_of(t, choices, b + "attn_norm.weight"), GgmlType::F32) << i;
  }
  EXPECT_EQ(type_of(t, choices, "output.weight"), GgmlType::Q6_K);
  EXPECT_EQ(type_of(t, choices, "token_embd.weight"), GgmlType::Q4_K);  // untied: the default type
  EXPECT_EQ(type_of(t, choices, "output_norm.weight"), GgmlType::F32);
}

// Tied embeddings: token_embd is the output (Q6_K, or Q8_0 when its rows are not whole
// super-blocks). Rows of 96: Q4_K -> Q5_0, Q6_K -> Q8_0; rows of 80: F16.
TEST(GgufQ4KM, TiedEmbeddingAndFallbacks) {
  const Tensors t = llama_tensors(8, 256, 96, true);
  const auto choices = q4_k_m_tensor_types(config(8), "qwen3", t.names, t.shapes);
  EXPECT_EQ(type_of(t, choices, "token_embd.weight"), GgmlType::Q6_K);
  EXPECT_EQ(type_of(t, choices, "blk.0.ffn_down.weight"), GgmlType::Q8_0);
  EXPECT_EQ(type_of(t, choices, "blk.1.ffn_down.weight"), GgmlType::Q5_0);
  EXPECT_EQ(type_of(t, choices, "blk.1.ffn_up.weight"), GgmlType::Q4_K);

  const Tensors narrow = llama_tensors(8, 80, 96, true);
  const auto n = q4_k_m_tensor_types(config(8), "qwen2", narrow.names, narrow.shapes);
  EXPECT_EQ(type_of(narrow, n, "token_embd.weight"), GgmlType::F16);  // Q8_0 needs 32-value rows
  EXPECT_EQ(type_of(narrow, n, "blk.1.attn_q.weight"), GgmlType::F16);
  EXPECT_EQ(type_of(narrow, n, "blk.1.ffn_down.weight"), GgmlType::Q5_0);
  const Tensors small = llama_tensors(8, 96, 512, true);
  const auto s = q4_k_m_tensor_types(config(8), "qwen2", small.names, small.shapes);
  EXPECT_EQ(type_of(small, s, "token_embd.weight"), GgmlType::Q8_0);
}

// What llama.cpp would quantize with a type keel does not write is refused by name.
TEST(GgufQ4KM, Refusals) {
  const Tensors t = llama_tensors(80, 256, 512, false);
  expect_keel_error([&] { q4_k_m_tensor_types(config(80, 8, 2), "llama", t.names, t.shapes); },
                    {"70B", "Q5_K", "llama-quantize"});
  expect_keel_error([&] { q4_k_m_tensor_types(config(80), "qwen2", t.names, t.shapes); }, {"70B"});
  (void)q4_k_m_tensor_types(config(80, 8, 8), "llama", t.names, t.shapes);  // 65B-type: no special case
  Tensors fused = llama_tensors(2, 256, 512, false);
  fused.names[3] = "blk.0.attn_qkv.weight";
  expect_keel_error([&] { q4_k_m_tensor_types(config(2), "llama", fused.names, fused.shapes); },
                    {"blk.0.attn_qkv.weight", "Q5_K"});
}

}  // namespace
}  // namespace keel::model
