// Raw allreduce bandwidth of this machine's MPI through keel's communicator, as the yardstick for
// gradient synchronisation: run under `mpirun -np N`, prints one JSON line on rank 0 with the
// algorithm bandwidth (bytes / time) and the bus bandwidth (algbw * 2(N-1)/N, the figure that is
// comparable across rank counts, as nccl-tests define it).
//
//   mpirun -np 2 build/bench/allreduce_bandwidth [--mb 25] [--total-mb 512] [--repeats 3]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "keel/dist/communicator.h"

int main(int argc, char** argv) {
  double bucket_mb = 25, total_mb = 512;
  int repeats = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--mb") bucket_mb = std::atof(argv[i + 1]);
    else if (a == "--total-mb") total_mb = std::atof(argv[i + 1]);
    else if (a == "--repeats") repeats = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
  }
  auto comm = keel::dist::make_communicator(600);
  const int64_t total = int64_t(total_mb * (1 << 20) / sizeof(float));
  const int64_t bucket = std::max<int64_t>(1, int64_t(bucket_mb * (1 << 20) / sizeof(float)));
  std::vector<float> data(size_t(total), 1.0f);
  auto once = [&] {  // the gradient buffer in buckets, all queued, then waited for: as a step does
    std::vector<keel::dist::Ticket> tickets;
    for (int64_t off = 0; off < total; off += bucket)
      tickets.push_back(comm->allreduce_sum_async(data.data() + off, std::min(bucket, total - off), false));
    for (auto t : tickets) comm->wait(t);
  };
  once();  // warm-up: connections, registration, page faults
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    comm->barrier();
    const auto t0 = std::chrono::steady_clock::now();
    once();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const double bytes = double(total) * sizeof(float), n = comm->size();
  const double algbw = bytes / best;
  if (comm->rank() == 0)
    std::printf("{\"ranks\": %d, \"bytes\": %.0f, \"bucket_bytes\": %.0f, \"seconds\": %.6f, \"algbw_GBps\": %.3f, "
                "\"busbw_GBps\": %.3f, \"communicator\": \"%s\"}\n",
                comm->size(), bytes, double(bucket) * sizeof(float), best, algbw / 1e9,
                n > 1 ? algbw * 2 * (n - 1) / n / 1e9 : 0.0, comm->name().c_str());
  return 0;
}
