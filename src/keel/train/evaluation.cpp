#include "keel/train/evaluation.h"

#include <algorithm>
#include <cmath>

namespace keel::train {

EvalResult evaluate(model::Decoder& decoder, BatchSource& loader) {
  const int64_t n = loader.sequences();
  double loss_sum = 0;
  EvalResult result;
  for (int64_t step = 1, first = 0; first < n; ++step, first += loader.samples_per_step()) {
    // A copy: the rows past the end are masked here without touching the loader's buffers.
    data::PackedMicroBatch mb = loader.step_batches(step)[0];
    for (int64_t b = std::max<int64_t>(0, n - first); b < mb.batch; ++b)
      for (int64_t t = 0; t < mb.seq; ++t) {
        int32_t& target = mb.targets[b * mb.seq + t];
        mb.target_tokens -= target != -100;
        target = -100;
      }
    model::MicroBatch batch{mb.batch,
                            mb.seq,
                            mb.input_ids.data(),
                            mb.targets.data(),
                            mb.positions.data(),
                            loader.packed() ? mb.segments.data() : nullptr};
    loss_sum += decoder.forward_loss(batch);
    result.target_tokens += mb.target_tokens;
  }
  result.loss = result.target_tokens > 0 ? loss_sum / double(result.target_tokens) : 0.0;
  result.perplexity = std::exp(result.loss);
  return result;
}

}  // namespace keel::train
