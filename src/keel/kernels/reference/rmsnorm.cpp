#include "keel/kernels/reference/rmsnorm.h"

#include <cmath>
#include <vector>

namespace keel::kernels::reference {
namespace {

// Vector h of row r of a buffer with row stride ld.
int64_t at(const RmsNormShape& s, int64_t r, int64_t h, int64_t ld) { return r * ld + h * s.dim; }

}  // namespace

void rmsnorm_forward(const RmsNormShape& s, const float* x, const float* w, float* y, float* rstd) {
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t h = 0; h < s.heads; ++h) {
      const float* v = x + at(s, r, h, s.ldx);
      double squares = 0;
      for (int64_t c = 0; c < s.dim; ++c) squares += double(v[c]) * double(v[c]);
      const double rs = 1.0 / std::sqrt(squares / double(s.dim) + s.eps);
      float* out = y + at(s, r, h, s.ldy);  // y may be x: each element read before it is written
      for (int64_t c = 0; c < s.dim; ++c) out[c] = float((s.weight_offset + double(w[c])) * double(v[c]) * rs);
      rstd[r * s.heads + h] = float(rs);
    }
}

void rmsnorm_backward(const RmsNormShape& s, const float* x, const float* w, const float* rstd, const float* dy,
                      float* dx, float* dw, const float* residual) {
  std::vector<double> dw_sum(size_t(s.dim), 0.0);
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t h = 0; h < s.heads; ++h) {
      const float *v = x + at(s, r, h, s.ldx), *g = dy + at(s, r, h, s.ldy);
      const double rs = rstd[r * s.heads + h];
      double mean_gv = 0;
      for (int64_t c = 0; c < s.dim; ++c) mean_gv += (s.weight_offset + double(w[c])) * double(g[c]) * double(v[c]);
      mean_gv /= double(s.dim);
      const int64_t o = at(s, r, h, s.lddx);
      for (int64_t c = 0; c < s.dim; ++c) {
        const double gc = (s.weight_offset + double(w[c])) * double(g[c]);
        dx[o + c] = float(rs * (gc - double(v[c]) * rs * rs * mean_gv) + (residual ? double(residual[o + c]) : 0.0));
        dw_sum[size_t(c)] += double(g[c]) * double(v[c]) * rs;
      }
    }
  if (dw)
    for (int64_t c = 0; c < s.dim; ++c) dw[c] = float(double(dw[c]) + dw_sum[size_t(c)]);
}

}  // namespace keel::kernels::reference
