// What a resume may continue, and what a fresh start may not overwrite: the checkpoint a --resume
// request names, the fingerprints that must match (model, data, the keys that decide the batches),
// the notes a changed recipe is owed, and the checkpoints of an earlier run in checkpoint_dir.
// Apart from the trainer's step loop (issue 54: checkpoint and resume policy in its own file).
#pragma once
#include <cstdint>
#include <ostream>
#include <string>

#include "keel/checkpoint/checkpoint.h"
#include "keel/model/params.h"
#include "keel/recipe/recipe.h"
#include "keel/train/lr_schedule.h"
#include "keel/train/trainer.h"

namespace keel::train {

// The checkpoint a --resume request names: with "auto" the newest in checkpoint_dir ("" when there
// is none yet), else the step directory the path names (or a checkpoint_dir's latest).
std::string resume_path(const recipe::Recipe& r, const std::string& request);

// The recipe keys that decide which samples each step sees and how they are computed: a resume
// with any of them changed could not continue the run, so it is refused. The world size is not
// one of them, only the global batch: micro-batch i of rank r is the step's (i * ranks + r)-th
// whatever the number of ranks, so a run may resume on another number of ranks with the
// accumulation changed to keep gradient_accumulation_steps x dp_degree (a lost node, a bigger
// allocation).
std::string compat_fingerprint(const recipe::Recipe& r);

struct ResumeRequest {
  std::string request;  // TrainOptions::resume
  bool with_new_data = false;
};
struct Resumed {
  bool resumed = false;          // a checkpoint was loaded
  checkpoint::TrainingState state;
  bool already_complete = false;  // at max_steps with the final model written: nothing to do
};
// Loads the checkpoint `request` names into `trained` (either layout, any world size: each rank
// reads what it holds) and checks that it continues the run `expected` describes; says what it
// did, and what changed, on `log`. Errors name the checkpoint and what differs; a corrupt latest
// under "auto" names the newest intact checkpoint.
Resumed resume_run(const recipe::Recipe& r, const ResumeRequest& request, model::ParamStore& trained,
                   const checkpoint::TrainingState& expected, int64_t max_steps, const LrSchedule& schedule,
                   std::ostream& log);

// A fresh run must not write its checkpoints between another run's (their steps interleave and
// keep_last_n prunes the wrong ones): refused unless --resume or --overwrite says what to do.
void refuse_mixing_runs(const std::string& dir, const TrainOptions& options, std::ostream& log);

// A bf16 resume multiplies as the run that wrote its checkpoint did (kernels/bf16_widening.h:
// keep), or its steps would round differently from the uninterrupted run's: decided before the
// model is set up, whose memory plan depends on the way. What cannot be kept is said.
void keep_checkpoint_products(const recipe::Recipe& r, const TrainOptions& options, std::ostream& log);

}  // namespace keel::train
