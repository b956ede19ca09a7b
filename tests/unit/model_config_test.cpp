// config.json parsing for the four supported formats (with their defaults and their error
// messages), parameter counts against published model sizes, and export round trips.
#include "keel/model/config.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <functional>
#include <map>

#include "keel/core/error.h"
#include "keel/core/file_io.h"

namespace keel::model {
namespace {

void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "expected keel::Error";
  } catch (const Error& e) {
    for (const auto& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

ModelConfig parse(const std::string& json) { return parse_model_config(json, "config.json"); }

void expect_parse_error(const std::string& json, std::initializer_list<std::string> parts) {
  expect_error([&] { parse(json); }, parts);
}

// Every field except the original text.
void expect_same_model(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.family, b.family);
  EXPECT_EQ(a.architecture, b.architecture);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.num_heads, b.num_heads);
  EXPECT_EQ(a.num_kv_heads, b.num_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.rotary_dim, b.rotary_dim);
  EXPECT_EQ(a.rope_interleaved, b.rope_interleaved);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.qkv_bias, b.qkv_bias);
  EXPECT_EQ(a.qk_norm, b.qk_norm);
  EXPECT_EQ(a.sliding_window, b.sliding_window);
  EXPECT_EQ(a.sliding_layers, b.sliding_layers);
  EXPECT_EQ(a.norm_weight_offset, b.norm_weight_offset);
  EXPECT_EQ(a.mlp_activation, b.mlp_activation);
  EXPECT_EQ(a.scale_embeddings, b.scale_embeddings);
  EXPECT_EQ(a.sandwich_norms, b.sandwich_norms);
  EXPECT_EQ(a.query_pre_attn_scalar, b.query_pre_attn_scalar);
  EXPECT_EQ(a.attn_logit_softcap, b.attn_logit_softcap);
  EXPECT_EQ(a.final_logit_softcap, b.final_logit_softcap);
  EXPECT_EQ(a.rope_local_theta, b.rope_local_theta);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.torch_dtype, b.torch_dtype);
  EXPECT_EQ(a.eos_token_ids, b.eos_token_ids);
  EXPECT_EQ(a.bos_token_id, b.bos_token_id);
  EXPECT_EQ(a.moe.experts, b.moe.experts);
  EXPECT_EQ(a.moe.experts_per_token, b.moe.experts_per_token);
  EXPECT_EQ(a.moe.intermediate_size, b.moe.intermediate_size);
  EXPECT_EQ(a.moe.norm_topk_prob, b.moe.norm_topk_prob);
  EXPECT_EQ(a.moe.sparse_layers, b.moe.sparse_layers);
  EXPECT_EQ(a.moe.router_aux_loss_coef, b.moe.router_aux_loss_coef);
  EXPECT_EQ(a.moe.output_router_logits, b.moe.output_router_logits);
  EXPECT_EQ(a.moe.sigmoid_router, b.moe.sigmoid_router);
  EXPECT_EQ(a.moe.groups, b.moe.groups);
  EXPECT_EQ(a.moe.topk_groups, b.moe.topk_groups);
  EXPECT_EQ(a.moe.routed_scaling_factor, b.moe.routed_scaling_factor);
  EXPECT_EQ(a.moe.shared_intermediate_size, b.moe.shared_intermediate_size);
  EXPECT_EQ(a.nextn_predict_layers, b.nextn_predict_layers);
  EXPECT_EQ(a.pad_token_id, b.pad_token_id);
  EXPECT_EQ(a.initializer_range, b.initializer_range);
}

// meta-llama/Llama-2-7b-hf
const char* kLlama2_7b = R"({
  "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
  "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 4096,
  "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
  "pad_token_id": null, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null, "tie_word_embeddings": false,
  "torch_dtype": "float16", "transformers_version": "4.31.0.dev0", "use_cache": true, "vocab_size": 32000
})";

// Qwen/Qwen2-0.5B
const char* kQwen2_05b = R"({
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
  "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
  "max_position_embeddings": 131072, "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
  "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "sliding_window": 131072, "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.40.1",
  "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
})";

// THUDM/glm-4-9b-hf (transformers-native)
const char* kGlm4_9b_hf = R"({
  "architectures": ["GlmForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
  "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
  "initializer_range": 0.02, "intermediate_size": 13696, "max_position_embeddings": 131072, "model_type": "glm",
  "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 2, "pad_token_id": 151329,
  "partial_rotary_factor": 0.5, "rms_norm_eps": 1.5625e-07, "rope_theta": 10000.0, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "transformers_version": "4.46.0.dev0", "use_cache": true, "vocab_size": 151552
})";

// THUDM/glm-4-9b (original remote-code format)
const char* kGlm4_9b = R"({
  "_name_or_path": "THUDM/glm-4-9b", "model_type": "chatglm", "architectures": ["ChatGLMModel"],
  "auto_map": {"AutoConfig": "configuration_chatglm.ChatGLMConfig",
               "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration"},
  "add_bias_linear": false, "add_qkv_bias": true, "apply_query_key_layer_scaling": true,
  "apply_residual_connection_post_layernorm": false, "attention_dropout": 0.0, "attention_softmax_in_fp32": true,
  "bias_dropout_fusion": true, "ffn_hidden_size": 13696, "fp32_residual_connection": false, "hidden_dropout": 0.0,
  "hidden_size": 4096, "kv_channels": 128, "layernorm_epsilon": 1.5625e-07, "multi_query_attention": true,
  "multi_query_group_num": 2, "num_attention_heads": 32, "num_layers": 40, "original_rope": true,
  "padded_vocab_size": 151552, "post_layer_norm": true, "rmsnorm": true, "seq_length": 8192, "use_cache": true,
  "torch_dtype": "bfloat16", "transformers_version": "4.42.4", "tie_word_embeddings": false,
  "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329
})";

// Qwen/Qwen3-0.6B
const char* kQwen3_06b = R"({
  "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
  "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
  "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
  "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": true,
  "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
  "vocab_size": 151936
})";

// mistralai/Mistral-7B-v0.1
const char* kMistral_7b = R"({
  "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
  "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
  "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": true, "vocab_size": 32000
})";

// Qwen/Qwen3-30B-A3B
const char* kQwen3_30b_a3b = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
  "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
  "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
  "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
  "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": false, "rms_norm_eps": 1e-06,
  "rope_scaling": null, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": null,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": true,
  "use_sliding_window": false, "vocab_size": 151936
})";

TEST(ModelConfig, Qwen3MoeAsQwen3MoeConfigReadsIt) {
  ModelConfig c = parse(kQwen3_30b_a3b);
  EXPECT_EQ(c.family, Family::Qwen3Moe);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.moe.experts, 128);
  EXPECT_EQ(c.moe.experts_per_token, 8);
  EXPECT_EQ(c.moe.intermediate_size, 768);
  EXPECT_TRUE(c.moe.norm_topk_prob);
  EXPECT_EQ(c.moe.sparse_layers, std::vector<bool>(48, true));
  EXPECT_EQ(c.aux_loss_weight(), 0.0);  // output_router_logits false: the loss is not added
  EXPECT_EQ(c.total_parameters(), 30532122624);  // transformers' Qwen3MoeForCausalLM of this config
  // decoder_sparse_step and mlp_only_layers as Qwen3MoeDecoderLayer reads them (sparse where
  // (layer + 1) % step == 0 and not listed): 4 layers, step 2, layer 3 listed -> only layer 1.
  std::string mixed = kQwen3_30b_a3b;
  mixed.replace(mixed.find(R"("decoder_sparse_step": 1)"), 24, R"("decoder_sparse_step": 2)");
  mixed.replace(mixed.find(R"("mlp_only_layers": [])"), 21, R"("mlp_only_layers": [3])");
  mixed.replace(mixed.find(R"("num_hidden_layers": 48)"), 23, R"("num_hidden_layers": 4)");
  mixed.replace(mixed.find(R"("output_router_logits": false)"), 29, R"("output_router_logits": true)");
  ModelConfig m = parse(mixed);
  EXPECT_EQ(m.moe.sparse_layers, (std::vector<bool>{false, true, false, false}));
  EXPECT_EQ(m.aux_loss_weight(), 0.001);
  // The defaults of Qwen3MoeConfig where the keys are absent.
  std::string bare = kQwen3_30b_a3b;
  for (const char* key : {R"("num_experts": 128, )", R"("num_experts_per_tok": 8,)", R"("norm_topk_prob": true, )"}) {
    bare.replace(bare.find(key), std::string(key).size(), "");
  }
  ModelConfig d = parse(bare);
  EXPECT_EQ(d.moe.experts, 128);
  EXPECT_EQ(d.moe.experts_per_token, 8);
  EXPECT_FALSE(d.moe.norm_topk_prob);
  auto with = [&](const char* from, const char* to) {
    std::string s = kQwen3_30b_a3b;
    return s.replace(s.find(from), std::string(from).size(), to);
  };
  expect_parse_error(with(R"("num_experts_per_tok": 8)", R"("num_experts_per_tok": 129)"),
                     {"num_experts_per_tok", "from 1 to num_experts (128)", "129"});
  expect_parse_error(with(R"("mlp_only_layers": [])", R"("mlp_only_layers": [48])"),
                     {"'mlp_only_layers'", "layer indices"});
  expect_parse_error(with(R"("router_aux_loss_coef": 0.001)", R"("router_aux_loss_coef": -1)"),
                     {"'router_aux_loss_coef'", "non-negative"});
  expect_parse_error(with(R"("use_sliding_window": false)", R"("use_sliding_window": true)"),
                     {"'use_sliding_window'", "Qwen3MoeForCausalLM"});
  // transformers 5 saves num_experts as num_local_experts (Qwen3MoeConfig.attribute_map): a model
  // it saved reads back with its own number of experts, not the default 128.
  EXPECT_EQ(parse(with(R"("num_experts": 128)", R"("num_local_experts": 16)")).moe.experts, 16);
  EXPECT_EQ(parse(with(R"("num_experts": 128)", R"("num_experts": 128, "num_local_experts": 128)")).moe.experts, 128);
  expect_parse_error(with(R"("num_experts": 128)", R"("num_experts": 128, "num_local_experts": 16)"),
                     {"'num_experts' (128)", "'num_local_experts' (16)", "differ"});
}

// mistralai/Mixtral-8x7B-v0.1
const char* kMixtral_8x7b = R"({
  "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
  "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
  "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": false,
  "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "sliding_window": null,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
  "use_cache": true, "vocab_size": 32000
})";

TEST(ModelConfig, MixtralAsMixtralConfigReadsIt) {
  ModelConfig c = parse(kMixtral_8x7b);
  EXPECT_EQ(c.family, Family::Mixtral);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.moe.experts, 8);
  EXPECT_EQ(c.moe.experts_per_token, 2);
  EXPECT_EQ(c.moe.intermediate_size, 14336);  // intermediate_size is the experts' width
  EXPECT_TRUE(c.moe.norm_topk_prob);           // MixtralTopKRouter always renormalises
  EXPECT_EQ(c.moe.sparse_layers, std::vector<bool>(32, true));
  EXPECT_EQ(c.sliding_window, 0);  // null: full attention
  EXPECT_EQ(c.total_parameters(), 46702792704);  // transformers' MixtralForCausalLM of this config
  auto with = [&](const char* from, const char* to) {
    std::string s = kMixtral_8x7b;
    return s.replace(s.find(from), std::string(from).size(), to);
  };
  ModelConfig w = parse(with(R"("sliding_window": null)", R"("sliding_window": 4096)"));
  EXPECT_EQ(w.window_of(31), 4096);
  // Absent keys: MixtralConfig's defaults (no window, rope_theta 1e6).
  EXPECT_EQ(parse(with(R"("sliding_window": null,)", "")).sliding_window, 0);
  std::string no_theta = kMixtral_8x7b;
  no_theta.replace(no_theta.find(R"("rope_theta": 1e6, )"), 19, "");
  EXPECT_EQ(parse(no_theta).rope_theta, 1e6);
  expect_parse_error(with(R"("use_cache": true)", R"("use_cache": true, "router_jitter_noise": 0.1)"),
                     {"'router_jitter_noise'", "expected 0"});
  // MixtralConfig reads num_experts too (its attribute_map).
  EXPECT_EQ(parse(with(R"("num_local_experts": 8)", R"("num_experts": 4)")).moe.experts, 4);
}

// zai-org/GLM-4.5-Air (recipes/glm-4.5-air-qlora.toml's tests/data/glm-4.5-air/config.json)
const char* kGlm45Air = R"({
  "architectures": ["Glm4MoeForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
  "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
  "hidden_size": 4096, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 10944,
  "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1408,
  "norm_topk_prob": true, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 128,
  "n_shared_experts": 1, "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
  "num_hidden_layers": 46, "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": null, "rope_theta": 1000000, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.54.0", "use_cache": true, "use_qk_norm": false, "vocab_size": 151552
})";

TEST(ModelConfig, Glm45AirAsGlm4MoeConfigReadsIt) {
  ModelConfig c = parse(kGlm45Air);
  EXPECT_EQ(c.family, Family::Glm4Moe);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.rotary_dim, 64);         // head_dim x partial_rotary_factor
  EXPECT_FALSE(c.rope_interleaved);    // rotate_half's pairs, unlike GLM-4's
  EXPECT_TRUE(c.qkv_bias);             // attention_bias: q/k/v only
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.moe.experts, 128);
  EXPECT_EQ(c.moe.experts_per_token, 8);
  EXPECT_EQ(c.moe.intermediate_size, 1408);
  EXPECT_EQ(c.moe.shared_intermediate_size, 1408);
  EXPECT_TRUE(c.moe.sigmoid_router);
  EXPECT_TRUE(c.moe.norm_topk_prob);
  EXPECT_EQ(c.moe.groups, 1);
  EXPECT_EQ(c.nextn_predict_layers, 1);
  EXPECT_FALSE(c.sparse_layer(0));
  EXPECT_TRUE(c.sparse_layer(1));
  EXPECT_TRUE(c.sparse_layer(45));
  EXPECT_FALSE(c.has_aux_loss());
  EXPECT_EQ(c.mlp_width(0), 10944);
  EXPECT_EQ(c.mlp_width(1), 1408);
  // transformers' Glm4MoeForCausalLM of this config: sum of its parameters' and
  // e_score_correction_bias's numel (the MTP layer is not part of it).
  EXPECT_EQ(c.total_parameters(), 106852245504 + 45 * 128);
  auto with = [&](const char* from, const char* to) {
    std::string s = kGlm45Air;
    return s.replace(s.find(from), std::string(from).size(), to);
  };
  ModelConfig g = parse(with(R"("n_group": 1, "topk_group": 1)", R"("n_group": 8, "topk_group": 4)"));
  EXPECT_EQ(g.moe.groups, 8);
  EXPECT_EQ(g.moe.topk_groups, 4);
  EXPECT_EQ(parse(with(R"("partial_rotary_factor": 0.5, )", "")).rotary_dim, 64);  // Glm4MoeConfig's default
  EXPECT_EQ(parse(with(R"("first_k_dense_replace": 1)", R"("first_k_dense_replace": 0)")).sparse_layer(0), true);
  expect_parse_error(with(R"("n_group": 1, "topk_group": 1)", R"("n_group": 3, "topk_group": 1)"),
                     {"n_group", "divisor of n_routed_experts (128)"});
  expect_parse_error(with(R"("n_group": 1, "topk_group": 1)", R"("n_group": 8, "topk_group": 9)"),
                     {"topk_group", "from 1 to n_group (8)"});
  expect_parse_error(with(R"("first_k_dense_replace": 1)", R"("first_k_dense_replace": -1)"),
                     {"'first_k_dense_replace'", "non-negative integer"});
  expect_parse_error(with(R"("n_routed_experts": 128)", R"("n_routed_experts": 128, "num_local_experts": 64)"),
                     {"'n_routed_experts'", "'num_local_experts'"});
}

TEST(ModelConfig, Qwen3HasHeadNormsAndItsOwnHeadDim) {
  ModelConfig c = parse(kQwen3_06b);
  EXPECT_EQ(c.family, Family::Qwen3);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.head_dim, 128);  // not 1024 / 16
  EXPECT_EQ(c.q_size(), 2048);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.window_of(27), 0);
  EXPECT_EQ(c.total_parameters(), 596049920);  // transformers' Qwen3ForCausalLM of this config
  // head_dim absent: Qwen3Config's default 128, whatever hidden / heads is.
  std::string no_head_dim = kQwen3_06b;
  no_head_dim.replace(no_head_dim.find("\"head_dim\": 128, "), 17, "");
  EXPECT_EQ(parse(no_head_dim).head_dim, 128);
  expect_parse_error(std::string(kQwen3_06b).replace(std::string(kQwen3_06b).find("\"attention_bias\": false"), 23,
                                                     "\"attention_bias\": true"),
                     {"'attention_bias'", "Qwen3ForCausalLM", "o_proj"});
}

TEST(ModelConfig, Qwen3SlidingWindowLayersAsTransformersReadsThem) {
  const std::string base = R"({"model_type": "qwen3", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
                               "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 16, )";
  // use_sliding_window off: no window, whatever sliding_window says.
  EXPECT_EQ(parse(base + R"("use_sliding_window": false, "sliding_window": 8})").sliding_window, 0);
  // On: layers from max_window_layers on slide, or those layer_types names.
  ModelConfig c = parse(base + R"("use_sliding_window": true, "sliding_window": 8, "max_window_layers": 2})");
  EXPECT_EQ(c.sliding_window, 8);
  EXPECT_EQ(c.sliding_layers, (std::vector<bool>{false, false, true, true}));
  c = parse(base + R"("use_sliding_window": true, "sliding_window": 8, "layer_types": ["sliding_attention",
                     "full_attention", "sliding_attention", "full_attention"]})");
  EXPECT_EQ(c.sliding_layers, (std::vector<bool>{true, false, true, false}));
  EXPECT_EQ(c.window_of(0), 8);
  EXPECT_EQ(c.window_of(1), 0);
  expect_parse_error(base + R"("use_sliding_window": true, "layer_types": ["full_attention"]})",
                     {"'layer_types'", "one per layer (4)"});
  expect_parse_error(base + R"("use_sliding_window": true, "layer_types": ["a", "b", "c", "d"]})",
                     {"'layer_types'", "sliding_attention"});
}

TEST(ModelConfig, MistralSlidesOnEveryLayer) {
  ModelConfig c = parse(kMistral_7b);
  EXPECT_EQ(c.family, Family::Mistral);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_EQ(c.sliding_layers, std::vector<bool>(32, true));
  EXPECT_EQ(c.total_parameters(), 7241732096);  // the published Mistral-7B count
  // MistralConfig: an absent key is its default 4096, null is full attention.
  const std::string base = R"({"model_type": "mistral", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
                               "num_hidden_layers": 2, "num_attention_heads": 4)";
  EXPECT_EQ(parse(base + "}").sliding_window, 4096);
  EXPECT_EQ(parse(base + R"(, "sliding_window": null})").sliding_window, 0);
  EXPECT_TRUE(parse(base + R"(, "sliding_window": null})").sliding_layers.empty());
  expect_parse_error(base + R"(, "sliding_window": 0})", {"'sliding_window'", "positive integer"});
}

// google/gemma-2-2b
const char* kGemma2_2b = R"({
  "architectures": ["Gemma2ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 107],
  "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
  "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02,
  "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8,
  "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
  "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
  "transformers_version": "4.42.4", "use_cache": true, "vocab_size": 256000
})";

// google/gemma-3-1b-it
const char* kGemma3_1b = R"({
  "architectures": ["Gemma3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "attn_logit_softcapping": null, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
  "final_logit_softcapping": null, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
  "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
  "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
  "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
  "rope_scaling": null, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
  "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": true, "vocab_size": 262144
})";

TEST(ModelConfig, Gemma2AsGemma2ConfigReadsIt) {
  ModelConfig c = parse(kGemma2_2b);
  EXPECT_EQ(c.family, Family::Gemma2);
  EXPECT_TRUE(c.tie_word_embeddings);  // Gemma2Config's default
  EXPECT_EQ(c.norm_weight_offset, 1.0);
  EXPECT_EQ(c.mlp_activation, kernels::GluActivation::GeluTanh);
  EXPECT_TRUE(c.scale_embeddings);
  EXPECT_TRUE(c.sandwich_norms);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.query_pre_attn_scalar, 256.0);
  EXPECT_EQ(c.attn_logit_softcap, 50.0);
  EXPECT_EQ(c.final_logit_softcap, 30.0);
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_EQ(c.window_of(0), 4096);  // even layers slide
  EXPECT_EQ(c.window_of(1), 0);
  EXPECT_EQ(c.rope_local_theta, 0.0);
  EXPECT_EQ(c.total_parameters(), 2614341888);  // transformers' Gemma2ForCausalLM of this config
  // Caps: absent is Gemma2Config's default, null none.
  const std::string base = R"({"model_type": "gemma2", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16)";
  EXPECT_EQ(parse(base + "}").attn_logit_softcap, 50.0);
  EXPECT_EQ(parse(base + "}").head_dim, 16);
  EXPECT_EQ(parse(base + R"(, "attn_logit_softcapping": null, "final_logit_softcapping": null})").final_logit_softcap,
            0.0);
  expect_parse_error(base + R"(, "hidden_activation": "gelu"})", {"'hidden_activation'", "gelu_pytorch_tanh"});
  expect_parse_error(base + R"(, "attention_bias": true})", {"'attention_bias'", "Gemma2ForCausalLM"});
}

TEST(ModelConfig, Gemma3AsGemma3TextConfigReadsIt) {
  ModelConfig c = parse(kGemma3_1b);
  EXPECT_EQ(c.family, Family::Gemma3);
  EXPECT_EQ(c.architecture, "Gemma3ForCausalLM");
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.attn_logit_softcap, 0.0);
  EXPECT_EQ(c.final_logit_softcap, 0.0);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.rope_local_theta, 1e4);
  EXPECT_EQ(c.sliding_window, 512);
  for (int64_t l = 0; l < 26; ++l) EXPECT_EQ(c.window_of(l), (l + 1) % 6 == 0 ? 0 : 512) << l;  // 5 local : 1 global
  EXPECT_EQ(c.total_parameters(), 999885952);  // transformers' Gemma3ForCausalLM of this config
  // transformers v5 writes the two RoPE bases per layer type.
  const std::string base = R"({"model_type": "gemma3_text", "vocab_size": 100, "hidden_size": 64,
                               "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4)";
  c = parse(base + R"(, "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 2e3}}})");
  EXPECT_EQ(c.rope_theta, 5e5);
  EXPECT_EQ(c.rope_local_theta, 2e3);
  EXPECT_EQ(c.head_dim, 256);  // Gemma3TextConfig's default
  expect_parse_error(base + R"(, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0}}})",
                     {"'rope_parameters.full_attention'", "linear", "not supported"});
  expect_parse_error(base + R"(, "use_bidirectional_attention": true})", {"'use_bidirectional_attention'"});
}

TEST(ModelConfig, Llama2) {
  ModelConfig c = parse(kLlama2_7b);
  EXPECT_EQ(c.family, Family::Llama);
  EXPECT_EQ(c.architecture, "LlamaForCausalLM");
  EXPECT_EQ(c.vocab_size, 32000);
  EXPECT_EQ(c.num_kv_heads, 32);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.rotary_dim, 128);
  EXPECT_FALSE(c.rope_interleaved);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_EQ(c.torch_dtype, DType::F16);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{2});
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.pad_token_id, -1);
  EXPECT_EQ(c.config_json, kLlama2_7b);
  EXPECT_EQ(c.total_parameters(), 6738415616);  // the published Llama-2-7b count
}

TEST(ModelConfig, LlamaDefaults) {
  ModelConfig c = parse(R"({"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
                            "num_hidden_layers": 2, "num_attention_heads": 4})");
  EXPECT_EQ(c.family, Family::Llama);
  EXPECT_EQ(c.architecture, "LlamaForCausalLM");
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.rotary_dim, 16);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.torch_dtype, DType::F32);
  EXPECT_TRUE(c.eos_token_ids.empty());
  EXPECT_EQ(c.bos_token_id, -1);
  EXPECT_EQ(c.initializer_range, 0.02);  // PretrainedConfig's default
}

// A new model drawn at random uses config.json's initializer_range (transformers' _init_weights);
// the value is written back on export and must be a positive number.
TEST(ModelConfig, InitializerRangeIsReadWrittenAndChecked) {
  const std::string base = R"({"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "initializer_range": INIT})";
  auto with = [&](const std::string& v) { return std::string(base).replace(base.find("INIT"), 4, v); };
  const ModelConfig c = parse(with("0.006"));
  EXPECT_EQ(c.initializer_range, 0.006);
  EXPECT_EQ(parse(model_config_json(c, DType::F32)).initializer_range, 0.006);
  expect_parse_error(with("-0.1"), {"config.json", "initializer_range"});
  expect_parse_error(with("\"small\""), {"config.json", "initializer_range"});
}

TEST(ModelConfig, Qwen2HasQkvBiasAndTiedEmbeddings) {
  ModelConfig c = parse(kQwen2_05b);
  EXPECT_EQ(c.family, Family::Qwen2);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.torch_dtype, DType::BF16);
  EXPECT_EQ(c.total_parameters(), 494032768);  // the published Qwen2-0.5B count
  // The LM head counts as a matmul even when tied to the embedding.
  EXPECT_EQ(c.matmul_parameters(), c.total_parameters() - 24 * (2 * 896 + 896 + 2 * 128) - 896);  // less norms, biases
}

TEST(ModelConfig, MatmulParametersByHand) {
  ModelConfig c = parse(R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 12,
                            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "tie_word_embeddings": true})");
  // head_dim 2: q 8x8, k,v 8x4, o 8x8, MLP 3 x 8x12, LM head 10x8.
  int64_t per_layer = 64 + 32 + 32 + 64 + 3 * 96;
  EXPECT_EQ(c.matmul_parameters(), 3 * per_layer + 80);
  EXPECT_EQ(c.total_parameters(), 80 + 3 * (per_layer + 16) + 8);  // tied: one copy of the embedding
}

TEST(ModelConfig, GlmTransformersNative) {
  ModelConfig c = parse(kGlm4_9b_hf);
  EXPECT_EQ(c.family, Family::Glm);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.rotary_dim, 64);
  EXPECT_TRUE(c.rope_interleaved);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.rms_norm_eps, 1.5625e-07);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{151329, 151336, 151338}));
  EXPECT_EQ(c.pad_token_id, 151329);

  ModelConfig d = parse(R"({"architectures": ["GlmForCausalLM"], "vocab_size": 100, "hidden_size": 64,
                            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4})");
  EXPECT_TRUE(d.qkv_bias);     // attention_bias defaults to true for GLM
  EXPECT_EQ(d.rotary_dim, 8);  // partial_rotary_factor 0.5 of head_dim 16
}

// transformers builds each family's embed_tokens as nn.Embedding(vocab, hidden, padding_idx=
// config.pad_token_id), with the config class's default where config.json has no such key.
TEST(ModelConfig, EmbeddingPaddingRowAsTransformersBuildsIt) {
  const std::string sizes = R"("vocab_size": 200000, "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 4)";
  auto with = [&](const std::string& type, const std::string& pad) {
    return parse("{\"model_type\": \"" + type + "\", " + sizes + pad + "}");
  };
  EXPECT_EQ(with("llama", "").embedding_padding_idx(), -1);  // LlamaConfig: None
  EXPECT_EQ(with("llama", R"(, "pad_token_id": 7)").embedding_padding_idx(), 7);
  EXPECT_EQ(with("qwen2", R"(, "pad_token_id": 151643)").embedding_padding_idx(), 151643);
  EXPECT_EQ(with("gemma2", "").embedding_padding_idx(), 0);  // Gemma2Config: 0
  EXPECT_EQ(with("gemma3_text", "").embedding_padding_idx(), 0);
  EXPECT_EQ(with("gemma2", R"(, "pad_token_id": null)").embedding_padding_idx(), -1);  // null is None
  EXPECT_EQ(with("glm", "").pad_token_id, 151329);  // GlmConfig's default
  EXPECT_EQ(with("glm", "").embedding_padding_idx(), 151329);
  // Outside the vocabulary (nn.Embedding would refuse it): no padding row.
  ModelConfig small = parse(R"({"model_type": "glm", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4})");
  EXPECT_EQ(small.pad_token_id, 151329);
  EXPECT_EQ(small.embedding_padding_idx(), -1);
  // THUDM's ChatGLM builds its embedding without padding_idx.
  EXPECT_EQ(parse(kGlm4_9b).embedding_padding_idx(), -1);
}

TEST(ModelConfig, GlmOriginal) {
  ModelConfig c = parse(kGlm4_9b);
  EXPECT_EQ(c.family, Family::GlmOriginal);
  EXPECT_EQ(c.architecture, "ChatGLMModel");
  EXPECT_EQ(c.vocab_size, 151552);
  EXPECT_EQ(c.intermediate_size, 13696);
  EXPECT_EQ(c.num_layers, 40);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.rotary_dim, 64);
  EXPECT_TRUE(c.rope_interleaved);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_EQ(c.max_position_embeddings, 8192);
  EXPECT_EQ(c.torch_dtype, DType::BF16);
  // Same network as glm-4-9b-hf: same parameter count.
  EXPECT_EQ(c.total_parameters(), parse(kGlm4_9b_hf).total_parameters());
}

TEST(ModelConfig, GlmOriginalWithoutGroupedQueriesAndWithRopeRatio) {
  ModelConfig c = parse(R"({"model_type": "chatglm", "architectures": ["ChatGLMForConditionalGeneration"],
                            "padded_vocab_size": 100, "hidden_size": 64, "ffn_hidden_size": 96, "num_layers": 2,
                            "num_attention_heads": 4, "multi_query_attention": false, "multi_query_group_num": 2,
                            "rope_ratio": 500})");
  EXPECT_EQ(c.architecture, "ChatGLMForConditionalGeneration");
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.rotary_dim, 8);
  EXPECT_EQ(c.rope_theta, 5e6);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_FALSE(c.qkv_bias);
  // model_type marks the format even under an architecture name keel does not list.
  EXPECT_EQ(parse(R"({"model_type": "chatglm", "architectures": ["ChatGLMForSequenceClassification"],
                      "padded_vocab_size": 100, "hidden_size": 64, "ffn_hidden_size": 96, "num_layers": 2,
                      "num_attention_heads": 4})")
                .family,
            Family::GlmOriginal);
}

TEST(ModelConfig, LoadFromFileNamesTheFile) {
  char pattern[] = "/tmp/keel_config_XXXXXX";
  ASSERT_NE(mkdtemp(pattern), nullptr);
  std::string path = std::string(pattern) + "/config.json";
  write_file_atomic(path, kQwen2_05b);
  EXPECT_EQ(load_model_config(path).vocab_size, 151936);
  write_file_atomic(path, R"({"model_type": "qwen2", "vocab_size": "many"})");
  expect_error([&] { load_model_config(path); }, {path, "'vocab_size'", "positive integer", "string \"many\""});
  expect_error([&] { load_model_config(std::string(pattern) + "/absent.json"); }, {"absent.json"});
  std::filesystem::remove_all(pattern);
}

// --- errors -------------------------------------------------------------------------------------

// A small Llama config.json; `fields` adds keys or replaces the default sizes.
std::string llama_config(std::map<std::string, std::string> fields) {
  std::map<std::string, std::string> all = {{"vocab_size", "100"},
                                            {"hidden_size", "64"},
                                            {"intermediate_size", "128"},
                                            {"num_hidden_layers", "2"},
                                            {"num_attention_heads", "4"}};
  for (auto& [key, value] : fields) all[key] = value;
  std::string json = R"({"architectures": ["LlamaForCausalLM"])";
  for (const auto& [key, value] : all) json += ", \"" + key + "\": " + value;
  return json + "}";
}

std::string llama_with(const std::string& extra) {
  return llama_config({}).insert(1, extra.empty() ? "" : extra + ", ");
}

// Keys keel does not read are written back as Python's json.dumps(indent=2) writes them, nested
// and empty containers included (what transformers' save_pretrained leaves in config.json).
TEST(ModelConfig, UnreadKeysAreWrittenBackAsJsonDumpsIndentTwo) {
  const ModelConfig c = parse(llama_with(R"("extra": {"a": [], "b": {}, "c": [[1, 2], {"d": [true, null, "x"]}]})"));
  const std::string json = model_config_json(c, DType::F32);
  const std::string want = R"(  "extra": {
    "a": [],
    "b": {},
    "c": [
      [
        1,
        2
      ],
      {
        "d": [
          true,
          null,
          "x"
        ]
      }
    ]
  },)";
  EXPECT_NE(json.find(want), std::string::npos) << json;
}

TEST(ModelConfigErrors, NotJsonOrNotObject) {
  expect_parse_error("{", {"config.json", "valid JSON"});
  expect_parse_error("[]", {"config.json", "JSON object", "array"});
}

TEST(ModelConfigErrors, UnknownArchitectureListsSupported) {
  expect_parse_error(R"({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"})",
                     {"config.json", "Phi3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM", "GlmForCausalLM",
                      "ChatGLMModel", "Qwen3ForCausalLM", "MistralForCausalLM", "Gemma2ForCausalLM",
                      "Gemma3ForCausalLM", "not supported"});
  expect_parse_error(R"({"vocab_size": 3})", {"architectures", "LlamaForCausalLM"});
  expect_parse_error(R"({"architectures": []})", {"architectures", "non-empty array"});
}

TEST(ModelConfigErrors, WrongTypes) {
  expect_parse_error(llama_with(R"("num_key_value_heads": "2")"),
                     {"config.json", "key 'num_key_value_heads'", "expected a positive integer", "found string \"2\""});
  expect_parse_error(llama_with(R"("num_key_value_heads": 0)"), {"'num_key_value_heads'", "positive integer", "0"});
  expect_parse_error(llama_with(R"("head_dim": 2.5)"), {"'head_dim'", "positive integer", "number 2.5"});
  expect_parse_error(llama_with(R"("tie_word_embeddings": "yes")"), {"'tie_word_embeddings'", "true or false"});
  expect_parse_error(llama_with(R"("rope_theta": -1)"), {"'rope_theta'", "positive number"});
  expect_parse_error(llama_with(R"("torch_dtype": "int8")"), {"'torch_dtype'", "bfloat16", "int8"});
  expect_parse_error(llama_with(R"("eos_token_id": [1, "x"])"), {"'eos_token_id'"});
  expect_parse_error(llama_with(R"("bos_token_id": -3)"), {"'bos_token_id'", "non-negative"});
  expect_parse_error(R"({"model_type": "llama", "vocab_size": 100})", {"'hidden_size'", "required"});
  expect_parse_error(llama_with(R"("vocab_size": 5)"), {"'vocab_size'", "twice"});
  // 4096.0 is a whole number: accepted as an integer.
  EXPECT_EQ(parse(llama_with(R"("max_position_embeddings": 4096.0)")).max_position_embeddings, 4096);
}

TEST(ModelConfigErrors, TokenIdVariants) {
  EXPECT_EQ(parse(llama_with(R"("eos_token_id": [1, 2], "bos_token_id": null, "pad_token_id": 0)")).eos_token_ids,
            (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(parse(llama_with(R"("pad_token_id": 0)")).pad_token_id, 0);
  EXPECT_EQ(parse(llama_with(R"("dtype": "bfloat16")")).torch_dtype, DType::BF16);
}

TEST(ModelConfigErrors, InconsistentSizes) {
  expect_parse_error(llama_with(R"("num_key_value_heads": 3)"),
                     {"config.json", "num_attention_heads", "multiple of num_key_value_heads (3)", "found 4"});
  expect_parse_error(R"({"model_type": "llama", "vocab_size": 100, "hidden_size": 65, "intermediate_size": 128,
                         "num_hidden_layers": 2, "num_attention_heads": 4})",
                     {"'head_dim'", "hidden_size (65)", "multiple"});
  // GLM: head_dim 6 x 0.5 = 3 rotating channels, which cannot form pairs.
  expect_parse_error(R"({"architectures": ["GlmForCausalLM"], "vocab_size": 100, "hidden_size": 24,
                         "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "head_dim": 6})",
                     {"config.json", "rotary dimension", "partial_rotary_factor", "even", "found 3"});
  expect_parse_error(llama_config({{"vocab_size", "4294967296"}}), {"vocab_size", "below 2147483648"});
  expect_parse_error(llama_config({{"num_hidden_layers", "100000"}}), {"num_hidden_layers", "below 10000"});
  expect_parse_error(llama_config({{"hidden_size", "18446744073709551615"}}), {"'hidden_size'", "positive integer"});
}

TEST(ModelConfigErrors, UnsupportedVariants) {
  expect_parse_error(llama_with(R"("rope_scaling": {"rope_type": "llama3", "factor": 8.0})"),
                     {"'rope_scaling'", "llama3", "not supported"});
  expect_parse_error(llama_with(R"("rope_scaling": {"type": "linear", "factor": 2.0})"), {"'rope_scaling'", "linear"});
  EXPECT_NO_THROW(parse(llama_with(R"("rope_scaling": {"rope_type": "default"})")));
  expect_parse_error(llama_with(R"("hidden_act": "gelu")"), {"'hidden_act'", "silu", "gelu"});
  expect_parse_error(llama_with(R"("attention_bias": true)"), {"'attention_bias'", "o_proj"});
  expect_parse_error(llama_with(R"("mlp_bias": true)"), {"'mlp_bias'"});
  expect_parse_error(std::string(kQwen2_05b).replace(std::string(kQwen2_05b).find("\"use_sliding_window\": false"), 27,
                                                     "\"use_sliding_window\": true"),
                     {"'use_sliding_window'", "Qwen2ForCausalLM"});

  std::string glm = R"({"model_type": "chatglm", "padded_vocab_size": 100, "hidden_size": 64, "ffn_hidden_size": 96,
                        "num_layers": 2, "num_attention_heads": 4, )";
  expect_parse_error(glm + R"("rmsnorm": false})", {"'rmsnorm'", "not supported", "RMSNorm"});
  expect_parse_error(glm + R"("add_bias_linear": true})", {"'add_bias_linear'", "not supported"});
  expect_parse_error(glm + R"("post_layer_norm": false})", {"'post_layer_norm'", "not supported"});
  expect_parse_error(glm + R"("apply_residual_connection_post_layernorm": true})",
                     {"'apply_residual_connection_post_layernorm'", "not supported"});
}

TEST(ModelConfigErrors, ValidateCodeBuiltConfigs) {
  ModelConfig c;
  c.family = Family::Llama;
  c.vocab_size = 10, c.hidden_size = 8, c.intermediate_size = 16, c.num_layers = 1;
  c.num_heads = 2, c.num_kv_heads = 2, c.head_dim = 4, c.rotary_dim = 4;
  EXPECT_NO_THROW(validate(c, "recipe"));
  c.rotary_dim = 6;
  expect_error([&] { validate(c, "recipe"); }, {"recipe", "rotary dimension"});
  c.rotary_dim = 4;
  c.family = Family::Qwen2;  // Qwen2 without q/k/v biases cannot be written as a Qwen2 config
  expect_error([&] { validate(c, "recipe"); }, {"qkv_bias", "qwen2"});
  c.family = Family::Qwen3;  // Qwen3 always has q/k norms
  expect_error([&] { validate(c, "recipe"); }, {"qk_norm", "qwen3"});
  c.qk_norm = true;
  EXPECT_NO_THROW(validate(c, "recipe"));
  c.family = Family::Llama;
  expect_error([&] { validate(c, "recipe"); }, {"qk_norm", "llama"});
  c.qk_norm = false;
  c.sliding_window = 16;  // a window needs its layers
  expect_error([&] { validate(c, "recipe"); }, {"sliding_window", "llama"});
  c.family = Family::Mistral;
  expect_error([&] { validate(c, "recipe"); }, {"sliding_layers", "one entry per layer (1)"});
  c.sliding_layers = {true};
  EXPECT_NO_THROW(validate(c, "recipe"));
}

// --- names and export ---------------------------------------------------------------------------

TEST(ModelConfig, FamilyNames) {
  for (Family f : {Family::Llama, Family::Qwen2, Family::Glm, Family::GlmOriginal, Family::Qwen3, Family::Mistral,
                   Family::Gemma2, Family::Gemma3, Family::Qwen3Moe, Family::Mixtral, Family::Glm4Moe}) {
    EXPECT_EQ(family_from_name(family_name(f)), f);
  }
  EXPECT_EQ(family_name(Family::GlmOriginal), "glm_original");
  expect_error([] { family_from_name("phi3"); },
               {"phi3", "llama, qwen2, glm, glm_original, qwen3, mistral, gemma2, gemma3, qwen3_moe, mixtral, glm4_moe"});
}

ModelConfig small_config(Family family) {
  ModelConfig c;
  c.family = family;
  c.vocab_size = 1000;
  c.hidden_size = 96;
  c.intermediate_size = 160;
  c.num_layers = 3;
  c.num_heads = 6;
  c.num_kv_heads = 2;
  c.head_dim = 24;
  c.rotary_dim = 24;
  c.rope_theta = 123456.789;
  c.rms_norm_eps = 1.5625e-07;
  c.max_position_embeddings = 8192;
  c.tie_word_embeddings = true;
  c.eos_token_ids = {7, 9};
  c.bos_token_id = 1;
  switch (family) {
    case Family::Llama: break;
    case Family::Qwen2: c.qkv_bias = true; break;
    case Family::Glm:
      c.qkv_bias = true;
      c.rotary_dim = 14;  // a factor (14/24) that is not a round number
      c.rope_interleaved = true;
      break;
    case Family::GlmOriginal:
      c.qkv_bias = true;
      c.rotary_dim = 12;
      c.rope_interleaved = true;
      c.pad_token_id = 0;
      break;
    case Family::Qwen3:
      c.qk_norm = true;
      c.sliding_window = 11;
      c.sliding_layers = {false, true, true};
      break;
    case Family::Mistral:
      c.sliding_window = 7;
      c.sliding_layers = {true, true, true};
      break;
    case Family::Qwen3Moe:
      c.qk_norm = true;
      c.moe.experts = 6;
      c.moe.experts_per_token = 2;
      c.moe.intermediate_size = 40;
      c.moe.norm_topk_prob = true;
      c.moe.sparse_layers = {true, false, true};
      c.moe.router_aux_loss_coef = 0.015625;
      c.moe.output_router_logits = true;
      break;
    case Family::Mixtral:
      c.sliding_window = 7;
      c.sliding_layers = {true, true, true};
      c.moe.experts = 4;
      c.moe.experts_per_token = 2;
      c.moe.intermediate_size = c.intermediate_size;
      c.moe.norm_topk_prob = true;
      c.moe.sparse_layers = {true, true, true};
      c.moe.router_aux_loss_coef = 0.03125;
      break;
    case Family::Glm4Moe:
      c.qkv_bias = true;
      c.qk_norm = true;
      c.rotary_dim = 10;  // partial, in rotate_half's pairs
      c.moe.experts = 6;
      c.moe.experts_per_token = 3;
      c.moe.intermediate_size = 40;
      c.moe.shared_intermediate_size = 80;
      c.moe.norm_topk_prob = false;
      c.moe.sigmoid_router = true;
      c.moe.groups = 3;
      c.moe.topk_groups = 2;
      c.moe.routed_scaling_factor = 2.5;
      c.moe.sparse_layers = {false, true, true};
      c.moe.router_aux_loss_coef = 0;
      c.moe.output_router_logits = true;
      c.nextn_predict_layers = 1;
      break;
    case Family::Gemma2:
    case Family::Gemma3: {
      ModelConfig traits = c;
      apply_family_traits(traits);
      c.qk_norm = traits.qk_norm;
      c.norm_weight_offset = 1.0;
      c.mlp_activation = kernels::GluActivation::GeluTanh;
      c.scale_embeddings = c.sandwich_norms = true;
      c.query_pre_attn_scalar = 64.5;  // not a whole number: written as a float
      c.attn_logit_softcap = family == Family::Gemma2 ? 20.0 : 0.0;
      c.final_logit_softcap = 15.5;
      c.rope_local_theta = family == Family::Gemma3 ? 321.0 : 0.0;
      c.sliding_window = 9;
      c.sliding_layers = {true, false, true};
      break;
    }
  }
  ModelConfig traits = c;
  apply_family_traits(traits);
  c.architecture = traits.architecture;
  return c;
}

TEST(ModelConfigExport, GeneratedJsonParsesBackEqual) {
  for (Family f : {Family::Llama, Family::Qwen2, Family::Glm, Family::GlmOriginal, Family::Qwen3, Family::Mistral,
                   Family::Gemma2, Family::Gemma3, Family::Qwen3Moe, Family::Mixtral, Family::Glm4Moe}) {
    SCOPED_TRACE(family_name(f));
    ModelConfig c = small_config(f);
    validate(c, "test");
    for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
      std::string json = model_config_json(c, dtype);
      ModelConfig back = parse_model_config(json, "generated");
      c.torch_dtype = dtype;
      expect_same_model(c, back);
      // Exported again from the parsed config (which keeps the text) gives the same text.
      EXPECT_EQ(model_config_json(back, dtype), json);
    }
  }
  // One-element eos lists come back as a plain integer, in either case the same ids.
  ModelConfig c = small_config(Family::Llama);
  c.eos_token_ids = {2};
  EXPECT_EQ(parse_model_config(model_config_json(c, DType::F32), "generated").eos_token_ids, c.eos_token_ids);
}

TEST(ModelConfigExport, GeneratedJsonUsesEachFormatsKeys) {
  std::string glm = model_config_json(small_config(Family::GlmOriginal), DType::BF16);
  for (const char* key : {"\"padded_vocab_size\": 1000", "\"ffn_hidden_size\": 160", "\"kv_channels\": 24",
                          "\"multi_query_attention\": true", "\"multi_query_group_num\": 2", "\"rmsnorm\": true",
                          "\"post_layer_norm\": true", "\"apply_residual_connection_post_layernorm\": false",
                          "\"add_bias_linear\": false", "\"original_rope\": true", "\"model_type\": \"chatglm\"",
                          "\"torch_dtype\": \"bfloat16\"", "\"seq_length\": 8192"}) {
    EXPECT_NE(glm.find(key), std::string::npos) << key << "\n" << glm;
  }
  std::string llama = model_config_json(small_config(Family::Llama), DType::F32);
  for (const char* key : {"\"architectures\": [\n    \"LlamaForCausalLM\"\n  ]", "\"model_type\": \"llama\"",
                          "\"rope_theta\": 123456.789", "\"rope_scaling\": null", "\"num_key_value_heads\": 2"}) {
    EXPECT_NE(llama.find(key), std::string::npos) << key << "\n" << llama;
  }
  EXPECT_NE(model_config_json(small_config(Family::Glm), DType::F32).find("\"partial_rotary_factor\""),
            std::string::npos);
}

TEST(ModelConfigExport, OriginalTextKeptExceptDtype) {
  ModelConfig c = parse(kGlm4_9b);
  std::string json = model_config_json(c, DType::F32);
  EXPECT_NE(json.find("\"torch_dtype\": \"float32\""), std::string::npos) << json;
  EXPECT_EQ(json.find("bfloat16"), std::string::npos);
  // Keys keel does not interpret survive, in their original order.
  size_t name = json.find("\"_name_or_path\": \"THUDM/glm-4-9b\""), auto_map = json.find("\"AutoConfig\"");
  EXPECT_NE(name, std::string::npos);
  EXPECT_NE(auto_map, std::string::npos);
  EXPECT_LT(name, auto_map);
  expect_same_model(parse_model_config(json, "exported"), [&] {
    ModelConfig expected = c;
    expected.torch_dtype = DType::F32;
    return expected;
  }());

  // A config without a dtype gains one; transformers >= 4.56 spelling "dtype" is replaced in place.
  ModelConfig d = parse(llama_with(""));
  EXPECT_NE(model_config_json(d, DType::BF16).find("\"torch_dtype\": \"bfloat16\""), std::string::npos);
  ModelConfig e = parse(llama_with(R"("dtype": "float32")"));
  std::string e_json = model_config_json(e, DType::F16);
  EXPECT_NE(e_json.find("\"dtype\": \"float16\""), std::string::npos) << e_json;
  EXPECT_EQ(e_json.find("torch_dtype"), std::string::npos);
}

TEST(ModelConfigExport, GlmFormatsConvertBothWays) {
  // THUDM/glm-4-9b (ChatGLMModel) as GlmForCausalLM and back: the same model, each format's keys.
  const ModelConfig original = parse(kGlm4_9b);
  const ModelConfig hf = config_for_family(original, Family::Glm);
  EXPECT_EQ(hf.family, Family::Glm);
  EXPECT_EQ(hf.architecture, "GlmForCausalLM");
  EXPECT_TRUE(hf.config_json.empty());  // the ChatGLM keys (auto_map, ...) do not describe the new format
  const std::string hf_json = model_config_json(hf, DType::BF16);
  EXPECT_EQ(hf_json.find("padded_vocab_size"), std::string::npos) << hf_json;
  const ModelConfig hf_back = parse_model_config(hf_json, "converted");
  expect_same_model(hf_back, hf);
  const ModelConfig again = config_for_family(hf_back, Family::GlmOriginal);
  const ModelConfig again_back = parse_model_config(model_config_json(again, DType::BF16), "converted back");
  expect_same_model(again_back, original);
  // The same family: unchanged, original text included.
  EXPECT_EQ(config_for_family(original, Family::GlmOriginal).config_json, original.config_json);

  expect_error([] { config_for_family(small_config(Family::Llama), Family::GlmOriginal); },
               {"llama", "LlamaForCausalLM", "glm_original", "only GLM-4 models"});
  expect_error([] { config_for_family(small_config(Family::Qwen2), Family::Glm); }, {"qwen2", "glm"});
  // GlmForCausalLM may rotate any even part of a head; ChatGLM rotates exactly half.
  expect_error([] { config_for_family(small_config(Family::Glm), Family::GlmOriginal); }, {"rotates half"});
}

}  // namespace
}  // namespace keel::model

namespace {

std::string quantized_llama_config(const std::string& quantization_config) {
  return R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "quantization_config": )" +
         quantization_config + "}";
}

std::string quantization_error(const std::string& quantization_config) {
  try {
    keel::model::parse_model_config(quantized_llama_config(quantization_config), "m/config.json");
  } catch (const keel::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(ModelConfig, ABitsandbytesFourBitCheckpointIsRead) {
  using keel::FourBitType;
  auto nf4 = keel::model::parse_model_config(
      quantized_llama_config(R"({"quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": true, "bnb_4bit_quant_storage": "uint8"})"),
      "m/config.json");
  ASSERT_TRUE(nf4.saved_four_bit);
  EXPECT_EQ(nf4.saved_four_bit->type, FourBitType::Nf4);
  EXPECT_TRUE(nf4.saved_four_bit->double_quantization);
  // BitsAndBytesConfig's defaults: FP4 without double quantization (transformers' older spelling).
  auto fp4 = keel::model::parse_model_config(
      quantized_llama_config(R"({"quant_method": "bitsandbytes", "_load_in_4bit": true})"), "m/config.json");
  ASSERT_TRUE(fp4.saved_four_bit);
  EXPECT_EQ(fp4.saved_four_bit->type, FourBitType::Fp4);
  EXPECT_FALSE(fp4.saved_four_bit->double_quantization);
  // What keel writes for it (a merged export) is full precision: no quantization_config.
  EXPECT_EQ(keel::model::model_config_json(nf4, keel::DType::BF16).find("quantization_config"), std::string::npos);
  EXPECT_FALSE(
      keel::model::parse_model_config(keel::model::model_config_json(nf4, keel::DType::BF16), "x").saved_four_bit);
}

TEST(ModelConfig, OtherQuantizedCheckpointsAreRefusedByName) {
  struct Case {
    std::string config;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {R"({"quant_method": "gptq", "bits": 4})",
       {"m/config.json: key 'quantization_config'", "\"gptq\"", "quantization_bit = 4"}},
      {R"({"quant_method": "bitsandbytes", "load_in_8bit": true})", {"8-bit", "load_in_8bit", "quantization_bit = 4"}},
      {R"({"quant_method": "bitsandbytes"})", {"without load_in_4bit"}},
      {R"({"quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type": "int4"})",
       {"bnb_4bit_quant_type", "\"int4\""}},
      {R"({"quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_storage": "bfloat16"})",
       {"bnb_4bit_quant_storage", "\"bfloat16\""}},
      {R"("bitsandbytes")", {"quantization_config", "expected an object"}},
  };
  for (const auto& c : cases) {
    const std::string what = quantization_error(c.config);
    ASSERT_FALSE(what.empty()) << c.config << " must be refused";
    for (const auto& e : c.expected) EXPECT_NE(what.find(e), std::string::npos) << c.config << ": " << what;
  }
}
