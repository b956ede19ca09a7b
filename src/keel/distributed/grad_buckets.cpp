#include "keel/distributed/grad_buckets.h"

#include "keel/core/error.h"

namespace keel::distributed {

GradBuckets::GradBuckets(const std::vector<ParamSpan>& spans, int64_t bucket_bytes,
                         const std::vector<FlatRange>* zero_shards, const std::vector<int>& group_starts)
    : zero_shards_(zero_shards) {
  require(!spans.empty(), "gradient buckets: no parameters");
  std::vector<bool> starts_group(spans.size(), false);
  for (int p : group_starts) starts_group.at(size_t(p)) = true;
  const int64_t cap = std::max<int64_t>(1, bucket_bytes / int64_t(sizeof(float)));
  bucket_of_param_.assign(spans.size(), -1);
  // Walk from the last parameter backwards: the LM head and last layers finish first.
  int last = int(spans.size()) - 1;
  while (last >= 0) {
    int first = last;
    int64_t size = spans[last].count;
    while (first > 0 && !starts_group[size_t(first)] && size + spans[first - 1].count <= cap)
      size += spans[--first].count;
    Bucket b;
    b.first_param = first;
    b.last_param = last;
    b.offset = spans[first].offset;
    b.count = spans[last].offset + spans[last].count - b.offset;  // includes alignment padding: harmless zeros
    for (int p = first; p <= last; ++p) bucket_of_param_[p] = int(buckets_.size());
    buckets_.push_back(b);
    last = first - 1;
  }
}

void GradBuckets::begin(float* grads, Communicator& comm, bool deterministic) {
  grads_ = grads;
  param_grads_ = nullptr;
  reset(comm, deterministic);
  blocking_ = false;
}

void GradBuckets::begin_staged(const std::vector<float*>& param_grads, float* shard_sums, Communicator& comm,
                               bool deterministic, bool blocking) {
  require(zero_shards_ && param_grads.size() == bucket_of_param_.size(),
          "gradient buckets: staged gradients need ZeRO shards and one address per parameter");
  grads_ = nullptr;
  param_grads_ = &param_grads;
  shard_sums_ = shard_sums;
  reset(comm, deterministic);
  blocking_ = blocking;
}

void GradBuckets::reset(Communicator& comm, bool deterministic) {
  comm_ = &comm;
  deterministic_ = deterministic;
  for (auto& b : buckets_) {
    b.pending = b.last_param - b.first_param + 1;
    b.started = false;
    b.ticket = 0;
  }
}

void GradBuckets::start(Bucket& b) {
  b.started = true;
  if (param_grads_) {
    b.ticket = comm_->reduce_scatter_accumulate_async((*param_grads_)[size_t(b.first_param)],
                                                      {b.offset, b.offset + b.count}, *zero_shards_, shard_sums_,
                                                      deterministic_, b.ready);
    if (blocking_) comm_->wait(b.ticket);
    return;
  }
  b.ticket = zero_shards_ ? comm_->reduce_scatter_sum_async(grads_, {b.offset, b.offset + b.count}, *zero_shards_,
                                                            deterministic_, b.ready)
                          : comm_->allreduce_sum_async(grads_ + b.offset, b.count, deterministic_, b.ready);
}

void GradBuckets::param_ready(int param, ComputeEvent ready) {
  Bucket& b = buckets_[bucket_of_param_[param]];
  if (ready.sequence > b.ready.sequence) b.ready = ready;
  if (--b.pending == 0 && !b.started) start(b);
}

void GradBuckets::wait_params(int first, int last) {
  // Buckets run in reverse parameter order: the last parameter's bucket comes first.
  const int from = bucket_of_param_.at(size_t(last)), to = bucket_of_param_.at(size_t(first));
  for (int i = from; i <= to; ++i)
    if (!buckets_[size_t(i)].started) start(buckets_[size_t(i)]);
  for (int i = from; i <= to; ++i) comm_->wait(buckets_[size_t(i)].ticket);
}

void GradBuckets::finish() {
  // Start stragglers in bucket order (identical on every rank, so collectives match up).
  for (auto& b : buckets_)
    if (!b.started) start(b);
  for (auto& b : buckets_) comm_->wait(b.ticket);
}

}  // namespace keel::distributed
