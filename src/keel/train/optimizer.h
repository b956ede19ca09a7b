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
  // this rank's ZeRO shard) from params.shard_grads() times grad_scale (clip_coefficient); `step`
  // counts from 1 (bias correction).
  void step(double lr, int64_t step, double grad_scale = 1.0);

 private:
  kernels::Backend& backend_;
  model::ParamStore& params_;
  AdamWConfig config_;
};

// The gradients' functions read params.shard_grads() over params.optimizer_range(): all of them,
// or under ZeRO this rank's shard (whose sums of squares the ranks add for the global norm).
//
// L2 norm of the gradients (as clip_grad_norm_ computes it; the global norm without ZeRO).
double gradient_norm(kernels::Backend& backend, model::ParamStore& params);
double gradient_sum_of_squares(kernels::Backend& backend, model::ParamStore& params);
// clip_grad_norm_'s factor for gradients of this norm: max_norm / (norm + 1e-6) when that is below
// 1, else 1 (also when max_norm <= 0: no clipping). AdamW::step applies it as it reads each
// gradient, so clipping costs no pass over the gradients of its own.
double clip_coefficient(double norm, double max_norm);

}  // namespace keel::train
