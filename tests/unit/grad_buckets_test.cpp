// Gradient buckets: reverse-order grouping under the size cap, every parameter in exactly one
// bucket, and allreduces started as soon as a bucket's last gradient is ready, in the same order
// on every rank.
#include "keel/distributed/grad_buckets.h"

#include <gtest/gtest.h>

#include <vector>

#include "fake_communicator.h"

namespace keel::distributed {
namespace {

// Records which ranges were submitted, in order.
class RecordingCommunicator final : public FakeCommunicator {
 public:
  std::vector<std::pair<int64_t, int64_t>> submitted;  // (offset from base, count)
  std::vector<FlatRange> scattered;                    // reduce-scatters (ZeRO-1)
  std::vector<uint64_t> after;                         // each collective's compute event
  float* base = nullptr;
  Ticket allreduce_sum_async(float* data, int64_t n, bool, ComputeEvent ready) override {
    submitted.push_back({data - base, n});
    after.push_back(ready.sequence);
    return submitted.size();
  }
  Ticket reduce_scatter_sum_async(float* data, FlatRange range, const std::vector<FlatRange>&, bool,
                                  ComputeEvent ready) override {
    EXPECT_EQ(data, base);  // ranges are offsets into the whole gradient buffer
    scattered.push_back(range);
    after.push_back(ready.sequence);
    return scattered.size();
  }
  struct Staged {
    const float* from;
    FlatRange range;
    float* into;
  };
  std::vector<Staged> staged;  // ZeRO-2's reductions from staging buffers
  std::vector<Ticket> waited;
  Ticket reduce_scatter_accumulate_async(float* from, FlatRange range, const std::vector<FlatRange>&, float* into,
                                         bool, ComputeEvent) override {
    staged.push_back({from, range, into});
    return staged.size();
  }
  void wait(Ticket t) override { waited.push_back(t); }
};

std::vector<ParamSpan> spans_of(const std::vector<int64_t>& sizes) {
  std::vector<ParamSpan> spans;
  int64_t offset = 0;
  for (int64_t n : sizes) {
    spans.push_back({offset, n});
    offset += (n + 15) / 16 * 16;  // padded like the ParamStore
  }
  return spans;
}

TEST(GradBuckets, GroupsFromTheEndUnderTheCap) {
  auto spans = spans_of({100, 40, 40, 40, 200, 10});
  GradBuckets buckets(spans, 100 * sizeof(float));
  const auto& b = buckets.buckets();
  // From the back: {5} alone? 10 + 200 > 100, so {5}; {4} (200 > cap, alone); {2,3} (80); {1}... {0,1}? 100+40 > 100.
  ASSERT_EQ(b.size(), 5u);
  EXPECT_EQ(b[0].first_param, 5);
  EXPECT_EQ(b[1].first_param, 4);
  EXPECT_EQ(b[2].first_param, 2);
  EXPECT_EQ(b[2].last_param, 3);
  EXPECT_EQ(b[3].first_param, 1);
  EXPECT_EQ(b[4].first_param, 0);
  // Buckets tile the parameters: each covers its parameters' spans contiguously.
  int covered = 0;
  for (const auto& bucket : b) {
    covered += bucket.last_param - bucket.first_param + 1;
    EXPECT_EQ(bucket.offset, spans[bucket.first_param].offset);
    EXPECT_EQ(bucket.offset + bucket.count, spans[bucket.last_param].offset + spans[bucket.last_param].count);
  }
  EXPECT_EQ(covered, 6);
}

TEST(GradBuckets, StartsABucketWhenItsLastGradientIsReady) {
  auto spans = spans_of({16, 16, 16, 16});
  GradBuckets buckets(spans, 32 * sizeof(float));  // {2,3}, {0,1}
  std::vector<float> grads(64);
  RecordingCommunicator comm;
  comm.base = grads.data();
  buckets.begin(grads.data(), comm, false);
  buckets.param_ready(3);
  EXPECT_TRUE(comm.submitted.empty());
  buckets.param_ready(2);
  ASSERT_EQ(comm.submitted.size(), 1u);
  EXPECT_EQ(comm.submitted[0], std::make_pair(int64_t(32), int64_t(32)));
  buckets.param_ready(1);
  buckets.finish();  // starts {0,1} although param 0 never reported
  ASSERT_EQ(comm.submitted.size(), 2u);
  EXPECT_EQ(comm.submitted[1], std::make_pair(int64_t(0), int64_t(32)));
}

// A device backend's gradients are final only once its stream passes the event that wrote them:
// each bucket's collective carries the latest event of its parameters.
TEST(GradBuckets, ACollectiveWaitsForTheLatestEventOfItsBucket) {
  auto spans = spans_of({16, 16, 16, 16});
  GradBuckets buckets(spans, 32 * sizeof(float));  // {2,3}, {0,1}
  std::vector<float> grads(64);
  RecordingCommunicator comm;
  comm.base = grads.data();
  buckets.begin(grads.data(), comm, false);
  buckets.param_ready(3, ComputeEvent{7});
  buckets.param_ready(2, ComputeEvent{5});  // reported later, written earlier: 7 still stands
  buckets.param_ready(1, ComputeEvent{9});
  buckets.param_ready(0, ComputeEvent{12});
  buckets.finish();
  EXPECT_EQ(comm.after, (std::vector<uint64_t>{7, 12}));
}

TEST(GradBuckets, ZeroOneReduceScattersEachBucketOntoTheShards) {
  auto spans = spans_of({16, 16, 16, 16});
  const std::vector<FlatRange> shards = shard_ranges(64, 2);
  GradBuckets buckets(spans, 32 * sizeof(float), &shards);
  std::vector<float> grads(64);
  RecordingCommunicator comm;
  comm.base = grads.data();
  buckets.begin(grads.data(), comm, false);
  for (int p = 3; p >= 0; --p) buckets.param_ready(p);
  buckets.finish();
  EXPECT_TRUE(comm.submitted.empty());  // no allreduce at all
  ASSERT_EQ(comm.scattered.size(), 2u);
  EXPECT_EQ(comm.scattered[0].begin, 32);
  EXPECT_EQ(comm.scattered[0].end, 64);
  EXPECT_EQ(comm.scattered[1].begin, 0);
  EXPECT_EQ(comm.scattered[1].end, 32);
}

// ZeRO-2: buckets never cross the start of a gradient group (each lies in one staging buffer),
// reduce from where each bucket's first parameter is staged into the shard, and a group's buckets
// can be waited for on their own; blocking buckets are waited for as they start.
TEST(GradBuckets, ZeroTwoReducesEachGroupsBucketsFromItsStaging) {
  auto spans = spans_of({16, 16, 16, 16, 16});
  const std::vector<FlatRange> shards = shard_ranges(80, 2);
  GradBuckets buckets(spans, 64 * sizeof(float), &shards, {0, 3});  // groups {0,1,2}, {3,4}
  const auto& b = buckets.buckets();
  ASSERT_EQ(b.size(), 2u) << "the cap would take 4 parameters; the group start cuts at 3";
  EXPECT_EQ(b[0].first_param, 3);
  EXPECT_EQ(b[1].first_param, 0);
  EXPECT_EQ(b[1].last_param, 2);
  std::vector<float> group_a(48), group_b(32), shard(40);
  const std::vector<float*> at = {group_a.data(), group_a.data() + 16, group_a.data() + 32, group_b.data(),
                                  group_b.data() + 16};
  RecordingCommunicator comm;
  buckets.begin_staged(at, shard.data(), comm, false, /*blocking=*/false);
  buckets.param_ready(4);
  buckets.param_ready(3);
  ASSERT_EQ(comm.staged.size(), 1u);
  EXPECT_EQ(comm.staged[0].from, group_b.data());
  EXPECT_EQ(comm.staged[0].range.begin, 48);
  EXPECT_EQ(comm.staged[0].range.end, 80);
  EXPECT_EQ(comm.staged[0].into, shard.data());
  EXPECT_TRUE(comm.waited.empty());
  buckets.wait_params(3, 4);
  EXPECT_EQ(comm.waited, (std::vector<Ticket>{1}));
  buckets.wait_params(0, 2);  // not ready yet: started now, then waited for
  ASSERT_EQ(comm.staged.size(), 2u);
  EXPECT_EQ(comm.staged[1].from, group_a.data());
  EXPECT_EQ(comm.waited, (std::vector<Ticket>{1, 2}));

  RecordingCommunicator blocking;
  buckets.begin_staged(at, shard.data(), blocking, false, /*blocking=*/true);
  buckets.param_ready(4);
  buckets.param_ready(3);
  EXPECT_EQ(blocking.waited, (std::vector<Ticket>{1}));
}

TEST(ShardRanges, CoverTheBufferInAlignedNearEqualParts) {
  for (int64_t total : {16, 64, 1000 * 16, 12345 * 16}) {
    for (int ranks : {1, 2, 3, 4, 7}) {
      const auto shards = shard_ranges(total, ranks);
      ASSERT_EQ(shards.size(), size_t(ranks));
      EXPECT_EQ(shards.front().begin, 0);
      EXPECT_EQ(shards.back().end, total);
      for (int r = 0; r < ranks; ++r) {
        EXPECT_EQ(shards[size_t(r)].begin % 16, 0);
        EXPECT_LE(shards[size_t(r)].size(), shards[0].size());  // shard 0 is the largest: every rank plans it
        EXPECT_GE(shards[size_t(r)].size(), shards[0].size() - 16);
        if (r > 0) {
          EXPECT_EQ(shards[size_t(r)].begin, shards[size_t(r) - 1].end);
        }
      }
    }
  }
}

}  // namespace
}  // namespace keel::distributed
