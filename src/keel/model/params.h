// ParamStore: every trainable tensor of the model lives in one contiguous fp32 buffer (and its
// gradient, Adam moments and bf16 compute copy in parallel buffers with the same offsets).
// One flat range makes the optimizer, the global gradient norm, gradient buckets for data
// parallel (contiguous ranges in reverse layer order) and ZeRO shards simple slices.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "keel/core/dtype.h"

namespace keel::model {

struct Param {
  std::string name;              // internal name, e.g. "layers.3.qkv.weight"
  std::vector<int64_t> shape;    // [rows, cols] or [n]
  int64_t offset = 0;            // into the flat buffers, in elements (64-byte aligned)
  int64_t numel = 0;
  bool weight_decay = true;      // false for biases and norm weights (HF Trainer's rule)
};

class ParamStore {
 public:
  // Declares a parameter; returns its index. All declarations come before allocate().
  int add(std::string name, std::vector<int64_t> shape, bool weight_decay);
  // Allocates the buffers (weights, grads; Adam moments and the bf16 copy on request).
  void allocate(bool with_bf16_copy);
  void allocate_optimizer_state();

  const std::vector<Param>& params() const { return params_; }
  const Param& param(int i) const { return params_[i]; }
  int64_t total() const { return total_; }

  float* weight(int i) { return weights_.data() + params_[i].offset; }
  const float* weight(int i) const { return weights_.data() + params_[i].offset; }
  float* grad(int i) { return grads_.data() + params_[i].offset; }
  bf16* weight_bf16(int i) { return weights_bf16_.empty() ? nullptr : weights_bf16_.data() + params_[i].offset; }

  float* weights() { return weights_.data(); }
  const float* weights_data() const { return weights_.data(); }
  float* grads() { return grads_.data(); }
  float* adam_m() { return adam_m_.data(); }
  float* adam_v() { return adam_v_.data(); }
  bf16* weights_bf16() { return weights_bf16_.empty() ? nullptr : weights_bf16_.data(); }
  bool has_bf16_copy() const { return !weights_bf16_.empty(); }

  void zero_grads();
  void refresh_bf16_copy();  // after weights change outside the optimizer (load, init)

 private:
  std::vector<Param> params_;
  int64_t total_ = 0;
  std::vector<float> weights_, grads_, adam_m_, adam_v_;
  std::vector<bf16> weights_bf16_;
};

}  // namespace keel::model
