// Gated MLP activations, out = act(g) * u.
// SwiGLU: silu(g) = g * sigmoid(g) = g / (1 + exp(-g));
//   d out/du = silu(g);  d out/dg = u * sigmoid(g) * (1 + g * (1 - sigmoid(g))).
// GeGLU with tanh-approximated GELU, as torch's kernel evaluates it:
//   gelu(g) = 0.5 g (1 + tanh(k (g + 0.044715 g^3))),  k = sqrt(2 / pi);
//   d gelu/dg = 0.5 (1 + t) + 0.5 g (1 - t^2) k (1 + 3 * 0.044715 g^2),  t = tanh(...).
#include "keel/kernels/glu.h"

#include <cmath>
#include <type_traits>

#include "keel/core/error.h"
#include "keel/core/threads.h"
#include "keel/kernels/cpu/vector_ops.h"

namespace keel::kernels {
namespace {

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMinElements = int64_t(1) << 15;

// torch's constants: kBeta = M_SQRT2 * M_2_SQRTPI * 0.5 (= sqrt(2 / pi)), kKappa = 0.044715.
template <typename T>
struct GeluTanh {
  static constexpr T kBeta = T(M_SQRT2 * M_2_SQRTPI * 0.5);
  static constexpr T kKappa = T(0.044715);
  static T value(T x) {
    const T inner = kBeta * (x + kKappa * x * x * x);
    return T(0.5) * x * (T(1) + std::tanh(inner));
  }
  static T derivative(T x) {
    const T x_sq = x * x;
    const T inner = kBeta * (x + kKappa * x_sq * x);
    const T t = std::tanh(inner);
    const T left = T(0.5) * x, right = T(1) + t;
    const T left_derivative = T(0.5) * right;
    const T right_derivative = left * (T(1) - t * t) * kBeta * (T(1) + T(3) * kKappa * x_sq);
    return left_derivative + right_derivative;
  }
};

// float: the vectorised row kernels (tanh through exp, within 1e-7); double: std::tanh.
template <typename T>
void glu_row(GluActivation act, const T* g, const T* u, T* o, int64_t inter) {
  if (act == GluActivation::GeluTanh) {
    if constexpr (std::is_same_v<T, float>)
      vector_ops().gelu_tanh_mul(g, u, o, inter);
    else
      for (int64_t c = 0; c < inter; ++c) o[c] = GeluTanh<T>::value(g[c]) * u[c];
    return;
  }
  // torch's silu kernel evaluates x / (1 + exp(-x)); the same expression (float: vectorised,
  // with keel's exp).
  if constexpr (std::is_same_v<T, float>)
    vector_ops().silu_mul(g, u, o, inter);
  else
    for (int64_t c = 0; c < inter; ++c) o[c] = g[c] / (T(1) + std::exp(-g[c])) * u[c];
}

template <typename T>
void glu_row_backward(GluActivation act, const T* g, const T* u, const T* dy, T* dg, T* du, int64_t inter) {
  if (act == GluActivation::GeluTanh) {
    if constexpr (std::is_same_v<T, float>) {
      vector_ops().gelu_tanh_mul_backward(g, u, dy, dg, du, inter);
    } else {
      for (int64_t c = 0; c < inter; ++c) {
        du[c] = dy[c] * GeluTanh<T>::value(g[c]);
        dg[c] = dy[c] * u[c] * GeluTanh<T>::derivative(g[c]);
      }
    }
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    vector_ops().silu_mul_backward(g, u, dy, dg, du, inter);
    return;
  }
  for (int64_t c = 0; c < inter; ++c) {
    const T sig = T(1) / (T(1) + std::exp(-g[c]));
    du[c] = dy[c] * (g[c] * sig);
    dg[c] = dy[c] * u[c] * sig * (T(1) + g[c] * (T(1) - sig));
  }
}

// bf16(row) into `copy` right after the row was written. Float rows only: the callers refuse a
// bf16 output for double before their parallel region (an exception must not leave one).
template <typename T>
void row_to_bf16(const T* row, bf16* copy, int64_t n) {
  if constexpr (std::is_same_v<T, float>) vector_ops().scale_to_bf16(row, 1.0f, copy, n);
}

template <typename T>
void require_float_for_bf16(const bf16* copy) {
  if constexpr (!std::is_same_v<T, float>) require(copy == nullptr, "glu: a bf16 output needs float rows");
}

}  // namespace

template <typename T>
void glu_forward(GluActivation act, const T* gate_up, int64_t rows, int64_t inter, T* out, bf16* out_bf16) {
  require_float_for_bf16<T>(out_bf16);
  parallel_for(rows, rows * inter >= kParallelMinElements, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * inter;
      glu_row(act, g, g + inter, out + r * inter, inter);
      if (out_bf16) row_to_bf16(out + r * inter, out_bf16 + r * inter, inter);
    }
  });
}

template <typename T>
void glu_backward(GluActivation act, const T* gate_up, const T* dout, int64_t rows, int64_t inter, T* dgate_up,
                  bf16* dgate_up_bf16) {
  require_float_for_bf16<T>(dgate_up_bf16);
  parallel_for(rows, rows * inter >= kParallelMinElements, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * inter;
      T* dg = dgate_up + r * 2 * inter;
      glu_row_backward(act, g, g + inter, dout + r * inter, dg, dg + inter, inter);
      if (dgate_up_bf16) row_to_bf16(dg, dgate_up_bf16 + r * 2 * inter, 2 * inter);
    }
  });
}

template void glu_forward<float>(GluActivation, const float*, int64_t, int64_t, float*, bf16*);
template void glu_forward<double>(GluActivation, const double*, int64_t, int64_t, double*, bf16*);
template void glu_backward<float>(GluActivation, const float*, const float*, int64_t, int64_t, float*, bf16*);
template void glu_backward<double>(GluActivation, const double*, const double*, int64_t, int64_t, double*, bf16*);

}  // namespace keel::kernels
