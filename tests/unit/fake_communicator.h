// A Communicator for unit tests: every operation does nothing; tests override the ones they watch.
#pragma once
#include <stdexcept>
#include <string>
#include <vector>

#include "keel/distributed/communicator.h"

namespace keel::distributed {

class FakeCommunicator : public Communicator {
 public:
  explicit FakeCommunicator(int size = 2, int rank = 0) : size_(size), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "fake"; }
  Ticket allreduce_sum_async(float*, int64_t, bool, ComputeEvent) override { return 0; }
  Ticket reduce_scatter_sum_async(float*, FlatRange, const std::vector<FlatRange>&, bool, ComputeEvent) override {
    return 0;
  }
  Ticket reduce_scatter_accumulate_async(float*, FlatRange, const std::vector<FlatRange>&, float*, bool,
                                         ComputeEvent) override {
    return 0;
  }
  Ticket allgather_shards_async(float*, const std::vector<FlatRange>&) override { return 0; }
  void send_to_root(const float*, int64_t) override {}
  void receive_piece(int, float*, int64_t) override {}
  void wait(Ticket) override {}
  void allreduce_totals(double*, int64_t) override {}
  void broadcast(void*, int64_t, int) override {}
  void allgather(const void*, void*, int64_t) override {}
  void barrier() override {}
  [[noreturn]] void abort(const std::string& m) override { throw std::runtime_error(m); }

 private:
  int size_, rank_;
};

}  // namespace keel::distributed
