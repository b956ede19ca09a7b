// The recipe's data as the data room's sources read it: the one place where a recipe's data
// settings (tokenizer, packing, chat template, prompt masking, cache, bad-record budget, pipeline,
// loader threads) become a data request, for the training data and the evaluation data alike, in
// supervised fine-tuning and in preference tuning.
#pragma once
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>

#include "keel/data/batch_source.h"
#include "keel/data/pair_source.h"
#include "keel/model/config.h"
#include "keel/recipe/recipe.h"

namespace keel::train {

using data::BatchSource;
using data::BatchSourceOptions;
using data::PairSource;

// The id padding gets in a run of this model: its pad_token_id when it has one in its vocabulary, else 0.
int32_t model_pad_id(const model::ModelConfig& config);

// What a run of this recipe asks of the data at `path` (its data_path or eval_data_path), for
// batches shaped by `options` (their vocabulary and padding id).
data::BatchSourceRequest batch_source_request(const recipe::Recipe& recipe, const std::string& path,
                                              const BatchSourceOptions& options);

// The micro-batches of `path` as the recipe says.
std::unique_ptr<BatchSource> open_batch_source(const std::string& path, const recipe::Recipe& recipe,
                                               const BatchSourceOptions& options, std::ostream& log);

// The preference pairs of `path` as the recipe says (ORPO: the prompt's tokens are targets too).
std::unique_ptr<PairSource> open_pair_source(const std::string& path, const recipe::Recipe& recipe,
                                             const BatchSourceOptions& options, std::ostream& log);

}  // namespace keel::train
