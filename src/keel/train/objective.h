// What a training step optimises. The trainer's loop does not know: it agrees on the step's
// micro-batches, hands each to the objective (which runs the decoder's forward and backward on it
// and keeps what the step's loss needs), synchronises the gradients with the objective's partial
// loss, and asks the objective for the step's loss. Next-token loss (supervised fine-tuning) is
// next_token_loss.h; an objective over whole sequences (preference losses) scores them with
// Decoder::forward_score and weighs them with Decoder::forward_backward_weighted.
#pragma once
#include <cstdint>
#include <span>

#include "keel/data/shard_loader.h"
#include "keel/model/decoder.h"
#include "keel/report/metrics.h"

namespace keel::train {

// What every rank agreed on for a step before its micro-batches run (over all ranks).
struct StepTotals {
  double target_tokens = 0;  // tokens whose target is not -100
  double tokens = 0;         // every token of the step's rows, padding excluded
};

class Objective {
 public:
  virtual ~Objective() = default;
  // A step begins on this rank; `totals` are the whole step's, over all ranks.
  virtual void begin_step(const StepTotals& totals) = 0;
  // One micro-batch: forward and backward, its gradients added to the decoder's as
  // Decoder::forward_backward adds them (scaled so the step's micro-batches sum to its gradient).
  // `rows` is the data `batch` points into (preference pairs: which pair each row holds).
  virtual void micro_batch(model::Decoder& decoder, const model::MicroBatch& batch,
                           const data::PackedMicroBatch& rows) = 0;
  // This rank's part of the step's loss: what data parallel sums over the ranks.
  virtual double partial_loss() const = 0;
  // The step's loss from the sum of every rank's partial_loss().
  virtual double step_loss(double summed_partial_loss) const = 0;
  // This rank's sums behind the objective's own metrics (data parallel sums them over the ranks,
  // as the loss), and the step's metrics from the summed ones. None for next-token loss.
  virtual std::span<double> partial_metrics() { return {}; }
  virtual void report(std::span<const double> summed_metrics, report::StepMetrics& m) const {}
};

}  // namespace keel::train
