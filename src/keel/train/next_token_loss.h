// Next-token loss (supervised fine-tuning, Hugging Face Trainer's semantics): the mean over every
// target token of the step, on every rank, of -log p(target); each micro-batch's gradient is
// scaled by 1 / the step's target tokens, so micro-batches and ranks sum to the step's mean.
#pragma once
#include "keel/train/objective.h"

namespace keel::train {

class NextTokenLoss final : public Objective {
 public:
  void begin_step(const StepTotals& totals) override {
    target_tokens_ = totals.target_tokens;
    grad_scale_ = totals.target_tokens > 0 ? 1.0 / totals.target_tokens : 0.0;
    loss_sum_ = 0.0;
  }
  void micro_batch(model::Decoder& decoder, const model::MicroBatch& batch, const data::PackedMicroBatch&) override {
    loss_sum_ += decoder.forward_backward(batch, grad_scale_);
  }
  double partial_loss() const override { return loss_sum_; }
  double step_loss(double summed) const override { return target_tokens_ > 0 ? summed / target_tokens_ : 0.0; }

 private:
  double target_tokens_ = 0, grad_scale_ = 0, loss_sum_ = 0;
};

}  // namespace keel::train
