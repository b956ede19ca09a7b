// SwiGLU (Shazeer 2020): out = silu(g) * u, silu(g) = g * sigmoid(g) = g / (1 + exp(-g)).
// Derivatives: d out/du = silu(g);  d out/dg = u * sigmoid(g) * (1 + g * (1 - sigmoid(g))).
#include "keel/kernels/swiglu.h"

#include <cmath>
#include <type_traits>

#include "keel/core/threads.h"
#include "keel/kernels/cpu/vector_ops.h"

namespace keel::kernels {
namespace {

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMinElements = int64_t(1) << 15;

}  // namespace

template <typename T>
void swiglu_forward(const T* gate_up, int64_t rows, int64_t inter, T* out) {
  parallel_for(rows, rows * inter >= kParallelMinElements, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      // torch's silu kernel evaluates x / (1 + exp(-x)); the same expression (float: vectorised,
      // with keel's exp).
      if constexpr (std::is_same_v<T, float>)
        vector_ops().silu_mul(g, u, o, inter);
      else
        for (int64_t c = 0; c < inter; ++c) o[c] = g[c] / (T(1) + std::exp(-g[c])) * u[c];
    }
  });
}

template <typename T>
void swiglu_backward(const T* gate_up, const T* dout, int64_t rows, int64_t inter, T* dgate_up) {
  parallel_for(rows, rows * inter >= kParallelMinElements, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * inter;
      const T* u = g + inter;
      const T* dy = dout + r * inter;
      T* dg = dgate_up + r * 2 * inter;
      T* du = dg + inter;
      if constexpr (std::is_same_v<T, float>) {
        vector_ops().silu_mul_backward(g, u, dy, dg, du, inter);
        continue;
      }
      for (int64_t c = 0; c < inter; ++c) {
        const T sig = T(1) / (T(1) + std::exp(-g[c]));
        du[c] = dy[c] * (g[c] * sig);
        dg[c] = dy[c] * u[c] * sig * (T(1) + g[c] * (T(1) - sig));
      }
    }
  });
}

template void swiglu_forward<float>(const float*, int64_t, int64_t, float*);
template void swiglu_forward<double>(const double*, int64_t, int64_t, double*);
template void swiglu_backward<float>(const float*, const float*, int64_t, int64_t, float*);
template void swiglu_backward<double>(const double*, const double*, int64_t, int64_t, double*);

}  // namespace keel::kernels
