// GGUF files as keel writes them (formats/gguf_writer.h) and the quantizers of their tensors
// (formats/gguf_quants.h). Bit-identity with llama.cpp's own converter on real models is
// tests/reference/gguf_reference.py's; here: the layout byte by byte, gguf-py's rounding rules on
// values where they decide, and every refusal.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "keel/core/dtype.h"
#include "keel/core/file_io.h"
#include "keel/formats/gguf_quants.h"
#include "keel/formats/gguf_writer.h"
#include "test_support.h"

namespace keel::formats {
namespace {

using testing::expect_keel_error;
using testing::TempDir;

uint16_t half_of(GgmlType type, float x) {
  uint8_t out[2];
  ggml_quantize(type, &x, 1, out);
  return uint16_t(out[0] | (out[1] << 8));
}

float from_bits(uint32_t u) { return std::bit_cast<float>(u); }

TEST(GgufQuants, F16RoundsToNearestEvenAndKeepsNanPayloadAsNumpy) {
  EXPECT_EQ(half_of(GgmlType::F16, 1.0f), 0x3c00);
  EXPECT_EQ(half_of(GgmlType::F16, -2.0f), 0xc000);
  EXPECT_EQ(half_of(GgmlType::F16, 65504.0f), 0x7bff);
  EXPECT_EQ(half_of(GgmlType::F16, 65520.0f), 0x7c00);  // halfway to the next: rounds to inf
  EXPECT_EQ(half_of(GgmlType::F16, 1.0f + 1.0f / 2048), 0x3c00);  // a tie, to even
  EXPECT_EQ(half_of(GgmlType::F16, 1.0f + 3.0f / 2048), 0x3c02);  // a tie, to even (up)
  EXPECT_EQ(half_of(GgmlType::F16, std::ldexp(1.0f, -24)), 0x0001);  // the smallest subnormal
  EXPECT_EQ(half_of(GgmlType::F16, std::ldexp(1.0f, -25)), 0x0000);  // half of it: a tie, to even
  EXPECT_EQ(half_of(GgmlType::F16, from_bits(0x7fc00000)), 0x7e00);
  EXPECT_EQ(half_of(GgmlType::F16, from_bits(0x7f800001)), 0x7c01);  // payload below f16's: still NaN
  EXPECT_EQ(half_of(GgmlType::F16, from_bits(0xff802000)), 0xfc01);
}

TEST(GgufQuants, Bf16RoundsToNearestEvenAndQuietsNan) {
  EXPECT_EQ(half_of(GgmlType::BF16, 1.0f), 0x3f80);
  EXPECT_EQ(half_of(GgmlType::BF16, from_bits(0x3f808000)), 0x3f80);  // tie, even stays
  EXPECT_EQ(half_of(GgmlType::BF16, from_bits(0x3f818000)), 0x3f82);  // tie, odd goes up
  EXPECT_EQ(half_of(GgmlType::BF16, from_bits(0x3f808001)), 0x3f81);
  EXPECT_EQ(half_of(GgmlType::BF16, from_bits(0x7f800001)), 0x7fc0);  // signalling NaN made quiet
  EXPECT_EQ(half_of(GgmlType::BF16, from_bits(0xff812345)), 0xffc1);
}

// The writer copies stored F16/BF16 bytes without converting where ggml_converts_to_itself says
// converting would give them back: every one of the 65,536 patterns that is not a NaN widens to
// fp32 (as the checkpoint reader widens it) and converts to itself, and every NaN is refused (a
// bf16 signalling NaN comes back quiet). F32 both ways is a copy.
TEST(GgufQuants, ConvertsToItselfIsEveryPatternButNan) {
  for (GgmlType type : {GgmlType::F16, GgmlType::BF16}) {
    int64_t nans = 0;
    for (uint32_t p = 0; p < 65536; ++p) {
      const uint16_t bits = uint16_t(p);
      uint8_t stored[2];
      std::memcpy(stored, &bits, 2);
      const float wide = type == GgmlType::F16 ? f16_to_float(bits) : bf16_to_float(bf16{bits});
      const bool nan = std::isnan(wide);
      nans += nan;
      ASSERT_EQ(ggml_converts_to_itself(type, stored, 1), !nan) << ggml_type_name(type) << " 0x" << std::hex << p;
      if (!nan) {
        ASSERT_EQ(half_of(type, wide), bits) << ggml_type_name(type) << " 0x" << std::hex << p;
      }
    }
    EXPECT_EQ(nans, type == GgmlType::F16 ? 2 * 1023 : 2 * 127) << ggml_type_name(type);
  }
  // A NaN anywhere in a run, and no NaN: one pass over all of it.
  std::vector<uint16_t> run(1000, 0x3f80);
  EXPECT_TRUE(ggml_converts_to_itself(GgmlType::BF16, reinterpret_cast<const uint8_t*>(run.data()), 1000));
  run[997] = 0x7f81;
  EXPECT_FALSE(ggml_converts_to_itself(GgmlType::BF16, reinterpret_cast<const uint8_t*>(run.data()), 1000));
  EXPECT_TRUE(ggml_converts_to_itself(GgmlType::BF16, reinterpret_cast<const uint8_t*>(run.data()), 997));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(ggml_converts_to_itself(GgmlType::F32, reinterpret_cast<const uint8_t*>(&nan), 1));
  EXPECT_FALSE(ggml_converts_to_itself(GgmlType::Q8_0, reinterpret_cast<const uint8_t*>(run.data()), 32));
}

TEST(GgufQuants, Q8_0ScalesByMaxOver127AndRoundsHalvesAwayFromZero) {
  std::vector<float> x(32, 0.0f);
  x[0] = 127.0f;  // d = 1: every value is its own code
  x[1] = 2.5f;
  x[2] = -2.5f;
  x[3] = 0.5f;
  x[4] = -0.49f;
  x[5] = -127.0f;
  x[6] = 3.5f;
  uint8_t out[34];
  ggml_quantize(GgmlType::Q8_0, x.data(), 32, out);
  EXPECT_EQ(out[0] | (out[1] << 8), 0x3c00);  // d = 1.0 as f16
  EXPECT_EQ(int8_t(out[2]), 127);
  EXPECT_EQ(int8_t(out[3]), 3);  // not banker's rounding (np.round would give 2)
  EXPECT_EQ(int8_t(out[4]), -3);
  EXPECT_EQ(int8_t(out[5]), 1);
  EXPECT_EQ(int8_t(out[6]), 0);
  EXPECT_EQ(int8_t(out[7]), -127);
  EXPECT_EQ(int8_t(out[8]), 4);
  // An all-zero block: d = 0 and codes 0 (gguf-py's id = 0 where d = 0).
  std::vector<float> zeros(32, 0.0f);
  ggml_quantize(GgmlType::Q8_0, zeros.data(), 32, out);
  for (uint8_t b : out) EXPECT_EQ(b, 0);
}

TEST(GgufQuants, Q4_0TakesTheSignedLargestAndPacksHalvesIntoNibbles) {
  std::vector<float> x(32, 0.0f);
  x[0] = -8.0f;  // the largest |x|, negative: d = -8 / -8 = 1
  x[1] = 7.6f;   // trunc(7.6 + 8.5) = 16, clipped to 15
  x[16] = 1.0f;  // high nibble of byte 0
  x[17] = -3.0f;
  uint8_t out[18];
  ggml_quantize(GgmlType::Q4_0, x.data(), 32, out);
  EXPECT_EQ(out[0] | (out[1] << 8), 0x3c00);
  EXPECT_EQ(out[2], uint8_t(0 | (9 << 4)));   // -8 -> 0; 1 -> trunc(9.5) = 9
  EXPECT_EQ(out[3], uint8_t(15 | (5 << 4)));  // 7.6 -> 15; -3 -> trunc(5.5) = 5
  EXPECT_EQ(out[4], uint8_t(8 | (8 << 4)));   // zeros -> 8
  // Of equal magnitudes the first decides the sign of d (numpy's argmax).
  std::vector<float> y(32, 0.0f);
  y[3] = 4.0f;
  y[9] = -4.0f;
  ggml_quantize(GgmlType::Q4_0, y.data(), 32, out);
  EXPECT_EQ(out[0] | (out[1] << 8), 0xb800);  // d = 4 / -8 = -0.5
}

TEST(GgufQuants, SizesAreGgmlsAndPartialBlocksAreRefused) {
  EXPECT_EQ(ggml_nbytes(GgmlType::F32, 10), 40u);
  EXPECT_EQ(ggml_nbytes(GgmlType::BF16, 10), 20u);
  EXPECT_EQ(ggml_nbytes(GgmlType::Q8_0, 64), 68u);
  EXPECT_EQ(ggml_nbytes(GgmlType::Q4_0, 64), 36u);
  EXPECT_TRUE(ggml_row_fits(GgmlType::F16, 33));
  EXPECT_FALSE(ggml_row_fits(GgmlType::Q8_0, 33));
  std::vector<float> x(33, 1.0f);
  std::vector<uint8_t> out(64);
  expect_keel_error([&] { ggml_quantize(GgmlType::Q8_0, x.data(), 33, out.data()); }, {"Q8_0", "32", "33"});
}

// The bytes GGUF v3 specifies, built by hand for a file of one key and two tensors.
TEST(GgufWriter, WritesTheLayoutOfTheSpecification) {
  TempDir dir;
  GgufMetadata kv;
  kv.add_uint32("general.test", 7);
  std::vector<GgufTensor> tensors = {
      {"a", {2, 3}, GgmlType::F32,
       [](int64_t b, int64_t n, float* d) { for (int64_t i = 0; i < n; ++i) d[i] = float(b + i); }},
      {"b", {2}, GgmlType::F16, [](int64_t, int64_t, float* d) { d[0] = 1.0f, d[1] = -2.0f; }},
  };
  write_gguf(dir / "m.gguf", kv, tensors);
  const std::string file = read_file(dir / "m.gguf");

  std::string expected;
  auto u32 = [&](uint32_t v) { expected.append(reinterpret_cast<const char*>(&v), 4); };
  auto u64 = [&](uint64_t v) { expected.append(reinterpret_cast<const char*>(&v), 8); };
  auto str = [&](const std::string& s) { u64(s.size()), expected += s; };
  expected += "GGUF";
  u32(3), u64(2), u64(1);
  str("general.test"), u32(4), u32(7);
  str("a"), u32(2), u64(3), u64(2), u32(0), u64(0);  // dimensions innermost first
  str("b"), u32(1), u64(2), u32(1), u64(32);         // 24 bytes of "a" padded to 32
  expected.resize((expected.size() + 31) / 32 * 32, '\0');
  for (int i = 0; i < 6; ++i) {
    const float f = float(i);
    expected.append(reinterpret_cast<const char*>(&f), 4);
  }
  expected.append(8, '\0');
  expected += std::string("\x00\x3c\x00\xc0", 4);
  expected.append(28, '\0');
  EXPECT_EQ(file, expected);
}

TEST(GgufWriter, MetadataArraysAndEveryScalarType) {
  GgufMetadata kv;
  kv.add_uint8("u8", 1), kv.add_int8("i8", -1), kv.add_uint16("u16", 2), kv.add_int16("i16", -2);
  kv.add_int32("i32", -3), kv.add_uint64("u64", 4), kv.add_int64("i64", -4), kv.add_float32("f32", 0.5f);
  kv.add_float64("f64", 0.25), kv.add_bool("b", true), kv.add_string("s", "hé");
  kv.add_strings("ss", {"x", ""}), kv.add_int32s("is", {5, -6}), kv.add_uint32s("us", {7}),
      kv.add_float32s("fs", {1.5f});
  EXPECT_EQ(kv.size(), 15u);
  EXPECT_TRUE(kv.has("ss"));
  const std::string& b = kv.encoded();
  // "b": key (8 + 1), type 7, one byte 1.
  const std::string bool_entry = std::string("\x01\0\0\0\0\0\0\0b\x07\0\0\0\x01", 14);
  EXPECT_NE(b.find(bool_entry), std::string::npos);
  // "ss": type 9, element type 8, count 2, "x", "".
  const std::string array_entry = std::string("\x02\0\0\0\0\0\0\0ss\x09\0\0\0\x08\0\0\0\x02\0\0\0\0\0\0\0", 26) +
                                  std::string("\x01\0\0\0\0\0\0\0x\0\0\0\0\0\0\0\0", 17);
  EXPECT_NE(b.find(array_entry), std::string::npos);
  expect_keel_error([&] { kv.add_uint32("u8", 1); }, {"'u8'", "twice"});
  expect_keel_error([&] { kv.add_strings("empty", {}); }, {"'empty'", "non-empty array"});
}

TEST(GgufWriter, RefusesBadTensorsNamingTheFileAndTheTensor) {
  TempDir dir;
  const std::string path = dir / "bad.gguf";
  auto fill = [](int64_t, int64_t, float* d) { d[0] = 0; };
  GgufMetadata kv;
  expect_keel_error([&] { write_gguf(path, kv, {{"t", {1}, GgmlType::F32, fill}, {"t", {1}, GgmlType::F32, fill}}); },
                    {path, "'t'", "twice"});
  expect_keel_error([&] { write_gguf(path, kv, {{std::string(64, 'n'), {1}, GgmlType::F32, fill}}); },
                    {path, "63 bytes", "found 64"});
  expect_keel_error([&] { write_gguf(path, kv, {{"q", {2, 33}, GgmlType::Q8_0, fill}}); },
                    {path, "'q'", "Q8_0", "33", "float type"});
  expect_keel_error([&] { write_gguf(path, kv, {{"r", {1, 1, 1, 1, 1}, GgmlType::F32, fill}}); },
                    {path, "'r'", "1 to 4 dimensions"});
  EXPECT_FALSE(std::filesystem::exists(path));
}

// A tensor source failing half way (a crash, Ctrl-C's exception) leaves the file that was there.
TEST(GgufWriter, AFailedWriteLeavesNoPartialFile) {
  TempDir dir;
  const std::string path = dir / "m.gguf";
  write_file_atomic(path, "previous");
  GgufMetadata kv;
  std::vector<GgufTensor> tensors = {
      {"a", {4}, GgmlType::F32, [](int64_t, int64_t n, float* d) { std::fill(d, d + n, 1.0f); }},
      {"b", {4}, GgmlType::F32, [](int64_t, int64_t, float*) { fail("source failed"); }},
  };
  expect_keel_error([&] { write_gguf(path, kv, tensors); }, {"source failed"});
  EXPECT_EQ(read_file(path), "previous");
  for (const auto& entry : std::filesystem::directory_iterator(dir.path()))
    EXPECT_EQ(entry.path().filename(), "m.gguf") << "a temporary file was left behind";
}


// The writer holds pieces of a tensor, not the tensor: it asks for the values a piece of whole rows
// at a time (at most the piece size, or one row where a row is longer; a large piece in tasks from
// several threads), covering the tensor once, and the bytes are those of the tensor converted
// whole, for every type. Pieces of one row, of two rows, of a part of a row (one row then), and the
// whole tensor; a tensor small enough for one task and one converted by two.
TEST(GgufWriter, WritesATensorAPieceOfWholeRowsAtATime) {
  TempDir dir;
  GgufMetadata kv;
  kv.add_uint32("general.test", 1);
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{7, 512}, {300, 1024}}) {
    const int64_t n = rows * cols;
    std::vector<float> values(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) values[size_t(i)] = std::sin(0.37f * float(i)) * float(1 + i % 13);
    for (GgmlType type : {GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4_0,
                          GgmlType::Q5_0, GgmlType::Q4_K, GgmlType::Q6_K}) {
      std::vector<uint8_t> whole(ggml_nbytes(type, n));
      ggml_quantize(type, values.data(), n, whole.data());
      const std::string expected(whole.begin(), whole.end());
      for (const int64_t piece : {n, cols, 2 * cols + 100, int64_t(100)}) {
        std::mutex mutex;
        std::vector<std::pair<int64_t, int64_t>> asked;
        const GgufTensor t{"t", {rows, cols}, type, [&](int64_t begin, int64_t count, float* dst) {
                             {
                               std::lock_guard<std::mutex> lock(mutex);
                               asked.emplace_back(begin, count);
                             }
                             std::copy(values.begin() + begin, values.begin() + begin + count, dst);
                           }};
        write_gguf(dir / "m.gguf", kv, {t}, nullptr, piece);
        const std::string file = read_file(dir / "m.gguf");
        const size_t data = file.size() - (whole.size() + 31) / 32 * 32;  // the one tensor's bytes, last
        EXPECT_EQ(file.substr(data, whole.size()), expected)
            << ggml_type_name(type) << ", " << rows << " rows, pieces of " << piece;
        std::sort(asked.begin(), asked.end());
        int64_t next = 0;
        for (const auto& [begin, count] : asked) {
          EXPECT_EQ(begin, next);
          EXPECT_TRUE(count > 0 && count % cols == 0 && count <= std::max(piece, cols)) << count << " of " << piece;
          next = begin + count;
        }
        EXPECT_EQ(next, n);
      }
    }
  }
}

// A tensor whose bytes already lie in the file's type (a bf16 checkpoint written as bf16) is
// copied from `stored`, a piece at a time, and the file is the one converting from `fill` writes:
// F32, F16 and BF16, pieces of one row, of several and the whole, and a tensor after it converted
// (the converted piece before a stored one is written first). A piece holding a NaN is converted
// instead (the bf16 signalling NaN comes out quiet, as gguf-py writes it), the others still copied.
TEST(GgufWriter, CopiesStoredBytesAsConvertingWouldWriteThem) {
  TempDir dir;
  GgufMetadata kv;
  kv.add_uint32("general.test", 1);
  const int64_t rows = 40, cols = 96, n = rows * cols;
  std::vector<float> values(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) values[size_t(i)] = std::sin(0.37f * float(i)) * float(1 + i % 13);
  for (GgmlType type : {GgmlType::F32, GgmlType::F16, GgmlType::BF16}) {
    for (const bool with_nan : {false, true}) {
      if (with_nan && type == GgmlType::F32) continue;
      std::vector<uint8_t> bytes(ggml_nbytes(type, n));
      ggml_quantize(type, values.data(), n, bytes.data());
      std::vector<float> widened = values;  // what the source's fill gives: its stored values, widened
      if (type == GgmlType::F16)
        for (int64_t i = 0; i < n; ++i) widened[size_t(i)] = f16_to_float(uint16_t(bytes[2 * i] | bytes[2 * i + 1] << 8));
      if (type == GgmlType::BF16)
        for (int64_t i = 0; i < n; ++i) widened[size_t(i)] = bf16_to_float(bf16{uint16_t(bytes[2 * i] | bytes[2 * i + 1] << 8)});
      const int64_t nan_at = 3 * cols + 5;  // in the fourth row
      if (with_nan) {
        const uint16_t nan = type == GgmlType::BF16 ? 0x7f81 : 0x7c01;  // bf16's signalling
        std::memcpy(bytes.data() + 2 * nan_at, &nan, 2);
        widened[size_t(nan_at)] = type == GgmlType::BF16 ? bf16_to_float(bf16{nan}) : f16_to_float(nan);
      }
      for (const int64_t piece : {cols, 3 * cols, n}) {
        SCOPED_TRACE(::testing::Message() << ggml_type_name(type) << (with_nan ? ", a NaN" : "") << ", pieces of "
                                          << piece);
        int64_t filled = 0, copied = 0;
        std::mutex mutex;
        GgufFill fill = [&](int64_t begin, int64_t count, float* dst) {
          std::lock_guard<std::mutex> lock(mutex);
          filled += count;
          std::copy(widened.begin() + begin, widened.begin() + begin + count, dst);
        };
        const GgufTensor first{"first", {rows, cols}, GgmlType::F32, fill};
        GgufTensor converted{"t", {rows, cols}, type, fill}, as_stored = converted;
        as_stored.stored = [&](int64_t begin, int64_t count, const std::function<void(const uint8_t*)>& use) {
          copied += count;
          use(bytes.data() + ggml_nbytes(type, begin));
        };
        write_gguf(dir / "converted.gguf", kv, {first, converted}, nullptr, piece);
        filled = 0;
        write_gguf(dir / "stored.gguf", kv, {first, as_stored}, nullptr, piece);
        EXPECT_EQ(read_file(dir / "stored.gguf"), read_file(dir / "converted.gguf"));
        EXPECT_EQ(copied, n) << "every piece offered";
        // The first tensor converted, and the one piece holding the NaN.
        const int64_t nan_piece = std::max(piece, cols);
        EXPECT_EQ(filled, n + (with_nan ? nan_piece : 0));
      }
    }
  }
}

}  // namespace
}  // namespace keel::formats
