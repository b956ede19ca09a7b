// AdamW over the model's flat parameter store, with Hugging Face Trainer's grouping (no weight
// decay on biases and norm weights) and torch.nn.utils.clip_grad_norm_ clipping.
#pragma once
#include <cstdint>

#include "keel/kernels/backend.h"
#include "keel/model/params.h"

namespace keel::train {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
};

class AdamW {
 public:
  AdamW(kernels::Backend& backend, model::ParamStore& params, AdamWConfig config);
  // One update with learning rate lr of the parameters in params.optimizer_range() (everything, or
  // this rank's ZeRO-1 shard); `step` counts from 1 (bias correction).
  void step(double lr, int64_t step);

 private:
  kernels::Backend& backend_;
  model::ParamStore& params_;
  AdamWConfig config_;
};

// Global L2 norm of all gradients (as clip_grad_norm_ computes it).
double gradient_norm(kernels::Backend& backend, model::ParamStore& params);
// The sum of squares of the gradients in `range` (ZeRO-1: ranks add theirs for the global norm).
double gradient_sum_of_squares(kernels::Backend& backend, model::ParamStore& params, FlatRange range);
// Scales the gradients in `range` (default: all) by max_norm / (norm + 1e-6) when that is below 1,
// like clip_grad_norm_. Returns the factor applied (1 when not clipped).
double clip_gradients(kernels::Backend& backend, model::ParamStore& params, double norm, double max_norm,
                      FlatRange range = {0, -1});

}  // namespace keel::train
