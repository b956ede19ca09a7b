// llama-quantize's quantizers (formats/gguf_k_quants.h, through ggml_quantize) against llama.cpp's
// own ggml library: the bytes tests/reference/gguf_k_quants_golden.py had ggml_quantize_chunk make
// of the same values, compared byte for byte; and the blocks read back through keel's dequantizer.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "keel/core/file_io.h"
#include "keel/formats/gguf_dequantize.h"
#include "keel/formats/gguf_quants.h"

namespace keel::formats {
namespace {

const std::string kGolden = std::string(KEEL_TEST_DATA_DIR) + "/gguf_k_quants/";

std::vector<float> golden_values() {
  const std::string bytes = read_file(kGolden + "values.f32");
  std::vector<float> x(bytes.size() / 4);
  std::memcpy(x.data(), bytes.data(), x.size() * 4);
  return x;
}

class GgufKQuantsGolden : public ::testing::TestWithParam<GgmlType> {};

TEST_P(GgufKQuantsGolden, EqualsGgmlByteForByte) {
  const GgmlType type = GetParam();
  const std::vector<float> x = golden_values();
  const std::string expected = read_file(kGolden + std::string(ggml_type_name(type)) + ".blocks");
  ASSERT_EQ(expected.size(), ggml_nbytes(type, int64_t(x.size())));
  std::vector<uint8_t> got(expected.size());
  ggml_quantize(type, x.data(), int64_t(x.size()), got.data());
  const int64_t block_bytes = ggml_type_size(type);
  int64_t differing = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != uint8_t(expected[i]) && differing++ < 3)
      ADD_FAILURE() << ggml_type_name(type) << " block " << int64_t(i) / block_bytes << " byte "
                    << int64_t(i) % block_bytes << ": keel " << int(got[i]) << ", ggml " << int(uint8_t(expected[i]));
  EXPECT_EQ(differing, 0) << ggml_type_name(type);
}

INSTANTIATE_TEST_SUITE_P(Types, GgufKQuantsGolden,
                         ::testing::Values(GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q5_0, GgmlType::Q8_0),
                         [](const auto& info) { return std::string(ggml_type_name(info.param)); });

// Quantized then dequantized by keel's own reader, group by group: each value back within its
// group's step plus the super-block's scale coding (the group scales are coded against the largest
// one: 6 bits for Q4_K, int8 for Q6_K, so a group next to an outlier gets a coarse scale, or none),
// the RMS error within half of that (a rounding error is uniform: step / sqrt(12) = 0.29 step).
// Steps: Q4_K 15 levels over [min(0, lo), hi]; Q6_K 32 over the largest |x|; groups below ggml's
// GROUP_MAX_EPS (1e-15) come back as zeros. A wrong packing (a nibble or a scale in the wrong
// place) misses by a good part of the range.
TEST(GgufKQuants, RoundTripThroughKeelsDequantizer) {
  const std::vector<float> x = golden_values();
  for (GgmlType type : {GgmlType::Q4_K, GgmlType::Q6_K}) {
    std::vector<uint8_t> bytes(ggml_nbytes(type, int64_t(x.size())));
    ggml_quantize(type, x.data(), int64_t(x.size()), bytes.data());
    std::vector<float> y(x.size());
    ggml_dequantize(uint32_t(type), bytes.data(), int64_t(x.size()), y.data());
    const int group = type == GgmlType::Q4_K ? 32 : 16;
    for (size_t sb = 0; sb < x.size(); sb += 256) {
      float sb_amax = 0;
      for (size_t i = sb; i < sb + 256; ++i) sb_amax = std::fmax(sb_amax, std::fabs(x[i]));
      const float coding = sb_amax / (type == GgmlType::Q4_K ? 63 * 15 : 128 * 32) * 16;
      for (size_t g = sb; g < sb + 256; g += size_t(group)) {
        float lo = 0, hi = 0, amax = 0;
        for (int i = 0; i < group; ++i) {
          lo = std::fmin(lo, x[g + size_t(i)]);
          hi = std::fmax(hi, x[g + size_t(i)]);
          amax = std::fmax(amax, std::fabs(x[g + size_t(i)]));
        }
        const float step = type == GgmlType::Q4_K ? (hi - lo) / 15 : amax / 32;
        double squares = 0;
        for (int i = 0; i < group; ++i) {
          const size_t at = g + size_t(i);
          if (amax < 1e-15f) EXPECT_EQ(y[at], 0.0f) << ggml_type_name(type) << " value " << at;
          else EXPECT_NEAR(y[at], x[at], step + coding) << ggml_type_name(type) << " value " << at;
          squares += double(y[at] - x[at]) * double(y[at] - x[at]);
        }
        EXPECT_LE(std::sqrt(squares / group), 0.5 * (step + coding)) << ggml_type_name(type) << " group at " << g;
      }
    }
  }
}

}  // namespace
}  // namespace keel::formats
