// Evaluation on held-out records: mean token loss over the whole set (the same shifted,
// -100-ignoring loss as training) and its perplexity.
#pragma once
#include <cstdint>

#include "keel/data/batch_builder.h"
#include "keel/data/token_records.h"
#include "keel/model/decoder.h"

namespace keel::train {

struct EvalResult {
  double loss = 0, perplexity = 0;
  int64_t target_tokens = 0;
};

// Runs every record once, in file order, in micro-batches shaped like `buffers` (reused); a last
// partial batch is padded with fully ignored rows.
EvalResult evaluate(model::Decoder& decoder, const data::TokenRecords& records, int32_t pad_id,
                    data::MicroBatchData& buffers);

}  // namespace keel::train
