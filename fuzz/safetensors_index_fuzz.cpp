// model.safetensors.index.json: CheckpointReader::open_dir on a directory holding the input as the
// index and the two small valid shards keel's writer made with it (embed.weight and norm.weight in
// model-00001-of-00002.safetensors, lm_head.weight in model-00002-of-00002.safetensors).
#include "fuzz_support.h"
#include "keel/formats/safetensors.h"

namespace {

// Two shards and an index, as keel's writer lays them out (seed_corpus.cpp writes the same).
void write_sharded_model(const std::string& dir) {
  static const float values[6] = {1, 2, 3, 4, 5, 6};
  keel::formats::write_model_weights(
      dir, {{"embed.weight", {2, 2}, values}, {"norm.weight", {2}, values}, {"lm_head.weight", {3, 2}, values}},
      keel::DType::BF16, /*max_shard_bytes=*/12);
}

const std::string& model_dir() {
  static const std::string dir = [] {
    std::string d = keel::fuzz::scratch_dir() + "/sharded";
    write_sharded_model(d);
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel;
  const std::string& dir = model_dir();
  fuzz::write_bytes(dir + "/model.safetensors.index.json", data, size);
  try {
    auto reader = formats::CheckpointReader::open_dir(dir);
    std::vector<float> out;
    for (const auto& name : reader.names()) {
      const formats::TensorInfo& t = reader.get(name);
      out.assign(size_t(t.numel()), 0.0f);
      reader.read_f32(name, t.shape, out.data());
    }
  } catch (const Error&) {}
  return 0;
}
