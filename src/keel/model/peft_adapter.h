// LoRA adapters in PEFT's format (what PeftModel.from_pretrained and vLLM's LoRA loader read): a
// directory with adapter_config.json (peft_type "LORA", r, lora_alpha, target_modules, ...) and
// adapter_model.safetensors holding "base_model.model.<module path>.lora_A.weight" [r, in] and
// ".lora_B.weight" [out, r] for each adapted module, in the model's own module names.
#pragma once
#include <string>

#include "keel/core/dtype.h"
#include "keel/model/decoder.h"

namespace keel::model {

inline constexpr const char* kAdapterConfigFile = "adapter_config.json";
inline constexpr const char* kAdapterWeightsFile = "adapter_model.safetensors";

// What an adapter directory's adapter_config.json says, as keel's LoRA settings (plus dropout,
// which only training uses). Errors name the file and the key: not a LoRA adapter, a regex
// target_modules (keel matches names), layers_to_transform, a bias or modules_to_save.
struct PeftAdapterConfig {
  LoraSpec spec;
  double dropout = 0.0;
  std::string base_model;  // base_model_name_or_path ("" if absent)
};
PeftAdapterConfig read_peft_adapter_config(const std::string& dir);
// The same from the text of an adapter_config.json (`path` names it in errors).
PeftAdapterConfig parse_peft_adapter_config(const std::string& text, const std::string& path);
bool is_peft_adapter_dir(const std::string& dir);

// Writes the decoder's adapter (it must have one) into `dir` in `dtype`.
void save_peft_adapter(const Decoder& decoder, const std::string& dir, const std::string& base_model,
                       double dropout, DType dtype);
// Loads an adapter directory into the decoder's adapter. Its settings must equal the decoder's
// (rank, alpha, rsLoRA, the same modules): a mismatch is an error naming both values.
void load_peft_adapter(Decoder& decoder, const std::string& dir);
// Adds an adapter directory's update into a decoder's own weights, W += scaling * B A (PEFT's
// merge_and_unload), in fp32; the decoder needs no adapter of its own. Returns the modules merged.
int64_t merge_peft_adapter(Decoder& decoder, const std::string& dir);
// The same for the decoder's own adapter (keel export --merge of a LoRA run).
void merge_own_adapter(Decoder& decoder);

}  // namespace keel::model
