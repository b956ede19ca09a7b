// Sharded checkpoints (checkpoint/sharded_*.h): a valid one is written once by two "ranks"
// (ShardWriter, then commit_sharded_checkpoint); each input then replaces one of its files (the
// first byte picks which) and load_checkpoint reads it back, as a rank holding half the moments and
// as one holding all of them. manifest.json is fuzzed as it is (its parser and the checks of pieces
// against their files); for trainer_state.json and a shard file the manifest's sizes and checksums
// are rewritten to match, so the fuzzed bytes reach the readers behind the checksums; a rank's
// report is fuzzed through rank 0's commit (parse_shard_report and its checks against the plan).
#include <fmt/format.h>

#include <filesystem>

#include "fuzz_support.h"
#include "keel/checkpoint/checkpoint.h"
#include "keel/checkpoint/sharded_manifest.h"
#include "keel/checkpoint/sharded_writer.h"
#include "keel/core/checksum.h"
#include "keel/core/file_io.h"
#include "keel/model/params.h"

namespace {

using keel::model::ParamStore;

void layout(ParamStore& p) {
  p.add("embed.weight", {4, 3}, true);
  p.add("layers.0.norm.weight", {3}, false);
  p.add("lm_head.weight", {4, 3}, true);
  p.allocate(false);
  p.allocate_optimizer_state();
}

struct Fixture {
  std::string root, step_dir;
  std::string manifest, state, shard0, report0;
  ParamStore params;
};

keel::checkpoint::HeldState held(ParamStore& p) {
  return {p.masters(), p.master_range(), p.adam_m(), p.adam_v(), p.optimizer_range()};
}

keel::checkpoint::TrainingState state_at(int64_t step) {
  keel::checkpoint::TrainingState s;
  s.step = step;
  s.samples_consumed = 40;
  s.seed = 42;
  s.recipe_hash = s.model_fingerprint = s.data_fingerprint = s.compat_fingerprint = "0123456789abcdef";
  return s;
}

// Both ranks' parts of step `step` written into its temporary directory.
void write_parts(Fixture& fx, int64_t step) {
  const auto windows = keel::shard_ranges(fx.params.total(), 2);
  for (int rank = 0; rank < 2; ++rank) {
    keel::checkpoint::ShardWriter writer(false, 0);
    writer.write(keel::checkpoint::sharded_step_tmp(fx.root, step), rank, 2, fx.params.params(),
                 windows[size_t(rank)], held(fx.params));
  }
}

Fixture& fixture() {
  static Fixture* f = [] {
    auto* fx = new Fixture;
    fx->root = keel::fuzz::scratch_dir() + "/sharded";
    layout(fx->params);
    for (int64_t i = 0; i < fx->params.total(); ++i) {
      fx->params.weights()[i] = float(i) * 0.5f;
      fx->params.adam_m()[i] = float(i) * 0.25f;
      fx->params.adam_v()[i] = float(i) * 0.125f;
    }
    write_parts(*fx, 5);
    const std::string tmp = keel::checkpoint::sharded_step_tmp(fx->root, 5);
    fx->report0 = keel::read_file(tmp + "/shard-00000-of-00002.json");
    keel::checkpoint::commit_sharded_checkpoint(fx->root, tmp, keel::shard_ranges(fx->params.total(), 2), 1,
                                                fx->params.params(), state_at(5), "max_steps = 10\n", 3);
    fx->step_dir = fx->root + "/step-00000005";
    fx->manifest = keel::read_file(fx->step_dir + "/manifest.json");
    fx->state = keel::read_file(fx->step_dir + "/trainer_state.json");
    fx->shard0 = keel::read_file(fx->step_dir + "/shard-00000-of-00002.bin");
    return fx;
  }();
  return *f;
}

// The valid manifest with `file`'s size and checksum (a listed file or shard) set to `bytes`'s.
std::string manifest_matching(const Fixture& fx, const std::string& file, const std::string& bytes) {
  auto m = keel::checkpoint::parse_sharded_manifest(fx.manifest, "manifest.json");
  for (auto& f : m.files)
    if (f.name == file) {
      f.size = int64_t(bytes.size());
      f.xxh3 = keel::checksum(bytes);
    }
  for (auto& s : m.shards)
    if (s.name == file) s.size = int64_t(bytes.size());
  return keel::checkpoint::sharded_manifest_json(m);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel;
  Fixture& fx = fixture();
  if (size == 0) return 0;
  const int which = data[0] % 4;
  const std::string input(reinterpret_cast<const char*>(data) + 1, size - 1);

  std::string manifest = fx.manifest, state = fx.state, shard0 = fx.shard0;
  switch (which) {
    case 0: manifest = input; break;
    case 1: state = input; manifest = manifest_matching(fx, "trainer_state.json", state); break;
    case 2: shard0 = input; manifest = manifest_matching(fx, "shard-00000-of-00002.bin", shard0); break;
    case 3: {  // rank 0's report, as rank 0 merges it at commit
      write_parts(fx, 7);
      const std::string tmp = checkpoint::sharded_step_tmp(fx.root, 7);
      fuzz::write_bytes(tmp + "/shard-00000-of-00002.json", input);
      try {
        checkpoint::commit_sharded_checkpoint(fx.root, tmp, shard_ranges(fx.params.total(), 2), 1,
                                              fx.params.params(), state_at(7), "", 3);
      } catch (const Error&) {}
      // Whatever report was accepted, the manifest rank 0 published is one its parser reads.
      if (path_exists(fx.root + "/step-00000007/manifest.json")) try {
          checkpoint::parse_sharded_manifest(read_file(fx.root + "/step-00000007/manifest.json"), "manifest");
        } catch (const Error& e) {
          fuzz::property_failed("commit published a manifest its parser refuses", e.what());
        }
      std::error_code ignored;
      std::filesystem::remove_all(tmp, ignored);
      std::filesystem::remove_all(fx.root + "/step-00000007", ignored);
      fuzz::write_bytes(fx.root + "/latest", std::string_view("step-00000005\n"));
      return 0;
    }
  }
  fuzz::write_bytes(fx.step_dir + "/manifest.json", manifest);
  fuzz::write_bytes(fx.step_dir + "/trainer_state.json", state);
  fuzz::write_bytes(fx.step_dir + "/shard-00000-of-00002.bin", shard0);
  for (int half = 0; half < 2; ++half) {
    ParamStore loaded;
    layout(loaded);
    if (half) loaded.set_optimizer_range(shard_ranges(loaded.total(), 2)[1]);
    loaded.allocate_optimizer_state();
    try {
      checkpoint::TrainingState s = checkpoint::load_checkpoint(fx.step_dir, loaded);
      if (s.step < 0 || s.samples_consumed < 0) fuzz::property_failed("negative step accepted");
    } catch (const Error&) {}
  }
  return 0;
}
