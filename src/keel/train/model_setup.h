// Builds the model a recipe asks for: loaded from an HF directory, or new from [model_config].
#pragma once
#include <memory>
#include <string>

#include "keel/core/dtype.h"
#include "keel/model/decoder.h"
#include "keel/train/recipe.h"

namespace keel::train {

struct ModelSetup {
  std::unique_ptr<model::Decoder> decoder;
  DType export_dtype = DType::F32;  // the dtype the weights came in (or the recipe's, for new models)
  std::vector<std::string> unused_tensors;
};

model::ModelConfig scratch_model_config(const ScratchModel& m);
ModelSetup setup_model(const Recipe& recipe);

}  // namespace keel::train
