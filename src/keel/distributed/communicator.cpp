#include "keel/distributed/communicator.h"

#include <cstdlib>
#include <cstring>

#include "keel/core/error.h"
#include "keel/distributed/mpi_communicator.h"

namespace keel::distributed {
namespace {

class SingleProcess final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "single process"; }
  Ticket allreduce_sum_async(float*, int64_t, bool, ComputeEvent) override { return 0; }
  void wait(Ticket) override {}
  Ticket reduce_scatter_sum_async(float*, FlatRange, const std::vector<FlatRange>&, bool, ComputeEvent) override {
    return 0;
  }
  // The sum over one rank is its contribution: accumulated as it is.
  Ticket reduce_scatter_accumulate_async(float* staged, FlatRange range, const std::vector<FlatRange>& shards,
                                         float* shard_sums, bool, ComputeEvent) override {
    const FlatRange mine = range.intersect(shards.at(0));
    for (int64_t j = mine.begin; j < mine.end; ++j) shard_sums[j - shards[0].begin] += staged[j - range.begin];
    return 0;
  }
  Ticket allgather_shards_async(float*, const std::vector<FlatRange>&) override { return 0; }
  void send_to_root(const float*, int64_t) override { throw Error("send_to_root: a single process is rank 0"); }
  void receive_piece(int source, float*, int64_t) override {
    throw Error("receive_piece: a single process has no rank " + std::to_string(source));
  }
  void allreduce_totals(double*, int64_t) override {}
  void broadcast(void*, int64_t, int) override {}
  void allgather(const void* in, void* out, int64_t bytes) override { std::memcpy(out, in, size_t(bytes)); }
  void barrier() override {}
  [[noreturn]] void abort(const std::string& message) override { throw Error(message); }
};

}  // namespace

bool launched_by_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(var)) return true;
  return false;
}

std::unique_ptr<Communicator> make_communicator(double timeout_s) {
  if (!launched_by_mpi()) return std::make_unique<SingleProcess>();
  return make_mpi_communicator(timeout_s);
}

}  // namespace keel::distributed
