// The training loop: recipe -> model + data -> optimizer steps -> metrics and the exported model.
#pragma once
#include <cstdint>
#include <ostream>

#include "keel/train/recipe.h"

namespace keel::train {

struct TrainSummary {
  int64_t steps = 0;
  double final_loss = 0;
  double tokens_per_s = 0;
  double seconds = 0;
};

// Runs the recipe to completion, logging to `log`; writes output_dir/metrics.jsonl and
// output_dir/final/ (an HF model directory).
TrainSummary run_training(const Recipe& recipe, std::ostream& log);

}  // namespace keel::train
