// ModelConfig: the architecture of a decoder-only model, read from a Hugging Face config.json.
// One internal description covers the four supported formats; `family` records which one the
// checkpoint came in so that export writes it back in the same format and tensor names.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "keel/core/dtype.h"
#include "keel/core/four_bit.h"
#include "keel/kernels/shapes.h"

namespace keel::model {

enum class Family : uint8_t {
  Llama,        // LlamaForCausalLM
  Qwen2,        // Qwen2ForCausalLM (Llama + q/k/v biases)
  Glm,          // GlmForCausalLM (transformers-native glm-4-9b-hf)
  GlmOriginal,  // ChatGLMModel / ChatGLMForConditionalGeneration (THUDM/glm-4-9b original format)
  Qwen3,        // Qwen3ForCausalLM (Llama + RMSNorm of each query and key head before RoPE)
  Mistral,      // MistralForCausalLM (Llama + sliding-window attention)
  Gemma2,       // Gemma2ForCausalLM (sandwich norms, GeGLU, soft-capping, alternating windows)
  Gemma3,       // Gemma3ForCausalLM, text (Gemma 2's layout + q/k norms and a local RoPE base)
  Qwen3Moe,     // Qwen3MoeForCausalLM (Qwen3's attention + mixture-of-experts MLPs)
  Mixtral,      // MixtralForCausalLM (Mistral's attention + a mixture of experts on every layer)
  Glm4Moe,      // Glm4MoeForCausalLM (GLM-4.5: sigmoid router, grouped top-k, shared experts, dense first layers)
};

// "llama", "qwen2", "glm", "glm_original", "qwen3", "mistral", "gemma2", "gemma3", "qwen3_moe", "mixtral",
// "glm4_moe"
std::string family_name(Family f);
Family family_from_name(const std::string& name);  // inverse; throws keel::Error listing valid names
// What users call the family: "Llama", "GLM-4", "Gemma 2", ...
std::string family_display_name(Family f);
// Every family keel reads, in the order of the format table the config loader uses (so a list
// shown to users, such as `keel --help`'s, is the loader's own).
std::vector<Family> supported_families();

struct ModelConfig {
  Family family = Family::Llama;
  std::string architecture;  // as in config.json "architectures"[0]
  int64_t vocab_size = 0;    // rows of the embedding (padded_vocab_size for GLM original)
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // ffn_hidden_size for GLM original
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;       // multi_query_group_num for GLM original (num_heads if MQA is off)
  int64_t head_dim = 0;           // kv_channels for GLM original; else head_dim or hidden/heads
  int64_t rotary_dim = 0;         // channels of each head that rotate (even)
  bool rope_interleaved = false;  // GLM: pairs (2i, 2i+1); Llama/Qwen2: pairs (i, i + rotary_dim/2)
  double rope_theta = 10000.0;    // GLM original: 10000 * rope_ratio
  double rms_norm_eps = 1e-6;
  bool qkv_bias = false;
  // Qwen3: q_norm and k_norm, an RMSNorm over each head's head_dim channels (one weight for all
  // query heads, one for all key heads), applied after the projection and before RoPE.
  bool qk_norm = false;
  // Sliding-window attention: a layer marked in sliding_layers lets query i see keys j with
  // i - sliding_window < j <= i (transformers' sliding_window_overlay). 0: none. Mistral marks
  // every layer; Qwen3 with use_sliding_window the layers its layer_types name.
  int64_t sliding_window = 0;
  std::vector<bool> sliding_layers;  // [num_layers] when sliding_window > 0
  // Gemma's differences (each the Llama behaviour at its default):
  double norm_weight_offset = 0.0;  // RMSNorm scales by (offset + w): Gemma's 1 + w
  kernels::GluActivation mlp_activation = kernels::GluActivation::Silu;  // Gemma: GeGLU (gelu_pytorch_tanh)
  bool scale_embeddings = false;    // the embedding's output times sqrt(hidden_size), rounded to float
  // A norm on the attention's and on the MLP's output before each residual add (Gemma's
  // post_attention_layernorm and post_feedforward_layernorm; its pre-MLP norm is keel's post norm).
  bool sandwich_norms = false;
  double query_pre_attn_scalar = 0;  // Gemma: scores scaled by its^-0.5; 0: by 1/sqrt(head_dim)
  double attn_logit_softcap = 0.0;   // Gemma 2: scores -> cap * tanh(scores / cap); 0: none
  double final_logit_softcap = 0.0;  // Gemma 2: logits -> cap * tanh(logits / cap); 0: none
  double rope_local_theta = 0.0;     // Gemma 3: the RoPE base of sliding-window layers; 0: rope_theta
  bool tie_word_embeddings = false;
  // The standard deviation of a random initialisation's matrices (transformers' _init_weights:
  // normal(0, initializer_range)); 0.02 where config.json does not say, as the config classes.
  double initializer_range = 0.02;
  int64_t max_position_embeddings = 4096;        // seq_length for GLM original
  DType torch_dtype = DType::F32;                // "torch_dtype" (or "dtype") in config.json
  std::vector<int64_t> eos_token_ids;            // may be empty
  // -1 for none. pad_token_id absent from config.json is the config class's default (Gemma 0,
  // GLM 151329), as transformers reads it.
  int64_t bos_token_id = -1, pad_token_id = -1;
  std::string config_json;  // the original text of config.json (empty for models built from scratch)
  // A checkpoint transformers saved with bitsandbytes in 4 bits (config.json's quantization_config,
  // quant_method "bitsandbytes", load_in_4bit): the blocks' projections are stored quantized
  // (model/bnb_4bit.h), the rest in torch_dtype. Unset for a full-precision checkpoint.
  struct SavedFourBit {
    FourBitType type = FourBitType::Nf4;
    bool double_quantization = false;
  };
  std::optional<SavedFourBit> saved_four_bit;
  // Mixture of experts (Qwen3-MoE, Mixtral): a sparse layer's MLP is `experts` SwiGLU experts of
  // width moe_intermediate_size, each token sent to the experts_per_token with the highest router
  // probability (softmax over the router's logits) and its output their sum weighted by those
  // probabilities (renormalised to sum to 1 with norm_topk_prob: always for Mixtral). The other
  // layers keep the dense MLP of width intermediate_size (Mixtral has none: every layer is sparse,
  // and its intermediate_size is the experts' width). experts == 0: a dense model.
  struct Experts {
    int64_t experts = 0, experts_per_token = 0, intermediate_size = 0;
    bool norm_topk_prob = false;
    std::vector<bool> sparse_layers;  // [num_layers]: decoder_sparse_step and mlp_only_layers resolved
    // The load-balancing loss (Switch Transformer's, as transformers' load_balancing_loss_func
    // computes it), added to the loss times router_aux_loss_coef when output_router_logits is true.
    double router_aux_loss_coef = 0.001;
    bool output_router_logits = false;
    // GLM-4.5 (Glm4MoeTopkRouter; DeepSeek-V3's "noaux_tc" routing): scores are sigmoid(logits), not
    // a softmax; the choice adds e_score_correction_bias (a buffer, never trained) to them and keeps
    // only the topk_groups of the groups (experts split into `groups` equal runs) whose two best
    // scores sum highest; the weights are the chosen scores without the bias (renormalised with
    // norm_topk_prob, + 1e-20 in the denominator) times routed_scaling_factor. Its forward adds no
    // load-balancing loss (output_router_logits is read and written back, and does nothing).
    bool sigmoid_router = false;
    int64_t groups = 1, topk_groups = 1;
    double routed_scaling_factor = 1.0;
    // n_shared_experts x moe_intermediate_size: a dense SwiGLU MLP of this width on the same input,
    // added to the routed experts' output in every sparse layer (0: none).
    int64_t shared_intermediate_size = 0;
  };
  Experts moe;
  // GLM-4.5's multi-token-prediction layers (num_nextn_predict_layers), stored in checkpoints as
  // model.layers.{num_layers ...}: Glm4MoeForCausalLM never runs them (its forward stops at
  // num_hidden_layers and its loading ignores their tensors), and neither does keel.
  int64_t nextn_predict_layers = 0;
  // Whether a checkpoint tensor belongs to one of those layers (model.layers.{num_layers + i}.*).
  bool next_token_prediction_tensor(const std::string& name) const;

  bool gemma() const { return family == Family::Gemma2 || family == Family::Gemma3; }
  // Whether layer `layer`'s MLP is a mixture of experts.
  bool sparse_layer(int64_t layer) const { return moe.experts > 0 && moe.sparse_layers.at(size_t(layer)); }
  bool has_experts() const { return moe.experts > 0; }
  // Whether the family's transformers class can add the load-balancing loss (Glm4Moe's cannot).
  bool has_aux_loss() const { return has_experts() && family != Family::Glm4Moe; }
  // The load-balancing loss's weight in the training loss (0 when it is not added).
  double aux_loss_weight() const {
    return has_aux_loss() && moe.output_router_logits ? moe.router_aux_loss_coef : 0.0;
  }
  // The width of layer `layer`'s dense SwiGLU MLP: intermediate_size, or in a sparse layer its
  // shared experts' (0: none, the experts alone).
  int64_t mlp_width(int64_t layer) const {
    return sparse_layer(layer) ? moe.shared_intermediate_size : intermediate_size;
  }
  // The window layer `layer`'s attention uses (0: every earlier key).
  int64_t window_of(int64_t layer) const {
    return sliding_window > 0 && sliding_layers.at(size_t(layer)) ? sliding_window : 0;
  }

  // The embedding row whose lookups give it no gradient (-1: none): transformers builds every
  // family's embed_tokens as nn.Embedding(vocab, hidden, padding_idx=pad_token_id), so where pad is
  // EOS or end-of-turn (many instruct models) that row trains only through a tied LM head. THUDM's
  // ChatGLM (glm_original) has no padding_idx; an id outside the vocabulary gives none.
  int64_t embedding_padding_idx() const;

  // Derived sizes.
  int64_t q_size() const { return num_heads * head_dim; }
  int64_t kv_size() const { return num_kv_heads * head_dim; }
  // Parameters used in matmuls (for MFU: 6N FLOPs per token), including the LM head.
  int64_t matmul_parameters() const;
  int64_t total_parameters() const;
};

// Parses and validates config.json. Errors name the file and the key ("config.json: key
// 'num_attention_heads': expected a positive integer"), including unknown architectures
// (listing the supported ones) and inconsistent sizes (heads not dividing, odd rotary dim, ...).
ModelConfig load_model_config(const std::string& path);
ModelConfig parse_model_config(const std::string& json_text, const std::string& path_for_errors);

// Checks the sizes are consistent (called by the parser and for configs built in code).
void validate(const ModelConfig& c, const std::string& where);

// Sets what the family fixes (architecture name, q/k/v biases, RoPE layout and rotary width, q/k
// norms) on a config built in code from sizes (a recipe's [model_config]).
void apply_family_traits(ModelConfig& c);

// The same model described in another family's format, for exporting it under that format's
// tensor names and config.json: only glm <-> glm_original (GlmForCausalLM and THUDM's ChatGLMModel
// hold the same weights under different names), anything else is a keel::Error naming both.
// The converted config is generated afresh (config_json is cleared: its keys are the other format's).
ModelConfig config_for_family(const ModelConfig& c, Family family);

// config.json text for this config in its family's format (torch_dtype set to `dtype`).
// If c.config_json is non-empty it is kept as is except for "torch_dtype", so keys keel does not
// interpret survive a load/export round trip.
std::string model_config_json(const ModelConfig& c, DType dtype);

}  // namespace keel::model
