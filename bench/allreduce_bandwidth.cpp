// Raw allreduce bandwidth of this machine's MPI through keel's communicator, as the yardstick for
// gradient synchronisation: run under `mpirun -np N`, prints one JSON line on rank 0 with the
// algorithm bandwidth (bytes / time) and the bus bandwidth (algbw * 2(N-1)/N, the figure that is
// comparable across rank counts, as nccl-tests define it).
//
//   mpirun -np 2 build/bench/allreduce_bandwidth [--mb 25] [--total-mb 512] [--repeats 3] [--zero]
//
// --zero measures what ZeRO-1 moves instead: each bucket reduce-scattered onto the ranks' shards,
// then the whole buffer all-gathered from them (reported separately; the bus bandwidth of each is
// bytes * (N-1)/N / time, as nccl-tests define it for these collectives).
#include <algorithm>
#include <chrono>
#include <functional>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "keel/distributed/communicator.h"

int main(int argc, char** argv) {
  double bucket_mb = 25, total_mb = 512;
  int repeats = 3;
  bool zero = false;
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--zero") {
      zero = true;
      --i;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n", argv[i]);
      return 2;
    }
    if (a == "--mb")
      bucket_mb = std::atof(argv[i + 1]);
    else if (a == "--total-mb")
      total_mb = std::atof(argv[i + 1]);
    else if (a == "--repeats")
      repeats = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
  }
  auto comm = keel::distributed::make_communicator(600);
  const int64_t total = int64_t(total_mb * (1 << 20) / sizeof(float));
  const int64_t bucket = std::max<int64_t>(1, int64_t(bucket_mb * (1 << 20) / sizeof(float)));
  std::vector<float> data(size_t(total), 1.0f);
  auto once = [&] {  // the gradient buffer in buckets, all queued, then waited for: as a step does
    std::vector<keel::distributed::Ticket> tickets;
    for (int64_t off = 0; off < total; off += bucket)
      tickets.push_back(comm->allreduce_sum_async(data.data() + off, std::min(bucket, total - off), false));
    for (auto t : tickets) comm->wait(t);
  };
  const std::vector<keel::FlatRange> shards = keel::shard_ranges(total, comm->size());
  auto reduce_scatter = [&] {
    std::vector<keel::distributed::Ticket> tickets;
    for (int64_t off = 0; off < total; off += bucket)
      tickets.push_back(
          comm->reduce_scatter_sum_async(data.data(), {off, std::min(off + bucket, total)}, shards, false));
    for (auto t : tickets) comm->wait(t);
  };
  auto allgather = [&] { comm->wait(comm->allgather_shards_async(data.data(), shards)); };
  auto best_of = [&](const std::function<void()>& op) {
    op();  // warm-up: connections, registration, page faults
    double best = 1e30;
    for (int r = 0; r < repeats; ++r) {
      comm->barrier();
      const auto t0 = std::chrono::steady_clock::now();
      op();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
  };
  const double bytes = double(total) * sizeof(float), n = comm->size();
  if (zero) {
    const double rs = best_of(reduce_scatter), ag = best_of(allgather);
    if (comm->rank() == 0)
      std::printf(
          "{\"ranks\": %d, \"bytes\": %.0f, \"bucket_bytes\": %.0f, \"reduce_scatter_seconds\": %.6f, "
          "\"reduce_scatter_busbw_GBps\": %.3f, \"allgather_seconds\": %.6f, \"allgather_busbw_GBps\": %.3f, "
          "\"communicator\": \"%s\"}\n",
          comm->size(), bytes, double(bucket) * sizeof(float), rs, bytes * (n - 1) / n / rs / 1e9, ag,
          bytes * (n - 1) / n / ag / 1e9, comm->name().c_str());
    return 0;
  }
  const double best = best_of(once);
  const double algbw = bytes / best;
  if (comm->rank() == 0)
    std::printf(
        "{\"ranks\": %d, \"bytes\": %.0f, \"bucket_bytes\": %.0f, \"seconds\": %.6f, \"algbw_GBps\": %.3f, "
        "\"busbw_GBps\": %.3f, \"communicator\": \"%s\"}\n",
        comm->size(), bytes, double(bucket) * sizeof(float), best, algbw / 1e9,
        n > 1 ? algbw * 2 * (n - 1) / n / 1e9 : 0.0, comm->name().c_str());
  return 0;
}
