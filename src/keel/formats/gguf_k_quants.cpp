#include "keel/formats/gguf_k_quants.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "keel/core/dtype.h"

// Each line below is ggml's, in ggml's order of operations: float sums accumulate left to right as
// the C source writes them (w*x[i]*l is (w*x[i])*l), ints convert to float where C converts them,
// and f16 values are rounded where ggml stores them (GGML_FP32_TO_FP16, round to nearest even) and
// read back (GGML_FP16_TO_FP32) before use. A reordering changes the last bit of a sum, and the
// search below then picks another scale: whole blocks differ, not one value.
namespace keel::formats {
namespace {

constexpr float kGroupMaxEps = 1e-15f;  // GROUP_MAX_EPS: a group below it is all zero

// nearest_int: round to nearest (ties to even) by adding 1.5 * 2^23, which leaves the integer in
// the low mantissa bits. ggml asserts |x| <= 4194303; past it the result is the same garbage.
int nearest_int(float fval) {
  const float val = fval + 12582912.f;
  int i;
  std::memcpy(&i, &val, sizeof(int));
  return (i & 0x007fffff) - 0x00400000;
}

uint16_t to_half(float f) { return float_to_f16(f); }  // GGML_FP32_TO_FP16 (finite values, RNE)
float from_half(uint16_t h) { return f16_to_float(h); }

void store_half(uint8_t* out, uint16_t h) { std::memcpy(out, &h, 2); }

// make_qkx2_quants: an asymmetric n-value group, x ~ scale * L + min with L in 0..nmax and
// min <= 0. Starts from the range (min..max over nmax steps), then tries nstep + 1 wider or
// narrower steps (iscale = (rmin + rdelta*is + nmax) / (max - min)); for each, the weighted
// least-squares scale and min of those L (min clamped to 0, scale refit then), kept if the
// weighted squared error (use_mad: absolute) is lower. Returns the scale; *the_min = -min.
float make_qkx2_quants(int n, int nmax, const float* x, const float* weights, uint8_t* L, float* the_min,
                       uint8_t* Laux, float rmin, float rdelta, int nstep, bool use_mad) {
  float min = x[0];
  float max = x[0];
  float sum_w = weights[0];
  float sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    const float w = weights[i];
    sum_w += w;
    sum_x += w * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    *the_min = -min;
    return 0.f;
  }
  float iscale = float(nmax) / (max - min);
  float scale = 1 / iscale;
  float best_error = 0;
  for (int i = 0; i < n; ++i) {
    const int l = nearest_int(iscale * (x[i] - min));
    L[i] = uint8_t(std::max(0, std::min(nmax, l)));
    float diff = scale * float(L[i]) + min - x[i];
    diff = use_mad ? std::fabs(diff) : diff * diff;
    const float w = weights[i];
    best_error += w * diff;
  }
  if (nstep < 1) {
    *the_min = -min;
    return scale;
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * float(is) + float(nmax)) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      int l = nearest_int(iscale * (x[i] - min));
      l = std::max(0, std::min(nmax, l));
      Laux[i] = uint8_t(l);
      const float w = weights[i];
      const float fl = float(l);
      sum_l += w * fl;
      sum_l2 += w * fl * fl;
      sum_xl += w * fl * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float cur_error = 0;
      for (int i = 0; i < n; ++i) {
        float diff = this_scale * float(Laux[i]) + this_min - x[i];
        diff = use_mad ? std::fabs(diff) : diff * diff;
        const float w = weights[i];
        cur_error += w * diff;
      }
      if (cur_error < best_error) {
        for (int i = 0; i < n; ++i) L[i] = Laux[i];
        best_error = cur_error;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  *the_min = -min;
  return scale;
}

// make_qx_quants with rmse_type 1 and no importance weights (what quantize_row_q6_K_ref asks): a
// symmetric group, x ~ scale * l with l in -nmax..nmax-1 (L = l + nmax). iscale = -nmax / x_m
// (x_m the value of largest |x|, so x_m maps to -nmax), then 18 nearby steps
// -(nmax + 0.1 is) / x_m, is = -9..9 without 0; each step's least-squares scale
// sum(w x l) / sum(w l^2) with w = x^2, kept where it explains more (sumlx^2 / suml2 larger).
float make_qx_quants_rmse1(int n, int nmax, const float* x, int8_t* L) {
  float max = 0;
  float amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < kGroupMaxEps) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.f;
  }
  float iscale = float(-nmax) / max;
  float sumlx = 0;
  float suml2 = 0;
  for (int i = 0; i < n; ++i) {
    int l = nearest_int(iscale * x[i]);
    l = std::max(-nmax, std::min(nmax - 1, l));
    L[i] = int8_t(l + nmax);
    const float w = x[i] * x[i];
    const float fl = float(l);
    sumlx += w * x[i] * fl;
    suml2 += w * fl * fl;
  }
  float scale = suml2 != 0 ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(float(nmax) + 0.1f * float(is)) / max;
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      int l = nearest_int(iscale * x[i]);
      l = std::max(-nmax, std::min(nmax - 1, l));
      const float w = x[i] * x[i];
      const float fl = float(l);
      sumlx += w * x[i] * fl;
      suml2 += w * fl * fl;
    }
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      for (int i = 0; i < n; ++i) {
        const int l = nearest_int(iscale * x[i]);
        L[i] = int8_t(nmax + std::max(-nmax, std::min(nmax - 1, l)));
      }
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

// get_scale_min_k4: group j's 6-bit scale and min from the 12 packed bytes.
void get_scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = uint8_t((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = uint8_t((q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4));
  }
}

}  // namespace

// quantize_row_q4_K_ref, one super-block. Per group of 32: make_qkx2_quants with weights
// av_x + |x| (av_x the group's RMS), 15 levels, 21 steps from -1 by 0.1. The eight scales and
// mins are then coded in 6 bits against the largest of each (d = max_scale / 63,
// dmin = max_min / 63, f16), and every value requantized with the coded scale and min:
// q = round((x + dmin*m) / (d*sc)), clamped to 0..15.
void quantize_q4_k_block(const float* x, uint8_t* out) {
  uint8_t L[kQK_K];
  uint8_t Laux[32];
  float weights[32];
  float mins[kQK_K / 32];
  float scales[kQK_K / 32];
  float max_scale = 0;  // the min is deducted, so scales are positive
  float max_min = 0;
  for (int j = 0; j < kQK_K / 32; ++j) {
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(x[32 * j + l]);
    scales[j] = make_qkx2_quants(32, 15, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, -1.f, 0.1f, 20, false);
    const float scale = scales[j];
    if (scale > max_scale) max_scale = scale;
    const float min = mins[j];
    if (min > max_min) max_min = min;
  }
  uint8_t* y_scales = out + 4;
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  for (int j = 0; j < kQK_K / 32; ++j) {
    // uint8_t of an int, as ggml stores it, then clamped.
    uint8_t ls = uint8_t(nearest_int(inv_scale * scales[j]));
    uint8_t lm = uint8_t(nearest_int(inv_min * mins[j]));
    ls = std::min<uint8_t>(63, ls);
    lm = std::min<uint8_t>(63, lm);
    if (j < 4) {
      y_scales[j] = ls;
      y_scales[j + 4] = lm;
    } else {
      y_scales[j + 4] = uint8_t((ls & 0xF) | ((lm & 0xF) << 4));
      y_scales[j - 4] |= uint8_t((ls >> 4) << 6);
      y_scales[j - 0] |= uint8_t((lm >> 4) << 6);
    }
  }
  const uint16_t d_half = to_half(max_scale / 63.f);
  const uint16_t dmin_half = to_half(max_min / 63.f);
  store_half(out, d_half);
  store_half(out + 2, dmin_half);

  uint8_t sc, m;
  for (int j = 0; j < kQK_K / 32; ++j) {
    get_scale_min_k4(j, y_scales, &sc, &m);
    const float d = from_half(d_half) * float(sc);
    if (d == 0) continue;  // the group keeps make_qkx2_quants' L
    const float dm = from_half(dmin_half) * float(m);
    for (int ii = 0; ii < 32; ++ii) {
      int l = nearest_int((x[32 * j + ii] + dm) / d);
      l = std::max(0, std::min(15, l));
      L[32 * j + ii] = uint8_t(l);
    }
  }
  // 64 values per 32 bytes: value j + l in the low nibble, j + l + 32 in the high one.
  uint8_t* q = out + 16;
  for (int j = 0; j < kQK_K; j += 64) {
    for (int l = 0; l < 32; ++l) q[l] = uint8_t(L[j + l] | (L[j + l + 32] << 4));
    q += 32;
  }
}

// quantize_row_q6_K_ref, one super-block. Per group of 16: make_qx_quants (32 levels each side,
// rmse_type 1). The sixteen scales are coded as int8 against the one of largest magnitude
// (iscale = -128 / max_scale, d = 1 / iscale as f16, sc = min(127, round(iscale * scale))), and
// every value requantized with its coded scale: q = round(x / (d*sc)) clamped to -32..31, stored
// q + 32 as 4 low bits (ql) and 2 high bits (qh).
void quantize_q6_k_block(const float* x, uint8_t* out) {
  uint8_t* ql = out;
  uint8_t* qh = out + 128;
  int8_t* y_scales = reinterpret_cast<int8_t*>(out + 192);
  uint8_t* d_out = out + 208;
  int8_t L[kQK_K];
  float scales[kQK_K / 16];
  float max_scale = 0;
  float max_abs_scale = 0;
  for (int ib = 0; ib < kQK_K / 16; ++ib) {
    const float scale = make_qx_quants_rmse1(16, 32, x + 16 * ib, L + 16 * ib);
    scales[ib] = scale;
    const float abs_scale = std::fabs(scale);
    if (abs_scale > max_abs_scale) {
      max_abs_scale = abs_scale;
      max_scale = scale;
    }
  }
  if (max_abs_scale < kGroupMaxEps) {  // an all-zero super-block: zero bytes, d = +0
    std::memset(out, 0, size_t(kQ6_KBytes));
    store_half(d_out, to_half(0.f));
    return;
  }
  const float iscale = -128.f / max_scale;
  const uint16_t d_half = to_half(1 / iscale);
  store_half(d_out, d_half);
  for (int ib = 0; ib < kQK_K / 16; ++ib) y_scales[ib] = int8_t(std::min(127, nearest_int(iscale * scales[ib])));
  for (int j = 0; j < kQK_K / 16; ++j) {
    const float d = from_half(d_half) * float(y_scales[j]);
    if (d == 0) continue;  // the group keeps make_qx_quants' L
    for (int ii = 0; ii < 16; ++ii) {
      int l = nearest_int(x[16 * j + ii] / d);
      l = std::max(-32, std::min(31, l));
      L[16 * j + ii] = int8_t(l + 32);
    }
  }
  // Per 128 values: ql[l] holds values l (low) and l + 64 (high nibble), ql[l + 32] values l + 32
  // and l + 96; qh[l] the top two bits of l, l + 32, l + 64, l + 96.
  for (int j = 0; j < kQK_K; j += 128) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t q1 = uint8_t(L[j + l + 0] & 0xF);
      const uint8_t q2 = uint8_t(L[j + l + 32] & 0xF);
      const uint8_t q3 = uint8_t(L[j + l + 64] & 0xF);
      const uint8_t q4 = uint8_t(L[j + l + 96] & 0xF);
      ql[l + 0] = uint8_t(q1 | (q3 << 4));
      ql[l + 32] = uint8_t(q2 | (q4 << 4));
      qh[l] = uint8_t((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4) |
                      ((L[j + l + 96] >> 4) << 6));
    }
    ql += 64;
    qh += 32;
  }
}

// quantize_row_q5_0_ref, one block of 32: d = x_m / -16 (x_m the first value of largest |x|),
// q = min(31, (int8)(x / d + 16.5)) (truncation toward zero of a value >= 0), 4 low bits two per
// byte (value j low nibble, j + 16 high) and the fifth bits in a 32-bit qh.
void quantize_q5_0_block(const float* x, uint8_t* out) {
  constexpr int qk = 32;
  float amax = 0.0f;
  float max = 0.0f;
  for (int j = 0; j < qk; ++j) {
    const float v = x[j];
    if (amax < std::fabs(v)) {
      amax = std::fabs(v);
      max = v;
    }
  }
  const float d = max / -16;
  const float id = d != 0 ? 1.0f / d : 0.0f;
  store_half(out, to_half(d));
  uint32_t qh = 0;
  uint8_t* qs = out + 6;
  for (int j = 0; j < qk / 2; ++j) {
    const float x0 = x[0 + j] * id;
    const float x1 = x[qk / 2 + j] * id;
    const uint8_t xi0 = uint8_t(std::min(31, int(int8_t(x0 + 16.5f))));
    const uint8_t xi1 = uint8_t(std::min(31, int(int8_t(x1 + 16.5f))));
    qs[j] = uint8_t((xi0 & 0x0F) | ((xi1 & 0x0F) << 4));
    qh |= ((xi0 & 0x10u) >> 4) << (j + 0);
    qh |= ((xi1 & 0x10u) >> 4) << (j + qk / 2);
  }
  std::memcpy(out + 2, &qh, 4);
}

}  // namespace keel::formats
