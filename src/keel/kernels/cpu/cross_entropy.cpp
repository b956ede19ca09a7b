// Softmax cross-entropy fused with its gradient, one row of logits at a time:
//   lse = max + log(sum_j exp(x_j - max)),  loss = lse - x[label],
//   d loss / d x_j = softmax_j - [j == label].
// The row is overwritten in place: first with exp(x_j - max), then with the scaled gradient,
// so only two passes over the vocabulary need an exp.
// Final-logit soft-capping (Gemma 2) first replaces each logit by cap * tanh(x / cap), as
// transformers does (divide, tanh, multiply), and multiplies the gradient by 1 - tanh^2.
#include "keel/kernels/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "keel/core/error.h"
#include "keel/core/threads.h"
#include "keel/kernels/cpu/vector_ops.h"

namespace keel::kernels {
namespace {

// Below this many logits a parallel region costs more than it saves.
constexpr int64_t kParallelMinElements = int64_t(1) << 15;

// Loss of one row; the row becomes (softmax - onehot(label)) * grad_scale.
// float: the same steps through the vectorised row kernels, and with `grad_bf16` the last pass
// writes the gradient there in bf16 (scale_to_bf16 rounds x * factor as scale then conversion did).
double cross_entropy_row(float* x, int32_t label, int64_t vocab, double grad_scale, bf16* grad_bf16 = nullptr) {
  const VectorOps& ops = vector_ops();
  const float max = ops.masked_max(x, RowVisibility{vocab, nullptr, 0});
  const double target = double(x[label]);
  const double sum = ops.exp_sum_f64(x, vocab, max);
  const double lse = double(max) + std::log(sum);
  const double target_prob = double(x[label]) / sum;
  const float label_grad = float((target_prob - 1.0) * grad_scale);
  if (grad_bf16) {
    ops.scale_to_bf16(x, float(grad_scale / sum), grad_bf16, vocab);
    grad_bf16[label] = float_to_bf16(label_grad);
    return lse - target;
  }
  ops.scale(x, float(grad_scale / sum), vocab);
  x[label] = label_grad;
  return lse - target;
}

template <typename T>
double cross_entropy_row(T* x, int32_t label, int64_t vocab, double grad_scale) {
  T max = x[0];
  for (int64_t j = 1; j < vocab; ++j) max = x[j] > max ? x[j] : max;
  const double target = double(x[label]);
  double sum = 0;  // double: a 150k-term sum of float exps would lose the small ones
  for (int64_t j = 0; j < vocab; ++j) {
    const T e = std::exp(x[j] - max);
    x[j] = e;
    sum += double(e);
  }
  const double lse = double(max) + std::log(sum);
  const double target_prob = double(x[label]) / sum;
  const double prob_scale = grad_scale / sum;  // softmax_j * grad_scale = exp(x_j - max) * this
  for (int64_t j = 0; j < vocab; ++j) x[j] = T(double(x[j]) * prob_scale);
  x[label] = T((target_prob - 1.0) * grad_scale);
  return lse - target;
}

// Soft-capping around a row's loss: the capped logits in place, the cap's slope 1 - tanh^2 kept
// for the gradient's chain rule (float: the vectorised row kernel). The thread's buffer grows to
// the vocabulary once; steps then reuse it.
template <typename T>
double capped_cross_entropy_row(T* x, int32_t label, int64_t vocab, double grad_scale, double softcap) {
  static thread_local std::vector<T> slope_of_row;
  if (slope_of_row.size() < size_t(vocab)) slope_of_row.resize(size_t(vocab));
  T* slope = slope_of_row.data();
  const T cap = T(softcap);
  if constexpr (std::is_same_v<T, float>) {
    vector_ops().soft_cap(x, vocab, 1.0f, cap, slope);
  } else {
    for (int64_t j = 0; j < vocab; ++j) {
      const T t = std::tanh(x[j] / cap);
      x[j] = t * cap;
      slope[j] = T(1) - t * t;
    }
  }
  const double loss = cross_entropy_row(x, label, vocab, grad_scale);
  for (int64_t j = 0; j < vocab; ++j) x[j] *= slope[j];
  return loss;
}

}  // namespace

template <typename T>
double cross_entropy_forward_backward(T* logits, int64_t ld, const int32_t* labels, int64_t rows, int64_t vocab,
                                      double grad_scale, double softcap, bf16* grad_bf16, const LossRows& per_row) {
  require(grad_bf16 == nullptr || std::is_same_v<T, float>, "cross_entropy: a bf16 gradient of double logits");
  for (int64_t r = 0; r < rows; ++r)
    require(labels[r] == kIgnoreIndex || (labels[r] >= 0 && labels[r] < vocab),
            "cross_entropy: row {} has label {}, expected {} or a token id in [0, {})", r, labels[r], kIgnoreIndex,
            vocab);
  const double scale = grad_scale;
  // Row losses are summed after the parallel loop, in row order, so the total does not depend on
  // the thread count.
  static thread_local std::vector<double> row_loss;
  row_loss.assign(rows, 0.0);
  double* losses = row_loss.data();
  for_each_task(rows, rows * vocab >= kParallelMinElements, [&](int64_t r, int) {
    T* x = logits + r * ld;
    bf16* xb = grad_bf16 ? grad_bf16 + r * ld : nullptr;
    if (per_row.mean_logit) {  // of the logits the loss reads: after the cap
      double sum = 0;
      for (int64_t j = 0; j < vocab; ++j)
        sum += softcap > 0 ? softcap * std::tanh(double(x[j]) / softcap) : double(x[j]);
      per_row.mean_logit[r] = sum / double(vocab);
    }
    const double grad_scale = per_row.grad_scale ? scale * double(per_row.grad_scale[r]) : scale;
    if (labels[r] == kIgnoreIndex) {
      for (int64_t j = 0; j < vocab; ++j) x[j] = T(0);
      if (xb) std::fill_n(xb, vocab, bf16{});
      return;
    }
    if constexpr (std::is_same_v<T, float>)
      if (xb && softcap <= 0) {  // the fused last pass; a capped row converts after its slope
        losses[r] = cross_entropy_row(x, labels[r], vocab, grad_scale, xb);
        return;
      }
    losses[r] = softcap > 0 ? capped_cross_entropy_row(x, labels[r], vocab, grad_scale, softcap)
                            : cross_entropy_row(x, labels[r], vocab, grad_scale);
    if constexpr (std::is_same_v<T, float>)
      if (xb) vector_ops().scale_to_bf16(x, 1.0f, xb, vocab);
  });
  double total = 0;
  for (int64_t r = 0; r < rows; ++r) total += losses[r];
  if (per_row.loss) std::copy_n(losses, rows, per_row.loss);
  return total;
}

template double cross_entropy_forward_backward<float>(float*, int64_t, const int32_t*, int64_t, int64_t, double, double,
                                                      bf16*, const LossRows&);
template double cross_entropy_forward_backward<double>(double*, int64_t, const int32_t*, int64_t, int64_t, double,
                                                       double, bf16*, const LossRows&);

}  // namespace keel::kernels
