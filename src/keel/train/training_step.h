// One optimizer step, from the step's micro-batches (already fetched and agreed on by every rank) to
// the updated weights: the gradients' start, the objective's forward and backward over each
// micro-batch (objective.h), data parallel's synchronisation (grad_sync.h, when there is one), the
// gradient norm, the step's loss and the objective's metrics, the non-finite check, the learning
// rate and AdamW with clip_grad_norm_'s clipping — what one iteration of transformers' Trainer loop
// does between fetching a batch and `optimizer.step()`. What is the run's (fetching and agreeing on
// the data, checkpoints, evaluation, the metrics files, the banner) is the trainer's (trainer.cpp).
//
// Every dependency is handed in, so a unit test drives a step on a decoder it built
// (tests/unit/training_step_test.cpp). The step runs in three phases because the trainer's own work
// falls between them: an asynchronous checkpoint save may still read the state the optimizer is
// about to change (waited for between compute_gradients and update), and the next step is agreed on
// before the weights' all-gather starts (between update and share_weights; see trainer.cpp).
// run() is the three in a row. Like the decoder's step, a steady-state step allocates nothing (the
// metrics' expert_load list aside, when the caller hands in fresh metrics).
#pragma once
#include <cstdint>
#include <span>

#include "keel/data/shard_loader.h"
#include "keel/distributed/communicator.h"
#include "keel/model/decoder.h"
#include "keel/report/metrics.h"
#include "keel/train/grad_sync.h"
#include "keel/train/lr_schedule.h"
#include "keel/train/objective.h"
#include "keel/train/optimizer.h"

namespace keel::train {

// The few recipe keys the step reads.
struct TrainingStepOptions {
  uint64_t seed = 0;                  // seed: LoRA dropout's masks are drawn from it
  double max_grad_norm = 0;           // max_grad_norm: clip_grad_norm_'s max_norm; <= 0: no clipping
  bool skip_nonfinite_steps = false;  // a non-finite loss or gradient norm skips the update instead of stopping
};

// A step's input: this rank's micro-batches and what every rank agreed on for the step.
struct StepBatch {
  int64_t step = 0;                               // counts from 1 (the LR schedule, AdamW's bias correction)
  std::span<const data::PackedMicroBatch> micro;  // this rank's, in order
  bool packed = false;  // rows hold several documents: attention stays inside each (their segments)
  StepTotals totals;    // the whole step's token counts, over every rank
};

class TrainingStep {
 public:
  // `sync`: data parallel's gradient path, or null in a single process. `comm` gives the rank (the
  // dropout masks) and sums the objective's metrics over the ranks. Every reference must outlive
  // the step; `schedule` is read at each update, so a schedule the caller changes later counts.
  TrainingStep(model::Decoder& decoder, Objective& objective, AdamW& optimizer, const LrSchedule& schedule,
               distributed::Communicator& comm, GradSync* sync, const TrainingStepOptions& options);

  // compute_gradients, update and share_weights in a row, into fresh metrics.
  report::StepMetrics run(const StepBatch& batch);

  // The gradients and the loss: m.step, tokens, target_tokens, loss, grad_norm, the objective's
  // metrics, expert_load, compute_s, and grad_sync_s (added to what `m` holds).
  void compute_gradients(const StepBatch& batch, report::StepMetrics& m);
  // The update of step m.step: m.lr, and AdamW with clipping unless the loss or the gradient norm is
  // not finite, which stops the run (keel::Error naming skip_nonfinite_steps) or, with
  // skip_nonfinite_steps, sets m.skipped and leaves the weights and the optimizer state as they
  // were. m.optimizer_s.
  void update(report::StepMetrics& m);
  // ZeRO: every rank's updated shard to every rank (GradSync::gather_weights), unless the step was
  // skipped; its time into m.grad_sync_s. Nothing in a single process.
  void share_weights(report::StepMetrics& m);

 private:
  model::Decoder& decoder_;
  Objective& objective_;
  AdamW& optimizer_;
  const LrSchedule& schedule_;
  distributed::Communicator& comm_;
  GradSync* sync_;
  TrainingStepOptions options_;
};

}  // namespace keel::train
