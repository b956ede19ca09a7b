// Next-token loss (supervised fine-tuning, Hugging Face Trainer's semantics): the mean over every
// target token of the step, on every rank, of -log p(target); each micro-batch's gradient is
// scaled by 1 / the step's target tokens, so micro-batches and ranks sum to the step's mean.
// A mixture-of-experts model adds router_aux_loss_coef times each micro-batch's load-balancing
// loss (model/experts.h), unscaled, as transformers' Trainer does: the model adds it to a loss
// already divided by the step's tokens (num_items_in_batch), which the Trainer then leaves
// undivided by the accumulation steps; the step's loss is logged as their sum over the step.
#pragma once
#include <array>

#include "keel/train/objective.h"

namespace keel::train {

class NextTokenLoss final : public Objective {
 public:
  void begin_step(const StepTotals& totals) override {
    target_tokens_ = totals.target_tokens;
    grad_scale_ = totals.target_tokens > 0 ? 1.0 / totals.target_tokens : 0.0;
    loss_sum_ = 0.0;
    aux_ = {0.0, 0.0};
  }
  void micro_batch(model::Decoder& decoder, const model::MicroBatch& batch, const data::PackedMicroBatch&) override {
    loss_sum_ += decoder.forward_backward(batch, grad_scale_);
    // GLM-4.5's transformers class computes no load-balancing loss: nothing to report or add.
    if (!decoder.config().has_aux_loss()) return;
    experts_ = true;
    aux_weight_ = decoder.config().aux_loss_weight();
    aux_[0] += decoder.aux_loss();
    aux_[1] += 1;
  }
  double partial_loss() const override { return loss_sum_; }
  double step_loss(double summed) const override { return target_tokens_ > 0 ? summed / target_tokens_ : 0.0; }
  // Mixture of experts: the load-balancing losses' sum and the micro-batches they came from.
  std::span<double> partial_metrics() override { return experts_ ? std::span<double>(aux_) : std::span<double>(); }
  void report(std::span<const double> summed, report::StepMetrics& m) const override {
    if (summed.size() < 2 || summed[1] <= 0) return;
    m.aux_loss = summed[0] / summed[1];
    m.loss += aux_weight_ * summed[0];
  }

 private:
  double target_tokens_ = 0, grad_scale_ = 0, loss_sum_ = 0;
  bool experts_ = false;
  double aux_weight_ = 0;
  std::array<double, 2> aux_{};
};

}  // namespace keel::train
