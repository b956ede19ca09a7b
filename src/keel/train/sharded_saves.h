// The save policy of sharded checkpoints (checkpoint/sharded_writer.h) in a run: every rank writes
// the part of the flat state it owns (its ZeRO shard, or under stage 0 an equal 1/dp split of the
// replicated state), then the ranks agree that every part is durable and rank 0 publishes the
// checkpoint (manifest, rename, `latest`). An asynchronous save's agreement rides on the step's own
// agreement collective (agreement_slots more totals), so it costs a step no collective of its own;
// a step waits for the writer only before its optimizer step, and only while the writer still
// reads the state it would change.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "keel/checkpoint/checkpoint.h"
#include "keel/checkpoint/sharded_writer.h"
#include "keel/core/flat_range.h"
#include "keel/distributed/communicator.h"
#include "keel/model/params.h"

namespace keel::train {

struct ShardedSaveOptions {
  std::string dir;  // checkpoint_dir
  int64_t keep_last_n = 3;
  bool async = false;
  int64_t staging_bytes = 0;  // per rank, asynchronous saves
  int zero_stage = 0;
};

class ShardedSaves {
 public:
  // windows[r]: what rank r writes; they cover the flat buffer of `trained` in rank order, and this
  // rank's lies inside what it holds (its master and optimizer ranges).
  ShardedSaves(ShardedSaveOptions options, distributed::Communicator& comm, model::ParamStore& trained,
               std::vector<FlatRange> windows);
  // The windows of a run: the ZeRO shards, or (stage 0, one rank) an equal split of `total`.
  static std::vector<FlatRange> windows_for(const std::vector<FlatRange>& zero_shards, int64_t total, int ranks);

  // A save of `state` (every rank, at the same step). Waits first for the previous save to be
  // published or given up. Synchronous: written, agreed and published on return. Returns the
  // seconds the step was blocked; messages for the log (failures, on rank 0) in *notes; in *saved
  // whether this save was published (synchronous) or is under way (asynchronous). Throws (rank 0)
  // when a save failed and fail_on_save_error asks to stop.
  double save(const checkpoint::TrainingState& state, const std::string& recipe, std::vector<std::string>* notes,
              bool* saved);
  // Before an optimizer step: waits while an asynchronous save still reads the state; seconds.
  double before_optimizer_step();
  // The step's agreement: this rank's totals into slots[0, kSlots) before the sum, and after it
  // what the sum says (every rank's part durable: rank 0 publishes; one failed: given up).
  static constexpr int kSlots = 2;
  void contribute(double* slots);
  void agreed(const double* slots, std::vector<std::string>* notes);
  // The run's end: the save in flight finished, agreed and published. Its error, or "".
  std::string finish(std::vector<std::string>* notes);
  checkpoint::SaveRecord record() const { return record_; }
  bool fail_on_error = false;

 private:
  // Settles the pending save from the summed slots (all ranks finished).
  void settle(const double* slots, std::vector<std::string>* notes);
  ShardedSaveOptions options_;
  distributed::Communicator& comm_;
  model::ParamStore& trained_;
  std::vector<FlatRange> windows_;
  checkpoint::ShardWriter writer_;
  // The save in flight (written, not yet agreed on).
  bool pending_ = false;
  checkpoint::TrainingState pending_state_;
  std::string pending_recipe_;
  // This rank's part, once finished: durable ("" error) or failed.
  bool local_done_ = false;
  std::string local_error_;
  std::string last_failure_;
  checkpoint::SaveRecord record_;
};

}  // namespace keel::train
