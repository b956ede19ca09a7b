#include "keel/train/evaluation.h"

#include <cmath>

namespace keel::train {

EvalResult evaluate(model::Decoder& decoder, const data::TokenRecords& records, int32_t pad_id,
                    data::MicroBatchData& buffers) {
  data::SampleOrder file_order(records.size(), false, 0);
  double loss_sum = 0;
  EvalResult result;
  for (int64_t first = 0; first < records.size(); first += buffers.batch) {
    data::fill_micro_batch(records, file_order, first, pad_id, buffers);
    // Rows past the end of the set wrapped around to the start: they must not count twice.
    for (int64_t b = records.size() - first; b < buffers.batch; ++b) {
      if (b < 0) continue;
      for (int64_t t = 0; t < buffers.seq; ++t) {
        int32_t& target = buffers.targets[b * buffers.seq + t];
        buffers.target_tokens -= target != -100;
        target = -100;
      }
    }
    model::MicroBatch mb{buffers.batch, buffers.seq, buffers.input_ids.data(), buffers.targets.data(),
                         buffers.positions.data(), nullptr};
    loss_sum += decoder.forward_loss(mb);
    result.target_tokens += buffers.target_tokens;
  }
  result.loss = result.target_tokens > 0 ? loss_sum / double(result.target_tokens) : 0.0;
  result.perplexity = std::exp(result.loss);
  return result;
}

}  // namespace keel::train
