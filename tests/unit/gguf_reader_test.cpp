// GGUF files read back (formats/gguf_reader.h): what keel's writer wrote comes back key for key and
// byte for byte, and every malformed part is refused with the file, the place and the expectation.
// That the reader agrees with gguf-py on files llama.cpp's converter wrote is reference.gguf's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "keel/core/file_io.h"
#include "keel/formats/gguf_reader.h"
#include "keel/formats/gguf_writer.h"
#include "test_support.h"

namespace keel::formats {
namespace {

using testing::expect_keel_error;
using testing::TempDir;

std::string written(const GgufMetadata& kv, const std::vector<GgufTensor>& tensors) {
  TempDir dir;
  write_gguf(dir / "m.gguf", kv, tensors);
  return read_file(dir / "m.gguf");
}

TEST(GgufReader, ReadsBackWhatTheWriterWrote) {
  GgufMetadata kv;
  kv.add_string("general.architecture", "llama");
  kv.add_uint32("llama.block_count", 2);
  kv.add_float32("llama.rope.freq_base", 500000.0f);
  kv.add_bool("tokenizer.ggml.add_bos_token", true);
  kv.add_int64("big", -(int64_t(1) << 40));
  kv.add_strings("tokenizer.ggml.tokens", {"a", "bc", ""});
  kv.add_int32s("tokenizer.ggml.token_type", {1, 3, -2});
  std::vector<GgufTensor> tensors = {
      {"token_embd.weight", {3, 32}, GgmlType::Q8_0,
       [](int64_t b, int64_t n, float* d) { for (int64_t i = 0; i < n; ++i) d[i] = float(b + i); }},
      {"output_norm.weight", {5}, GgmlType::F32,
       [](int64_t b, int64_t n, float* d) { for (int64_t i = 0; i < n; ++i) d[i] = 0.5f * float(b + i); }},
  };
  const std::string bytes = written(kv, tensors);
  const GgufFile file(bytes, "m.gguf");
  EXPECT_EQ(file.version(), 3u);
  ASSERT_EQ(file.metadata().size(), 7u);
  EXPECT_EQ(file.string_value("general.architecture"), "llama");
  EXPECT_EQ(file.integer_value("llama.block_count"), 2);
  EXPECT_EQ(file.integer_value("big"), -(int64_t(1) << 40));
  EXPECT_EQ(file.find("llama.rope.freq_base")->number, 500000.0);
  EXPECT_EQ(file.find("tokenizer.ggml.add_bos_token")->number, 1.0);
  EXPECT_EQ(file.find("tokenizer.ggml.tokens")->strings, (std::vector<std::string>{"a", "bc", ""}));
  EXPECT_EQ(file.find("tokenizer.ggml.token_type")->numbers, (std::vector<double>{1, 3, -2}));
  EXPECT_EQ(file.find("absent"), nullptr);
  expect_keel_error([&] { file.integer_value("general.architecture"); }, {"m.gguf", "general.architecture", "integer"});
  EXPECT_EQ(file.number_value("llama.rope.freq_base"), 500000.0);
  EXPECT_EQ(file.number_value("llama.block_count"), 2.0);
  EXPECT_EQ(file.bool_value("tokenizer.ggml.add_bos_token"), true);
  EXPECT_EQ(file.bool_value("absent"), std::nullopt);
  expect_keel_error([&] { file.number_value("general.architecture"); }, {"m.gguf", "general.architecture", "number"});
  expect_keel_error([&] { file.bool_value("llama.block_count"); }, {"m.gguf", "llama.block_count", "boolean"});

  ASSERT_EQ(file.tensors().size(), 2u);
  const auto& embd = file.tensors()[0];
  EXPECT_EQ(embd.name, "token_embd.weight");
  EXPECT_EQ(embd.shape, (std::vector<int64_t>{3, 32}));
  EXPECT_EQ(std::string(ggml_type_traits(embd.type)->name), "Q8_0");
  EXPECT_EQ(embd.nbytes, 3u * 34u);
  std::vector<uint8_t> q8(embd.nbytes);
  std::vector<float> values(96);
  for (int i = 0; i < 96; ++i) values[size_t(i)] = float(i);
  ggml_quantize(GgmlType::Q8_0, values.data(), 96, q8.data());
  const auto stored = file.tensor_bytes(embd);
  EXPECT_TRUE(std::equal(stored.begin(), stored.end(), q8.begin(), q8.end()));
  const auto norm = file.tensor_bytes(file.tensors()[1]);
  ASSERT_EQ(norm.size(), 20u);
  float second;
  std::memcpy(&second, norm.data() + 4, 4);
  EXPECT_EQ(second, 0.5f);
}

TEST(GgufReader, ReadsAFileFromDisk) {
  TempDir dir;
  GgufMetadata kv;
  kv.add_string("general.architecture", "qwen3");
  write_gguf(dir / "m.gguf", kv,
             {{"t", {2}, GgmlType::F32, [](int64_t, int64_t, float* d) { d[0] = 1, d[1] = 2; }}});
  const GgufFile file(dir / "m.gguf");
  EXPECT_EQ(file.string_value("general.architecture"), "qwen3");
  EXPECT_EQ(file.tensors().at(0).nbytes, 8u);
  // Released pages come back from the file when read again.
  file.release_tensor_bytes(file.tensors().at(0));
  float second;
  std::memcpy(&second, file.tensor_bytes(file.tensors().at(0)).data() + 4, 4);
  EXPECT_EQ(second, 2.0f);
  expect_keel_error([&] { GgufFile(dir / "absent.gguf"); }, {"absent.gguf", "cannot open"});
  expect_keel_error([&] { GgufFile(dir.path()); }, {"regular GGUF file", "directory"});
}

// Each malformed part named; never a read past the end.
TEST(GgufReader, RefusesMalformedFilesNamingThePlace) {
  GgufMetadata kv;
  kv.add_string("general.architecture", "llama");
  const std::string good =
      written(kv, {{"t", {4}, GgmlType::F32, [](int64_t, int64_t n, float* d) { std::fill(d, d + n, 1.0f); }}});
  auto refuses = [](const std::string& bytes, std::initializer_list<std::string> words) {
    expect_keel_error([&] { GgufFile(bytes, "bad.gguf"); }, words);
  };
  refuses("GGML" + good.substr(4), {"bad.gguf", "expected a GGUF file"});
  std::string v1 = good;
  v1[4] = 1;
  refuses(v1, {"version 1", "2 and 3"});
  for (size_t cut : {size_t(10), size_t(30), size_t(60), good.size() - 20})  // the last: into the tensor's bytes
    refuses(good.substr(0, cut), {"bad.gguf", "truncated"});
  std::string huge_count = good;
  huge_count[8] = '\xff', huge_count[9] = '\xff';  // the tensor count
  refuses(huge_count, {"more than the file's"});
  std::string bad_type = good;
  const size_t type_at = good.find("llama") - 8 - 4;  // the value type before the string's length
  bad_type[type_at] = 13;
  refuses(bad_type, {"general.architecture", "value type 13"});
  std::string bad_ggml = good;
  const size_t ggml_at = good.find('t', good.find("llama") + 5) + 1 + 4 + 8;  // name, n_dims, ne[0]
  bad_ggml[ggml_at] = 4;  // a removed type (Q4_2)
  refuses(bad_ggml, {"'t'", "ggml type 4"});
}

TEST(GgufReader, KnowsEveryGgmlTypeGgufPyKnows) {
  EXPECT_EQ(std::string(ggml_type_traits(12)->name), "Q4_K");
  EXPECT_EQ(ggml_type_traits(12)->block_size, 256);
  EXPECT_EQ(ggml_type_traits(12)->type_size, 144);
  EXPECT_EQ(ggml_type_traits(14)->type_size, 210);  // Q6_K
  EXPECT_EQ(ggml_type_traits(4), nullptr);
  EXPECT_EQ(ggml_type_traits(1000), nullptr);
}

}  // namespace
}  // namespace keel::formats
