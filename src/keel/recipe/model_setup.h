// Builds the model a recipe asks for: loaded from an HF directory, or new from [model_config].
#pragma once
#include <memory>
#include <ostream>
#include <string>

#include "keel/core/dtype.h"
#include "keel/model/decoder.h"
#include "keel/recipe/recipe.h"

namespace keel::recipe {

struct ModelSetup {
  std::unique_ptr<model::Decoder> decoder;
  DType export_dtype = DType::F32;  // the dtype the weights came in (or the recipe's, for new models)
  std::vector<std::string> unused_tensors;
};

model::ModelConfig scratch_model_config(const ScratchModel& m);
// The model's architecture from the recipe alone: [model_config], or model_name/config.json
// (no weights are read, so a directory holding only config.json is enough).
model::ModelConfig recipe_model_config(const Recipe& recipe);
model::Precision recipe_precision(const Recipe& recipe);
// keel::Error when the run's sequences are longer than the model has positions
// (max_position_embeddings): it would train on positions the model never had, silently.
void require_sequence_fits_model(const Recipe& recipe, const model::ModelConfig& config);
// The decoder settings a training run of this recipe uses: gradient checkpointing, optimizer
// state in the arena (ZeRO-1: a 1/dp_degree shard), memory_pool_size (GiB) as the arena's cap and
// memory_planning, LoRA and QLoRA's 4-bit base (the recipe's quantization_bit, or the model's own
// when it was saved in 4 bits by bitsandbytes: keel::Error when the recipe asks otherwise).
model::DecoderOptions training_decoder_options(const Recipe& recipe, const model::ModelConfig& config);
// What ZeRO stage `stage` shards over `dp` ranks (stage 1: the optimizer state, and in bf16 full
// fine-tuning the fp32 masters with it; 2: the gradients too; 3: the weights too), into `o`
// (LoRA already set: its frozen base has no masters to shard below stage 3).
void set_zero_stage(model::DecoderOptions& o, int64_t stage, int64_t dp, model::Precision precision);
// The recipe's LoRA settings (rank 0 when finetuning_type is "full").
model::LoraSpec recipe_lora_spec(const Recipe& recipe);
// The dtype a run's model is exported in by default (output_dir/final, keel export): that of
// model_name's weights, or the recipe's dtype for a model built from [model_config].
DType recipe_export_dtype(const Recipe& recipe, const model::ModelConfig& config, const model::DecoderParamIds& ids);
// `rank`: this process's data-parallel rank, which picks its optimizer shard under ZeRO-1.
// progress_log, if given, shows the weights loading (a live line with live_progress).
ModelSetup setup_model(const Recipe& recipe, int rank = 0, std::ostream* progress_log = nullptr,
                       bool live_progress = false);

}  // namespace keel::recipe
