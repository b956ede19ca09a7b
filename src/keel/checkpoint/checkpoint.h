// Training-state checkpoints: everything needed to continue a run bit-identically.
//
//   checkpoint_dir/
//     step-00000200/            one complete checkpoint
//       weights.safetensors     fp32 master weights (keel's internal tensor names)
//       optimizer.safetensors   AdamW first and second moments ("m.<name>", "v.<name>")
//       trainer_state.json      step, samples consumed (the loader position), seed, fingerprints
//       recipe.toml             the resolved recipe of the run that wrote it
//       manifest.json           size and XXH3 checksum of every file above (written last)
//     latest                    the name of the newest complete checkpoint (replaced atomically)
//
// A checkpoint is written into ".tmp-step-N-<pid>", every file fsynced, then renamed into place;
// the `latest` pointer moves only after that. A process killed at any moment therefore leaves the
// previous checkpoint intact; leftover ".tmp-*" directories are removed on the next start.
#pragma once
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "keel/core/worker_thread.h"
#include "keel/model/params.h"

namespace keel::checkpoint {

struct TrainingState {
  int64_t step = 0;              // optimizer steps completed
  int64_t samples_consumed = 0;  // position of the data loader in its sample stream
  uint64_t seed = 0;
  std::string recipe_hash;         // of the resolved recipe (informational: some keys may change)
  std::string model_fingerprint;   // of the architecture and parameter layout: must match to resume
  std::string data_fingerprint;    // of the training records: must match to resume
  std::string compat_fingerprint;  // of the recipe keys that shape the run (batch, accumulation, ...)
  // bf16 runs: how the products multiplied ("native" or "widened", kernels/gemm.h), so that a
  // resume multiplies the same way; empty in fp32 and in checkpoints from before 2026-12-05.
  std::string bf16_products;
};

struct SaveStats {
  double blocked_s = 0;  // time the training loop was blocked by this save
  bool async = false;
};

// How a run's saves went, for its end: a run whose saves all failed, or whose last ones did, must
// not end as if its work were safe.
struct SaveRecord {
  int64_t attempted = 0, failed = 0;
  int64_t failed_in_a_row = 0;  // the latest saves that failed, one after another
  int64_t last_saved_step = -1;
};

class CheckpointWriter {
 public:
  CheckpointWriter(std::string dir, int64_t keep_last_n, bool async);
  ~CheckpointWriter();  // waits for a save in flight
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Saves the state after `state.step`. Synchronous: writes before returning. Asynchronous:
  // copies weights and optimizer state into a staging buffer (allocated once) and writes on a
  // background thread; waits first if the previous save is still in flight (at most one).
  // Throws keel::Error if a previous asynchronous save failed (see take_failure()).
  SaveStats save(model::ParamStore& params, const TrainingState& state, const std::string& resolved_recipe);
  // Saves from the staging buffer, which `fill(weights, m, v)` (each `total` floats) writes first:
  // for state that is not in one ParamStore (ZeRO-1's moments, gathered from every rank). Written
  // before returning or in the background, as save().
  SaveStats save_snapshot(const std::vector<model::Param>& layout, int64_t total, const TrainingState& state,
                          const std::string& resolved_recipe,
                          const std::function<void(float* weights, float* m, float* v)>& fill);
  // A synchronous save whose optimizer state is read piece by piece while the file is written
  // (ZeRO-1 on rank 0: the other ranks' moments arrive as they are needed; distributed::ShardReader), so
  // no copy of the whole state is held. moments(which, begin, max_count, &n) returns elements
  // [begin, begin + n) of the flat m (which = 0) or v (which = 1), 0 < n <= max_count; and, when
  // `weights` is null (ZeRO-3: no rank holds them whole), of the weights (which = 2), read first.
  using MomentSource = std::function<const float*(int which, int64_t begin, int64_t max_count, int64_t* n)>;
  SaveStats save_streamed(const std::vector<model::Param>& layout, const float* weights, const MomentSource& moments,
                          const TrainingState& state, const std::string& resolved_recipe);
  // Allocates and touches the staging buffer for `params` now (when saves are asynchronous, or
  // with `snapshot` for save_snapshot), so no save pays for page faults and the memory is part of
  // the run's footprint from the start.
  void prepare(const model::ParamStore& params, bool snapshot = false);
  // Waits for a save in flight; returns its error message, if it failed ("" otherwise).
  std::string wait();
  // The error of the last failed asynchronous save, once ("" if none).
  std::string take_failure();
  // What the writer did on its own since the last call (room made on a full disk), in words.
  std::vector<std::string> take_notes();
  SaveRecord record() const;
  const std::string& dir() const { return dir_; }

 private:
  void write(const std::vector<model::Param>& layout, const float* weights, const float* m, const float* v,
             const TrainingState& state, const std::string& recipe);
  // `replayable`: `moments` can be read a second time, so a save that failed for lack of space can
  // be retried once room is made (not so for ZeRO-1's streamed moments: the next save benefits).
  void write(const std::vector<model::Param>& layout, const float* weights, const MomentSource& moments,
             const TrainingState& state, const std::string& recipe, bool replayable);
  void write_once(const std::vector<model::Param>& layout, const float* weights, const MomentSource& moments,
                  const TrainingState& state, const std::string& recipe);
  void write_staged();

  std::string dir_;
  int64_t keep_last_n_;
  bool async_;
  std::vector<float> staging_;  // async snapshot: weights | m | v
  std::vector<model::Param> staged_layout_;
  TrainingState staged_state_;
  std::string staged_recipe_;
  std::mutex mutex_;  // failure_: written by the background save
  std::string failure_;
  std::vector<std::string> notes_;
  mutable std::mutex record_mutex_;  // record_ and notes_: written by whichever thread saves
  SaveRecord record_;
  std::unique_ptr<WorkerThread> worker_;  // asynchronous saves; last, so destroyed first
};

// Removes what a killed process can leave in a checkpoint_dir: ".tmp-*" directories of a save cut
// short, ".latest.tmp.<pid>" files of a pointer update cut short, and step-N directories without a
// manifest (a deletion cut short: the manifest goes first); returns how many.
int clean_incomplete_checkpoints(const std::string& dir);
// The retention rule on a full disk: every complete checkpoint in `dir` but the one `latest` names
// (the one a resume would use) is removed, so a disk with room for two keeps saving (without it,
// old ones are pruned only after a save succeeds). Returns whether any was, with what in *note.
bool make_room(const std::string& dir, std::string* note);
// Whether an error message reports a full disk (the errno text every writer of keel puts in it).
bool is_out_of_space(const std::string& message);
// The newest checkpoint in `dir` that passes verify_checkpoint, or "" if none does.
std::string newest_intact_checkpoint(const std::string& dir);
// Deletes every checkpoint in `dir` (the `latest` pointer first, then each step-N with its manifest
// first, so a deletion cut short never leaves something that looks complete); returns how many.
int remove_checkpoints(const std::string& dir);
// The newest complete checkpoint in `dir` (per its `latest` pointer), or "" if there is none.
std::string latest_checkpoint(const std::string& dir);

// The step directory `path` names: `path` itself when it holds a manifest.json (step-N/), else the
// checkpoint its `latest` pointer names (a checkpoint_dir). Errors name the path and what is missing.
std::string checkpoint_step_dir(const std::string& path);

// Verifies the manifest's checksums, then loads weights and optimizer state into `params`
// (whose layout must match) and returns the training state. Errors name the file and problem.
// Either layout: a sharded checkpoint is read only where `params` holds state (its master and
// optimizer ranges), each piece read checked against its own checksum.
TrainingState load_checkpoint(const std::string& path, model::ParamStore& params);

// Whether `path` (a step directory with a manifest) is of the sharded layout (sharded_manifest.h):
// one file per rank, read by load_checkpoint piece by piece, each rank only the pieces it holds.
bool is_sharded_checkpoint(const std::string& path);

// The steps of load_checkpoint, for readers that need the checkpoint's recipe before they can lay
// out `params` (keel export). verify_checkpoint: every file the manifest lists exists with its
// recorded size and XXH3 checksum (errors name the file); the readers below do not verify again.
void verify_checkpoint(const std::string& path);
TrainingState read_checkpoint_state(const std::string& path);  // trainer_state.json
// The fp32 master weights (weights.safetensors) into `params`, whose layout must match.
void read_checkpoint_weights(const std::string& path, model::ParamStore& params);

// Fingerprints of what must not change across a resume.
std::string model_fingerprint(const model::ParamStore& params, const std::string& architecture);
std::string fingerprint_of(std::string_view text);

}  // namespace keel::checkpoint
