// Time the training loop is blocked per checkpoint save, synchronous versus asynchronous, for the
// bench model (Llama architecture, hidden 768, 12 layers, vocab 32000: 134M parameters; weights
// plus AdamW moments are 1.6 GB of fp32 state).
//
//   build/bench/checkpoint_bench [DIR]      (DIR defaults to /tmp/keel_checkpoint_bench)
#include <fmt/format.h>

#include <chrono>
#include <filesystem>

#include "keel/model/decoder.h"
#include "keel/checkpoint/checkpoint.h"
#include "keel/recipe/model_setup.h"

using namespace keel;

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : "/tmp/keel_checkpoint_bench";
  recipe::ScratchModel m;
  m.family = "llama";
  m.vocab_size = 32000;
  m.hidden_size = 768;
  m.intermediate_size = 2048;
  m.num_layers = 12;
  m.num_heads = 12;
  model::Decoder decoder(recipe::scratch_model_config(m), model::Precision::BF16, 1, 16);
  decoder.init_random(1);
  decoder.params().allocate_optimizer_state();
  checkpoint::TrainingState state;
  const double gb = double(decoder.params().total()) * 3 * 4 / 1e9;
  fmt::print("state: {:.1f}M parameters, {:.2f} GB of fp32 weights + AdamW moments\n",
             double(decoder.params().total()) / 1e6, gb);
  for (bool async : {false, true}) {
    std::filesystem::remove_all(dir);
    checkpoint::CheckpointWriter writer(dir, 2, async);
    writer.prepare(decoder.params());
    double blocked = 0, total = 0;
    const int saves = 3;
    for (int i = 1; i <= saves; ++i) {
      state.step = i;
      const auto t0 = std::chrono::steady_clock::now();
      blocked += writer.save(decoder.params(), state, "# bench\n").blocked_s;
      const std::string failure = writer.wait();  // measure the full write too
      total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!failure.empty()) fmt::print("save failed: {}\n", failure);
    }
    fmt::print("{:<5}: blocked {:.3f} s per save, full write {:.3f} s per save\n", async ? "async" : "sync",
               blocked / saves, total / saves);
  }
  std::filesystem::remove_all(dir);
  return 0;
}
