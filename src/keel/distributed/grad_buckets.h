// Gradient buckets (the HCCL_BUFFSIZE / DDP bucket_cap_mb analogue): parameters are grouped, in
// reverse order of their position in the flat gradient buffer (the order the backward pass
// finishes them), into contiguous ranges of about bucket_bytes. When the backward pass has
// produced every gradient of a bucket, its allreduce starts on the communication thread while the
// backward pass goes on; the optimizer waits for all buckets at the end. Under ZeRO-1 the
// allreduce becomes a reduce-scatter onto the ranks' shards (half the traffic of an allreduce).
// Under ZeRO-2 there is no whole gradient buffer: each bucket lies inside one staging buffer (the
// decoder's gradient groups; buckets never cross a group's start) and is reduce-scattered from it
// into this rank's accumulated shard, every micro-batch.
#pragma once
#include <cstdint>
#include <vector>

#include "keel/distributed/communicator.h"

namespace keel::distributed {

struct ParamSpan {
  int64_t offset = 0, count = 0;  // elements in the flat gradient buffer
};

struct Bucket {
  int64_t offset = 0, count = 0;        // a contiguous range of the flat gradient buffer
  int first_param = 0, last_param = 0;  // [first, last] parameter indices it covers
  int pending = 0;                      // parameters whose gradient is not final yet this step
  Ticket ticket = 0;
  bool started = false;
  ComputeEvent ready;  // the latest event that wrote one of its gradients this step
};

class GradBuckets {
 public:
  // spans: every parameter's range, in flat-buffer order (contiguous, padding allowed between).
  // With `zero_shards` (ZeRO-1: one range of the flat buffer per rank, kept alive by the caller)
  // each bucket is reduce-scattered instead of all-reduced: a rank ends up with the summed
  // gradients of its own shard only, the rest of the buffer is left undefined.
  // `group_starts`: parameters that begin a new bucket whatever its size (ZeRO-2's groups).
  GradBuckets(const std::vector<ParamSpan>& spans, int64_t bucket_bytes,
              const std::vector<FlatRange>* zero_shards = nullptr, const std::vector<int>& group_starts = {});
  // Starts a step's synchronisation: nothing is ready.
  void begin(float* grads, Communicator& comm, bool deterministic);
  // ZeRO-2: starts a micro-batch's synchronisation. Parameter p's gradient is at param_grads[p]
  // (a bucket's gradients are contiguous from its first parameter's); each bucket's reduced shard
  // part is added to shard_sums. `param_grads` stays alive while the buckets are used. `blocking`:
  // each bucket's reduction is waited for as soon as it starts (no overlap with compute).
  void begin_staged(const std::vector<float*>& param_grads, float* shard_sums, Communicator& comm, bool deterministic,
                    bool blocking);
  // Waits for the buckets holding parameters [first, last], starting any that has not started.
  void wait_params(int first, int last);
  // The gradient of `param` is final for this step once `ready` (the compute event that wrote it)
  // has passed; starts its bucket's allreduce, after the bucket's latest event, if it completes one.
  void param_ready(int param, ComputeEvent ready = {});
  // Starts whatever has not started (params that never reported), then waits for every bucket.
  void finish();
  const std::vector<Bucket>& buckets() const { return buckets_; }

 private:
  void start(Bucket& b);
  void reset(Communicator& comm, bool deterministic);
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_param_;
  float* grads_ = nullptr;
  const std::vector<float*>* param_grads_ = nullptr;  // ZeRO-2
  float* shard_sums_ = nullptr;
  bool blocking_ = false;
  Communicator* comm_ = nullptr;
  bool deterministic_ = false;
  const std::vector<FlatRange>* zero_shards_ = nullptr;
};

}  // namespace keel::distributed
