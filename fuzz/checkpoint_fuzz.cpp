// Training-state checkpoints: a valid checkpoint is written once by CheckpointWriter; each input
// then replaces one of its files (the first byte picks which) and load_checkpoint reads it back.
// For files behind the manifest's checksums the manifest is rewritten to match, so the fuzzed
// bytes reach trainer_state.json's and the safetensors parsers rather than stopping at the
// checksum; the manifest itself and the `latest` pointer are fuzzed as they are.
#include <fmt/format.h>

#include <map>

#include "fuzz_support.h"
#include "keel/core/checksum.h"
#include "keel/core/file_io.h"
#include "keel/model/params.h"
#include "keel/checkpoint/checkpoint.h"

namespace {

using keel::model::ParamStore;

const char* const kFiles[] = {"weights.safetensors", "optimizer.safetensors", "trainer_state.json", "recipe.toml"};

struct Fixture {
  std::string root;                          // checkpoint_dir
  std::string step_dir;                      // root/step-00000005
  std::map<std::string, std::string> files;  // the valid checkpoint's files
  ParamStore params;
};

void layout(ParamStore& p) {
  p.add("embed.weight", {4, 3}, true);
  p.add("layers.0.norm.weight", {3}, false);
  p.add("lm_head.weight", {4, 3}, true);
  p.allocate(false);
  p.allocate_optimizer_state();
}

Fixture& fixture() {
  static Fixture* f = [] {
    auto* fx = new Fixture;
    fx->root = keel::fuzz::scratch_dir() + "/checkpoints";
    layout(fx->params);
    for (int64_t i = 0; i < fx->params.total(); ++i) {
      fx->params.weights()[i] = float(i) * 0.5f;
      fx->params.adam_m()[i] = float(i) * 0.25f;
      fx->params.adam_v()[i] = float(i) * 0.125f;
    }
    keel::checkpoint::TrainingState state;
    state.step = 5;
    state.samples_consumed = 40;
    state.seed = 42;
    state.recipe_hash = state.model_fingerprint = state.data_fingerprint = state.compat_fingerprint =
        "0123456789abcdef";
    {
      keel::checkpoint::CheckpointWriter writer(fx->root, 3, false);
      writer.save(fx->params, state, "max_steps = 10\n");
    }
    fx->step_dir = fx->root + "/step-00000005";
    for (const char* name : kFiles) fx->files[name] = keel::read_file(fx->step_dir + "/" + name);
    fx->files["manifest.json"] = keel::read_file(fx->step_dir + "/manifest.json");
    return fx;
  }();
  return *f;
}

// The manifest CheckpointWriter writes, for the given file contents.
std::string manifest_for(const std::map<std::string, std::string>& files) {
  std::string entries;
  for (const char* name : kFiles) {
    const std::string& bytes = files.at(name);
    entries += fmt::format("{}    \"{}\": {{\"size\": {}, \"xxh3\": \"{}\"}}", entries.empty() ? "" : ",\n", name,
                           bytes.size(), keel::checksum_hex(keel::checksum(bytes)));
  }
  return fmt::format(
      "{{\n  \"format\": \"keel-checkpoint\",\n  \"version\": 1,\n  \"step\": 5,\n  \"files\": {{\n{}\n  }}\n}}\n",
      entries);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel;
  Fixture& fx = fixture();
  if (size == 0) return 0;
  const int which = data[0] % 5;
  const std::string input(reinterpret_cast<const char*>(data) + 1, size - 1);

  std::map<std::string, std::string> files = fx.files;
  std::string latest = "step-00000005\n";
  switch (which) {
    case 0: files["manifest.json"] = input; break;
    case 1: files["trainer_state.json"] = input; break;
    case 2: files["weights.safetensors"] = input; break;
    case 3: files["optimizer.safetensors"] = input; break;
    case 4: latest = input; break;
  }
  if (which >= 1 && which <= 3) files["manifest.json"] = manifest_for(files);
  for (const auto& [name, bytes] : files) fuzz::write_bytes(fx.step_dir + "/" + name, bytes);
  fuzz::write_bytes(fx.root + "/latest", latest);

  try {
    const std::string path = checkpoint::latest_checkpoint(fx.root);
    if (path.empty()) return 0;
    checkpoint::TrainingState s = checkpoint::load_checkpoint(path, fx.params);
    if (s.step < 0 || s.samples_consumed < 0) fuzz::property_failed("negative step accepted");
  } catch (const Error&) {}
  return 0;
}
