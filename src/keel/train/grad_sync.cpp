#include "keel/train/grad_sync.h"

#include <chrono>
#include <cmath>
#include <limits>

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

std::vector<FlatRange> GradSync::parts_within(FlatRange range, const std::vector<FlatRange>& shards, int64_t unit) {
  std::vector<FlatRange> parts;
  for (const FlatRange& shard : shards) {
    const FlatRange in = shard.intersect(range);
    const int64_t at = in.size() > 0 ? in.begin - range.begin : 0;
    require(at % unit == 0 && in.size() % unit == 0,
            "gradient sync: a shard's part [{}, {}) is not whole {}-element words", in.begin, in.end, unit);
    parts.push_back({at / unit, (at + in.size()) / unit});
  }
  return parts;
}

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
  // ZeRO-1/2's all-gather of the updated weights: with overlap (full fine-tuning) by the spans
  // the next forward pass reads first, each waited for there; else the whole buffer at once,
  // waited for at the end of the step (LoRA's adapter is small, and its tensors are read where
  // the base weights are).
  // LoRA under ZeRO-3 shards the frozen base: its adapter is gathered as in ZeRO-1/2.
  if (options_.zero_stage >= 1 && !params.sharded_weights()) {
    defer_post_step_ = options_.overlap && !decoder_.has_adapter();
    if (defer_post_step_)
      post_step_ = decoder_.first_weight_reads();
    else
      post_step_.push_back({0, int(params.params().size()) - 1, FlatRange{0, params.total()}, 0});
    for (const model::WeightGather& g : post_step_) post_step_parts_.push_back(parts_within(g.range, shards_));
    post_step_tickets_.assign(post_step_.size(), 0);
  }
  next_post_step_wait_ = post_step_.size();
  if (staged || defer_post_step_)
    decoder_.set_position_hook([this](int32_t at) {
      timed(hook_seconds_, [&] {
        weights_read_at(at);
        position(at);
      });
    });
  const model::ParamStore& weights = decoder_.params();  // the model's: trained, or LoRA's frozen base
  const bool resident = decoder_.resident_gathers();
  require((options_.zero_stage >= 3 || (resident && options_.zero_stage >= 1)) == weights.sharded_weights(),
          "gradient sync: ZeRO stage {} but the decoder's masters are {}", options_.zero_stage,
          weights.sharded_weights() ? "sharded" : "whole");
  if (weights.sharded_weights()) {
    const model::WeightShards shards = model::weight_shards(weights, comm_.size());
    const auto &masters = shards.masters, &compute_only = shards.compute_only, &four_bit = shards.four_bit;
    // Element units per fp32 word: bf16 pairs, 8 4-bit codes, a 64-element block's absmax.
    for (const model::WeightGather& g : decoder_.weight_gathers()) {
      std::vector<Transfer> spans;
      for (const model::WeightGather::Run& run : g.fp32_runs)
        spans.push_back({g.weights + run.at, parts_within(run.range, masters)});
      if (g.bf16_span.size() > 0)
        spans.push_back({reinterpret_cast<float*>(g.weights_bf16), parts_within(g.bf16_span, masters, 2)});
      if (g.compute_only.size() > 0)
        spans.push_back(
            {reinterpret_cast<float*>(g.compute_only_weights), parts_within(g.compute_only, compute_only, 2)});
      if (g.four_bit.size() > 0) {
        spans.push_back({reinterpret_cast<float*>(g.four_bit_packed), parts_within(g.four_bit, four_bit, 8)});
        spans.push_back({g.four_bit_absmax, parts_within(g.four_bit, four_bit, kFourBitBlockSize)});
      }
      gathers_.push_back(std::move(spans));
    }
    // A wait the compute makes is exposed communication, as ZeRO-2's waits inside the backward pass.
    // Overlapped, a gather starts one position ahead and the compute of the position before hides
    // it; without overlap (the same decision as the gradients', train/sync_overlap.h) it runs
    // whole where its position needs it, all of it exposed: the on/off pair bench/grad_sync_bench.py
    // measures. Resident gathers (sharded masters, ZeRO-1/2) all start after the optimizer step
    // (gather_weights) and are waited for where the next step first reads them, or at once
    // without overlap.
    if (options_.overlap || resident)
      decoder_.set_weight_gather_hooks({.start = [this](size_t g) { start_gather(g); },
                                        .wait = [this](size_t g) { timed(hook_seconds_, [&] { wait_gather(g); }); }});
    else
      decoder_.set_weight_gather_hooks({.start = [](size_t) {},
                                        .wait =
                                            [this](size_t g) {
                                              timed(hook_seconds_, [&] {
                                                start_gather(g);
                                                wait_gather(g);
                                              });
                                            }});
  }
}

void GradSync::start_gather(size_t g) {
  for (Transfer& t : gathers_[g]) t.ticket = comm_.allgather_shards_async(t.data, t.parts);
}

void GradSync::wait_gather(size_t g) {
  for (Transfer& t : gathers_[g]) comm_.wait(t.ticket);
}

GradSync::~GradSync() {
  // A gather still in flight writes into the decoder's weights: it completes before they can go.
  try {
    settle_weights();
  } catch (const std::exception&) {  // the communicator failed (and said so): nothing left to wait for
  }
  decoder_.set_grad_ready_hook({});
  decoder_.set_position_hook({});
  decoder_.set_weight_gather_hooks({});
}

void GradSync::begin_step() {
  decoder_.trainable().begin_gradient_step();
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
    if (!began_) {  // a step without micro-batches: this rank adds zeros (no write overwrote last step's)
      params.zero_grads();
      buckets_->begin(params.grads(), comm_, options_.deterministic);
    }
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
  if (decoder_.resident_gathers()) {  // this rank's bf16 part was written by the optimizer step
    decoder_.refresh_resident_weights(true);
    if (!options_.overlap) settle_weights();
    return;
  }
  if (post_step_.empty()) return;  // replicated, or ZeRO-3 (its weights are gathered where read)
  model::ParamStore& params = decoder_.trainable();
  for (size_t g = 0; g < post_step_.size(); ++g)
    post_step_tickets_[g] =
        comm_.allgather_shards_async(params.weights() + post_step_[g].range.begin, post_step_parts_[g]);
  next_post_step_wait_ = 0;
  if (!defer_post_step_) settle_weights();
}

// The spans first read at or before `at`: their gathers done, the other ranks' parts of them
// copied to bf16 (this rank's part was refreshed by its optimizer step).
void GradSync::weights_read_at(int32_t at) {
  model::ParamStore& params = decoder_.trainable();
  const FlatRange mine = params.optimizer_range();
  for (; next_post_step_wait_ < post_step_.size() && post_step_[next_post_step_wait_].position <= at;
       ++next_post_step_wait_) {
    const model::WeightGather& g = post_step_[next_post_step_wait_];
    comm_.wait(post_step_tickets_[next_post_step_wait_]);
    for (const FlatRange& other : shards_) {
      const FlatRange part = other.intersect(g.range);
      if (other.begin != mine.begin && part.size() > 0) params.refresh_bf16_copy(part);
    }
  }
}

void GradSync::weights_loaded() {
  if (decoder_.resident_gathers()) decoder_.refresh_resident_weights(false);
}

double GradSync::settle_weights() {
  double waited = 0;
  if (decoder_.resident_gathers()) {
    timed(waited, [&] { decoder_.settle_resident_weights(); });
    return waited;
  }
  if (next_post_step_wait_ >= post_step_.size()) return 0;
  timed(waited, [&] { weights_read_at(std::numeric_limits<int32_t>::max()); });
  return waited;
}

}  // namespace keel::train
