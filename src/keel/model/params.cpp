#include "keel/model/params.h"

#include <algorithm>

#include "keel/core/error.h"

namespace keel::model {

namespace {
constexpr int64_t kAlignElements = 16;  // 64 bytes of fp32: every tensor starts on a cache line
}

int ParamStore::add(std::string name, std::vector<int64_t> shape, bool weight_decay) {
  require(weights_.empty(), "ParamStore: parameter '{}' declared after allocation", name);
  Param p;
  p.name = std::move(name);
  p.shape = std::move(shape);
  p.numel = 1;
  for (int64_t d : p.shape) p.numel *= d;
  p.offset = total_;
  p.weight_decay = weight_decay;
  total_ += (p.numel + kAlignElements - 1) / kAlignElements * kAlignElements;
  params_.push_back(std::move(p));
  return int(params_.size()) - 1;
}

void ParamStore::allocate(bool with_bf16_copy) {
  weights_.assign(total_, 0.0f);
  grads_.assign(total_, 0.0f);
  if (with_bf16_copy) weights_bf16_.assign(total_, bf16{0});
}

void ParamStore::allocate_optimizer_state() {
  adam_m_.assign(total_, 0.0f);
  adam_v_.assign(total_, 0.0f);
}

void ParamStore::zero_grads() { std::fill(grads_.begin(), grads_.end(), 0.0f); }

void ParamStore::refresh_bf16_copy() {
  if (!weights_bf16_.empty()) convert_f32_to_bf16(weights_.data(), weights_bf16_.data(), total_);
}

}  // namespace keel::model
