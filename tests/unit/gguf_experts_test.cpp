// A mixture of experts in GGUF (checkpoint/gguf_experts.h, model/gguf_names.h): the stacks the
// converter makes of a layer's experts, their order and place, from both checkpoint layouts, and
// the models llama.cpp would not run as trained. That whole files equal the converter's is
// tests/reference/gguf_reference.py's (its qwen3_moe and mixtral cases).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "keel/checkpoint/gguf_experts.h"
#include "keel/model/gguf_names.h"
#include "test_support.h"

namespace keel::checkpoint {
namespace {

using formats::GgmlType;
using testing::expect_keel_error;

// Two experts of width 3 on a hidden size of 2, one sparse layer.
model::ModelConfig moe_config(model::Family family) {
  model::ModelConfig c;
  c.family = family;
  c.architecture = "X";
  c.num_layers = 1;
  c.hidden_size = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.moe.experts = 2;
  c.moe.experts_per_token = 1;
  c.moe.intermediate_size = 3;
  c.moe.norm_topk_prob = true;
  c.moe.sparse_layers = {true};
  return c;
}

// A tensor whose element i is base + i.
HfTensorSource counting(std::string name, std::vector<int64_t> shape, float base) {
  return {std::move(name), std::move(shape), [base](int64_t begin, int64_t count, float* dst) {
            for (int64_t i = 0; i < count; ++i) dst[i] = base + float(begin + i);
          }};
}

std::vector<float> values(const HfTensorSource& t) {
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  std::vector<float> out(static_cast<size_t>(n));
  t.read(0, n, out.data());
  return out;
}

// The same values read `piece` at a time, as the writer reads them: pieces that start and end
// inside an expert.
std::vector<float> values_in_pieces(const HfTensorSource& t, int64_t piece) {
  std::vector<float> out = values(t);
  std::fill(out.begin(), out.end(), -1.0f);
  for (int64_t begin = 0; begin < int64_t(out.size()); begin += piece)
    t.read(begin, std::min<int64_t>(piece, int64_t(out.size()) - begin), out.data() + begin);
  return out;
}

std::vector<std::string> names(const std::vector<HfTensorSource>& tensors) {
  std::vector<std::string> out;
  for (const auto& t : tensors) out.push_back(t.name);
  return out;
}

// Qwen3-MoE's published names, each expert's gate at 100 + 10e, up 200 + 10e, down 300 + 10e.
std::vector<HfTensorSource> qwen_per_expert() {
  std::vector<HfTensorSource> t;
  t.push_back(counting("model.layers.0.self_attn.q_proj.weight", {2, 2}, 0));
  t.push_back(counting("model.layers.0.mlp.gate.weight", {2, 2}, 0));
  t.push_back(counting("model.layers.0.input_layernorm.weight", {2}, 0));
  for (int e = 1; e >= 0; --e) {
    const std::string pre = "model.layers.0.mlp.experts." + std::to_string(e) + ".";
    t.push_back(counting(pre + "up_proj.weight", {3, 2}, float(200 + 10 * e)));
    t.push_back(counting(pre + "down_proj.weight", {2, 3}, float(300 + 10 * e)));
    t.push_back(counting(pre + "gate_proj.weight", {3, 2}, float(100 + 10 * e)));
  }
  return t;
}

TEST(GgufExperts, LayersExpertsAreStackedWhereTheySortInTheConvertersOrder) {
  const auto c = moe_config(model::Family::Qwen3Moe);
  const auto out = gguf_converter_order(c, qwen_per_expert());
  EXPECT_EQ(names(out), (std::vector<std::string>{"model.layers.0.input_layernorm.weight",
                                                  "model.layers.0.mlp.experts.down_proj.weight",
                                                  "model.layers.0.mlp.experts.gate_proj.weight",
                                                  "model.layers.0.mlp.experts.up_proj.weight",
                                                  "model.layers.0.mlp.gate.weight",
                                                  "model.layers.0.self_attn.q_proj.weight"}));
  EXPECT_EQ(out[1].shape, (std::vector<int64_t>{2, 2, 3}));
  EXPECT_EQ(out[2].shape, (std::vector<int64_t>{2, 3, 2}));
  // Expert 0's six values, then expert 1's.
  EXPECT_EQ(values(out[2]), (std::vector<float>{100, 101, 102, 103, 104, 105, 110, 111, 112, 113, 114, 115}));
  EXPECT_EQ(values(out[1]), (std::vector<float>{300, 301, 302, 303, 304, 305, 310, 311, 312, 313, 314, 315}));
  // Read as the writer reads, in pieces that start and end inside an expert: the same values.
  for (const int64_t piece : {1, 4, 5, 7, 12}) EXPECT_EQ(values_in_pieces(out[2], piece), values(out[2])) << piece;
  EXPECT_EQ(model::gguf_tensor_name(c, out[1].name), "blk.0.ffn_down_exps.weight");
  EXPECT_EQ(model::gguf_tensor_name(c, out[2].name), "blk.0.ffn_gate_exps.weight");
  EXPECT_EQ(model::gguf_tensor_name(c, out[3].name), "blk.0.ffn_up_exps.weight");
  EXPECT_EQ(model::gguf_tensor_name(c, out[4].name), "blk.0.ffn_gate_inp.weight");
  // A dense model's tensors only sort.
  auto dense = c;
  dense.moe = {};
  std::vector<HfTensorSource> two;
  two.push_back(counting("b", {1}, 0));
  two.push_back(counting("a", {1}, 0));
  EXPECT_EQ(names(gguf_converter_order(dense, std::move(two))), (std::vector<std::string>{"a", "b"}));
}

// transformers 5's fused layout gives the same stacks, in the same place.
TEST(GgufExperts, FusedLayoutGivesThePublishedLayoutsStacks) {
  const auto c = moe_config(model::Family::Qwen3Moe);
  std::vector<HfTensorSource> fused;
  fused.push_back(counting("model.layers.0.mlp.gate.weight", {2, 2}, 0));
  fused.push_back(counting("model.layers.0.input_layernorm.weight", {2}, 0));
  // gate_up [2, 6, 2]: expert e's gate rows then its up rows, values as qwen_per_expert's.
  fused.push_back({"model.layers.0.mlp.experts.gate_up_proj", {2, 6, 2}, [](int64_t begin, int64_t count, float* dst) {
                     for (int64_t k = begin; k < begin + count; ++k) {
                       const int64_t e = k / 12, i = k % 12;  // expert e's gate (i < 6), then its up
                       dst[k - begin] = float(i < 6 ? 100 + 10 * e + i : 200 + 10 * e + i - 6);
                     }
                   }});
  fused.push_back(counting("model.layers.0.mlp.experts.down_proj", {2, 2, 3}, 300));
  const auto out = gguf_converter_order(c, std::move(fused));
  const auto published = gguf_converter_order(c, qwen_per_expert());
  ASSERT_EQ(names(out), (std::vector<std::string>{"model.layers.0.input_layernorm.weight",
                                                  "model.layers.0.mlp.experts.down_proj.weight",
                                                  "model.layers.0.mlp.experts.gate_proj.weight",
                                                  "model.layers.0.mlp.experts.up_proj.weight",
                                                  "model.layers.0.mlp.gate.weight"}));
  for (size_t i = 2; i < 4; ++i) {
    EXPECT_EQ(out[i].shape, published[i].shape);
    EXPECT_EQ(values(out[i]), values(published[i])) << out[i].name;
    EXPECT_EQ(values_in_pieces(out[i], 5), values(published[i])) << out[i].name;
  }
  EXPECT_EQ(values(out[1])[6], 306.0f);  // the fused down is the stack as it is
}

// Mixtral: block_sparse_moe's w1, w2, w3 stacked as LlamaModel merges them (gate, down, up), before
// the router; transformers 5's fused names (mlp.gate, mlp.experts.*) land in the same places.
TEST(GgufExperts, MixtralsExpertsFollowLlamaModelsOrder) {
  const auto c = moe_config(model::Family::Mixtral);
  std::vector<HfTensorSource> t;
  t.push_back(counting("model.layers.0.block_sparse_moe.gate.weight", {2, 2}, 0));
  t.push_back(counting("model.layers.0.input_layernorm.weight", {2}, 0));
  for (int e = 0; e < 2; ++e) {
    const std::string pre = "model.layers.0.block_sparse_moe.experts." + std::to_string(e) + ".";
    t.push_back(counting(pre + "w1.weight", {3, 2}, 100));
    t.push_back(counting(pre + "w3.weight", {3, 2}, 200));
    t.push_back(counting(pre + "w2.weight", {2, 3}, 300));
  }
  const std::vector<std::string> expected = {"model.layers.0.mlp.experts.gate_proj.weight",
                                             "model.layers.0.mlp.experts.down_proj.weight",
                                             "model.layers.0.mlp.experts.up_proj.weight",
                                             "model.layers.0.block_sparse_moe.gate.weight",
                                             "model.layers.0.input_layernorm.weight"};
  const auto out = gguf_converter_order(c, std::move(t));
  EXPECT_EQ(names(out), expected);
  EXPECT_EQ(values(out[2])[0], 200.0f);
  std::vector<HfTensorSource> fused;
  fused.push_back(counting("model.layers.0.input_layernorm.weight", {2}, 0));
  fused.push_back(counting("model.layers.0.mlp.gate.weight", {2, 2}, 0));
  fused.push_back(counting("model.layers.0.mlp.experts.gate_up_proj", {2, 6, 2}, 0));
  fused.push_back(counting("model.layers.0.mlp.experts.down_proj", {2, 2, 3}, 0));
  EXPECT_EQ(names(gguf_converter_order(c, std::move(fused))), expected);
  EXPECT_EQ(model::gguf_tensor_name(c, expected[3]), "blk.0.ffn_gate_inp.weight");
  EXPECT_EQ(model::gguf_permuted_heads(c, "model.layers.0.self_attn.q_proj.weight"), 2);  // LlamaModel's permute
}

TEST(GgufExperts, MissingOrMisshapenExpertsAreErrorsNamingThem) {
  const auto c = moe_config(model::Family::Qwen3Moe);
  auto missing = qwen_per_expert();
  missing.erase(missing.begin() + 3);  // expert 1's up_proj
  expect_keel_error([&] { gguf_converter_order(c, missing); },
                    {"model.layers.0", "expert 1's up_proj is missing", "2 experts"});
  auto misshapen = qwen_per_expert();
  misshapen[4].shape = {3, 3};
  expect_keel_error([&] { gguf_converter_order(c, misshapen); },
                    {"model.layers.0.mlp.experts.1.down_proj.weight", "expected shape [2, 3]", "found [3, 3]"});
  auto extra = qwen_per_expert();
  extra.push_back(counting("model.layers.0.mlp.experts.2.up_proj.weight", {3, 2}, 0));
  expect_keel_error([&] { gguf_converter_order(c, extra); }, {"experts.2.up_proj", "expert 2 of a layer of 2"});
  auto both = qwen_per_expert();
  both.push_back(counting("model.layers.0.mlp.experts.down_proj", {2, 2, 3}, 0));
  expect_keel_error([&] { gguf_converter_order(c, both); }, {"model.layers.0", "both fused", "one layout"});
  std::vector<HfTensorSource> none;
  none.push_back(counting("model.layers.0.mlp.gate.weight", {2, 2}, 0));
  expect_keel_error([&] { gguf_converter_order(c, std::move(none)); }, {"model.layers.0", "no experts"});
}

TEST(GgufExperts, ArchitecturesNamesAndTypes) {
  EXPECT_EQ(model::gguf_architecture(moe_config(model::Family::Qwen3Moe)), "qwen3moe");
  EXPECT_EQ(model::gguf_architecture(moe_config(model::Family::Mixtral)), "llama");
  EXPECT_EQ(model::gguf_architecture(moe_config(model::Family::Glm4Moe)), "glm4moe");
  // The router stays F32 whatever the outtype, as the converter keeps FFN_GATE_INP; the stacks follow it.
  EXPECT_EQ(model::gguf_tensor_type("blk.0.ffn_gate_inp.weight", {8, 64}, GgmlType::Q8_0), GgmlType::F32);
  EXPECT_EQ(model::gguf_tensor_type("blk.0.ffn_gate_inp.weight", {8, 64}, GgmlType::F16), GgmlType::F32);
  EXPECT_EQ(model::gguf_tensor_type("blk.0.ffn_down_exps.weight", {8, 64, 32}, GgmlType::Q8_0), GgmlType::Q8_0);
  const auto c = moe_config(model::Family::Qwen3Moe);
  expect_keel_error([&] { model::gguf_tensor_name(c, "model.layers.0.mlp.experts.0.up_proj.weight"); },
                    {"no name"});
}

// gguf-py's GLM4_MOE list: the norm before the MLP is ATTN_POST_NORM (Qwen3-MoE's is FFN_NORM), the
// router's correction bias FFN_EXP_PROBS_B (a vector: F32), the shared experts *_shexp.
TEST(GgufExperts, Glm45TensorsHaveTheConvertersNames) {
  const auto glm = moe_config(model::Family::Glm4Moe), qwen = moe_config(model::Family::Qwen3Moe);
  EXPECT_EQ(model::gguf_tensor_name(glm, "model.layers.1.post_attention_layernorm.weight"),
            "blk.1.post_attention_norm.weight");
  EXPECT_EQ(model::gguf_tensor_name(qwen, "model.layers.1.post_attention_layernorm.weight"), "blk.1.ffn_norm.weight");
  EXPECT_EQ(model::gguf_tensor_name(glm, "model.layers.2.mlp.gate.e_score_correction_bias"), "blk.2.exp_probs_b.bias");
  EXPECT_EQ(model::gguf_tensor_type("blk.2.exp_probs_b.bias", {8}, GgmlType::Q8_0), GgmlType::F32);
  EXPECT_EQ(model::gguf_tensor_name(glm, "model.layers.1.mlp.shared_experts.gate_proj.weight"),
            "blk.1.ffn_gate_shexp.weight");
  EXPECT_EQ(model::gguf_tensor_name(glm, "model.layers.1.mlp.shared_experts.up_proj.weight"),
            "blk.1.ffn_up_shexp.weight");
  EXPECT_EQ(model::gguf_tensor_name(glm, "model.layers.1.mlp.shared_experts.down_proj.weight"),
            "blk.1.ffn_down_shexp.weight");
  EXPECT_EQ(model::gguf_tensor_name(glm, "model.layers.0.mlp.gate_proj.weight"), "blk.0.ffn_gate.weight");
  EXPECT_EQ(model::gguf_permuted_heads(glm, "model.layers.0.self_attn.q_proj.weight"), 0);  // rotate_half: none
  // Shared experts are GLM-4.5's alone in gguf-py's lists.
  expect_keel_error([&] { model::gguf_tensor_name(qwen, "model.layers.1.mlp.shared_experts.up_proj.weight"); },
                    {"no name"});
}

// llama.cpp's qwen3moe and llama want experts in every layer and renormalise the top-k weights;
// its glm4moe reads GLM-4.5's leading dense layers and renormalisation from the file.
TEST(GgufExperts, ModelsLlamaCppWouldRunOtherwiseAreRefused) {
  auto c = moe_config(model::Family::Qwen3Moe);
  c.num_layers = 2;
  c.moe.sparse_layers = {true, true};
  EXPECT_TRUE(check_llama_cpp_runs_as_trained(c, "qwen3moe").empty());
  auto dense_layer = c;
  dense_layer.moe.sparse_layers = {true, false};
  expect_keel_error([&] { check_llama_cpp_runs_as_trained(dense_layer, "qwen3moe"); },
                    {"layer 1", "dense MLP", "mlp_only_layers", "could not load", "--format hf"});
  auto unnormalised = c;
  unnormalised.moe.norm_topk_prob = false;
  expect_keel_error([&] { check_llama_cpp_runs_as_trained(unnormalised, "qwen3moe"); },
                    {"norm_topk_prob false", "qwen3moe always does", "would not run the model as trained"});
  auto mixtral = moe_config(model::Family::Mixtral);
  mixtral.sliding_window = 4096;  // a note, as Mistral's
  EXPECT_EQ(check_llama_cpp_runs_as_trained(mixtral, "llama").size(), 1u);
  auto glm = moe_config(model::Family::Glm4Moe);
  glm.num_layers = 2;
  glm.moe.sparse_layers = {false, true};
  glm.moe.norm_topk_prob = false;
  EXPECT_TRUE(check_llama_cpp_runs_as_trained(glm, "glm4moe").empty());
}

}  // namespace
}  // namespace keel::checkpoint
