// AdamW over the model's flat parameter store, with Hugging Face Trainer's grouping (no weight
// decay on biases and norm weights) and torch.nn.utils.clip_grad_norm_ clipping.
#pragma once
#include <cstdint>

#include "keel/model/params.h"

namespace keel::train {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
};

class AdamW {
 public:
  AdamW(model::ParamStore& params, AdamWConfig config);
  // One update with learning rate lr; `step` counts from 1 (bias correction).
  void step(double lr, int64_t step);

 private:
  model::ParamStore& params_;
  AdamWConfig config_;
};

// Global L2 norm of all gradients (as clip_grad_norm_ computes it).
double gradient_norm(model::ParamStore& params);
// Scales gradients by max_norm / (norm + 1e-6) when that is below 1, like clip_grad_norm_.
// Returns the factor applied (1 when not clipped).
double clip_gradients(model::ParamStore& params, double norm, double max_norm);

}  // namespace keel::train
