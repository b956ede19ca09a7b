// Loading and saving whole models in each family's HF format: sharded and single-file checkpoints
// load the same weights, export -> reload is bit-exact, and missing or mis-shaped tensors are
// errors naming the tensor.
#include "keel/model/hf_weights.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "keel/core/file_io.h"
#include "keel/recipe/model_setup.h"
#include "test_support.h"

namespace keel::model {

// The file formats this reads and writes (formats/).
using formats::CheckpointReader;
using formats::TensorToWrite;
using formats::write_model_weights;
namespace {

using keel::testing::expect_keel_error;
using keel::testing::TempDir;

ModelConfig tiny(const std::string& family, bool tied = false) {
  recipe::ScratchModel m;
  m.family = family;
  m.vocab_size = 50;
  m.hidden_size = 32;
  m.intermediate_size = 48;
  m.num_layers = 2;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.tie_word_embeddings = tied;
  return recipe::scratch_model_config(m);
}

bool same_weights(const Decoder& a, const Decoder& b) {
  return a.params().total() == b.params().total() &&
         std::memcmp(a.params().weights_data(), b.params().weights_data(), sizeof(float) * a.params().total()) == 0;
}

class HfWeights : public ::testing::TestWithParam<std::string> {};

TEST_P(HfWeights, ExportReloadIsBitExactAndShardsMatchSingleFile) {
  const auto config = tiny(GetParam(), GetParam() == "qwen2");
  Decoder original(config, Precision::F32, 1, 8);
  original.init_random(3, 0.5);
  TempDir dir;
  save_hf_model(original, dir / "single", DType::F32);
  save_hf_model(original, dir / "sharded", DType::F32, 20000);  // several shards + index
  ASSERT_TRUE(path_exists(dir / "sharded/model.safetensors.index.json"));
  ASSERT_FALSE(path_exists(dir / "single/model.safetensors.index.json"));

  for (const char* sub : {"single", "sharded"}) {
    const auto reloaded_config = load_model_config(dir / std::string(sub) + "/config.json");
    EXPECT_EQ(reloaded_config.family, config.family);
    Decoder reloaded(reloaded_config, Precision::F32, 1, 8);
    EXPECT_TRUE(load_hf_weights(reloaded, dir / sub).empty());
    EXPECT_TRUE(same_weights(original, reloaded)) << sub;
  }
}

TEST_P(HfWeights, Bf16ExportRoundTripsBf16Values) {
  const auto config = tiny(GetParam());
  Decoder original(config, Precision::BF16, 1, 8);
  original.init_random(4, 0.5);
  // Round the weights to bf16 first: then the bf16 export must reload them exactly.
  auto& P = original.params();
  for (int64_t i = 0; i < P.total(); ++i) P.weights()[i] = bf16_to_float(float_to_bf16(P.weights()[i]));
  TempDir dir;
  save_hf_model(original, dir.path(), DType::BF16);
  EXPECT_EQ(CheckpointReader::open_dir(dir.path()).dtype_of(hf_tensors(config, original.ids())[0].name), DType::BF16);
  Decoder reloaded(load_model_config(dir / "config.json"), Precision::BF16, 1, 8);
  load_hf_weights(reloaded, dir.path());
  EXPECT_TRUE(same_weights(original, reloaded));
}

// ZeRO-3's final save: the weights arrive as a forward-only stream of the flat buffer, in pieces
// shorter than any tensor (as distributed::ShardReader hands them over); the files load to the
// same model as an export from memory, single-file and sharded.
TEST_P(HfWeights, StreamedSaveLoadsAsTheInMemorySave) {
  const auto config = tiny(GetParam(), GetParam() == "qwen2");
  Decoder original(config, Precision::F32, 1, 8);
  original.init_random(6, 0.5);
  const float* flat = original.params().weights_data();
  int64_t furthest = 0, calls = 0;
  const FlatWeightStream stream = [&](int64_t begin, int64_t max_count, int64_t* n) {
    EXPECT_GE(begin, furthest) << "the stream went back";
    furthest = begin;
    ++calls;
    *n = std::min<int64_t>(max_count, 777);
    return flat + begin;
  };
  TempDir dir;
  save_hf_model_streamed(original, dir / "single", DType::F32, stream);
  EXPECT_GT(calls, original.params().total() / 777);
  furthest = 0;
  save_hf_model_streamed(original, dir / "sharded", DType::F32, stream, 20000);
  ASSERT_TRUE(path_exists(dir / "sharded/model.safetensors.index.json"));
  for (const char* sub : {"single", "sharded"}) {
    Decoder reloaded(load_model_config(dir / std::string(sub) + "/config.json"), Precision::F32, 1, 8);
    EXPECT_TRUE(load_hf_weights(reloaded, dir / sub).empty()) << sub;
    EXPECT_TRUE(same_weights(original, reloaded)) << sub;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, HfWeights, ::testing::Values("llama", "qwen2", "glm", "glm_original"));

TEST(HfWeightsErrors, MissingAndMisShapedTensorsAreNamed) {
  const auto config = tiny("llama");
  Decoder model(config, Precision::F32, 1, 8);
  model.init_random(5);
  TempDir dir;
  save_hf_model(model, dir.path(), DType::F32);

  // Rewrite the checkpoint without one tensor, and with one tensor of the wrong shape.
  auto reader = CheckpointReader::open_dir(dir.path());
  std::vector<std::vector<float>> storage;
  std::vector<TensorToWrite> missing, misshaped;
  for (const auto& name : reader.names()) {
    const auto& info = reader.get(name);
    storage.emplace_back(info.numel());
    reader.read_f32(name, info.shape, storage.back().data());
    if (name != "model.layers.1.mlp.up_proj.weight") missing.push_back({name, info.shape, storage.back().data()});
    auto shape = info.shape;
    if (name == "model.layers.0.self_attn.k_proj.weight") shape = {shape[1], shape[0]};
    misshaped.push_back({name, shape, storage.back().data()});
  }
  write_model_weights(dir / "missing", missing, DType::F32);
  write_model_weights(dir / "misshaped", misshaped, DType::F32);
  Decoder target(config, Precision::F32, 1, 8);
  expect_keel_error([&] { load_hf_weights(target, dir / "missing"); }, {"model.layers.1.mlp.up_proj.weight"});
  expect_keel_error([&] { load_hf_weights(target, dir / "misshaped"); },
                    {"model.layers.0.self_attn.k_proj.weight", "shape"});
}

TEST(HfWeightsErrors, UnusedTensorsAreReported) {
  const auto config = tiny("llama");
  Decoder model(config, Precision::F32, 1, 8);
  model.init_random(6);
  TempDir dir;
  std::vector<TensorToWrite> tensors;
  for (const auto& t : hf_tensors(config, model.ids()))
    tensors.push_back(
        {t.name, t.shape(),
         model.params().weights_data() + model.params().param(t.param).offset + t.row_begin * (t.cols ? t.cols : 1)});
  std::vector<float> extra(4, 1.0f);
  tensors.push_back({"model.layers.0.mlp.extra_adapter.weight", {2, 2}, extra.data()});
  write_model_weights(dir.path(), tensors, DType::F32);
  Decoder target(config, Precision::F32, 1, 8);
  auto unused = load_hf_weights(target, dir.path());
  ASSERT_EQ(unused.size(), 1u);
  EXPECT_EQ(unused[0], "model.layers.0.mlp.extra_adapter.weight");
}

}  // namespace
}  // namespace keel::model
