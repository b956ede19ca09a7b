// GGUF's dequantizers (formats/gguf_dequantize.h) against gguf-py's own: the golden blocks and
// values tests/reference/gguf_dequantize_golden.py wrote with gguf.quants.dequantize, compared bit
// for bit; and keel's quantizers' blocks read back.
#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <string>
#include <vector>

#include "keel/core/file_io.h"
#include "keel/formats/gguf_dequantize.h"
#include "keel/formats/gguf_quants.h"
#include "keel/formats/gguf_reader.h"
#include "test_support.h"

namespace keel::formats {
namespace {

const std::string kGolden = std::string(KEEL_TEST_DATA_DIR) + "/gguf_dequantize/";

class GgufDequantizeGolden : public ::testing::TestWithParam<uint32_t> {};

TEST_P(GgufDequantizeGolden, EqualsGgufPyBitForBit) {
  const auto* traits = ggml_type_traits(GetParam());
  ASSERT_NE(traits, nullptr);
  const std::string blocks = read_file(kGolden + traits->name + ".blocks");
  const std::string expected = read_file(kGolden + traits->name + ".f32");
  const int64_t count = int64_t(blocks.size()) / traits->type_size * traits->block_size;
  ASSERT_EQ(expected.size(), size_t(count) * 4);
  std::vector<float> got(static_cast<size_t>(count));
  ggml_dequantize(traits->id, reinterpret_cast<const uint8_t*>(blocks.data()), count, got.data());
  int64_t differing = 0;
  for (int64_t i = 0; i < count; ++i) {
    float want;
    std::memcpy(&want, expected.data() + 4 * i, 4);
    if (std::bit_cast<uint32_t>(got[size_t(i)]) != std::bit_cast<uint32_t>(want) && differing++ < 3)
      ADD_FAILURE() << traits->name << " value " << i << ": keel " << got[size_t(i)] << ", gguf-py " << want;
  }
  EXPECT_EQ(differing, 0) << traits->name;
}

INSTANTIATE_TEST_SUITE_P(Types, GgufDequantizeGolden, ::testing::Values(8u, 2u, 3u, 12u, 13u, 14u),
                         [](const auto& info) { return std::string(ggml_type_traits(info.param)->name); });

// What keel's own quantizers write reads back: F16 and BF16 exactly as rounded, Q8_0 and Q4_0 to
// their blocks' values.
TEST(GgufDequantize, ReadsBackKeelsQuantizers) {
  std::vector<float> x(64);
  for (int i = 0; i < 64; ++i) x[size_t(i)] = 0.01f * float(i - 30);
  for (GgmlType type : {GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4_0}) {
    std::vector<uint8_t> bytes(ggml_nbytes(type, 64));
    ggml_quantize(type, x.data(), 64, bytes.data());
    std::vector<float> y(64);
    ggml_dequantize(uint32_t(type), bytes.data(), 64, y.data());
    const float tolerance = type == GgmlType::F32 ? 0.0f : type == GgmlType::Q4_0 ? 0.3f / 8 : 0.3f / 100;
    for (int i = 0; i < 64; ++i) EXPECT_NEAR(y[size_t(i)], x[size_t(i)], tolerance) << ggml_type_name(type) << " " << i;
  }
}

TEST(GgufDequantize, RefusesTypesItDoesNotRead) {
  EXPECT_TRUE(ggml_can_dequantize(12));
  EXPECT_FALSE(ggml_can_dequantize(10));  // Q2_K
  const uint8_t block[84] = {};
  float out[256];
  testing::expect_keel_error([&] { ggml_dequantize(10, block, 256, out); }, {"Q2_K", "keel reads", "Q6_K"});
  testing::expect_keel_error([&] { ggml_dequantize(8, block, 16, out); }, {"whole Q8_0 blocks"});
}

}  // namespace
}  // namespace keel::formats
