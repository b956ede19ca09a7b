// Gradient buckets (the HCCL_BUFFSIZE / DDP bucket_cap_mb analogue): parameters are grouped, in
// reverse order of their position in the flat gradient buffer (the order the backward pass
// finishes them), into contiguous ranges of about bucket_bytes. When the backward pass has
// produced every gradient of a bucket, its allreduce starts on the communication thread while the
// backward pass goes on; the optimizer waits for all buckets at the end.
#pragma once
#include <cstdint>
#include <vector>

#include "keel/dist/communicator.h"

namespace keel::dist {

struct ParamSpan {
  int64_t offset = 0, count = 0;  // elements in the flat gradient buffer
};

struct Bucket {
  int64_t offset = 0, count = 0;  // a contiguous range of the flat gradient buffer
  int first_param = 0, last_param = 0;  // [first, last] parameter indices it covers
  int pending = 0;                // parameters whose gradient is not final yet this step
  Ticket ticket = 0;
  bool started = false;
};

class GradBuckets {
 public:
  // spans: every parameter's range, in flat-buffer order (contiguous, padding allowed between).
  GradBuckets(const std::vector<ParamSpan>& spans, int64_t bucket_bytes);
  // Starts a step's synchronisation: nothing is ready.
  void begin(float* grads, Communicator& comm, bool deterministic);
  // The gradient of `param` is final for this step; starts its bucket's allreduce if it completes one.
  void param_ready(int param);
  // Starts whatever has not started (params that never reported), then waits for every bucket.
  void finish();
  const std::vector<Bucket>& buckets() const { return buckets_; }

 private:
  void start(Bucket& b);
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_param_;
  float* grads_ = nullptr;
  Communicator* comm_ = nullptr;
  bool deterministic_ = false;
};

}  // namespace keel::dist
