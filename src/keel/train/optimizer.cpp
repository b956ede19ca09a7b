#include "keel/train/optimizer.h"

#include <algorithm>
#include <cmath>

namespace keel::train {

AdamW::AdamW(kernels::Backend& backend, model::ParamStore& params, AdamWConfig config)
    : backend_(backend), params_(params), config_(config) {
  params_.allocate_optimizer_state();
}

void AdamW::step(double lr, int64_t step, double grad_scale) {
  kernels::AdamWStep s{float(lr), float(config_.beta1), float(config_.beta2), float(config_.eps), step, grad_scale};
  // Only the parameters' parts inside this process's optimizer range (all of them, or its ZeRO-1
  // shard): the moments are held for that range alone.
  // Under ZeRO-3 the masters held are that shard too, and the bf16 copies are made when the weights
  // are gathered, not here (weight_bf16 is null outside a call). With sharded masters under ZeRO-1/2
  // the bf16 copies are the resident buffers the step reads: this rank's part is written here and
  // the all-gather after the step moves it (Decoder::refresh_resident_weights).
  const FlatRange mine = params_.optimizer_range(), held = params_.master_range();
  for (size_t i = 0; i < params_.params().size(); ++i) {
    const auto& p = params_.param(int(i));
    const FlatRange part = FlatRange{p.offset, p.offset + p.numel}.intersect(mine);
    if (part.size() == 0) continue;
    const int64_t local = part.begin - p.offset, moment = part.begin - mine.begin;
    const float wd = p.weight_decay ? float(config_.weight_decay) : 0.0f;
    bf16* copy = params_.weight_bf16(int(i));
    backend_.adamw_update(params_.masters() + (part.begin - held.begin), params_.shard_grads() + moment,
                          params_.adam_m() + moment, params_.adam_v() + moment, part.size(), s, wd,
                          copy ? copy + local : nullptr);
  }
}

double gradient_sum_of_squares(kernels::Backend& backend, model::ParamStore& params) {
  return backend.sum_of_squares(params.shard_grads(), params.optimizer_range().size());
}

double gradient_norm(kernels::Backend& backend, model::ParamStore& params) {
  return std::sqrt(gradient_sum_of_squares(backend, params));
}

double clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  return std::min(1.0, max_norm / (norm + 1e-6));
}

}  // namespace keel::train
