#include "keel/train/resume_policy.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/kernels/backend.h"
#include "keel/kernels/bf16_widening.h"

namespace keel::train {
namespace {

// What checkpoints written before compat_fingerprint recorded: the same keys, accumulation and world size
// apart. Such a checkpoint resumes with both unchanged.
std::string compat_fingerprint_v1(const recipe::Recipe& r) {
  return checkpoint::fingerprint_of(fmt::format("{}|{}|{}|{}|{}|{}|{}|{}", recipe::choice_name(r.dtype),
                                                r.max_seq_len, r.batch_size,
                                                r.gradient_accumulation_steps, r.seed, r.shuffle, r.dp_degree,
                                                r.model_config ? "scratch" : "loaded"));
}

// A changed max_steps, learning rate, scheduler or warmup moves the learning rate at the resume
// step (a raised max_steps stretches a cosine decay): say so with both rates, rather than let the
// loss curve jump without a word.
void note_schedule_change(const recipe::Recipe& r, const std::string& checkpoint, int64_t step, int64_t max_steps,
                          const LrSchedule& schedule, std::ostream& log) {
  const std::string saved_recipe = checkpoint::checkpoint_step_dir(checkpoint) + "/recipe.toml";
  if (!path_exists(saved_recipe)) return;
  recipe::Recipe before;
  try {
    before = recipe::parse_recipe(read_file(saved_recipe), saved_recipe);
  } catch (const Error&) {
    return;  // written by another keel version: the general note above stands
  }
  const LrSchedule old{before.lr_scheduler, before.learning_rate, before.warmup_steps,
                       before.max_steps > 0 ? before.max_steps : max_steps};
  const double was = old.lr_for_step(step + 1), now = schedule.lr_for_step(step + 1);
  if (was == now) return;
  fmt::print(log,
             "note: the learning-rate schedule changed (max_steps {} -> {}, learning_rate {} -> {}, {} -> {}): "
             "step {} trains at {:.4g} instead of {:.4g}\n",
             old.total_steps, max_steps, before.learning_rate, r.learning_rate,
             recipe::choice_name(before.lr_scheduler), recipe::choice_name(r.lr_scheduler), step + 1, now, was);
}

}  // namespace

std::string resume_path(const recipe::Recipe& r, const std::string& request) {
  if (request != "auto") return checkpoint::checkpoint_step_dir(request);
  require(!r.checkpoint_dir.empty(), "{}: --resume auto needs 'checkpoint_dir' in the recipe", r.source);
  return checkpoint::latest_checkpoint(r.checkpoint_dir);
}

std::string compat_fingerprint(const recipe::Recipe& r) {
  return checkpoint::fingerprint_of(fmt::format("{}|{}|{}|global {}|{}|{}|{}", recipe::choice_name(r.dtype),
                                                r.max_seq_len, r.batch_size,
                                                r.gradient_accumulation_steps * r.dp_degree, r.seed, r.shuffle,
                                                r.model_config ? "scratch" : "loaded"));
}

Resumed resume_run(const recipe::Recipe& r, const ResumeRequest& req, model::ParamStore& trained,
                   const checkpoint::TrainingState& expected, int64_t max_steps, const LrSchedule& schedule,
                   std::ostream& log) {
  Resumed out;
  const std::string& request = req.request;
  if (request.empty()) return out;
  const std::string path = resume_path(r, request);
  if (path.empty()) {
    fmt::print(log, "keel: no checkpoint in {} yet; starting from step 1\n", r.checkpoint_dir);
    return out;
  }
  checkpoint::TrainingState saved;
  try {
    saved = checkpoint::load_checkpoint(path, trained);
  } catch (const Error& e) {
    if (request != "auto") throw;
    // The latest is corrupt: say which one a resume can use instead.
    const std::string intact = checkpoint::newest_intact_checkpoint(r.checkpoint_dir);
    fail("{}; {}", e.what(),
         intact.empty()
             ? fmt::format("no checkpoint in {} is intact", r.checkpoint_dir)
             : fmt::format("the newest intact checkpoint is {}: resume from it with --resume {}", intact, intact));
  }
  require(saved.model_fingerprint == expected.model_fingerprint,
          "{}: the checkpoint was written for a different model (architecture or sizes changed)", path);
  if (saved.data_fingerprint != expected.data_fingerprint) {
    require(req.with_new_data,
            "{}: the checkpoint was written for different training data ({} changed). To continue on the new data, "
            "add --resume-with-new-data",
            path, r.data_path);
    fmt::print(log,
               "note: the training data changed since {} ({}); --resume-with-new-data: step {} on reads what the "
               "new data's order puts at that step, as if the run had trained on it from the start\n",
               path, r.data_path, saved.step + 1);
  }
  require(
      saved.compat_fingerprint == expected.compat_fingerprint || saved.compat_fingerprint == compat_fingerprint_v1(r),
      "{}: the recipe changed in a key that decides the batches (dtype, max_seq_len, batch_size, seed, "
      "shuffle, or the global batch gradient_accumulation_steps x dp_degree); resuming would not continue the "
      "same run",
      path);
  require(saved.step <= max_steps, "{}: the checkpoint is at step {}, past max_steps = {}", path, saved.step,
          max_steps);
  if (saved.recipe_hash != expected.recipe_hash) {
    fmt::print(log,
               "note: the recipe differs from the one that wrote {} (allowed keys such as max_steps, "
               "logging or save_interval)\n",
               path);
    note_schedule_change(r, path, saved.step, max_steps, schedule, log);
  }
  out.resumed = true;
  out.state = saved;
  // At max_steps with the final model written, the run is finished: nothing to do. Without it (the
  // save of final/ failed, e.g. on a full disk) the resume goes on to write it.
  out.already_complete = saved.step == max_steps && (path_exists(r.output_dir + "/final/config.json") ||
                                                     path_exists(r.output_dir + "/final/adapter_config.json"));
  if (!out.already_complete) fmt::print(log, "keel: resumed from {} at step {}\n", path, saved.step);
  return out;
}

void refuse_mixing_runs(const std::string& dir, const TrainOptions& options, std::ostream& log) {
  if (!options.resume.empty()) return;
  const std::string latest = checkpoint::latest_checkpoint(dir);
  if (latest.empty()) return;
  if (!options.overwrite)
    fail(
        "checkpoint_dir '{}' holds checkpoints of an earlier run (latest: {}). Pass --resume auto to continue "
        "it, --overwrite to delete them and start afresh, or choose another checkpoint_dir",
        dir, latest);
  const int removed = checkpoint::remove_checkpoints(dir);
  fmt::print(log, "keel: --overwrite: removed {} checkpoint(s) of the earlier run from {}\n", removed, dir);
}

void keep_checkpoint_products(const recipe::Recipe& r, const TrainOptions& options, std::ostream& log) {
  if (options.resume.empty() || r.dtype != recipe::Precision::Bf16) return;
  std::string path;
  checkpoint::TrainingState saved;
  try {
    path = resume_path(r, options.resume);
    if (path.empty()) return;
    saved = checkpoint::read_checkpoint_state(path);
  } catch (const Error&) {
    return;  // the resume itself says what is wrong with the request or the checkpoint
  }
  if (saved.bf16_products.empty()) return;  // written before keel recorded the way
  const bool widened = saved.bf16_products == "widened";
  kernels::Backend& backend = kernels::backend_named(r.backend);
  kernels::Bf16Widening* widening = kernels::bf16_widening(backend);
  // A backend that never widens multiplies as a run that did not.
  const bool kept = widening ? widening->keep(widened, fmt::format("as the run that wrote {} multiplied, for the rest "
                                                                   "of this process", path))
                             : !widened;
  if (!kept)
    fmt::print(log,
               "note: the run that wrote {} multiplied bf16 {}; this one cannot ({}): the resumed steps round "
               "differently from an uninterrupted run's\n",
               path, widened ? "widened to fp32" : "on oneDNN's bf16 matmul", backend.description(true));
}

}  // namespace keel::train
