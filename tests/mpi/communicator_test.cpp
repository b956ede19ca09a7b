// The MPI communicator's collectives checked element by element under `mpirun -np 2` (or more):
// buffers span several of its reduction pieces (kMessagePiece) with ragged ends, so the piece
// loops, the ZeRO shard boundaries inside a bucket and both reduction modes are all exercised.
// The integration tests train models too small to reach a piece boundary.
//
// Values are small integers, exact in float whatever the order of addition. Every rank runs every
// collective even after a failed check (so no rank hangs), then exits non-zero if any check failed.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "keel/core/flat_range.h"
#include "keel/distributed/communicator.h"
#include "keel/distributed/mpi_communicator.h"
#include "keel/distributed/shard_reader.h"

namespace {

using keel::FlatRange;
using keel::distributed::Communicator;

int failures = 0;

// Reports the first element where got != want(i) over `range`.
template <class Want>
void expect_range(const Communicator& comm, const std::string& what, const float* got, FlatRange range, Want want) {
  for (int64_t i = range.begin; i < range.end; ++i) {
    if (got[i] != want(i)) {
      std::fprintf(stderr, "rank %d: %s: element %lld is %g, expected %g\n", comm.rank(), what.c_str(),
                   static_cast<long long>(i), double(got[i]), double(want(i)));
      ++failures;
      return;
    }
  }
}

float contribution(int64_t i, int rank) { return float(i % 4093) + 1000.0f * float(rank); }

float sum_over_ranks(int64_t i, int ranks) {
  float s = 0;
  for (int r = 0; r < ranks; ++r) s += contribution(i, r);
  return s;
}

void fill(std::vector<float>& data, int rank) {
  for (size_t i = 0; i < data.size(); ++i) data[i] = contribution(int64_t(i), rank);
}

void test_allreduce(Communicator& comm, bool deterministic) {
  const int64_t n = 2 * keel::distributed::kMessagePiece + 1237;  // two whole pieces and a ragged tail
  std::vector<float> data(static_cast<size_t>(n));
  fill(data, comm.rank());
  comm.allreduce_sum_and_wait(data.data(), n, deterministic);
  expect_range(comm, std::string("allreduce") + (deterministic ? " (deterministic)" : ""), data.data(), {0, n},
               [&](int64_t i) { return sum_over_ranks(i, comm.size()); });
}

void test_reduce_scatter(Communicator& comm, bool deterministic) {
  const int64_t total = 3 * keel::distributed::kMessagePiece + 50;
  const std::vector<FlatRange> shards = keel::shard_ranges(total, comm.size());
  const FlatRange mine = shards[size_t(comm.rank())];
  std::vector<float> data(static_cast<size_t>(total));
  fill(data, comm.rank());
  // Two buckets as GradBuckets makes them: the tail first, then the rest; both cross a shard
  // boundary and piece boundaries.
  const FlatRange tail{keel::distributed::kMessagePiece / 2 + 3, total}, head{0, tail.begin};
  comm.wait(comm.reduce_scatter_sum_async(data.data(), tail, shards, deterministic));
  comm.wait(comm.reduce_scatter_sum_async(data.data(), head, shards, deterministic));
  expect_range(comm, std::string("reduce-scatter") + (deterministic ? " (deterministic)" : ""), data.data(), mine,
               [&](int64_t i) { return sum_over_ranks(i, comm.size()); });
}

// ZeRO-2: two buckets reduced from their own staging buffers (holding only their range) into the
// rank's shard, twice (two micro-batches): the shard accumulates both sums; the sums' accumulator
// outside this rank's part of each range is left alone.
void test_reduce_scatter_accumulate(Communicator& comm, bool deterministic) {
  const int64_t total = 3 * keel::distributed::kMessagePiece + 50;
  const std::vector<FlatRange> shards = keel::shard_ranges(total, comm.size());
  const FlatRange mine = shards[size_t(comm.rank())];
  std::vector<float> sums(size_t(mine.size()), 0.5f);
  const FlatRange tail{keel::distributed::kMessagePiece / 2 + 3, total}, head{0, tail.begin};
  for (int micro = 0; micro < 2; ++micro)
    for (FlatRange bucket : {tail, head}) {
      std::vector<float> staged(size_t(bucket.size()));
      for (int64_t i = bucket.begin; i < bucket.end; ++i) staged[size_t(i - bucket.begin)] = contribution(i, comm.rank());
      comm.wait(comm.reduce_scatter_accumulate_async(staged.data(), bucket, shards, sums.data(), deterministic));
    }
  std::vector<float> whole(size_t(total), 0.0f);
  std::copy(sums.begin(), sums.end(), whole.begin() + mine.begin);
  expect_range(comm, std::string("reduce-scatter into the shard (ZeRO-2)") + (deterministic ? " (deterministic)" : ""),
               whole.data(), mine, [&](int64_t i) { return 0.5f + 2.0f * sum_over_ranks(i, comm.size()); });
}

void test_allgather(Communicator& comm) {
  const int64_t total = 2 * keel::distributed::kMessagePiece + 333;
  const std::vector<FlatRange> shards = keel::shard_ranges(total, comm.size());
  const FlatRange mine = shards[size_t(comm.rank())];
  auto owner_value = [](int64_t i) { return float(i % 8191) - 77.0f; };
  std::vector<float> data(size_t(total), -1.0f);
  for (int64_t i = mine.begin; i < mine.end; ++i) data[size_t(i)] = owner_value(i);
  comm.wait(comm.allgather_shards_async(data.data(), shards));
  expect_range(comm, "all-gather of shards", data.data(), {0, total}, owner_value);
}

// ZeRO-1 checkpoints: every rank streams its shards of two buffers to rank 0, which reads both
// whole through ShardReader, piece by piece.
void test_shards_to_root(Communicator& comm) {
  const int64_t total = 3 * keel::distributed::kMessagePiece + 4321;
  const std::vector<FlatRange> shards = keel::shard_ranges(total, comm.size());
  const FlatRange mine = shards[size_t(comm.rank())];
  auto stream_value = [](int stream, int64_t i) { return float(i % 8191) + (stream == 0 ? 0.5f : -0.5f); };
  std::vector<float> m(static_cast<size_t>(mine.size())), v(static_cast<size_t>(mine.size()));
  for (int64_t i = 0; i < mine.size(); ++i) {
    m[size_t(i)] = stream_value(0, mine.begin + i);
    v[size_t(i)] = stream_value(1, mine.begin + i);
  }
  if (comm.rank() != 0) {
    comm.send_to_root(m.data(), mine.size());
    comm.send_to_root(v.data(), mine.size());
    return;
  }
  keel::distributed::ShardReader reader(comm, shards, {m.data(), v.data()});
  std::vector<float> whole(static_cast<size_t>(total));
  for (int stream = 0; stream < 2; ++stream) {
    for (int64_t begin = 0, n = 0; begin < total; begin += n) {
      const float* p = reader.read(stream, begin, 1 << 20, &n);
      std::copy_n(p, n, whole.data() + begin);
    }
    expect_range(comm, stream == 0 ? "shards of m streamed to rank 0" : "shards of v streamed to rank 0", whole.data(),
                 {0, total}, [&](int64_t i) { return stream_value(stream, i); });
  }
  reader.drain();
}

void test_step_totals(Communicator& comm) {
  double totals[2] = {1.5 + comm.rank(), 1e12};
  comm.allreduce_totals(totals, 2);
  const double n = comm.size();
  if (totals[0] != 1.5 * n + n * (n - 1) / 2 || totals[1] != 1e12 * n) {
    std::fprintf(stderr, "rank %d: allreduce of doubles: got %g, %g\n", comm.rank(), totals[0], totals[1]);
    ++failures;
  }
}

}  // namespace

int main() {
  if (!keel::distributed::launched_by_mpi()) {
    std::fprintf(stderr, "run under mpirun with 2 or more ranks\n");
    return 2;
  }
  auto comm = keel::distributed::make_communicator(120);
  if (comm->size() < 2) {
    std::fprintf(stderr, "run under mpirun with 2 or more ranks (got %d)\n", comm->size());
    return 2;
  }
  for (bool deterministic : {false, true}) {
    test_allreduce(*comm, deterministic);
    test_reduce_scatter(*comm, deterministic);
    test_reduce_scatter_accumulate(*comm, deterministic);
  }
  test_allgather(*comm);
  test_shards_to_root(*comm);
  test_step_totals(*comm);
  // Every rank's verdict: a failure on any rank fails every rank (and the mpirun exit status).
  double failed = failures;
  comm->allreduce_totals(&failed, 1);
  if (comm->rank() == 0)
    std::printf("%s: %d ranks, %.0f failed check(s)\n", failed == 0 ? "PASS" : "FAIL", comm->size(), failed);
  return failed == 0 ? 0 : 1;
}
