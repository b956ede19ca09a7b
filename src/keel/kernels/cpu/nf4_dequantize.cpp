#include "keel/kernels/nf4_dequantize.h"

#include "keel/core/error.h"
#include "keel/core/nf4.h"
#include "keel/core/threads.h"
#include "keel/kernels/cpu/vector_ops.h"

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

// A block's 64 code values (unscaled): the scaling and, for bf16, the rounding then run on whole
// vectors (vector_ops' scale_to_bf16, compiled per ISA).
void block_values(const uint8_t* codes, float* values) {
  for (int64_t j = 0; j < kNf4BlockSize / 2; ++j) values[2 * j] = kPairs.first[codes[j]], values[2 * j + 1] = kPairs.second[codes[j]];
}

template <typename Out>
void dequantize(const uint8_t* packed, const float* absmax, int64_t n, Out* out) {
  require(n % kNf4BlockSize == 0, "dequantize_nf4: {} elements, not a multiple of {}", n, kNf4BlockSize);
  const int64_t blocks = n / kNf4BlockSize;
  const VectorOps& ops = vector_ops();
  parallel_for(blocks, n >= kParallelMinElements, [&](int64_t begin, int64_t end) {
    alignas(64) float values[kNf4BlockSize];
    for (int64_t b = begin; b < end; ++b) {
      const float scale = absmax[b];
      Out* o = out + b * kNf4BlockSize;
      if constexpr (sizeof(Out) == sizeof(float)) {
        block_values(packed + b * (kNf4BlockSize / 2), o);
        for (int64_t i = 0; i < kNf4BlockSize; ++i) o[i] *= scale;
      } else {
        block_values(packed + b * (kNf4BlockSize / 2), values);
        ops.scale_to_bf16(values, scale, o, kNf4BlockSize);
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
