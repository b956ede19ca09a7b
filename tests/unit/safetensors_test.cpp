// safetensors reading and writing: round trips in every dtype keel stores, sharded model
// directories, and one test per kind of malformed input, each expecting a keel::Error that
// names the problem (never a crash).
#include "keel/formats/safetensors.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <utility>
#include <vector>

#include "keel/core/error.h"
#include "keel/core/file_io.h"

namespace keel::formats {
namespace {

namespace fs = std::filesystem;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/keel_safetensors_XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  std::string dir_;
};

// Runs fn, which must throw keel::Error whose message contains every one of `parts`.
void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "expected keel::Error";
  } catch (const Error& e) {
    for (const auto& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

// A safetensors file from raw pieces, for crafting malformed inputs.
void write_raw(const std::string& path, const std::string& header, const std::string& data,
               std::optional<uint64_t> declared_length = std::nullopt) {
  uint64_t n = declared_length.value_or(header.size());
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = char(n >> (8 * i));
  write_file_atomic(path, bytes + header + data);
}

std::vector<float> ramp(size_t n, float scale = 0.37f) {
  std::vector<float> v(n);
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (size_t i = 0; i < n; ++i) v[i] = scale * normal(rng);
  return v;
}

std::vector<float> read_all(const CheckpointReader& r, const std::string& name) {
  const TensorInfo& t = r.get(name);
  std::vector<float> out(size_t(t.numel()));
  r.read_f32(name, t.shape, out.data());
  return out;
}

TEST_F(SafetensorsTest, RoundTripF32IsExact) {
  auto a = ramp(6), b = ramp(5);
  float scalar = 3.25f;
  std::vector<TensorToWrite> tensors = {{"layer.weight", {2, 3}, a.data()},
                                        {"bias \"quoted\"", {5}, b.data()},
                                        {"scalar", {}, &scalar},
                                        {"empty", {0, 4}, nullptr}};
  write_safetensors(path("model.safetensors"), tensors, DType::F32, {{"format", "pt"}, {"note", "line\nbreak"}});

  auto file = SafetensorsFile::open(path("model.safetensors"));
  ASSERT_EQ(file->tensors().size(), 4u);
  EXPECT_EQ(file->tensors()[0].name, "layer.weight");  // file order = given order
  EXPECT_EQ(file->tensors()[1].name, "bias \"quoted\"");
  EXPECT_EQ(file->metadata().at("note"), "line\nbreak");
  EXPECT_EQ(file->find("missing"), nullptr);
  const TensorInfo* s = file->find("scalar");
  ASSERT_NE(s, nullptr);
  EXPECT_TRUE(s->shape.empty());
  EXPECT_EQ(s->numel(), 1);

  auto reader = CheckpointReader::open_dir(dir_);
  EXPECT_EQ(read_all(reader, "layer.weight"), a);
  EXPECT_EQ(read_all(reader, "bias \"quoted\""), b);
  EXPECT_EQ(read_all(reader, "scalar"), std::vector<float>{scalar});
  EXPECT_EQ(reader.get("empty").numel(), 0);
  EXPECT_EQ(reader.dtype_of("layer.weight"), DType::F32);
}

TEST_F(SafetensorsTest, HeaderIsPaddedSoDataIsEightByteAligned) {
  auto a = ramp(3);
  write_safetensors(path("x.safetensors"), {{"a", {3}, a.data()}}, DType::F32);
  std::string bytes = read_file(path("x.safetensors"));
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + n + 12);
  EXPECT_EQ(bytes[8 + n - 1] == ' ' || bytes[8 + n - 1] == '}', true);
}

TEST_F(SafetensorsTest, RoundTripBf16AndF16RoundToNearest) {
  auto values = ramp(1000, 5.f);
  values.push_back(65504.f);  // largest half
  values.push_back(1e-7f);    // half subnormal
  values.push_back(-0.f);
  for (DType dtype : {DType::BF16, DType::F16}) {
    write_safetensors(path("model.safetensors"), {{"w", {int64_t(values.size())}, values.data()}}, dtype);
    auto reader = CheckpointReader::open_dir(dir_);
    EXPECT_EQ(reader.dtype_of("w"), dtype);
    auto back = read_all(reader, "w");
    for (size_t i = 0; i < values.size(); ++i) {
      float expected =
          dtype == DType::BF16 ? bf16_to_float(float_to_bf16(values[i])) : f16_to_float(float_to_f16(values[i]));
      ASSERT_EQ(std::memcmp(&back[i], &expected, 4), 0) << dtype_name(dtype) << " at " << i;
    }
  }
}

// A part of a tensor reads as that slice of the whole, in every dtype (a GGUF export streams a
// tensor a piece at a time), and writes nothing past it; a part outside the tensor is an error
// naming the tensor.
TEST_F(SafetensorsTest, ReadsAPartOfATensorAsTheSliceOfTheWhole) {
  auto values = ramp(1000, 3.f);
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    write_safetensors(path("model.safetensors"), {{"w", {10, 100}, values.data()}}, dtype);
    auto reader = CheckpointReader::open_dir(dir_);
    const auto whole = read_all(reader, "w");
    const std::vector<std::pair<int64_t, int64_t>> parts = {{0, 1000}, {0, 1},  {137, 400},
                                                            {999, 1},  {500, 0}, {1000, 0}};
    for (const auto& [begin, count] : parts) {
      std::vector<float> part(size_t(count) + 1, -7.0f);
      reader.read_f32_part("w", {10, 100}, begin, count, part.data());
      EXPECT_EQ(std::vector<float>(part.begin(), part.begin() + count),
                std::vector<float>(whole.begin() + begin, whole.begin() + begin + count))
          << dtype_name(dtype) << " [" << begin << ", +" << count << ")";
      EXPECT_EQ(part[size_t(count)], -7.0f) << "written past the part";
    }
    std::vector<float> out(10);
    expect_error([&] { reader.read_f32_part("w", {10, 100}, 995, 10, out.data()); },
                 {"tensor 'w'", "[995, 1005)", "1000 elements"});
    expect_error([&] { reader.read_f32_part("w", {10, 100}, -1, 1, out.data()); }, {"tensor 'w'", "[-1, 0)"});
    expect_error([&] { reader.read_f32_part("w", {100, 10}, 0, 1, out.data()); }, {"expected shape [100, 10]"});
  }
}

// The stored bytes of a part: the file's own bytes of those elements (what the whole file holds
// there), in the tensor's dtype; the same range and shape checks as read_f32_part.
TEST_F(SafetensorsTest, HandsOverAPartsStoredBytes) {
  auto values = ramp(1000, 3.f);
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    write_safetensors(path("model.safetensors"), {{"w", {10, 100}, values.data()}}, dtype);
    const std::string file = read_file(path("model.safetensors"));
    auto reader = CheckpointReader::open_dir(dir_);
    ASSERT_EQ(reader.dtype_of("w"), dtype);
    const size_t element = dtype_size(dtype), data = file.size() - 1000 * element;  // the one tensor, last
    for (const auto& [begin, count] : std::vector<std::pair<int64_t, int64_t>>{{0, 1000}, {137, 400}, {999, 1}}) {
      std::string seen;
      reader.read_stored_part("w", {10, 100}, begin, count, [&](const uint8_t* bytes) {
        seen.assign(reinterpret_cast<const char*>(bytes), size_t(count) * element);
      });
      EXPECT_EQ(seen, file.substr(data + size_t(begin) * element, size_t(count) * element))
          << dtype_name(dtype) << " [" << begin << ", +" << count << ")";
    }
    bool called = false;
    reader.read_stored_part("w", {10, 100}, 500, 0, [&](const uint8_t*) { called = true; });
    EXPECT_FALSE(called) << "nothing to hand over";
    auto use = [](const uint8_t*) {};
    expect_error([&] { reader.read_stored_part("w", {10, 100}, 995, 10, use); },
                 {"tensor 'w'", "[995, 1005)", "1000 elements"});
    expect_error([&] { reader.read_stored_part("w", {100, 10}, 0, 1, use); }, {"expected shape [100, 10]"});
  }
}

TEST_F(SafetensorsTest, ShardedWeightsReadBackLikeSingleFile) {
  std::vector<std::vector<float>> data = {ramp(64), ramp(10), ramp(200), ramp(3), ramp(50)};
  std::vector<TensorToWrite> tensors;
  for (size_t i = 0; i < data.size(); ++i) {
    tensors.push_back({"t" + std::to_string(i), {int64_t(data[i].size())}, data[i].data()});
  }
  std::string single = path("single"), sharded = path("sharded");
  write_model_weights(single, tensors, DType::BF16);
  write_model_weights(sharded, tensors, DType::BF16, 300);  // bytes: 128, 20, 400, 6, 100

  EXPECT_TRUE(path_exists(single + "/model.safetensors"));
  EXPECT_FALSE(path_exists(single + "/model.safetensors.index.json"));
  EXPECT_FALSE(path_exists(sharded + "/model.safetensors"));
  EXPECT_TRUE(path_exists(sharded + "/model.safetensors.index.json"));
  EXPECT_TRUE(path_exists(sharded + "/model-00001-of-00003.safetensors"));
  EXPECT_TRUE(path_exists(sharded + "/model-00003-of-00003.safetensors"));
  std::string index = read_file(sharded + "/model.safetensors.index.json");
  EXPECT_NE(index.find("\"total_size\": 654"), std::string::npos) << index;
  EXPECT_NE(index.find("\"t2\": \"model-00002-of-00003.safetensors\""), std::string::npos) << index;

  auto a = CheckpointReader::open_dir(single), b = CheckpointReader::open_dir(sharded);
  ASSERT_EQ(a.names(), b.names());
  for (const auto& name : a.names()) EXPECT_EQ(read_all(a, name), read_all(b, name)) << name;
  EXPECT_EQ(SafetensorsFile::open(single + "/model.safetensors")->metadata().at("format"), "pt");

  // Saving a single file over the sharded layout removes the index and shards it would shadow.
  write_model_weights(sharded, tensors, DType::BF16);
  EXPECT_FALSE(path_exists(sharded + "/model.safetensors.index.json"));
  EXPECT_FALSE(path_exists(sharded + "/model-00001-of-00003.safetensors"));
  // And the other way round.
  write_model_weights(sharded, tensors, DType::F32, 300);
  EXPECT_FALSE(path_exists(sharded + "/model.safetensors"));
  auto c = CheckpointReader::open_dir(sharded);
  EXPECT_EQ(c.names(), a.names());
  EXPECT_EQ(read_all(c, "t2"), data[2]);
}

TEST_F(SafetensorsTest, WriteRejectsBadTensors) {
  float x = 1;
  expect_error(
      [&] {
        write_safetensors(path("a.safetensors"), {{"a", {1}, &x}, {"a", {1}, &x}}, DType::F32);
      },
      {"'a'", "unique"});
  expect_error([&] { write_safetensors(path("a.safetensors"), {{"a", {4}, nullptr}}, DType::F32); }, {"null"});
  expect_error([&] { write_safetensors(path("a.safetensors"), {{"a", {-1}, &x}}, DType::F32); }, {"non-negative"});
  expect_error([&] { write_model_weights(path("m"), {}, DType::F32); }, {"no tensors"});
  EXPECT_FALSE(path_exists(path("a.safetensors")));
  for (const auto& entry : fs::directory_iterator(dir_)) ADD_FAILURE() << "left behind: " << entry.path();
}

// --- malformed files ------------------------------------------------------------------------------

TEST_F(SafetensorsTest, TruncatedFile) {
  write_file_atomic(path("model.safetensors"), "abc");
  expect_error([&] { SafetensorsFile::open(path("model.safetensors")); }, {"model.safetensors", "8 bytes", "3-byte"});
}

TEST_F(SafetensorsTest, HeaderLengthBeyondFile) {
  write_raw(path("x.safetensors"), "{}", "", 1000);
  expect_error([&] { SafetensorsFile::open(path("x.safetensors")); }, {"x.safetensors", "header length", "1000"});
  write_raw(path("y.safetensors"), "{}", "", 1ull << 62);
  expect_error([&] { SafetensorsFile::open(path("y.safetensors")); }, {"header length"});
}

TEST_F(SafetensorsTest, HeaderAboveSaneMaximum) {
  // A sparse file: the length is refused before any of the header is read.
  uint64_t length = (100u << 20) + 8;
  write_raw(path("x.safetensors"), "{}", "", length);
  fs::resize_file(path("x.safetensors"), 8 + length);
  expect_error([&] { SafetensorsFile::open(path("x.safetensors")); }, {"at most 104857600"});
}

TEST_F(SafetensorsTest, BadJson) {
  write_raw(path("x.safetensors"), "{\"a\": {\"dtype\": ", "");
  expect_error([&] { SafetensorsFile::open(path("x.safetensors")); }, {"x.safetensors", "valid JSON"});
  write_raw(path("y.safetensors"), "[1, 2]", "");
  expect_error([&] { SafetensorsFile::open(path("y.safetensors")); }, {"JSON object", "an array"});
  write_raw(path("z.safetensors"), R"({"a": 3})", "");
  expect_error([&] { SafetensorsFile::open(path("z.safetensors")); }, {"tensor 'a'", "expected an object"});
}

TEST_F(SafetensorsTest, OffsetsOutOfBounds) {
  write_raw(path("x.safetensors"), R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "1234");
  expect_error([&] { SafetensorsFile::open(path("x.safetensors")); }, {"tensor 'w'", "4-byte data section", "[0, 8]"});
  write_raw(path("y.safetensors"), R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", "12345678");
  expect_error([&] { SafetensorsFile::open(path("y.safetensors")); }, {"tensor 'w'", "begin <= end"});
  write_raw(path("z.safetensors"), R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", "1234");
  expect_error([&] { SafetensorsFile::open(path("z.safetensors")); }, {"tensor 'w'", "data_offsets"});
}

TEST_F(SafetensorsTest, SizeMismatchWithShape) {
  write_raw(path("x.safetensors"), R"({"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,8]}})", "12345678");
  expect_error([&] { SafetensorsFile::open(path("x.safetensors")); },
               {"tensor 'w'", "expected 12 bytes", "[2, 3]", "8 bytes"});
}

TEST_F(SafetensorsTest, ShapeProductOverflowAndBadDims) {
  write_raw(path("x.safetensors"), R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", "");
  expect_error([&] { SafetensorsFile::open(path("x.safetensors")); }, {"tensor 'w'", "64 bits"});
  write_raw(path("y.safetensors"), R"({"w":{"dtype":"F32","shape":[2,-1],"data_offsets":[0,0]}})", "");
  expect_error([&] { SafetensorsFile::open(path("y.safetensors")); }, {"tensor 'w'", "non-negative"});
  write_raw(path("z.safetensors"), R"({"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,0]}})", "");
  expect_error([&] { SafetensorsFile::open(path("z.safetensors")); }, {"tensor 'w'", "non-negative integers"});
}

TEST_F(SafetensorsTest, OverlappingTensors) {
  write_raw(
      path("x.safetensors"),
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
      "12345678");
  expect_error([&] { SafetensorsFile::open(path("x.safetensors")); }, {"overlapping", "'a'", "'b'"});
}

TEST_F(SafetensorsTest, DuplicateNamesInHeader) {
  write_raw(
      path("x.safetensors"),
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
      "12345678");
  expect_error([&] { SafetensorsFile::open(path("x.safetensors")); }, {"tensor 'a'", "twice"});
}

TEST_F(SafetensorsTest, InvalidDtypeFailsOnOpen) {
  write_raw(path("x.safetensors"), R"({"w":{"dtype":"F99","shape":[1],"data_offsets":[0,4]}})", "1234");
  expect_error([&] { SafetensorsFile::open(path("x.safetensors")); }, {"tensor 'w'", "F99"});
}

TEST_F(SafetensorsTest, UnsupportedDtypeFailsOnlyWhenFetched) {
  // An int64 buffer next to a float weight, as old checkpoints carry position_ids.
  write_raw(path("model.safetensors"),
            R"({"__metadata__":{"format":"pt"},"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},)"
            R"("w":{"dtype":"F32","shape":[1],"data_offsets":[16,20]}})",
            std::string(16, '\0') + std::string("\0\0\x80\x3f", 4));
  auto file = SafetensorsFile::open(path("model.safetensors"));
  EXPECT_EQ(file->tensors().size(), 1u);
  expect_error([&] { file->find("ids"); }, {"tensor 'ids'", "I64"});

  auto reader = CheckpointReader::open_dir(dir_);
  EXPECT_TRUE(reader.has("ids"));
  EXPECT_EQ(reader.names(), (std::vector<std::string>{"ids", "w"}));
  EXPECT_EQ(read_all(reader, "w"), std::vector<float>{1.f});
  expect_error([&] { reader.get("ids"); }, {"model.safetensors", "tensor 'ids'", "F32, BF16 or F16", "found I64"});
  std::vector<float> out(2);
  expect_error([&] { reader.read_f32("ids", {2}, out.data()); }, {"tensor 'ids'", "I64"});
}

TEST_F(SafetensorsTest, MetadataMustBeStrings) {
  write_raw(path("x.safetensors"), R"({"__metadata__":{"step":3}})", "");
  expect_error([&] { SafetensorsFile::open(path("x.safetensors")); }, {"__metadata__", "'step'", "string"});
}

TEST_F(SafetensorsTest, ShapeMismatchInReadF32) {
  auto a = ramp(6);
  write_safetensors(path("model.safetensors"), {{"w", {2, 3}, a.data()}}, DType::F32);
  auto reader = CheckpointReader::open_dir(dir_);
  std::vector<float> out(6);
  expect_error(
      [&] {
        reader.read_f32("w", {3, 2}, out.data());
      },
      {"tensor 'w'", "expected shape [3, 2]", "found [2, 3]"});
  expect_error([&] { reader.get("nope"); }, {"tensor 'nope'", dir_});
}

// --- model directories ----------------------------------------------------------------------------

TEST_F(SafetensorsTest, MissingDirectoryOrWeights) {
  expect_error([&] { CheckpointReader::open_dir(path("absent")); }, {"absent", "model directory"});
  expect_error([&] { CheckpointReader::open_dir(dir_); }, {dir_, "model.safetensors", "found neither"});
}

class ShardedDirTest : public SafetensorsTest {
 protected:
  // Two shards; the caller supplies the index text.
  void write_shards() {
    write_safetensors(path("a.safetensors"), {{"x", {2}, values}}, DType::F32);
    write_safetensors(path("b.safetensors"), {{"y", {2}, values}}, DType::F32);
  }
  float values[2] = {1, 2};
};

TEST_F(ShardedDirTest, IndexWithHandNamedShards) {
  write_shards();
  write_file_atomic(path("model.safetensors.index.json"),
                    R"({"metadata":{},"weight_map":{"x":"a.safetensors","y":"./b.safetensors"}})");
  auto reader = CheckpointReader::open_dir(dir_);
  EXPECT_EQ(reader.names(), (std::vector<std::string>{"x", "y"}));
}

TEST_F(ShardedDirTest, MissingShardFile) {
  write_shards();
  write_file_atomic(path("model.safetensors.index.json"),
                    R"({"weight_map":{"x":"a.safetensors","y":"c.safetensors"}})");
  expect_error([&] { CheckpointReader::open_dir(dir_); },
               {"index.json", "tensor 'y'", "c.safetensors", "no such file"});
}

TEST_F(ShardedDirTest, IndexReferencesMissingTensor) {
  write_shards();
  write_file_atomic(path("model.safetensors.index.json"),
                    R"({"weight_map":{"x":"a.safetensors","z":"b.safetensors"}})");
  expect_error([&] { CheckpointReader::open_dir(dir_); },
               {"index.json", "tensor 'z'", "b.safetensors", "no such tensor"});
}

TEST_F(ShardedDirTest, PathTraversalInIndex) {
  write_shards();
  for (std::string shard : {"../a.safetensors", "/etc/passwd", "sub/../../a.safetensors", ""}) {
    write_file_atomic(path("model.safetensors.index.json"), R"({"weight_map":{"x":")" + shard + R"("}})");
    expect_error([&] { CheckpointReader::open_dir(dir_); }, {"tensor 'x'", "relative to the model directory"});
  }
}

TEST_F(ShardedDirTest, TensorInTwoShards) {
  write_shards();
  write_safetensors(path("b.safetensors"), {{"x", {2}, values}}, DType::F32);
  write_file_atomic(path("model.safetensors.index.json"),
                    R"({"weight_map":{"x":"a.safetensors","y":"b.safetensors"}})");
  expect_error([&] { CheckpointReader::open_dir(dir_); }, {"tensor 'x'", "one shard only"});
}

TEST_F(ShardedDirTest, MalformedIndex) {
  write_shards();
  write_file_atomic(path("model.safetensors.index.json"), R"({"weight_map":["a.safetensors"]})");
  expect_error([&] { CheckpointReader::open_dir(dir_); }, {"index.json", "weight_map"});
  write_file_atomic(path("model.safetensors.index.json"), R"({"weight_map":{"x":5}})");
  expect_error([&] { CheckpointReader::open_dir(dir_); }, {"index.json", "tensor 'x'", "shard file name"});
  write_file_atomic(path("model.safetensors.index.json"), "{");
  expect_error([&] { CheckpointReader::open_dir(dir_); }, {"index.json", "valid JSON"});
}

TEST_F(SafetensorsTest, RandomCorruptionNeverCrashes) {
  // Every single-byte change and every truncation of a valid file either still parses or
  // raises keel::Error.
  auto a = ramp(4);
  write_safetensors(path("good.safetensors"), {{"w", {2, 2}, a.data()}, {"b", {4}, a.data()}}, DType::BF16,
                    {{"k", "v"}});
  std::string good = read_file(path("good.safetensors"));
  make_dirs(path("corrupt"));
  std::mt19937 rng(7);
  for (int trial = 0; trial < 400; ++trial) {
    std::string bytes = good;
    if (trial % 4 == 0) {
      bytes.resize(rng() % bytes.size());
    } else {
      bytes[rng() % bytes.size()] = char(rng());
    }
    write_file_atomic(path("corrupt/model.safetensors"), bytes);
    try {
      // Reading every tensor in full lets the sanitizers see any access outside the mapping.
      auto reader = CheckpointReader::open_dir(path("corrupt"));
      for (const auto& name : reader.names()) read_all(reader, name);
    } catch (const Error&) {}
  }
}

}  // namespace
}  // namespace keel::formats
