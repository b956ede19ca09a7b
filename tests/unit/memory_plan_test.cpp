// The memory planner: no two buffers alive at the same time ever share a byte (checked pair by
// pair on random instances), sharing by lifetime beats one allocation per buffer, the peak and the
// per-category breakdown add up, a cap fails with the breakdown, and the arena is usable memory.
// Then the decoder's plan: gradient checkpointing shares one block's intermediates among all blocks.
#include "keel/core/memory_plan.h"

#include <gtest/gtest.h>

#include <algorithm>

#include <random>

#include "keel/core/process_memory.h"
#include "keel/model/decoder.h"
#include "keel/recipe/model_setup.h"
#include "test_support.h"

namespace keel {
namespace {

using keel::testing::expect_keel_error;

// Every pair of buffers whose lifetimes overlap occupies disjoint bytes, every offset is aligned,
// and the arena holds every buffer.
void expect_valid_packing(const MemoryPlan& plan) {
  const auto& b = plan.buffers();
  size_t top = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (!b[i].in_arena) continue;
    EXPECT_EQ(b[i].offset % plan.alignment(), 0u) << b[i].name;
    EXPECT_GE(b[i].aligned_bytes, b[i].bytes);
    top = std::max(top, b[i].offset + b[i].aligned_bytes);
    for (size_t j = i + 1; j < b.size(); ++j) {
      if (!b[j].in_arena || b[i].aligned_bytes == 0 || b[j].aligned_bytes == 0) continue;
      const bool live_together = b[i].first_use <= b[j].last_use && b[j].first_use <= b[i].last_use;
      const bool share_bytes =
          b[i].offset < b[j].offset + b[j].aligned_bytes && b[j].offset < b[i].offset + b[i].aligned_bytes;
      EXPECT_FALSE(live_together && share_bytes)
          << b[i].name << " [" << b[i].first_use << "," << b[i].last_use << "] @" << b[i].offset << "+"
          << b[i].aligned_bytes << " overlaps " << b[j].name << " [" << b[j].first_use << "," << b[j].last_use << "] @"
          << b[j].offset << "+" << b[j].aligned_bytes;
    }
  }
  EXPECT_EQ(plan.arena_bytes(), top);
  EXPECT_GE(plan.arena_bytes(), plan.peak_live_bytes());
  EXPECT_LE(plan.arena_bytes(), plan.naive_bytes());
}

TEST(MemoryPlan, RandomInstancesNeverOverlapLiveBuffers) {
  std::mt19937_64 rng(7);
  for (int instance = 0; instance < 300; ++instance) {
    const size_t alignment = size_t(1) << (rng() % 8);  // 1 .. 128
    MemoryPlan plan(alignment);
    const int buffers = 1 + int(rng() % 60), horizon = 1 + int(rng() % 40);
    for (int i = 0; i < buffers; ++i) {
      const int32_t a = int32_t(rng() % horizon), b = int32_t(rng() % horizon);
      const size_t bytes = rng() % 5 == 0 ? rng() % 100000 : rng() % 3000;  // a few large ones
      plan.add("b" + std::to_string(i), MemoryCategory(rng() % kMemoryCategories), bytes, std::min(a, b),
               std::max(a, b));
    }
    expect_valid_packing(plan);
    if (::testing::Test::HasFailure()) FAIL() << "instance " << instance;
  }
}

TEST(MemoryPlan, PeakIsTheLargestSumOfLiveBytes) {
  MemoryPlan plan(64);
  plan.add("a", MemoryCategory::Activations, 100, 0, 2);  // 128 aligned
  plan.add("b", MemoryCategory::Activations, 64, 1, 3);   // 64
  plan.add("c", MemoryCategory::Workspace, 1000, 3, 3);   // 1024
  plan.add("d", MemoryCategory::Workspace, 10, 4, 9);     // 64
  EXPECT_EQ(plan.peak_live_bytes(), 64u + 1024u);         // at position 3
  EXPECT_EQ(plan.peak_position(), 3);
  EXPECT_EQ(plan.naive_bytes(), 128u + 64u + 1024u + 64u);
  expect_valid_packing(plan);
}

TEST(MemoryPlan, BuffersNeverAliveTogetherShareOneRegion) {
  // A block-by-block chain: each layer's scratch lives one position. One region serves all.
  MemoryPlan plan;
  plan.add("weights", MemoryCategory::MasterWeights, 10 << 20, 0, 40);
  for (int l = 0; l < 40; ++l) plan.add("scratch." + std::to_string(l), MemoryCategory::Workspace, 3 << 20, l, l);
  EXPECT_EQ(plan.arena_bytes(), size_t(13) << 20);
  EXPECT_EQ(plan.peak_live_bytes(), size_t(13) << 20);
  EXPECT_DOUBLE_EQ(plan.waste(), 0.0);
  EXPECT_EQ(plan.naive_bytes(), size_t(10 + 40 * 3) << 20);
  expect_valid_packing(plan);
}

TEST(MemoryPlan, ForwardBackwardActivationsPackWithLittleWaste) {
  // The shape of a training step: activations of layer l live from forward l to backward l,
  // gradient scratch through the backward pass, a big logits chunk at the head only.
  const int L = 12;
  MemoryPlan plan;
  plan.add("params", MemoryCategory::MasterWeights, 50 << 20, 0, 2 * L + 2);
  for (int l = 0; l < L; ++l)
    for (int k = 0; k < 5; ++k) plan.add("act", MemoryCategory::Activations, size_t(1 + k) << 20, 1 + l, 2 * L + 1 - l);
  plan.add("logits", MemoryCategory::Workspace, 30 << 20, L + 1, L + 1);
  plan.add("grad.a", MemoryCategory::Workspace, 8 << 20, L + 2, 2 * L + 1);
  plan.add("grad.b", MemoryCategory::Workspace, 8 << 20, L + 2, 2 * L + 1);
  expect_valid_packing(plan);
  EXPECT_LT(plan.arena_bytes(), plan.naive_bytes());
  EXPECT_LE(plan.waste(), 0.01) << plan.breakdown();
}

TEST(MemoryPlan, CategoriesAtThePeakAddUpToTheTotal) {
  MemoryPlan plan;
  plan.add("w", MemoryCategory::MasterWeights, 1000, 0, 9);
  plan.add("g", MemoryCategory::Gradients, 1000, 0, 9);
  plan.add("x", MemoryCategory::Activations, 5000, 1, 5);
  plan.add("s", MemoryCategory::Workspace, 7000, 6, 8);
  plan.add_external("table", MemoryCategory::Data, 123, 0, 9);
  size_t sum = 0;
  for (int c = 0; c < kMemoryCategories; ++c) sum += plan.category_bytes_at_peak(MemoryCategory(c));
  EXPECT_EQ(sum, plan.peak_live_bytes() + plan.external_bytes());
  EXPECT_EQ(plan.external_bytes(), 123u);
  EXPECT_EQ(plan.total_bytes(), plan.arena_bytes() + 123u);
  const auto text = plan.breakdown();
  for (const char* line : {"master weights", "gradients", "workspace", "data", "packing waste", "total"})
    EXPECT_NE(text.find(line), std::string::npos) << text;
}

TEST(MemoryPlan, ExternalMemoryPeaksByLifetimeToo) {
  MemoryPlan plan;
  plan.add("arena", MemoryCategory::Activations, 1 << 20, 0, 5);
  plan.add_external("file mapped while loading", MemoryCategory::Data, 300, 0, 0);
  plan.add_external("program", MemoryCategory::Runtime, 100, 0, 5);
  plan.add_external("library scratch", MemoryCategory::Runtime, 150, 1, 5);
  plan.add_external("snapshot", MemoryCategory::CheckpointStaging, 120, 1, 5);
  // Loading: 300 + 100; training: 100 + 150 + 120. The process peaks while loading.
  EXPECT_EQ(plan.external_bytes(), 400u);
  EXPECT_EQ(plan.external_peak_position(), 0);
  EXPECT_EQ(plan.total_bytes(), plan.arena_bytes() + 400u);
  EXPECT_EQ(plan.category_bytes_at_peak(MemoryCategory::Data), 300u);
  EXPECT_EQ(plan.category_bytes_at_peak(MemoryCategory::Runtime), 100u);
  EXPECT_EQ(plan.category_bytes_at_peak(MemoryCategory::CheckpointStaging), 0u);
  EXPECT_EQ(plan.category_bytes(MemoryCategory::Runtime), 250u);
}

TEST(MemoryPlan, CapFailsFastWithTheBreakdown) {
  MemoryPlan plan;
  plan.add("weights", MemoryCategory::MasterWeights, 3 << 20, 0, 2);
  plan.add("activations", MemoryCategory::Activations, 2 << 20, 1, 1);
  plan.require_fits(5 << 20, "memory_pool_size");  // fits exactly
  plan.require_fits(0, "memory_pool_size");        // no cap
  expect_keel_error([&] { plan.require_fits(4 << 20, "memory_pool_size"); },
                    {"memory_pool_size", "5.00 MiB", "4.00 MiB", "master weights", "activations"});
}

TEST(MemoryPlan, RejectsBadInput) {
  expect_keel_error([] { MemoryPlan plan(48); }, {"alignment 48"});
  MemoryPlan plan;
  expect_keel_error([&] { plan.add("backwards", MemoryCategory::Workspace, 10, 5, 4); }, {"backwards"});
}

TEST(Arena, IsZeroedWritableAndHugePageAligned) {
  Arena arena(3 * 1024 * 1024 + 5);
  ASSERT_NE(arena.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(arena.data()) % MemoryPlan::kHugePage, 0u);
  EXPECT_EQ(arena.mapped_bytes(), 2 * MemoryPlan::kHugePage);
  for (size_t i = 0; i < arena.size(); i += 4093) EXPECT_EQ(arena.data()[i], std::byte{0});
  arena.data()[arena.size() - 1] = std::byte{7};
  Arena moved = std::move(arena);
  EXPECT_EQ(arena.data(), nullptr);
  EXPECT_EQ(moved.data()[moved.size() - 1], std::byte{7});
  Arena empty(0);
  EXPECT_EQ(empty.data(), nullptr);
}

TEST(ProcessMemory, ReportsResidentSetAndItsPeak) {
  const size_t rss = resident_bytes(), peak = peak_resident_bytes();
  EXPECT_GT(rss, 0u);
  EXPECT_GE(peak, rss);
  {
    Arena arena(64 << 20);  // touched up front: the resident set grows by the arena now
    EXPECT_GE(resident_bytes(), rss + (60 << 20));
  }
  EXPECT_GE(peak_resident_bytes(), rss + (60 << 20));
}

// ---- the decoder's plan ----

model::ModelConfig small_config(const std::string& family) {
  recipe::ScratchModel m;
  m.family = family;
  m.vocab_size = 300;
  m.hidden_size = 64;
  m.intermediate_size = 96;
  m.num_layers = 4;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  return recipe::scratch_model_config(m);
}

TEST(DecoderMemoryPlan, IsWhatTheDecoderAllocates) {
  const auto config = small_config("glm");
  for (bool checkpointing : {false, true})
    for (auto precision : {model::Precision::F32, model::Precision::BF16}) {
      model::DecoderOptions options{checkpointing, true, 0};
      const auto plan = model::decoder_memory_plan(config, precision, 2, 32, options);
      model::Decoder decoder(config, precision, 2, 32, options);
      EXPECT_EQ(decoder.memory_plan().arena_bytes(), plan.arena_bytes());
      EXPECT_EQ(decoder.arena_bytes(), plan.arena_bytes());
      EXPECT_EQ(decoder.memory_plan().buffers().size(), plan.buffers().size());
      EXPECT_TRUE(decoder.params().has_optimizer_state());
      EXPECT_EQ(decoder.params().has_bf16_copy(), precision == model::Precision::BF16);
      expect_valid_packing(plan);
    }
}

TEST(DecoderMemoryPlan, CheckpointingSharesOneBlockOfIntermediates) {
  const auto config = small_config("llama");
  const auto full = model::decoder_memory_plan(config, model::Precision::F32, 2, 64, {false, true, 0});
  const auto ckpt = model::decoder_memory_plan(config, model::Precision::F32, 2, 64, {true, true, 0});
  const size_t tokens = 2 * 64, H = 64;
  // The recomputed intermediates of all four blocks share their bytes: together they cover not
  // much more of the arena than one block's worth.
  std::vector<std::pair<size_t, size_t>> spans;  // [offset, end) of every recomputed buffer
  size_t one_block = 0;
  for (const auto& b : ckpt.buffers()) {
    if (b.name.find(".recomputed.") == std::string::npos) continue;
    spans.emplace_back(b.offset, b.offset + b.aligned_bytes);
    if (b.name.rfind("layers.0.", 0) == 0) one_block += b.aligned_bytes;
  }
  ASSERT_GT(one_block, 0u);
  std::sort(spans.begin(), spans.end());
  size_t covered = 0, end = 0;
  for (auto [begin, stop] : spans) {
    if (stop <= end) continue;
    covered += stop - std::max(begin, end);
    end = stop;
  }
  EXPECT_LE(covered, one_block * 3 / 2) << ckpt.breakdown();  // 4 blocks unshared: 4x
  // Activations at the peak: all blocks' intermediates without checkpointing; the block inputs
  // and one block's intermediates with it.
  const size_t act_full = full.category_bytes_at_peak(MemoryCategory::Activations);
  const size_t act_ckpt = ckpt.category_bytes_at_peak(MemoryCategory::Activations);
  EXPECT_LT(act_ckpt, act_full / 2) << full.breakdown() << ckpt.breakdown();
  EXPECT_GE(act_ckpt, 4 * tokens * H * sizeof(float));  // at least the saved block inputs
  EXPECT_LT(ckpt.arena_bytes(), full.arena_bytes());
  EXPECT_LE(ckpt.waste(), 0.05) << ckpt.breakdown();
  EXPECT_LE(full.waste(), 0.05) << full.breakdown();
}

TEST(DecoderMemoryPlan, PlansANineBillionParameterModelWithoutAllocatingIt) {
  model::ModelConfig c;
  c.family = model::Family::GlmOriginal;
  c.architecture = "ChatGLMModel";
  c.vocab_size = 151552;
  c.hidden_size = 4096;
  c.intermediate_size = 13696;
  c.num_layers = 40;
  c.num_heads = 32;
  c.num_kv_heads = 2;
  c.head_dim = 128;
  c.rotary_dim = 64;
  c.rope_interleaved = true;
  c.qkv_bias = true;
  c.max_position_embeddings = 8192;
  const size_t rss_before = resident_bytes();
  const auto plan = model::decoder_memory_plan(c, model::Precision::BF16, 1, 8192, {true, true, 0});
  EXPECT_GT(plan.arena_bytes(), size_t(100) << 30);  // > 100 GiB: 9.4B parameters x 18 bytes
  EXPECT_LT(resident_bytes(), rss_before + (64 << 20));
}

TEST(DecoderMemoryPlan, MemoryCapFailsAtConstruction) {
  const auto config = small_config("llama");
  expect_keel_error(
      [&] {
        model::Decoder d(config, model::Precision::F32, 2, 32, {false, true, 4096});
      },
      {"memory_pool_size", "activations", "optimizer state"});
}

}  // namespace
}  // namespace keel
