// Evaluation on held-out records: mean token loss over the whole set (the same shifted,
// -100-ignoring loss as training) and its perplexity.
#pragma once
#include <cstdint>

#include "keel/train/batch_source.h"
#include "keel/model/decoder.h"

namespace keel::train {

struct EvalResult {
  double loss = 0, perplexity = 0;
  int64_t target_tokens = 0;
};

// Runs every sequence once, in order: `source` must read without shuffling, one rank, one
// micro-batch per step. Rows of a last partial batch (wrapped around to the start) carry no loss.
EvalResult evaluate(model::Decoder& decoder, BatchSource& source);

}  // namespace keel::train
