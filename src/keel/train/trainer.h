// The training loop: recipe -> model + data -> optimizer steps -> metrics, summary, plot and the
// exported model.
#pragma once
#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "keel/recipe/recipe.h"
#include "keel/report/metrics.h"
#include "keel/report/summary.h"

namespace keel::train {

struct TrainOptions {
  std::string resume;           // "" (fresh start), "auto" (latest checkpoint in checkpoint_dir, if any) or a path
  bool terminal = false;        // live progress line instead of periodic log lines
  int64_t stop_after_step = 0;  // > 0: stop (saving a checkpoint) after this step, as if interrupted
  // A fresh run (no resume) into a checkpoint_dir that holds another run's checkpoints: refused
  // unless this is set, which deletes them first.
  bool overwrite = false;
  // The training data changed since the checkpoint (its fingerprint differs): continue anyway. The
  // batches stay a function of the step number, so step s reads what the new data's order puts at
  // step s, as if the run had trained on the new data from the start.
  bool resume_with_new_data = false;
  // The command line's --set overrides, repeated in the resume commands keel prints.
  std::vector<std::string> overrides;
  // For callers embedding the trainer (the Python package's callbacks), on rank 0, on the training
  // thread: each step at the log interval (and the last) with metrics.jsonl's record, each
  // evaluation, each checkpoint save (its step and checkpoint_dir, or output_dir/interrupted).
  // An exception thrown by one ends the run as keel's own errors do.
  std::function<void(const report::StepMetrics&)> on_log;
  std::function<void(int64_t step, double eval_loss, double eval_perplexity)> on_evaluate;
  std::function<void(int64_t step, const std::string& directory)> on_save;
};

struct TrainResult {
  report::RunSummary summary;
  bool interrupted = false;  // stopped early by SIGINT/SIGTERM
  int interrupt_signal = 0;
};

// Runs the recipe to completion (or until interrupted), logging to `log`; writes
// output_dir/metrics.jsonl, summary.json, loss.svg and final/ (an HF model directory).
TrainResult run_training(const recipe::Recipe& recipe, std::ostream& log, const TrainOptions& options = {});

}  // namespace keel::train
