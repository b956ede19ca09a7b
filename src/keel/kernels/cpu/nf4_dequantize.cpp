#include "keel/kernels/nf4_dequantize.h"

#include "keel/core/error.h"
#include "keel/core/nf4.h"
#include "keel/core/threads.h"

namespace keel::kernels {
namespace {

// Blocks of 64 per task; below this many elements one thread does it all.
constexpr int64_t kParallelMinElements = int64_t(1) << 16;

// Each byte's two values at once: a 256-entry table of code pairs, scaled per block.
struct PairTable {
  float first[256], second[256];
  PairTable() {
    for (int b = 0; b < 256; ++b) first[b] = kNf4Values[b >> 4], second[b] = kNf4Values[b & 0x0f];
  }
};
const PairTable kPairs;

template <typename Out>
void dequantize(const uint8_t* packed, const float* absmax, int64_t n, Out* out) {
  require(n % kNf4BlockSize == 0, "dequantize_nf4: {} elements, not a multiple of {}", n, kNf4BlockSize);
  const int64_t blocks = n / kNf4BlockSize;
  parallel_for(blocks, n >= kParallelMinElements, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float scale = absmax[b];
      const uint8_t* codes = packed + b * (kNf4BlockSize / 2);
      Out* o = out + b * kNf4BlockSize;
      for (int64_t j = 0; j < kNf4BlockSize / 2; ++j) {
        const float v0 = kPairs.first[codes[j]] * scale, v1 = kPairs.second[codes[j]] * scale;
        if constexpr (sizeof(Out) == sizeof(float)) {
          o[2 * j] = v0, o[2 * j + 1] = v1;
        } else {
          o[2 * j] = float_to_bf16(v0), o[2 * j + 1] = float_to_bf16(v1);
        }
      }
    }
  });
}

}  // namespace

void dequantize_nf4(const uint8_t* packed, const float* absmax, int64_t n, float* out) {
  dequantize(packed, absmax, n, out);
}
void dequantize_nf4(const uint8_t* packed, const float* absmax, int64_t n, bf16* out) {
  dequantize(packed, absmax, n, out);
}

}  // namespace keel::kernels
