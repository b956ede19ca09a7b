#include "keel/train/training_step.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "keel/core/dropout_mask.h"
#include "keel/core/error.h"
#include "keel/core/stopwatch.h"

namespace keel::train {
namespace {

using Clock = std::chrono::steady_clock;

// Mixture of experts: each sparse layer's busiest expert over the mean per expert in this step (on
// this rank), so a router collapsing onto a few experts shows in metrics.jsonl.
void record_expert_load(const model::Decoder& decoder, report::StepMetrics& m) {
  const std::span<const double> load = decoder.expert_load();
  const int64_t experts = decoder.config().moe.experts;
  m.expert_load.clear();
  for (size_t first = 0; experts > 0 && first < load.size(); first += size_t(experts)) {
    double most = 0, sum = 0;
    for (int64_t e = 0; e < experts; ++e) {
      most = std::max(most, load[first + size_t(e)]);
      sum += load[first + size_t(e)];
    }
    m.expert_load.push_back(sum > 0 ? most / (sum / double(experts)) : 0.0);
  }
}

}  // namespace

TrainingStep::TrainingStep(model::Decoder& decoder, Objective& objective, AdamW& optimizer,
                           const LrSchedule& schedule, distributed::Communicator& comm, GradSync* sync,
                           const TrainingStepOptions& options)
    : decoder_(decoder),
      objective_(objective),
      optimizer_(optimizer),
      schedule_(schedule),
      comm_(comm),
      sync_(sync),
      options_(options) {}

report::StepMetrics TrainingStep::run(const StepBatch& batch) {
  report::StepMetrics m;
  compute_gradients(batch, m);
  update(m);
  share_weights(m);
  return m;
}

void TrainingStep::compute_gradients(const StepBatch& in, report::StepMetrics& m) {
  m.step = in.step;
  m.target_tokens = int64_t(in.totals.target_tokens);
  m.tokens = int64_t(in.totals.tokens);
  const auto& micro = in.micro;
  const int64_t ranks = comm_.size();

  const auto t1 = Clock::now();
  if (sync_)
    sync_->begin_step();
  else if (micro.empty())  // no write will overwrite last step's gradients
    decoder_.trainable().zero_grads();
  else
    decoder_.trainable().begin_gradient_step();
  objective_.begin_step(in.totals);
  decoder_.clear_expert_load();
  double exposed_s = 0.0;
  for (size_t i = 0; i < micro.size(); ++i) {
    const auto& mb = micro[i];
    model::MicroBatch batch{mb.batch,
                            mb.seq,
                            mb.input_ids.data(),
                            mb.targets.data(),
                            mb.positions.data(),
                            in.packed ? mb.segments.data() : nullptr};
    batch.documents = mb.segments.data();  // where padding is, packed or not (experts' balance loss)
    // LoRA dropout: masks from the seed, the step and the micro-batch's place in the global step
    // (i * ranks + rank), so a resume, or another number of ranks, draws the same ones.
    batch.dropout_key = dropout_subkey(splitmix64(options_.seed), uint64_t(in.step) << 24 |
                                                                      (i * uint64_t(ranks) + uint64_t(comm_.rank())));
    if (sync_) sync_->before_micro_batch(i + 1 == micro.size());
    objective_.micro_batch(decoder_, batch, mb);
    if (sync_) {
      const auto t_wait = Clock::now();  // ZeRO-2: the micro-batch's last reductions
      sync_->after_micro_batch();
      exposed_s += seconds_since(t_wait) + sync_->take_hook_seconds();
    }
  }
  m.compute_s = seconds_since(t1) - exposed_s;
  m.grad_sync_s += exposed_s;
  double loss_sum = objective_.partial_loss();
  if (sync_) {
    // What is left of the synchronisation once the backward pass is done: the exposed part.
    const auto t_sync = Clock::now();
    const SyncedStep synced = sync_->finish(loss_sum);
    loss_sum = synced.loss_sum;
    m.grad_norm = synced.grad_norm;
    m.grad_sync_s += seconds_since(t_sync);
  } else {
    m.grad_norm = gradient_norm(decoder_.backend(), decoder_.trainable());
  }
  m.loss = objective_.step_loss(loss_sum);
  record_expert_load(decoder_, m);
  if (const std::span<double> sums = objective_.partial_metrics(); !sums.empty()) {
    if (comm_.size() > 1) comm_.allreduce_totals(sums.data(), int64_t(sums.size()));
    objective_.report(sums, m);
  }
}

void TrainingStep::update(report::StepMetrics& m) {
  const auto t2 = Clock::now();
  m.lr = schedule_.lr_for_step(m.step);
  if (!std::isfinite(m.loss) || !std::isfinite(m.grad_norm)) {
    require(options_.skip_nonfinite_steps,
            "step {}: the loss ({}) or the gradient norm ({}) is not finite; training stopped before the weights "
            "were corrupted (set skip_nonfinite_steps = true to skip such steps instead)",
            m.step, m.loss, m.grad_norm);
    m.skipped = true;  // weights and optimizer state stay as they were
  } else {
    optimizer_.step(m.lr, m.step, clip_coefficient(m.grad_norm, options_.max_grad_norm));
  }
  m.optimizer_s = seconds_since(t2);
}

void TrainingStep::share_weights(report::StepMetrics& m) {
  if (!sync_ || m.skipped) return;  // ZeRO: every rank needs every rank's updated shard
  const auto t_gather = Clock::now();
  sync_->gather_weights();
  m.grad_sync_s += seconds_since(t_gather);
}

}  // namespace keel::train
