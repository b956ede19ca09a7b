// MPI is called from one thread only (the communication thread), so MPI_THREAD_FUNNELED suffices
// and works with every MPI build. The training thread queues work and waits on tickets; a wait
// that exceeds the timeout means a peer died or hangs, and the job is aborted with a message
// naming the operation (Open MPI's launcher then names the rank that failed).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "keel/core/error.h"
#include "keel/dist/mpi_communicator.h"

namespace keel::dist {
namespace {

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(double timeout_s) : timeout_s_(timeout_s) {
    worker_ = std::thread([this] { loop(); });
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [this] { return initialized_; });
    require(init_error_.empty(), "MPI: {}", init_error_);
  }

  ~MpiCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return name_; }

  Ticket allreduce_sum_async(float* data, int64_t n, bool deterministic) override {
    return submit("allreduce of " + std::to_string(n) + " gradients", [this, data, n, deterministic] {
      for_each_chunk(data, n, kReducePiece, [&](float* p, int count) {
        if (deterministic)
          ordered_sum(p, count);
        else
          check(MPI_Allreduce(MPI_IN_PLACE, p, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD), "MPI_Allreduce");
      });
    });
  }

  Ticket reduce_scatter_sum_async(float* data, FlatRange range, const std::vector<FlatRange>& shards,
                                  bool deterministic) override {
    return submit("reduce-scatter of " + std::to_string(range.size()) + " gradients",
                  [this, data, range, &shards, deterministic] {
                    if (deterministic) {
                      // Pieces of kReducePiece elements in all: bounded scratch, int counts and displacements.
                      const int64_t piece = std::max<int64_t>(1, kReducePiece / size_);
                      for (int64_t b = range.begin; b < range.end; b += piece)
                        ordered_reduce_scatter(data, {b, std::min(b + piece, range.end)}, shards);
                      return;
                    }
                    // Open MPI 4.1's MPI_Reduce_scatter is slower here than its MPI_Allreduce of the whole
                    // range (shared memory, 2 ranks, 418 MB in 25 MB buckets: 0.15-0.17 s against
                    // 0.11 s, bench/allreduce_bandwidth --zero), although it moves half the bytes; so
                    // the range is all-reduced and this rank keeps its part. A transport whose
                    // reduce-scatter is cheaper (NCCL, HCCL) implements this interface with it.
                    for_each_chunk(data + range.begin, range.size(), kReducePiece, [&](float* p, int count) {
                      check(MPI_Allreduce(MPI_IN_PLACE, p, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD), "MPI_Allreduce");
                    });
                  });
  }

  // Each rank broadcasts its shard in turn: at two ranks the same traffic as a ring all-gather, and
  // no int displacement limits the size of the buffer.
  Ticket allgather_shards_async(float* data, const std::vector<FlatRange>& shards) override {
    return submit("all-gather of the updated weights", [this, data, &shards] {
      for (int q = 0; q < size_; ++q)
        for_each_chunk(data + shards[size_t(q)].begin, shards[size_t(q)].size(), kMaxCount, [&](float* p, int count) {
          check(MPI_Bcast(p, count, MPI_FLOAT, q, MPI_COMM_WORLD), "MPI_Bcast");
        });
    });
  }

  void send_to_root(const float* data, int64_t n) override {
    wait(submit("sending this rank's optimizer-state shard to rank 0", [this, data, n] {
      for_each_chunk(data, n, kShardPiece, [&](const float* p, int count) {
        check(MPI_Send(p, count, MPI_FLOAT, 0, kShardTag, MPI_COMM_WORLD), "MPI_Send");
      });
    }));
  }

  void receive_piece(int source, float* out, int64_t count) override {
    wait(submit(fmt::format("receiving rank {}'s optimizer-state shard", source), [this, source, out, count] {
      MPI_Status status;
      check(MPI_Recv(out, int(count), MPI_FLOAT, source, kShardTag, MPI_COMM_WORLD, &status), "MPI_Recv");
      int received = 0;
      MPI_Get_count(&status, MPI_FLOAT, &received);
      require(received == count, "rank {}: expected a piece of {} floats from rank {}, received {}", rank_, count,
              source, received);
    }));
  }

  void wait(Ticket ticket) override {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
    while (completed_ < ticket) {
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && completed_ < ticket) {
        const std::string what = pending_name_;
        lock.unlock();
        abort(fmt::format("rank {}: '{}' did not complete within {} s: another rank died or hangs "
                          "(raise comm_timeout_s if steps are legitimately slower){}",
                          rank_, what, timeout_s_, wait_context_.empty() ? "" : ". " + wait_context_));
      }
    }
    if (!failure_.empty()) abort(failure_);
  }

  void allreduce_sum(double* data, int64_t n) override {
    wait(submit("allreduce of step totals", [this, data, n] {
      std::vector<double> all(size_t(n) * size_);
      check(MPI_Allgather(data, int(n), MPI_DOUBLE, all.data(), int(n), MPI_DOUBLE, MPI_COMM_WORLD), "MPI_Allgather");
      for (int64_t i = 0; i < n; ++i) {
        double sum = 0;
        for (int r = 0; r < size_; ++r) sum += all[size_t(r) * n + i];  // rank order: identical everywhere
        data[i] = sum;
      }
    }));
  }

  void broadcast(void* data, int64_t bytes, int root) override {
    wait(submit("broadcast", [this, data, bytes, root] { check(MPI_Bcast(data, int(bytes), MPI_BYTE, root, MPI_COMM_WORLD), "MPI_Bcast"); }));
  }

  void allgather(const void* in, void* out, int64_t bytes) override {
    wait(submit("allgather", [this, in, out, bytes] {
      check(MPI_Allgather(in, int(bytes), MPI_BYTE, out, int(bytes), MPI_BYTE, MPI_COMM_WORLD), "MPI_Allgather");
    }));
  }

  void barrier() override {
    wait(submit("barrier", [this] { check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier"); }));
  }

  // Exiting without MPI_Finalize makes the launcher (mpirun) terminate every other rank and
  // report which one failed; MPI_Abort would need the MPI thread, which may be the stuck one.
  [[noreturn]] void abort(const std::string& message) override {
    fmt::print(stderr, "error: {}\n", message);
    std::fflush(stderr);
    std::_Exit(2);
  }

 private:
  void check(int rc, const char* what) {
    if (rc != MPI_SUCCESS) throw Error(fmt::format("rank {}: {} failed (MPI error {})", rank_, what, rc));
  }

  // Fixed-order sum: gather every rank's contribution, add them in rank order.
  void ordered_sum(float* data, int n) {
    gather_buffer_.resize(size_t(n) * size_t(size_));
    check(MPI_Allgather(data, n, MPI_FLOAT, gather_buffer_.data(), n, MPI_FLOAT, MPI_COMM_WORLD), "MPI_Allgather");
    for (int i = 0; i < n; ++i) {
      float sum = gather_buffer_[size_t(i)];
      for (int r = 1; r < size_; ++r) sum += gather_buffer_[size_t(r) * n + i];
      data[i] = sum;
    }
  }

  // Rank-ordered reduce-scatter of `range` (at most kReducePiece / size elements): every rank sends
  // each other rank that rank's part (all-to-all), then adds the received contributions in rank
  // order into its own part.
  void ordered_reduce_scatter(float* data, FlatRange range, const std::vector<FlatRange>& shards) {
    const FlatRange mine = range.intersect(shards[size_t(rank_)]);
    counts_.resize(size_t(size_));
    offsets_.resize(size_t(size_));
    for (int q = 0; q < size_; ++q) {
      const FlatRange part = range.intersect(shards[size_t(q)]);
      counts_[size_t(q)] = int(part.size());
      offsets_[size_t(q)] = part.size() > 0 ? int(part.begin - range.begin) : 0;
    }
    const int m = int(mine.size());
    gather_buffer_.resize(size_t(m) * size_t(size_));
    receive_counts_.assign(size_t(size_), m);
    receive_offsets_.resize(size_t(size_));
    for (int q = 0; q < size_; ++q) receive_offsets_[size_t(q)] = q * m;  // m * size <= kReducePiece
    check(MPI_Alltoallv(data + range.begin, counts_.data(), offsets_.data(), MPI_FLOAT, gather_buffer_.data(),
                        receive_counts_.data(), receive_offsets_.data(), MPI_FLOAT, MPI_COMM_WORLD),
          "MPI_Alltoallv");
    for (int i = 0; i < m; ++i) {
      float sum = gather_buffer_[size_t(i)];
      for (int q = 1; q < size_; ++q) sum += gather_buffer_[size_t(q) * size_t(m) + size_t(i)];
      data[mine.begin + i] = sum;
    }
  }

  // Calls f(pointer, count) over p[0, n) in pieces of at most `limit` elements (<= kMaxCount).
  template <class T, class F>
  static void for_each_chunk(T* p, int64_t n, int64_t limit, F&& f) {
    for (int64_t done = 0; done < n;) {
      const int count = int(std::min<int64_t>(n - done, limit));
      f(p + done, count);
      done += count;
    }
  }

  Ticket submit(std::string what, std::function<void()> op) {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back({++submitted_, std::move(what), std::move(op)});
    cv_.notify_all();
    return submitted_;
  }

  void loop() {
    int provided = 0;
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
      std::lock_guard<std::mutex> lock(mutex_);
      init_error_ = "MPI_Init_thread failed";
      initialized_ = true;
      cv_.notify_all();
      return;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int length = 0;
    MPI_Get_library_version(version, &length);
    std::string library(version, strnlen(version, size_t(length)));
    name_ = "MPI: " + library.substr(0, library.find_first_of(",\n"));  // "MPI: Open MPI v4.1.4"
    {
      std::lock_guard<std::mutex> lock(mutex_);
      initialized_ = true;
    }
    cv_.notify_all();
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [this] { return !queue_.empty() || stopping_; });
        if (queue_.empty()) break;
        job = std::move(queue_.front());
        queue_.pop_front();
        pending_name_ = job.what;
      }
      std::string error;
      try {
        job.op();
      } catch (const std::exception& e) {
        error = e.what();
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        completed_ = job.ticket;
        if (!error.empty() && failure_.empty()) failure_ = error;
      }
      cv_.notify_all();
    }
    MPI_Finalize();
  }

  struct Job {
    Ticket ticket = 0;
    std::string what;
    std::function<void()> op;
  };

  double timeout_s_;
  int rank_ = 0, size_ = 1;
  std::string name_;
  std::thread worker_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  Ticket submitted_ = 0, completed_ = 0;
  std::string pending_name_, failure_, init_error_;
  bool initialized_ = false, stopping_ = false;
  std::vector<float> gather_buffer_;
  std::vector<int> counts_, offsets_, receive_counts_, receive_offsets_;  // used by the communication thread only
  static constexpr int64_t kMaxCount = int64_t(1) << 30;  // MPI counts are int
  static constexpr int kShardTag = 17;  // send_to_root's messages (collectives use their own context)
  static constexpr int64_t kReducePiece = kMpiReducePiece;  // see mpi_communicator.h
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(double timeout_s) {
  return std::make_unique<MpiCommunicator>(timeout_s);
}

}  // namespace keel::dist
