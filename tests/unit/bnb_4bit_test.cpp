// model/bnb_4bit: reading a weight as transformers + bitsandbytes save it in 4 bits, and the setup's
// decisions for such a checkpoint. The layout is written here byte by byte (safetensors header,
// U8 codes, the packed quantization state); that it is bitsandbytes' own is checked end to end by
// tests/reference/lora_reference.py --prequantized, on checkpoints bitsandbytes wrote.
#include "keel/formats/bnb_4bit.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "keel/core/four_bit.h"
#include "keel/recipe/model_setup.h"
#include "test_support.h"

namespace keel::model {

// The file formats this reads and writes (formats/).
using formats::CheckpointReader;
using formats::is_bnb_4bit;
using formats::read_bnb_4bit_dequantized;
using formats::read_bnb_4bit;
namespace {

using keel::testing::expect_keel_error;
using keel::testing::TempDir;

struct RawTensor {
  std::string dtype;  // "U8" or "F32"
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

template <typename T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> out(v.size() * sizeof(T));
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

void write_raw_safetensors(const std::string& path, const std::map<std::string, RawTensor>& tensors) {
  std::string header = "{";
  size_t offset = 0;
  for (const auto& [name, t] : tensors) {
    header += fmt::format("{}\"{}\": {{\"dtype\": \"{}\", \"shape\": [{}], \"data_offsets\": [{}, {}]}}",
                          header.size() > 1 ? ", " : "", name, t.dtype, fmt::join(t.shape, ", "), offset,
                          offset + t.bytes.size());
    offset += t.bytes.size();
  }
  header += "}";
  std::ofstream f(path, std::ios::binary);
  const uint64_t n = header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << header;
  for (const auto& [name, t] : tensors)
    f.write(reinterpret_cast<const char*>(t.bytes.data()), std::streamsize(t.bytes.size()));
}

// One weight "w.weight" of rows x cols as QuantState.as_dict(packed=True) lays it out.
struct SavedWeight {
  std::vector<float> values;
  std::vector<uint8_t> packed, absmax_codes;
  std::vector<float> absmax, absmax2;
  float offset = 0.0f;
};

SavedWeight quantize(FourBitType type, int64_t n, bool nested, uint32_t seed) {
  SavedWeight w;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  w.values.resize(size_t(n));
  for (float& v : w.values) v = normal(rng);
  const int64_t blocks = n / kFourBitBlockSize;
  w.packed.resize(size_t(n / 2));
  w.absmax.resize(size_t(blocks));
  four_bit_quantize(type, w.values.data(), n, w.packed.data(), w.absmax.data());
  if (nested) {
    w.absmax_codes.resize(size_t(blocks));
    w.absmax2.resize(size_t((blocks + kAbsmaxBlockSize - 1) / kAbsmaxBlockSize));
    quantize_absmax(w.absmax.data(), blocks, w.absmax_codes.data(), w.absmax2.data(), &w.offset);
    dequantize_absmax(w.absmax_codes.data(), w.absmax2.data(), w.offset, blocks, w.absmax.data());
  }
  return w;
}

std::map<std::string, RawTensor> saved_tensors(const SavedWeight& w, FourBitType type, int64_t rows, int64_t cols,
                                               bool nested, const std::string& dtype = "float32",
                                               int64_t blocksize = kFourBitBlockSize) {
  const std::string name(four_bit_type_name(type));
  std::map<std::string, RawTensor> t;
  t["w.weight"] = {"U8", {rows * cols / 2, 1}, w.packed};
  std::vector<float> map(four_bit_values(type), four_bit_values(type) + 16);
  t["w.weight.quant_map"] = {"F32", {16}, bytes_of(map)};
  std::string state = fmt::format(R"({{"quant_type": "{}", "blocksize": {}, "dtype": "{}", "shape": [{}, {}])", name,
                                  blocksize, dtype, rows, cols);
  if (nested) {
    t["w.weight.absmax"] = {"U8", {int64_t(w.absmax_codes.size())}, w.absmax_codes};
    t["w.weight.nested_absmax"] = {"F32", {int64_t(w.absmax2.size())}, bytes_of(w.absmax2)};
    std::vector<float> dynamic(dynamic_map_values(), dynamic_map_values() + 256);
    t["w.weight.nested_quant_map"] = {"F32", {256}, bytes_of(dynamic)};
    state += fmt::format(R"(, "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": {:.9g})", w.offset);
  } else {
    t["w.weight.absmax"] = {"F32", {int64_t(w.absmax.size())}, bytes_of(w.absmax)};
  }
  state += "}";
  t["w.weight.quant_state.bitsandbytes__" + name] = {"U8", {int64_t(state.size())}, {state.begin(), state.end()}};
  return t;
}

TEST(Bnb4Bit, ReadsTheCodesAsSavedAndDequantizesAsBitsandbytes) {
  const int64_t rows = 40, cols = 512;  // 320 blocks: two blocks of double quantization, the last partial
  for (FourBitType type : {FourBitType::Nf4, FourBitType::Fp4})
    for (bool nested : {false, true}) {
      TempDir dir;
      const SavedWeight w = quantize(type, rows * cols, nested, 3);
      write_raw_safetensors(dir / "model.safetensors", saved_tensors(w, type, rows, cols, nested));
      auto reader = CheckpointReader::open_dir(dir.path());
      ASSERT_TRUE(is_bnb_4bit(reader, "w.weight"));
      EXPECT_FALSE(is_bnb_4bit(reader, "w.weight.absmax"));
      std::vector<uint8_t> packed(size_t(rows * cols / 2));
      std::vector<float> absmax(size_t(rows * cols / kFourBitBlockSize));
      read_bnb_4bit(reader, "w.weight", {rows, cols}, type, packed.data(), absmax.data());
      EXPECT_EQ(packed, w.packed);
      // Double quantization: map[code] * absmax2 + offset, with the offset through the JSON's text.
      EXPECT_EQ(0, std::memcmp(absmax.data(), w.absmax.data(), absmax.size() * sizeof(float)))
          << four_bit_type_name(type) << (nested ? " nested" : "");
      std::vector<float> want(size_t(rows * cols)), got(want.size());
      four_bit_dequantize(type, w.packed.data(), w.absmax.data(), rows * cols, want.data());
      read_bnb_4bit_dequantized(reader, "w.weight", {rows, cols}, type, got.data());
      EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * sizeof(float)));
    }
}

TEST(Bnb4Bit, DequantizesIntoTheSavedDtype) {
  TempDir dir;
  const SavedWeight w = quantize(FourBitType::Nf4, 64 * 8, false, 4);
  write_raw_safetensors(dir / "model.safetensors", saved_tensors(w, FourBitType::Nf4, 8, 64, false, "bfloat16"));
  auto reader = CheckpointReader::open_dir(dir.path());
  std::vector<float> want(64 * 8), got(want.size());
  four_bit_dequantize(FourBitType::Nf4, w.packed.data(), w.absmax.data(), 64 * 8, want.data());
  read_bnb_4bit_dequantized(reader, "w.weight", {8, 64}, FourBitType::Nf4, got.data());
  for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(got[i], bf16_to_float(float_to_bf16(want[i]))) << i;
}

TEST(Bnb4Bit, ErrorsNameTheTensorAndWhatDiffers) {
  const SavedWeight w = quantize(FourBitType::Nf4, 64 * 8, true, 5);
  auto expect = [&](std::map<std::string, RawTensor> tensors, std::vector<int64_t> shape, FourBitType expected,
                    std::initializer_list<std::string> parts) {
    TempDir dir;
    write_raw_safetensors(dir / "model.safetensors", tensors);
    auto reader = CheckpointReader::open_dir(dir.path());
    std::vector<uint8_t> packed(256);
    std::vector<float> absmax(8);
    expect_keel_error([&] { read_bnb_4bit(reader, "w.weight", shape, expected, packed.data(), absmax.data()); }, parts);
  };
  auto good = saved_tensors(w, FourBitType::Nf4, 8, 64, true);
  expect(good, {8, 64}, FourBitType::Fp4, {"'w.weight'", "stored as nf4", "expected fp4"});
  expect(good, {16, 32}, FourBitType::Nf4, {"bitsandbytes__nf4", "shape: expected [16, 32], found [8, 64]"});
  expect(saved_tensors(w, FourBitType::Nf4, 8, 64, true, "float32", 128), {8, 64}, FourBitType::Nf4,
         {"blocksize: expected 64", "128"});
  expect(saved_tensors(w, FourBitType::Nf4, 8, 64, true, "float64"), {8, 64}, FourBitType::Nf4, {"dtype", "float64"});
  auto unquantized = good;
  unquantized.erase("w.weight.quant_state.bitsandbytes__nf4");
  expect(unquantized, {8, 64}, FourBitType::Nf4, {"'w.weight'", "saved unquantized"});
  auto other_map = good;
  other_map["w.weight.quant_map"].bytes[3 * 4] ^= 1;  // code 3's value, one bit off
  expect(other_map, {8, 64}, FourBitType::Nf4, {"w.weight.quant_map", "code 3"});
  auto no_absmax = good;
  no_absmax.erase("w.weight.nested_absmax");
  expect(no_absmax, {8, 64}, FourBitType::Nf4, {"w.weight.nested_absmax"});
  auto float_codes = good;
  float_codes["w.weight"] = {"F32", {64, 1}, std::vector<uint8_t>(256)};
  expect(float_codes, {8, 64}, FourBitType::Nf4, {"'w.weight'", "expected dtype U8, found F32"});
}

TEST(Bnb4Bit, TheCheckpointDecidesTheFourBitBaseAndTheRecipeMayNotContradictIt) {
  ModelConfig config;
  config.saved_four_bit = ModelConfig::SavedFourBit{FourBitType::Fp4, true};
  recipe::Recipe r;
  r.source = "r.toml";
  r.model_name = "m4";
  r.finetuning_type = recipe::Finetuning::Lora;
  r.quantization_type = FourBitType::Nf4;  // the default, without quantization_bit: the checkpoint decides
  auto o = recipe::training_decoder_options(r, config);
  EXPECT_TRUE(o.four_bit_base);
  EXPECT_EQ(o.four_bit_type, FourBitType::Fp4);
  EXPECT_TRUE(o.double_quantization);
  r.quantization_bit = 4;
  expect_keel_error([&] { recipe::training_decoder_options(r, config); },
                    {"r.toml", "quantization_type = \"nf4\"", "'m4' is saved in 4 bits as fp4", "does not requantize"});
  r.quantization_type = FourBitType::Fp4;
  EXPECT_TRUE(recipe::training_decoder_options(r, config).four_bit_base);
  r.finetuning_type = recipe::Finetuning::Full;
  r.quantization_bit = 0;
  expect_keel_error([&] { recipe::training_decoder_options(r, config); },
                    {"r.toml", "'m4' is saved in 4 bits by bitsandbytes (fp4", "finetuning_type = \"lora\""});
}

}  // namespace
}  // namespace keel::model
