// keel export: a training checkpoint (checkpoint.h) -> a Hugging Face model directory, and the
// tokenizer files every exported model carries (here and in the trainer's output_dir/final).
#pragma once
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "keel/checkpoint/gguf_export.h"
#include "keel/core/dtype.h"
#include "keel/model/config.h"
#include "keel/recipe/recipe.h"

namespace keel::checkpoint {

enum class ExportFormat : uint8_t {
  AsTrained,    // the format (tensor names, config.json) the model was loaded or created in
  Hf,           // transformers' own classes: a glm_original model becomes GlmForCausalLM
  GlmOriginal,  // THUDM's ChatGLMModel names and config (GLM-4 models only)
  Gguf,         // one GGUF file for llama.cpp, as its convert_hf_to_gguf.py writes it (gguf_export.h)
};

struct ExportRequest {
  std::string checkpoint;      // a step-N directory, or a checkpoint_dir (its `latest` is exported);
                               // for GGUF also a Hugging Face model directory
  std::string destination;     // created if missing; for GGUF the .gguf file
  std::optional<DType> dtype;  // default: as output_dir/final (recipe::recipe_export_dtype)
  std::optional<formats::GgmlType> outtype;  // GGUF: default as llama.cpp's converter (default_gguf_outtype)
  ExportFormat format = ExportFormat::AsTrained;
  uint64_t max_shard_bytes = 5ull << 30;
  std::vector<std::string> recipe_overrides;  // "key=value" applied to the checkpoint's recipe.toml
  // Replace a destination that holds files keel did not write (by default refused: it may be the
  // user's model).
  bool overwrite = false;
  // A LoRA run's checkpoint: write the full model with the adapter merged into its weights
  // (W + scaling B A, PEFT's merge_and_unload) instead of the adapter.
  bool merge = false;
  // Where the progress of loading and writing weights goes (none if null); a live line if set.
  std::ostream* progress_log = nullptr;
  bool live_progress = false;
};

struct ExportResult {
  std::string step_dir;  // the checkpoint exported
  int64_t step = 0;
  DType dtype = DType::F32;
  model::ModelConfig config;  // as written (family and architecture of the export)
  bool adapter = false;       // a PEFT adapter was written (a LoRA checkpoint without --merge)
  std::vector<std::string> tokenizer_files;
  std::optional<GgufExportResult> gguf;  // what the GGUF export decided and wrote
};

// Verifies the checkpoint's manifest checksums, rebuilds the model from its recipe, loads the fp32
// master weights and writes config.json + safetensors (sharded with an index above
// max_shard_bytes) + the tokenizer files. Errors name the file: missing checkpoint, checksum
// mismatch, a model that no longer matches the checkpoint, an unwritable destination.
ExportResult export_checkpoint(const ExportRequest& request);

// Copies the tokenizer of the run (recipe::recipe_tokenizer_path: tokenizer.json, tokenizer_config.json,
// special_tokens_map.json, tokenizer.model, vocab/merges files, chat templates, tokenization_*.py)
// and model_name's generation_config.json into the model directory `dir`; a tokenizer given as a
// single file is copied as tokenizer.json (JSON) or under its own name (tiktoken ranks). Files
// that are not there are skipped. Returns the names copied.
std::vector<std::string> copy_tokenizer_files(const recipe::Recipe& recipe, const std::string& dir);

// Command-line spellings: "bf16" | "fp16" | "fp32" and "hf" | "glm-original" | "gguf"; errors list them.
DType export_dtype_from_name(const std::string& name);
ExportFormat export_format_from_name(const std::string& name);

}  // namespace keel::checkpoint
