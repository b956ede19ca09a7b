// RMSNorm forward and backward (HF LlamaRMSNorm semantics; Gemma's scales by 1 + w: the weight
// offset, 0 or 1, is added to w in the kernel's type first, as Gemma's (1.0 + weight.float()) is).
//   forward:  rstd = 1 / sqrt(mean(x^2) + eps),  y = (offset + w) * (x * rstd)
//   backward: with g = (offset + w) * dy,
//             dx = rstd * (g - x * rstd^2 * mean(g * x))
//             dw += sum_rows(dy * x * rstd)
#include "keel/kernels/rmsnorm.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "keel/core/error.h"
#include "keel/core/threads.h"
#include "keel/kernels/cpu/prefetch.h"
#include "keel/kernels/cpu/vector_ops.h"

namespace keel::kernels {
namespace {

// Columns of dw reduced by one task, at most: rows are visited in order for every column, so the
// sum for a column never depends on how the columns are cut or how many threads share them.
constexpr int64_t kDwColumnBlock = 256;

// The column block of dw's tasks: a whole number of tasks per thread, each at most kDwColumnBlock
// columns and a multiple of 16 (the row kernels' vectors; only dim's own tail is partial). A block
// of 256 left Qwen3's q/k norms (dim 64: one block) to one thread while the others waited, and a
// 768-wide norm in 3 blocks on 2 threads.
int64_t dw_column_block(int64_t dim, int64_t threads) {
  const int64_t per_thread = (dim + threads * kDwColumnBlock - 1) / (threads * kDwColumnBlock);
  const int64_t tasks = threads * per_thread;
  return std::min(kDwColumnBlock, ((dim + tasks - 1) / tasks + 15) / 16 * 16);
}

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMinElements = int64_t(1) << 15;

// mean(x^2) accumulated in double: for T=float this is at least as accurate as torch's float
// reduction, and the result is rounded back to T before eps is added, as torch does.
template <typename T>
T mean_of_squares(const T* x, int64_t dim) {
  double sum = 0;
  for (int64_t c = 0; c < dim; ++c) sum += double(x[c]) * double(x[c]);
  return T(sum / double(dim));
}

// d(loss)/dx for one row; mean(g*x) in double.
template <typename T>
void rmsnorm_row_backward(const T* x, const T* w, T offset, T rstd, const T* dy, int64_t dim, T* dx) {
  double dot = 0;
  for (int64_t c = 0; c < dim; ++c) dot += double(w[c] + offset) * double(dy[c]) * double(x[c]);
  const double r = rstd;
  const double coef = r * r * (dot / double(dim));
  for (int64_t c = 0; c < dim; ++c) {
    const double g = double(w[c] + offset) * double(dy[c]);
    dx[c] = T(r * (g - double(x[c]) * coef));
  }
}

// Vector i of s's rows * heads: row i / heads, head i % heads, in a buffer of row stride ld.
int64_t vector_at(const RmsNormShape& s, int64_t i, int64_t ld) { return i / s.heads * ld + i % s.heads * s.dim; }

}  // namespace

template <typename T>
void rmsnorm_forward(const RmsNormShape& s, const T* x, const T* w, T* y, T* rstd, bf16* y_bf16) {
  const T offset = T(s.weight_offset);
  const int64_t vectors = s.rows * s.heads, dim = s.dim;
  if constexpr (!std::is_same_v<T, float>) require(y_bf16 == nullptr, "rmsnorm: a bf16 output needs float rows");
  parallel_for(vectors, vectors * dim >= kParallelMinElements, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + vector_at(s, r, s.ldx);
      T* yr = y + vector_at(s, r, s.ldy);
      // torch: rsqrt(variance + eps) in the tensor's dtype, i.e. 1/sqrt correctly rounded. The
      // squares' sum in double: float rows in this CPU's vector lanes (one running sum is a chain
      // of dim dependent adds, a row's whole cost), the reference's double rows one by one.
      T mean;
      if constexpr (std::is_same_v<T, float>)
        mean = float(vector_ops().sum_of_squares_f64(xr, dim) / double(dim));
      else
        mean = mean_of_squares(xr, dim);
      const T rs = T(1) / std::sqrt(mean + T(s.eps));
      rstd[r] = rs;
      for (int64_t c = 0; c < dim; ++c) yr[c] = (w[c] + offset) * (xr[c] * rs);  // y may be x: each read first
      if constexpr (std::is_same_v<T, float>)
        if (y_bf16) vector_ops().scale_to_bf16(yr, 1.0f, y_bf16 + vector_at(s, r, s.ldy), dim);
    }
  });
}

template <typename T>
void rmsnorm_backward(const RmsNormShape& s, const T* x, const T* w, const T* rstd, const T* dy, T* dx, T* dw,
                      const T* residual, bf16* dx_bf16) {
  const T offset = T(s.weight_offset);
  const int64_t vectors = s.rows * s.heads, dim = s.dim;
  const bool parallel = vectors * dim >= kParallelMinElements;
  const int64_t column_block = dw_column_block(dim, parallel ? max_threads() : 1);
  const int64_t column_blocks = (dim + column_block - 1) / column_block;
  if constexpr (!std::is_same_v<T, float>) require(dx_bf16 == nullptr, "rmsnorm: a bf16 output needs float rows");
  const VectorOps& ops = vector_ops();  // float rows: this CPU's vector level
  parallel_for(vectors, parallel, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* res = residual ? residual + vector_at(s, r, s.lddx) : nullptr;
      const T *xr = x + vector_at(s, r, s.ldx), *dyr = dy + vector_at(s, r, s.ldy);
      T* dxr = dx + vector_at(s, r, s.lddx);
      if constexpr (std::is_same_v<T, float>) {
        ops.rmsnorm_row_backward(xr, w, offset, rstd[r], dyr, dim, dxr, res);
        if (dx_bf16) ops.scale_to_bf16(dxr, 1.0f, dx_bf16 + vector_at(s, r, s.lddx), dim);
      } else {
        rmsnorm_row_backward(xr, w, offset, rstd[r], dyr, dim, dxr);
        if (res)
          for (int64_t c = 0; c < dim; ++c) dxr[c] += res[c];
      }
    }
  });
  if (!dw) return;  // a frozen norm weight (LoRA): no gradient wanted
  parallel_for(column_blocks, parallel, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t c0 = blk * column_block;
      const int64_t nc = std::min(column_block, dim - c0);
      double acc[kDwColumnBlock] = {};
      for (int64_t r = 0; r < vectors; ++r) {
        const T* xr = x + vector_at(s, r, s.ldx) + c0;
        const T* dyr = dy + vector_at(s, r, s.ldy) + c0;
        const double rs = rstd[r];
        // A column block reads a few lines of each row, then jumps a row (prefetch.h): on Qwen3's
        // q/k norms (rows of 64 of [tokens, 2304]) that walk waited on memory row by row.
        if (r + kPrefetchRows < vectors) {
          prefetch_lines(x + vector_at(s, r + kPrefetchRows, s.ldx) + c0, sizeof(T) * size_t(nc));
          prefetch_lines(dy + vector_at(s, r + kPrefetchRows, s.ldy) + c0, sizeof(T) * size_t(nc));
        }
        if constexpr (std::is_same_v<T, float>)
          ops.accumulate_scaled_products_f64(acc, dyr, xr, rs, nc);
        else
          for (int64_t c = 0; c < nc; ++c) acc[c] += double(dyr[c]) * (double(xr[c]) * rs);
      }
      for (int64_t c = 0; c < nc; ++c) dw[c0 + c] = T(double(dw[c0 + c]) + acc[c]);
    }
  });
}

template void rmsnorm_forward<float>(const RmsNormShape&, const float*, const float*, float*, float*, bf16*);
template void rmsnorm_forward<double>(const RmsNormShape&, const double*, const double*, double*, double*, bf16*);
template void rmsnorm_backward<float>(const RmsNormShape&, const float*, const float*, const float*, const float*,
                                      float*, float*, const float*, bf16*);
template void rmsnorm_backward<double>(const RmsNormShape&, const double*, const double*, const double*,
                                       const double*, double*, double*, const double*, bf16*);

}  // namespace keel::kernels
