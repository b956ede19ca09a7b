// Evaluation on held-out records: mean token loss over the whole set (the same shifted,
// -100-ignoring loss as training) and its perplexity.
#pragma once
#include <cstdint>
#include <ostream>

#include "keel/train/data_sources.h"
#include "keel/model/decoder.h"
#include "keel/recipe/recipe.h"

namespace keel::train {

struct EvalResult {
  double loss = 0, perplexity = 0;
  int64_t target_tokens = 0;
};

// Runs every sequence once, in order: `source` must read without shuffling, one rank, one
// micro-batch per step. Rows of a last partial batch (wrapped around to the start) carry no loss.
EvalResult evaluate(model::Decoder& decoder, BatchSource& source);

// How evaluation reads eval_data_path: every sequence once, in order, one rank, batch_size rows.
BatchSourceOptions evaluation_source_options(const recipe::Recipe& recipe, const model::ModelConfig& config);

// The recipe's model (model_name, with adapter_name_or_path for LoRA; or a new [model_config]
// model) evaluated on its eval_data_path, as a training run evaluates: batch_size rows of
// max_seq_len, the same data preparation. keel.Trainer.evaluate() calls it.
EvalResult evaluate_recipe(const recipe::Recipe& recipe, std::ostream& log);

}  // namespace keel::train
