#include "keel/train/grad_sync.h"

#include <chrono>
#include <cmath>

#include "keel/core/error.h"
#include "keel/train/optimizer.h"

namespace keel::train {
namespace {

// Runs f, adding the seconds it took to `total`.
template <class F>
void timed(double& total, F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

GradSync::GradSync(model::Decoder& decoder, distributed::Communicator& comm, const GradSyncOptions& options)
    : decoder_(decoder), comm_(comm), options_(options) {
  model::ParamStore& params = decoder_.trainable();
  const bool staged = options_.zero_stage >= 2;
  require(staged == params.staged_grads(),
          "gradient sync: ZeRO stage {} but the decoder's gradients are {}", options_.zero_stage,
          params.staged_grads() ? "staged (ZeRO-2)" : "whole");
  std::vector<distributed::ParamSpan> spans;
  for (const auto& p : params.params()) spans.push_back({p.offset, p.numel});
  if (options_.zero_stage >= 1) {
    shards_ = shard_ranges(params.total(), comm_.size());
    const FlatRange mine = shards_[size_t(comm_.rank())];
    require(params.optimizer_range().begin == mine.begin && params.optimizer_range().end == mine.end,
            "gradient sync: the decoder's optimizer range is not rank {}'s ZeRO shard", comm_.rank());
  }
  std::vector<int> group_starts;
  for (const model::GradGroup& g : decoder_.grad_groups()) group_starts.push_back(g.first_param);
  buckets_ = std::make_unique<distributed::GradBuckets>(spans, options_.bucket_bytes,
                                                        shards_.empty() ? nullptr : &shards_, group_starts);
  if (staged)
    for (int i = 0; i < int(params.params().size()); ++i) staged_.push_back(params.grad(i));
  // Set once (no allocation per step); they act only while in_backward_.
  decoder_.set_grad_ready_hook([this](int param, ComputeEvent written) {
    if (in_backward_) timed(hook_seconds_, [&] { buckets_->param_ready(param, written); });
  });
  if (staged) decoder_.set_backward_position_hook([this](int32_t at) { timed(hook_seconds_, [&] { position(at); }); });
  require((options_.zero_stage >= 3) == params.sharded_weights(),
          "gradient sync: ZeRO stage {} but the decoder's weights are {}", options_.zero_stage,
          params.sharded_weights() ? "sharded (ZeRO-3)" : "whole");
  if (options_.zero_stage >= 3) {
    for (const model::WeightGather& g : decoder_.weight_gathers()) {
      std::vector<FlatRange> parts;
      for (const FlatRange& shard : shards_) {
        const FlatRange in = shard.intersect(g.range);
        const int64_t at = in.size() > 0 ? in.begin - g.range.begin : 0;
        parts.push_back({at, at + in.size()});
      }
      gather_parts_.push_back(std::move(parts));
    }
    gather_tickets_.assign(gather_parts_.size(), 0);
    // A wait the compute makes is exposed communication, as ZeRO-2's waits inside the backward pass.
    // Overlapped, a gather starts one position ahead and the compute of the position before hides
    // it; without overlap (the same decision as the gradients', train/sync_overlap.h) it runs
    // whole where its position needs it, all of it exposed: the on/off pair bench/grad_sync_bench.py
    // measures.
    auto start = [this](size_t g) {
      gather_tickets_[g] = comm_.allgather_shards_async(decoder_.weight_gathers()[g].weights, gather_parts_[g]);
    };
    if (options_.overlap)
      decoder_.set_weight_gather_hooks({.start = start, .wait = [this](size_t g) {
                                          timed(hook_seconds_, [&] { comm_.wait(gather_tickets_[g]); });
                                        }});
    else
      decoder_.set_weight_gather_hooks({.start = [](size_t) {},
                                        .wait =
                                            [this, start](size_t g) {
                                              timed(hook_seconds_, [&] {
                                                start(g);
                                                comm_.wait(gather_tickets_[g]);
                                              });
                                            }});
  }
}

GradSync::~GradSync() {
  decoder_.set_grad_ready_hook({});
  decoder_.set_backward_position_hook({});
  decoder_.set_weight_gather_hooks({});
}

void GradSync::begin_step() {
  decoder_.trainable().zero_grads();
  began_ = false;
}

void GradSync::before_micro_batch(bool last) {
  model::ParamStore& params = decoder_.trainable();
  if (!staged_.empty()) {
    buckets_->begin_staged(staged_, params.shard_grads(), comm_, options_.deterministic, !options_.overlap);
    began_ = in_backward_ = true;
    next_wait_ = 0;
    return;
  }
  // Whole gradients accumulate locally: synchronised once, during the last backward pass
  // (overlap: each bucket as soon as its gradients are final) or after it.
  if (!last) return;
  buckets_->begin(params.grads(), comm_, options_.deterministic);
  began_ = true;
  in_backward_ = options_.overlap;
}

void GradSync::after_micro_batch() {
  in_backward_ = false;
  // ZeRO-2: the next micro-batch's forward pass reuses the staging of the last groups.
  if (!staged_.empty()) buckets_->finish();
}

// ZeRO-2: a group's staging may be reused from two positions after its last write on (its plan
// lifetime ends one after): its reductions must be complete by then. Groups come in the order of
// their last write, positions in increasing order.
void GradSync::position(int32_t at) {
  if (!in_backward_) return;
  const auto& groups = decoder_.grad_groups();
  while (next_wait_ < groups.size() && groups[next_wait_].last_written + 1 < at) {
    buckets_->wait_params(groups[next_wait_].first_param, groups[next_wait_].last_param);
    ++next_wait_;
  }
}

SyncedStep GradSync::finish(double local_loss_sum) {
  model::ParamStore& params = decoder_.trainable();
  if (staged_.empty()) {
    if (!began_) buckets_->begin(params.grads(), comm_, options_.deterministic);  // a step without micro-batches
    buckets_->finish();
  }
  // Under ZeRO each rank holds the summed gradients of its shard only: the ranks add their sums of
  // squares; replicated, every rank holds them all.
  double sums[2] = {local_loss_sum, shards_.empty() ? 0.0 : gradient_sum_of_squares(decoder_.backend(), params)};
  comm_.allreduce_totals(sums, 2);
  return {sums[0], shards_.empty() ? gradient_norm(decoder_.backend(), params) : std::sqrt(sums[1])};
}

double GradSync::take_hook_seconds() {
  const double s = hook_seconds_;
  hook_seconds_ = 0;
  return s;
}

void GradSync::gather_weights() {
  if (shards_.empty() || options_.zero_stage >= 3) return;
  model::ParamStore& params = decoder_.trainable();
  comm_.wait(comm_.allgather_shards_async(params.weights(), shards_));
  const FlatRange mine = params.optimizer_range();
  for (const FlatRange& other : shards_)
    if (other.begin != mine.begin) params.refresh_bf16_copy(other);
}

}  // namespace keel::train
