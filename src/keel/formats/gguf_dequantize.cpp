#include "keel/formats/gguf_dequantize.h"

#include <cstring>

#include "keel/core/dtype.h"
#include "keel/core/error.h"
#include "keel/formats/gguf_reader.h"

namespace keel::formats {
namespace {

// ggml type ids (ggml.h).
constexpr uint32_t kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
                   kBF16 = 30;
constexpr uint32_t kReadable[] = {kF32, kF16, kBF16, kQ8_0, kQ4_0, kQ4_1, kQ4_K, kQ5_K, kQ6_K};

float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_float(h);
}

// Q4_K / Q5_K: group j's 6-bit scale and min from the 12 packed bytes (ggml's get_scale_min_k4).
void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = uint8_t((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = uint8_t((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

void q8_0(const uint8_t* b, float* y) {  // 34 bytes: d, q[32]
  const float d = half_at(b);
  for (int j = 0; j < 32; ++j) y[j] = float(int8_t(b[2 + j])) * d;
}

void q4_0(const uint8_t* b, float* y) {  // 18 bytes: d, qs[16]
  const float d = half_at(b);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * float((b[2 + j] & 0xF) - 8);
    y[j + 16] = d * float((b[2 + j] >> 4) - 8);
  }
}

void q4_1(const uint8_t* b, float* y) {  // 20 bytes: d, m, qs[16]
  const float d = half_at(b), m = half_at(b + 2);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * float(b[4 + j] & 0xF) + m;
    y[j + 16] = d * float(b[4 + j] >> 4) + m;
  }
}

// Q4_K (144 bytes: d, dmin, scales[12], qs[128]) and Q5_K (176: d, dmin, scales[12], qh[32],
// qs[128]): the same eight 32-value groups, Q5_K's values with a fifth bit, bit g of qh for group g.
void q45_k(const uint8_t* b, float* y, bool fifth_bit) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = fifth_bit ? b + 16 : nullptr;
  const uint8_t* q = b + (fifth_bit ? 48 : 16);
  for (int group = 0; group < 8; group += 2, q += 32) {
    for (int half = 0; half < 2; ++half) {
      uint8_t sc, m;
      scale_min_k4(group + half, scales, &sc, &m);
      const float dl = d * float(sc), ml = dmin * float(m);
      const int bit = group + half;
      for (int l = 0; l < 32; ++l) {
        const int low = half ? q[l] >> 4 : q[l] & 0xF;
        *y++ = dl * float(qh ? low | (((qh[l] >> bit) & 1) << 4) : low) - ml;
      }
    }
  }
}

void q4_k(const uint8_t* b, float* y) { q45_k(b, y, false); }
void q5_k(const uint8_t* b, float* y) { q45_k(b, y, true); }

void q6_k(const uint8_t* b, float* y) {  // 210 bytes: ql[128], qh[64], scales[16] (int8), d
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int n = 0; n < 256; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = (d * float(sc[is])) * float(q1);
      y[l + 32] = (d * float(sc[is + 2])) * float(q2);
      y[l + 64] = (d * float(sc[is + 4])) * float(q3);
      y[l + 96] = (d * float(sc[is + 6])) * float(q4);
    }
  }
}

}  // namespace

bool ggml_can_dequantize(uint32_t type) {
  for (uint32_t t : kReadable)
    if (t == type) return true;
  return false;
}

std::string ggml_dequantizable_types() {
  std::string out;
  for (uint32_t t : kReadable) out += (out.empty() ? "" : ", ") + std::string(ggml_type_traits(t)->name);
  return out;
}

void ggml_dequantize(uint32_t type, const uint8_t* src, int64_t count, float* dst) {
  const GgmlTypeTraits* traits = ggml_type_traits(type);
  require(traits && ggml_can_dequantize(type), "ggml type {}: keel reads {}", traits ? traits->name : "unknown",
          ggml_dequantizable_types());
  require(count % traits->block_size == 0, "ggml_dequantize: {} values are not whole {} blocks", count, traits->name);
  const int64_t blocks = count / traits->block_size;
  const int64_t bytes = traits->type_size;
  switch (type) {
    case kF32: std::memcpy(dst, src, size_t(count) * 4); return;
    case kF16:
      for (int64_t i = 0; i < count; ++i) dst[i] = half_at(src + 2 * i);
      return;
    case kBF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = bf16_to_float(bf16{h});
      }
      return;
    default: break;
  }
  void (*block)(const uint8_t*, float*) = type == kQ8_0 ? q8_0 : type == kQ4_0 ? q4_0 : type == kQ4_1 ? q4_1
                                        : type == kQ4_K ? q4_k : type == kQ5_K ? q5_k : q6_k;
  for (int64_t i = 0; i < blocks; ++i) block(src + i * bytes, dst + i * traits->block_size);
}

}  // namespace keel::formats
