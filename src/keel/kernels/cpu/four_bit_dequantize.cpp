#include "keel/kernels/four_bit_dequantize.h"

#include "keel/core/error.h"
#include "keel/core/four_bit.h"
#include "keel/core/threads.h"
#include "keel/kernels/cpu/vector_ops.h"

namespace keel::kernels {
namespace {

// Blocks of 64 per task; below this many elements one thread does it all.
constexpr int64_t kParallelMinElements = int64_t(1) << 16;

// Each byte's two values at once: a 256-entry table of code pairs, scaled per block.
struct PairTable {
  float first[256], second[256];
  explicit PairTable(FourBitType type) {
    const float* values = four_bit_values(type);
    for (int b = 0; b < 256; ++b) first[b] = values[b >> 4], second[b] = values[b & 0x0f];
  }
};
const PairTable& pairs_of(FourBitType type) {
  static const PairTable nf4(FourBitType::Nf4), fp4(FourBitType::Fp4);
  return type == FourBitType::Nf4 ? nf4 : fp4;
}

// A block's 64 code values (unscaled): the scaling and, for bf16, the rounding then run on whole
// vectors (vector_ops' scale_to_bf16, compiled per ISA).
void block_values(const PairTable& pairs, const uint8_t* codes, float* values) {
  for (int64_t j = 0; j < kFourBitBlockSize / 2; ++j)
    values[2 * j] = pairs.first[codes[j]], values[2 * j + 1] = pairs.second[codes[j]];
}

template <typename Out>
void dequantize(FourBitType type, const uint8_t* packed, const float* absmax, int64_t n, Out* out) {
  require(n % kFourBitBlockSize == 0, "dequantize_4bit: {} elements, not a multiple of {}", n, kFourBitBlockSize);
  const int64_t blocks = n / kFourBitBlockSize;
  const VectorOps& ops = vector_ops();
  const PairTable& pairs = pairs_of(type);
  parallel_for(blocks, n >= kParallelMinElements, [&](int64_t begin, int64_t end) {
    alignas(64) float values[kFourBitBlockSize];
    for (int64_t b = begin; b < end; ++b) {
      const float scale = absmax[b];
      Out* o = out + b * kFourBitBlockSize;
      if constexpr (sizeof(Out) == sizeof(float)) {
        block_values(pairs, packed + b * (kFourBitBlockSize / 2), o);
        for (int64_t i = 0; i < kFourBitBlockSize; ++i) o[i] *= scale;
      } else {
        block_values(pairs, packed + b * (kFourBitBlockSize / 2), values);
        ops.scale_to_bf16(values, scale, o, kFourBitBlockSize);
      }
    }
  });
}

}  // namespace

void dequantize_4bit(FourBitType type, const uint8_t* packed, const float* absmax, int64_t n, float* out) {
  dequantize(type, packed, absmax, n, out);
}
void dequantize_4bit(FourBitType type, const uint8_t* packed, const float* absmax, int64_t n, bf16* out) {
  dequantize(type, packed, absmax, n, out);
}

}  // namespace keel::kernels
