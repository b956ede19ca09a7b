// One rank's part of a sharded checkpoint (sharded_manifest.h): the pieces of the flat parameter
// buffer this rank owns, written to its own file in parallel with every other rank's, fsynced, and
// reported (their checksums) to rank 0, which publishes the checkpoint once every rank reported
// (commit_sharded_checkpoint). No rank ever holds another rank's state for a save.
//
// Asynchronous saves stage through a buffer of bounded size (checkpoint_staging_mb), not a whole
// snapshot: the last `staging` bytes of the file are copied aside, the rest is written from the live
// state, and the state is released (released()) once both are done; the tail, the fsync and the
// report follow in the background. The live state must not change until it is released: the
// trainer waits for that before its next optimizer step (the only write to masters and moments),
// which is the only time a step waits for the writer.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "keel/checkpoint/checkpoint.h"
#include "keel/checkpoint/sharded_manifest.h"
#include "keel/core/flat_range.h"
#include "keel/core/worker_thread.h"
#include "keel/model/params.h"

namespace keel::checkpoint {

// The largest piece, in elements (64 MiB): bounds the bytes a reader verifies beyond what it needs
// (a piece straddling its range is read whole, to check its checksum) and keeps a 9B model's
// manifest at a few thousand pieces.
inline constexpr int64_t kMaxPieceElements = int64_t(16) << 20;

// What this rank holds of the trained store: masters of master_range, moments of optimizer_range
// (element j of the flat buffer is masters[j - master_range.begin], as ParamStore lays them out).
struct HeldState {
  const float* masters = nullptr;
  FlatRange master_range;
  const float* m = nullptr;
  const float* v = nullptr;
  FlatRange optimizer_range;
};

// The pieces of `window` (the part of the flat buffer this rank writes) in file order: the
// weights, then m, then v, each in layout order, split at max_piece elements; xxh3 not yet set.
std::vector<Piece> plan_pieces(const std::vector<model::Param>& layout, FlatRange window, int shard,
                               int64_t max_piece = kMaxPieceElements);

class ShardWriter {
 public:
  // staging_bytes: the asynchronous save's staging buffer (0 with async false: writes go straight
  // from the live state, before write() returns).
  ShardWriter(bool async, int64_t staging_bytes);
  ~ShardWriter();  // waits for a write in flight
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // Allocates and touches the staging buffer (min(staging_bytes, 12 bytes per element of the
  // window: its weights, m and v)), so no
  // save pays for page faults and the memory is the run's from the start (as keel plan counts it).
  void prepare(const std::vector<model::Param>& layout, FlatRange window);
  int64_t staging_bytes() const { return int64_t(staging_.size() * sizeof(float)); }

  // Writes this rank's pieces of `window` into step_tmp/shard-R-of-W.bin and its report
  // shard-R-of-W.json, both fsynced. Synchronous: done (or thrown) on return. Asynchronous: starts
  // and returns; at most one in flight (call wait() first).
  void write(const std::string& step_tmp, int rank, int ranks, const std::vector<model::Param>& layout,
             FlatRange window, const HeldState& state);
  // Blocks until the write in flight no longer reads the live state; returns the seconds waited.
  double wait_released();
  // Whether the write in flight has finished (durable or failed), without blocking.
  bool finished();
  // Blocks until the write in flight has finished; its error ("" when durable, or none in flight).
  std::string wait();

 private:
  void write_now(const std::string& step_tmp, int rank, int ranks, const std::vector<model::Param>& layout,
                 FlatRange window, const HeldState& state, bool staged);

  bool async_;
  int64_t staging_limit_;
  std::vector<float> staging_;
  std::mutex mutex_;  // released_ and failure_, which the background write sets
  std::condition_variable cv_;
  bool released_ = true;
  std::string failure_;
  std::unique_ptr<WorkerThread> worker_;  // asynchronous writes; last, so destroyed first
};

// Rank 0, once every rank's report is durable in `step_tmp`: writes trainer_state.json and
// recipe.toml, merges the reports into manifest.json (checking each against the pieces of
// windows[rank], which that rank was to write), then publishes the step directory and moves
// `latest` (publish_checkpoint).
void commit_sharded_checkpoint(const std::string& checkpoint_dir, const std::string& step_tmp,
                               const std::vector<FlatRange>& windows, int zero_stage, const std::vector<model::Param>& layout, const TrainingState& state,
                               const std::string& recipe, int64_t keep_last_n);
// The directory every rank writes step `step`'s pieces into (the same name on every rank: a
// leftover of a killed save is removed at the next start, clean_incomplete_checkpoints).
std::string sharded_step_tmp(const std::string& checkpoint_dir, int64_t step);

}  // namespace keel::checkpoint
