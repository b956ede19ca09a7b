#include "keel/core/four_bit.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <numeric>

#include "keel/core/threads.h"

namespace keel {

namespace {

constexpr float kNf4Values[16] = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f,
};

// get_4bit_type("fp4"): these magnitudes divided by their maximum (12) in fp32; code 8 is +0.0
// (Python's -0 is the integer 0).
constexpr float kFp4Magnitudes[16] = {0, 0.0625f, 8, 12, 4, 6, 2, 3, 0, -0.0625f, -8, -12, -4, -6, -2, -3};

// bitsandbytes' create_dynamic_map(signed=True) as fp32 bit patterns (ascending).
constexpr uint32_t kDynamicMapBits[256] = {
    0xbf7e3333, 0xbf7a999a, 0xbf770000, 0xbf736666, 0xbf6fcccd, 0xbf6c3333, 0xbf68999a, 0xbf650000,
    0xbf616666, 0xbf5dcccd, 0xbf5a3333, 0xbf56999a, 0xbf530000, 0xbf4f6666, 0xbf4bcccd, 0xbf483333,
    0xbf44999a, 0xbf410000, 0xbf3d6666, 0xbf39cccd, 0xbf363334, 0xbf32999a, 0xbf2f0000, 0xbf2b6666,
    0xbf27cccd, 0xbf243334, 0xbf20999a, 0xbf1d0000, 0xbf196666, 0xbf15cccd, 0xbf123334, 0xbf0e999a,
    0xbf0b0000, 0xbf076666, 0xbf03cccc, 0xbf003333, 0xbef93332, 0xbef20000, 0xbeeacccc, 0xbee3999a,
    0xbedc6666, 0xbed53333, 0xbece0000, 0xbec6cccc, 0xbebf999a, 0xbeb86666, 0xbeb13333, 0xbeaa0000,
    0xbea2cccc, 0xbe9b999a, 0xbe946666, 0xbe8d3334, 0xbe860000, 0xbe7d9999, 0xbe6f3333, 0xbe60cccd,
    0xbe526666, 0xbe440000, 0xbe35999a, 0xbe273333, 0xbe18cccd, 0xbe0a6666, 0xbdf80000, 0xbddb3334,
    0xbdc9eb85, 0xbdc428f7, 0xbdbe6667, 0xbdb8a3d7, 0xbdb2e148, 0xbdad1eb8, 0xbda75c2a, 0xbda1999a,
    0xbd9bd70a, 0xbd96147b, 0xbd9051eb, 0xbd8a8f5d, 0xbd84cccd, 0xbd7e147b, 0xbd728f5d, 0xbd670a3d,
    0xbd5b851f, 0xbd500000, 0xbd447ae1, 0xbd38f5c3, 0xbd2d70a3, 0xbd21eb85, 0xbd166667, 0xbd0ae148,
    0xbcfeb852, 0xbce7ae15, 0xbcd0a3d7, 0xbcb9999a, 0xbca28f5d, 0xbc8b851f, 0xbc68f5c3, 0xbc3ae148,
    0xbc1f3b64, 0xbc160418, 0xbc0ccccd, 0xbc039581, 0xbbf4bc6a, 0xbbe24dd3, 0xbbcfdf3b, 0xbbbd70a4,
    0xbbab020d, 0xbb989374, 0xbb8624dd, 0xbb676c8a, 0xbb428f5c, 0xbb1db22d, 0xbaf1a9fc, 0xbaa7ef9d,
    0xba7765ff, 0xba59e83e, 0xba3c6a80, 0xba1eecc1, 0xba016f01, 0xb9c7e283, 0xb98ce705, 0xb923d70b,
    0xb8ba1f4b, 0xb88aefb3, 0xb8378034, 0xb7b24206, 0xb70205ff, 0xb65a1a94, 0xb513a3b7, 0x00000000,
    0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206, 0x38378034, 0x388aefb3, 0x38ba1f4b, 0x3923d70b,
    0x398ce705, 0x39c7e283, 0x3a016f01, 0x3a1eecc1, 0x3a3c6a80, 0x3a59e83e, 0x3a7765ff, 0x3aa7ef9d,
    0x3af1a9fc, 0x3b1db22d, 0x3b428f5c, 0x3b676c8a, 0x3b8624dd, 0x3b989374, 0x3bab020d, 0x3bbd70a4,
    0x3bcfdf3b, 0x3be24dd3, 0x3bf4bc6a, 0x3c039581, 0x3c0ccccd, 0x3c160418, 0x3c1f3b64, 0x3c3ae148,
    0x3c68f5c3, 0x3c8b851f, 0x3ca28f5d, 0x3cb9999a, 0x3cd0a3d7, 0x3ce7ae15, 0x3cfeb852, 0x3d0ae148,
    0x3d166667, 0x3d21eb85, 0x3d2d70a3, 0x3d38f5c3, 0x3d447ae1, 0x3d500000, 0x3d5b851f, 0x3d670a3d,
    0x3d728f5d, 0x3d7e147b, 0x3d84cccd, 0x3d8a8f5d, 0x3d9051eb, 0x3d96147b, 0x3d9bd70a, 0x3da1999a,
    0x3da75c2a, 0x3dad1eb8, 0x3db2e148, 0x3db8a3d7, 0x3dbe6667, 0x3dc428f7, 0x3dc9eb85, 0x3ddb3334,
    0x3df80000, 0x3e0a6666, 0x3e18cccd, 0x3e273333, 0x3e35999a, 0x3e440000, 0x3e526666, 0x3e60cccd,
    0x3e6f3333, 0x3e7d9999, 0x3e860000, 0x3e8d3334, 0x3e946666, 0x3e9b999a, 0x3ea2cccc, 0x3eaa0000,
    0x3eb13333, 0x3eb86666, 0x3ebf999a, 0x3ec6cccc, 0x3ece0000, 0x3ed53333, 0x3edc6666, 0x3ee3999a,
    0x3eeacccc, 0x3ef20000, 0x3ef93332, 0x3f003333, 0x3f03cccc, 0x3f076666, 0x3f0b0000, 0x3f0e999a,
    0x3f123334, 0x3f15cccd, 0x3f196666, 0x3f1d0000, 0x3f20999a, 0x3f243334, 0x3f27cccd, 0x3f2b6666,
    0x3f2f0000, 0x3f32999a, 0x3f363334, 0x3f39cccd, 0x3f3d6666, 0x3f410000, 0x3f44999a, 0x3f483333,
    0x3f4bcccd, 0x3f4f6666, 0x3f530000, 0x3f56999a, 0x3f5a3333, 0x3f5dcccd, 0x3f616666, 0x3f650000,
    0x3f68999a, 0x3f6c3333, 0x3f6fcccd, 0x3f736666, 0x3f770000, 0x3f7a999a, 0x3f7e3333, 0x3f800000,
};

struct DynamicMap {
  float at[256];
  float midpoints[255];  // as torch computes them in fp32
  DynamicMap() {
    for (int i = 0; i < 256; ++i) at[i] = std::bit_cast<float>(kDynamicMapBits[i]);
    for (int i = 0; i < 255; ++i) midpoints[i] = (at[i] + at[i + 1]) / 2.0f;
  }
};
const DynamicMap kDynamicMap;

// A type's code values, their order by value and the midpoints between consecutive sorted values,
// computed as torch computes them in fp32 (bitsandbytes' _get_4bit_quantize_bounds).
struct FourBitTable {
  float values[16];
  uint8_t order[16];  // sorted position -> code: torch.argsort, which keeps FP4's two zeros as 0, 8
  float midpoints[15];
  explicit FourBitTable(FourBitType type) {
    for (int i = 0; i < 16; ++i) values[i] = type == FourBitType::Nf4 ? kNf4Values[i] : kFp4Magnitudes[i] / 12.0f;
    std::iota(order, order + 16, uint8_t(0));
    std::stable_sort(order, order + 16, [&](uint8_t a, uint8_t b) { return values[a] < values[b]; });
    for (int i = 0; i < 15; ++i) midpoints[i] = (values[order[i]] + values[order[i + 1]]) / 2.0f;
  }
  uint8_t code(float scaled) const {
    // torch.bucketize(right=False): the number of midpoints strictly below the value.
    return order[std::lower_bound(midpoints, midpoints + 15, scaled) - midpoints];
  }
};
const FourBitTable kNf4Table(FourBitType::Nf4), kFp4Table(FourBitType::Fp4);
const FourBitTable& table_of(FourBitType type) { return type == FourBitType::Nf4 ? kNf4Table : kFp4Table; }

}  // namespace

std::string_view four_bit_type_name(FourBitType type) { return type == FourBitType::Nf4 ? "nf4" : "fp4"; }

std::optional<FourBitType> parse_four_bit_type(std::string_view name) {
  if (name == "nf4") return FourBitType::Nf4;
  if (name == "fp4") return FourBitType::Fp4;
  return std::nullopt;
}

const float* four_bit_values(FourBitType type) { return table_of(type).values; }
const float* dynamic_map_values() { return kDynamicMap.at; }

void four_bit_quantize(FourBitType type, const float* x, int64_t n, uint8_t* packed, float* absmax) {
  const FourBitTable& table = table_of(type);
  const int64_t full = n / kFourBitBlockSize * kFourBitBlockSize;
  auto code_at = [&](int64_t i) -> uint8_t {
    if (i >= n) return table.code(0.0f);  // the padding of an odd count
    const int64_t block = i / kFourBitBlockSize;
    const float a = absmax[block];
    // Full blocks multiply by the reciprocal, the tail divides (both as bitsandbytes).
    const float scaled = i < full ? x[i] * (1.0f / std::max(a, 1e-38f)) : x[i] / std::max(a, 1e-38f);
    return table.code(std::clamp(scaled, -1.0f, 1.0f));
  };
  const int64_t blocks = (n + kFourBitBlockSize - 1) / kFourBitBlockSize;
  // Blocks are independent (a block is 32 whole bytes): one task per range of blocks.
  parallel_for(blocks, blocks >= 64, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t begin = b * kFourBitBlockSize, end = std::min(n, begin + kFourBitBlockSize);
      float m = 0.0f;
      for (int64_t i = begin; i < end; ++i) m = std::max(m, std::fabs(x[i]));
      absmax[b] = m;
      for (int64_t i = begin; i < end; i += 2) packed[i / 2] = uint8_t(code_at(i) << 4 | code_at(i + 1));
    }
  });
}

void four_bit_dequantize(FourBitType type, const uint8_t* packed, const float* absmax, int64_t n, float* out) {
  const float* values = four_bit_values(type);
  parallel_for(n, n >= (int64_t(1) << 16), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t byte = packed[i / 2];
      const int code = i % 2 == 0 ? byte >> 4 : byte & 0x0f;
      out[i] = values[code] * absmax[i / kFourBitBlockSize];
    }
  });
}

void quantize_absmax(const float* absmax, int64_t count, uint8_t* codes, float* absmax2, float* offset) {
  double sum = 0.0;
  for (int64_t i = 0; i < count; ++i) sum += absmax[i];
  *offset = count > 0 ? float(sum / double(count)) : 0.0f;
  for (int64_t b = 0; b * kAbsmaxBlockSize < count; ++b) {
    const int64_t begin = b * kAbsmaxBlockSize, end = std::min(count, begin + kAbsmaxBlockSize);
    float m = -3.4028235e38f;
    for (int64_t i = begin; i < end; ++i) m = std::fmax(m, std::fabs(absmax[i] - *offset));
    absmax2[b] = m;
    const float reciprocal = 1.0f / std::max(m, 1e-38f);
    for (int64_t i = begin; i < end; ++i) {
      // The nearest code, ties to the lower: the number of midpoints strictly below the value.
      const float normed = std::clamp((absmax[i] - *offset) * reciprocal, -1.0f, 1.0f);
      codes[i] = uint8_t(std::lower_bound(kDynamicMap.midpoints, kDynamicMap.midpoints + 255, normed) -
                         kDynamicMap.midpoints);
    }
  }
}

void dequantize_absmax(const uint8_t* codes, const float* absmax2, float offset, int64_t count, float* absmax,
                       const float* map) {
  if (!map) map = kDynamicMap.at;
  for (int64_t i = 0; i < count; ++i) {
    const float scaled = map[codes[i]] * absmax2[i / kAbsmaxBlockSize];  // rounded here, then the offset added
    absmax[i] = scaled + offset;
  }
}

}  // namespace keel
