#include "keel/train/optimizer.h"

#include <cmath>

#include "keel/kernels/adamw.h"

namespace keel::train {

AdamW::AdamW(model::ParamStore& params, AdamWConfig config) : params_(params), config_(config) {
  params_.allocate_optimizer_state();
}

void AdamW::step(double lr, int64_t step) {
  kernels::AdamWStep s{float(lr), float(config_.beta1), float(config_.beta2), float(config_.eps), step};
  for (size_t i = 0; i < params_.params().size(); ++i) {
    const auto& p = params_.param(int(i));
    const float wd = p.weight_decay ? float(config_.weight_decay) : 0.0f;
    kernels::adamw_update(params_.weight(int(i)), params_.grad(int(i)), params_.adam_m() + p.offset,
                          params_.adam_v() + p.offset, p.numel, s, wd, params_.weight_bf16(int(i)));
  }
}

double gradient_norm(model::ParamStore& params) {
  return std::sqrt(kernels::sum_of_squares(params.grads(), params.total()));
}

double clip_gradients(model::ParamStore& params, double norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  const double coef = max_norm / (norm + 1e-6);
  if (coef >= 1.0) return 1.0;
  kernels::scale_in_place(params.grads(), params.total(), float(coef));
  return coef;
}

}  // namespace keel::train
