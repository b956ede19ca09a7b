// The sharded checkpoint layout (checkpoint/sharded_*.h) without MPI: "ranks" are windows of one
// process's store, written one after another as the ranks would in parallel, then read back into
// other windows (another world size), and broken on purpose: a corrupt piece, a missing one, a
// truncated shard, a manifest that lies about its pieces.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "keel/checkpoint/checkpoint.h"
#include "keel/checkpoint/sharded_manifest.h"
#include "keel/checkpoint/sharded_reader.h"
#include "keel/checkpoint/sharded_writer.h"
#include "keel/core/file_io.h"
#include "test_support.h"

namespace keel::checkpoint {
namespace {

using keel::testing::expect_keel_error;
using keel::testing::TempDir;

void layout(model::ParamStore& p) {
  p.add("embed.weight", {7, 5}, true);
  p.add("layers.0.norm.weight", {5}, false);
  p.add("layers.0.mlp.weight", {9, 5}, true);
  p.add("lm_head.weight", {7, 5}, true);
  p.allocate(false);
  p.allocate_optimizer_state();
}

void fill(model::ParamStore& p, float scale) {
  for (int64_t i = 0; i < p.total(); ++i) {
    p.weights()[i] = scale * float(i) + 0.5f;
    p.adam_m()[i] = scale * float(i) * 0.25f - 1.0f;
    p.adam_v()[i] = scale * float(i) * 0.125f + 2.0f;
  }
}

TrainingState state_at(int64_t step) {
  TrainingState s;
  s.step = step;
  s.samples_consumed = 8 * step;
  s.seed = 3;
  s.recipe_hash = s.model_fingerprint = s.data_fingerprint = s.compat_fingerprint = "0123456789abcdef";
  return s;
}

// Whether a[j - a_begin] == b[j] bit for bit for every element j of `window` inside a tensor (the
// alignment gaps between tensors are no tensor's and not saved).
bool same_values(const model::ParamStore& p, const float* a, int64_t a_begin, const float* b, FlatRange window) {
  for (const auto& param : p.params()) {
    const FlatRange part = FlatRange{param.offset, param.offset + param.numel}.intersect(window);
    if (part.size() > 0 && std::memcmp(a + (part.begin - a_begin), b + part.begin, sizeof(float) * size_t(part.size())))
      return false;
  }
  return true;
}

HeldState held(model::ParamStore& p) {
  return {p.masters(), p.master_range(), p.adam_m(), p.adam_v(), p.optimizer_range()};
}

// Every "rank" writes its window of `p`, then rank 0 commits: the checkpoint of `step`.
std::string save(const std::string& dir, model::ParamStore& p, int ranks, int64_t step, bool async,
                 int64_t staging_bytes = 64) {
  const auto windows = shard_ranges(p.total(), ranks);
  const std::string tmp = sharded_step_tmp(dir, step);
  for (int rank = 0; rank < ranks; ++rank) {
    ShardWriter writer(async, staging_bytes);
    writer.write(tmp, rank, ranks, p.params(), windows[size_t(rank)], held(p));
    writer.wait_released();
    EXPECT_EQ(writer.wait(), "");
  }
  commit_sharded_checkpoint(dir, tmp, windows, 1, p.params(), state_at(step), "max_steps = 9\n", 3);
  return latest_checkpoint(dir);
}

TEST(ShardedCheckpoint, PiecesTileEachWindowInFileOrder) {
  model::ParamStore p;
  layout(p);
  const FlatRange window{20, 70};
  const auto pieces = plan_pieces(p.params(), window, 1, /*max_piece=*/8);
  int64_t offset = 0, elements = 0;
  for (const auto& piece : pieces) {
    EXPECT_EQ(piece.offset, offset);
    EXPECT_LE(piece.end - piece.begin, 8);
    offset += piece.bytes();
    elements += piece.end - piece.begin;
  }
  int64_t held_elements = 0;  // the window minus the alignment gaps between tensors
  for (const auto& param : p.params())
    held_elements += FlatRange{param.offset, param.offset + param.numel}.intersect(window).size();
  EXPECT_EQ(elements, 3 * held_elements);
  EXPECT_EQ(pieces.front().kind, PieceKind::Weights);
  EXPECT_EQ(pieces.back().kind, PieceKind::V);
}

TEST(ShardedCheckpoint, ResumesOnAnotherNumberOfRanksBitExactly) {
  TempDir tmp;
  model::ParamStore saved;
  layout(saved);
  fill(saved, 1.5f);
  for (bool async : {false, true}) {
    const std::string dir = tmp / (async ? "async" : "sync");
    const std::string step = save(dir, saved, 2, 4, async, /*staging_bytes=*/40);
    ASSERT_TRUE(is_sharded_checkpoint(step));
    verify_checkpoint(step);
    for (int ranks : {1, 3}) {
      const auto windows = shard_ranges(saved.total(), ranks);
      model::ParamStore loaded;
      layout(loaded);
      for (int rank = 0; rank < ranks; ++rank) {
        // Each reader's window of the moments, as ZeRO-1 holds them; the masters whole.
        model::ParamStore shard;
        layout(shard);
        shard.set_optimizer_range(windows[size_t(rank)]);
        shard.allocate_optimizer_state();
        const TrainingState s = load_checkpoint(step, shard);
        EXPECT_EQ(s.step, 4);
        EXPECT_EQ(s.samples_consumed, 32);
        const FlatRange w = windows[size_t(rank)];
        EXPECT_TRUE(same_values(saved, shard.weights(), 0, saved.weights(), {0, saved.total()}));
        EXPECT_TRUE(same_values(saved, shard.adam_m(), w.begin, saved.adam_m(), w)) << ranks << " ranks, rank " << rank;
        EXPECT_TRUE(same_values(saved, shard.adam_v(), w.begin, saved.adam_v(), w)) << ranks << " ranks, rank " << rank;
      }
    }
  }
}

TEST(ShardedCheckpoint, ACorruptPieceIsNamed) {
  TempDir tmp;
  model::ParamStore p;
  layout(p);
  fill(p, 1.0f);
  const std::string step = save(tmp / "ck", p, 2, 2, false);
  const ShardedManifest m = parse_sharded_manifest(read_file(step + "/manifest.json"), "manifest");
  // Flip a byte inside rank 1's first m piece.
  const Piece* target = nullptr;
  for (const auto& piece : m.pieces)
    if (piece.shard == 1 && piece.kind == PieceKind::M) {
      target = &piece;
      break;
    }
  ASSERT_NE(target, nullptr);
  {
    std::fstream f(step + "/shard-00001-of-00002.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(target->offset + 1);
    f.put('\x7f');
  }
  model::ParamStore loaded;
  layout(loaded);
  const std::string piece = fmt::format("m.{}[{}:{}]", target->tensor, target->begin, target->end);
  expect_keel_error([&] { load_checkpoint(step, loaded); }, {"shard-00001-of-00002.bin", piece, "corrupt"});
  expect_keel_error([&] { verify_checkpoint(step); }, {piece, "corrupt"});
  // A reader whose moments lie in rank 0's part never reads the corrupt piece.
  model::ParamStore first_half;
  layout(first_half);
  first_half.set_optimizer_range(shard_ranges(p.total(), 2)[0]);
  first_half.allocate_optimizer_state();
  EXPECT_NO_THROW(load_checkpoint(step, first_half));
}

TEST(ShardedCheckpoint, AMissingOrTruncatedShardIsNamed) {
  TempDir tmp;
  model::ParamStore p;
  layout(p);
  fill(p, 1.0f);
  const std::string step = save(tmp / "ck", p, 2, 2, false);
  model::ParamStore loaded;
  layout(loaded);
  std::filesystem::resize_file(step + "/shard-00000-of-00002.bin", 100);
  expect_keel_error([&] { load_checkpoint(step, loaded); }, {"shard-00000-of-00002.bin", "truncated"});
  std::filesystem::remove(step + "/shard-00000-of-00002.bin");
  expect_keel_error([&] { load_checkpoint(step, loaded); }, {"shard-00000-of-00002.bin", "missing"});
  EXPECT_EQ(newest_intact_checkpoint(tmp / "ck"), "");
}

TEST(ShardedCheckpoint, APieceLeftOutOfTheManifestIsNamed) {
  TempDir tmp;
  model::ParamStore p;
  layout(p);
  fill(p, 1.0f);
  const std::string step = save(tmp / "ck", p, 2, 2, false);
  ShardedManifest m = parse_sharded_manifest(read_file(step + "/manifest.json"), "manifest");
  const Piece dropped = m.pieces[1];
  m.pieces.erase(m.pieces.begin() + 1);
  write_file_atomic(step + "/manifest.json", sharded_manifest_json(m));
  model::ParamStore loaded;
  layout(loaded);
  expect_keel_error([&] { load_checkpoint(step, loaded); },
                    {piece_tensor_name(dropped.kind, dropped.tensor), "in no piece", "missing"});
}

TEST(ShardedCheckpoint, ManifestRefusesOverlapsAndRangesPastTheTensor) {
  TempDir tmp;
  model::ParamStore p;
  layout(p);
  fill(p, 1.0f);
  const std::string step = save(tmp / "ck", p, 2, 2, false);
  const ShardedManifest m = parse_sharded_manifest(read_file(step + "/manifest.json"), "manifest");
  EXPECT_EQ(parse_sharded_manifest(sharded_manifest_json(m), "again").pieces.size(), m.pieces.size());
  ShardedManifest overlap = m;
  overlap.pieces[1].offset = overlap.pieces[0].offset;
  overlap.pieces[1].shard = overlap.pieces[0].shard;
  expect_keel_error([&] { parse_sharded_manifest(sharded_manifest_json(overlap), "m.json"); }, {"m.json", "overlaps"});
  ShardedManifest past = m;
  past.pieces[0].end = 1000;
  expect_keel_error([&] { parse_sharded_manifest(sharded_manifest_json(past), "m.json"); },
                    {"m.json", "past the tensor"});
}

TEST(ShardedCheckpoint, AnUnpublishedSaveLeavesTheLatestAlone) {
  TempDir tmp;
  model::ParamStore p;
  layout(p);
  fill(p, 1.0f);
  const std::string dir = tmp / "ck";
  const std::string first = save(dir, p, 2, 2, false);
  // Step 4: rank 0 wrote its part, rank 1 died before its own: nothing is published.
  const auto windows = shard_ranges(p.total(), 2);
  ShardWriter writer(false, 0);
  writer.write(sharded_step_tmp(dir, 4), 0, 2, p.params(), windows[0], held(p));
  EXPECT_EQ(latest_checkpoint(dir), first);
  EXPECT_EQ(clean_incomplete_checkpoints(dir), 1);
  EXPECT_FALSE(std::filesystem::exists(sharded_step_tmp(dir, 4)));
  expect_keel_error(
      [&] {
        commit_sharded_checkpoint(dir, sharded_step_tmp(dir, 6), windows, 1, p.params(), state_at(6), "", 3);
      },
      {"shard-00000-of-00002.json"});
  EXPECT_EQ(latest_checkpoint(dir), first);
}

}  // namespace
}  // namespace keel::checkpoint
