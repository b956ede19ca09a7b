// LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): the base weights
// stay frozen and each targeted linear layer W [out, in] gains a trainable low-rank update,
//   y = x W^T + scaling * (x A^T) B^T,   A [r, in], B [out, r],
// with scaling = alpha / r (or alpha / sqrt(r) with rsLoRA, Kalajdzievski 2023). Modules are named
// and shaped as the Hugging Face model names them (q_proj, query_key_value, gate_up_proj, ...), so
// the adapter keel writes is PEFT's: keel's fused internal weights (qkv, gate_up) hold one LoRA
// pair per HF module, each on its block of output rows.
//
// A sparse layer's experts are adapted as PEFT adapts transformers 5's fused expert parameters
// (target_parameters; PEFT's lora.ParamWrapper): mlp.experts.gate_up_proj [E, 2I, H] and
// mlp.experts.down_proj [E, H, I] each get one pair per expert, W_e + scaling * B_e A_e, with
// A_e [r, in] and B_e [out, r]. PEFT holds them as lora_A [E r, in] (expert e's rows e r .. e r + r)
// and lora_B [out, r E] (expert e's column j at j E + e); keel keeps A so and B expert by expert,
// [E out, r], so that each expert's B_e is a matrix its grouped products read (save and load
// permute it: peft_adapter.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "keel/model/config.h"
#include "keel/model/params.h"

namespace keel::model {

struct DecoderParamIds;

struct LoraSpec {
  int64_t rank = 0;  // 0: no LoRA (full fine-tuning)
  double alpha = 16.0;
  bool rslora = false;
  // HF module names ("q_proj", "self_attn.q_proj", a full path) or "all" (every linear layer of
  // the blocks); a module matches a target equal to its path or to a suffix of it after a '.',
  // as PEFT's target_modules matches. A target with "experts" as a component names the experts'
  // parameters instead (expert_target): "experts" (both), "experts.gate_up_proj",
  // "experts.down_proj", or a longer suffix of a parameter's path such as
  // "model.layers.0.mlp.experts.down_proj"; "all" does not reach the experts.
  std::vector<std::string> targets{"all"};
  // Dropout on each module's input on the LoRA path only (PEFT's lora_dropout), in training
  // passes (MicroBatch::dropout_key set); the base path sees the input unchanged.
  double dropout = 0.0;
  // Modules trained fully beside the adapters (PEFT's modules_to_save, LLaMA-Factory's
  // additional_target): the embedding and/or the LM head, by their HF names ("embed_tokens",
  // "lm_head"; ChatGLM's "word_embeddings", "output_layer"). Each trains as a copy of the original.
  std::vector<std::string> modules_to_save;
  bool enabled() const { return rank > 0; }
  double scaling() const;
};

// Which of a block's internal linear layers a module belongs to (decoder.h: qkv, o, gate_up, down;
// a sparse layer's experts' gate_up and down).
enum class LinearSlot : uint8_t { Qkv, O, GateUp, Down, ExpertsGateUp, ExpertsDown };
inline constexpr int kLinearSlots = 6;

// Whether a lora_target entry names the experts' parameters ("experts" is one of its components).
bool expert_target(const std::string& target);

struct LoraModule {
  std::string path;  // the HF module path, e.g. "model.layers.0.self_attn.q_proj"
  std::string name;  // its last component, e.g. "q_proj" (what target_modules lists)
  // The experts' parameters: the count of experts (0 for a linear module), each with its own pair;
  // path is the parameter's ("model.layers.0.mlp.experts.gate_up_proj", what target_parameters
  // matches), rows x cols one expert's matrix. peft_path: the module PEFT names the pair under,
  // "model.layers.0.mlp.experts" with ".base_layer" for gate_up_proj when down_proj is adapted
  // too (PEFT nests one ParamWrapper per parameter, the module's first parameter innermost).
  int64_t experts = 0;
  std::string peft_path;
  int64_t layer = 0;
  LinearSlot slot = LinearSlot::Qkv;
  int64_t row_begin = 0, rows = 0, cols = 0;  // its rows of the internal weight [.., cols]; cols = in features
  int a = -1, b = -1;                         // A [rank, cols] and B [rows, rank] in the adapter's ParamStore
                                              // (experts: [experts rank, cols] and [experts rows, rank])
  int64_t index_in_layer = 0;                 // its place among the layer's modules (activation buffers)
  bool on_experts() const { return experts > 0; }
};

// The internal weight a module's rows belong to: its block's fused qkv, o, gate_up or down.
int module_weight(const DecoderParamIds& ids, const LoraModule& m);

// The linear modules of the model's blocks that `spec` targets, in the order transformers names
// them (layer by layer). keel::Error when a target matches nothing, naming the model's modules.
std::vector<LoraModule> lora_modules(const ModelConfig& config, const DecoderParamIds& ids, const LoraSpec& spec);
// Every distinct linear-module name of the model's blocks ("q_proj", "k_proj", ...).
std::vector<std::string> block_linear_names(const ModelConfig& config, const DecoderParamIds& ids);
// Declares A and B of every module in `adapter` (fills their a/b indices), with weight decay: to
// the Trainer, PEFT's matrices are ordinary weights.
void declare_lora_params(std::vector<LoraModule>& modules, int64_t rank, ParamStore& adapter);
// PEFT's initialisation: A kaiming-uniform with a = sqrt(5) (uniform in +-1/sqrt(in)), B zero.
// Deterministic in `seed`.
void init_lora(const std::vector<LoraModule>& modules, ParamStore& adapter, uint64_t seed);

// PEFT's tensor names of a module's matrices: "base_model.model.<path>.lora_A.weight" (the
// experts': under peft_path).
std::string peft_tensor_name(const LoraModule& m, bool a);
// PEFT's lora_B [rows, rank x experts] (column j x experts + e: expert e's column j) to keel's
// expert-by-expert [experts x rows, rank], and back.
void expert_b_from_peft(const LoraModule& m, int64_t rank, const float* peft, float* keel);
void expert_b_to_peft(const LoraModule& m, int64_t rank, const float* keel, float* peft);

// modules_to_save resolved against the model: the HF tensor names of the embedding and the LM head
// to train ("" when not), and the names as target lists write them. keel::Error for a name that is
// neither (naming both) or for tied embeddings (one tensor, two roles: not supported).
struct SavedModules {
  std::string embedding, lm_head;             // e.g. "model.embed_tokens.weight", "lm_head.weight"
  std::vector<std::string> names;             // e.g. {"embed_tokens", "lm_head"}
};
SavedModules resolve_modules_to_save(const ModelConfig& config, const DecoderParamIds& ids, const LoraSpec& spec);

}  // namespace keel::model
