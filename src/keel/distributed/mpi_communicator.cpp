// MPI is called from one thread only (the communication thread), so MPI_THREAD_FUNNELED suffices
// and works with every MPI build. The training thread queues work and waits on tickets; a wait
// that exceeds the timeout means a peer died or hangs, and the job is aborted with a message
// naming the operation (Open MPI's launcher then names the rank that failed).
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "keel/core/error.h"
#include "keel/distributed/mpi_communicator.h"

namespace keel::distributed {
namespace {

class MpiCommunicator final : public Communicator {
  enum class Op {
    Allreduce,
    ReduceScatter,
    ReduceScatterAccumulate,
    AllgatherShards,
    SendToRoot,
    ReceivePiece,
    SumDoubles,
    Broadcast,
    Allgather,
    Barrier
  };
  // A queued operation, as plain data (see submit).
  struct Job {
    Ticket ticket = 0;
    Op op = Op::Barrier;
    void* data = nullptr;                            // the buffer operated on (received into, for allgather)
    const void* in = nullptr;                        // what allgather and send_to_root send
    int64_t n = 0;                                   // elements (bytes for broadcast and allgather)
    FlatRange range{};                               // reduce-scatter's range of `data`
    const std::vector<FlatRange>* shards = nullptr;  // ZeRO's shards (kept alive by the caller)
    float* sums = nullptr;                           // ZeRO-2's accumulator of this rank's shard
    bool deterministic = false;
    int peer = 0;  // broadcast's root, receive_piece's source
  };

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

  // `after` is complete already: this communicator moves host memory written by the CPU backends,
  // whose operations have finished when they return. (A device communicator would make its
  // stream wait for the event before the collective.)
  Ticket allreduce_sum_async(float* data, int64_t n, bool deterministic, ComputeEvent) override {
    return submit({.op = Op::Allreduce, .data = data, .n = n, .deterministic = deterministic});
  }

  Ticket reduce_scatter_sum_async(float* data, FlatRange range, const std::vector<FlatRange>& shards,
                                  bool deterministic, ComputeEvent) override {
    return submit(
        {.op = Op::ReduceScatter, .data = data, .range = range, .shards = &shards, .deterministic = deterministic});
  }

  Ticket reduce_scatter_accumulate_async(float* staged, FlatRange range, const std::vector<FlatRange>& shards,
                                         float* shard_sums, bool deterministic, ComputeEvent) override {
    return submit({.op = Op::ReduceScatterAccumulate,
                   .data = staged,
                   .range = range,
                   .shards = &shards,
                   .sums = shard_sums,
                   .deterministic = deterministic});
  }

  Ticket allgather_shards_async(float* data, const std::vector<FlatRange>& shards) override {
    return submit({.op = Op::AllgatherShards, .data = data, .shards = &shards});
  }

  void send_to_root(const float* data, int64_t n) override { wait(submit({.op = Op::SendToRoot, .in = data, .n = n})); }

  void receive_piece(int source, float* out, int64_t count) override {
    wait(submit({.op = Op::ReceivePiece, .data = out, .n = count, .peer = source}));
  }

  void wait(Ticket ticket) override {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
    while (completed_ < ticket) {
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && completed_ < ticket) timed_out(lock);
    }
    if (!failure_.empty()) abort(failure_);
  }

  void allreduce_totals(double* data, int64_t n) override {
    wait(submit({.op = Op::SumDoubles, .data = data, .n = n}));
  }

  void broadcast(void* data, int64_t bytes, int root) override {
    wait(submit({.op = Op::Broadcast, .data = data, .n = bytes, .peer = root}));
  }

  void allgather(const void* in, void* out, int64_t bytes) override {
    wait(submit({.op = Op::Allgather, .data = out, .in = in, .n = bytes}));
  }

  void barrier() override { wait(submit({.op = Op::Barrier})); }

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

  // In-place sum over ranks of p[0, n), handed to MPI in pieces of at most kMessagePiece floats.
  void sum_in_pieces(float* p, int64_t n, bool deterministic) {
    for_each_chunk(p, n, kMessagePiece, [&](float* piece, int count) {
      if (deterministic)
        ordered_sum(piece, count);
      else
        check(MPI_Allreduce(MPI_IN_PLACE, piece, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD), "MPI_Allreduce");
    });
  }

  // Fixed-order sum: gather every rank's contribution, add them in rank order.
  void ordered_sum(float* data, int n) {
    gather_buffer_.resize(size_t(n) * size_t(size_));
    check(MPI_Allgather(data, n, MPI_FLOAT, gather_buffer_.data(), n, MPI_FLOAT, MPI_COMM_WORLD), "MPI_Allgather");
    add_in_rank_order(gather_buffer_.data(), n, data);
  }

  // out[i] = the ranks' contributions added in rank order 0, 1, ...: `gathered` holds size_ blocks
  // of `count` values, rank-major. The same order on every rank makes the sums bit-identical.
  template <class T>
  void add_in_rank_order(const T* gathered, int64_t count, T* out) const {
    for (int64_t i = 0; i < count; ++i) {
      T sum = gathered[i];
      for (int r = 1; r < size_; ++r) sum += gathered[size_t(r) * size_t(count) + size_t(i)];
      out[i] = sum;
    }
  }

  // Rank-ordered reduce-scatter of `range` (at most kMessagePiece / size elements) of the flat
  // buffer whose element range.begin is base[0]: every rank sends each other rank that rank's part
  // (all-to-all), then adds the received contributions in rank order into its own part, in place.
  void ordered_reduce_scatter(float* base, FlatRange range, const std::vector<FlatRange>& shards) {
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
    for (int q = 0; q < size_; ++q) receive_offsets_[size_t(q)] = q * m;  // m * size <= kMessagePiece
    check(MPI_Alltoallv(base, counts_.data(), offsets_.data(), MPI_FLOAT, gather_buffer_.data(),
                        receive_counts_.data(), receive_offsets_.data(), MPI_FLOAT, MPI_COMM_WORLD),
          "MPI_Alltoallv");
    if (m > 0) add_in_rank_order(gather_buffer_.data(), m, base + (mine.begin - range.begin));
  }

  // Reduce-scatter of `range` of the flat buffer whose element range.begin is base[0], in place:
  // this rank's part ends up holding the sums (the rest is left undefined).
  void reduce_scatter_in_place(float* base, FlatRange range, const std::vector<FlatRange>& shards,
                               bool deterministic) {
    if (deterministic) {
      // Pieces of kMessagePiece elements in all: bounded scratch, int counts and displacements.
      const int64_t piece = std::max<int64_t>(1, kMessagePiece / size_);
      for (int64_t b = range.begin; b < range.end; b += piece)
        ordered_reduce_scatter(base + (b - range.begin), {b, std::min(b + piece, range.end)}, shards);
      return;
    }
    // Open MPI 4.1's MPI_Reduce_scatter is slower here than its MPI_Allreduce of the whole range
    // (shared memory, 2 ranks, 418 MB in 25 MB buckets: 0.11-0.20 s against 0.09 s,
    // bench/allreduce_bandwidth --zero), although it moves half the bytes; so the range is
    // all-reduced and this rank keeps its part. A transport whose reduce-scatter is cheaper
    // (NCCL, HCCL) implements this interface with it.
    sum_in_pieces(base, range.size(), false);
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

  // Queues a job. Jobs are plain data in a fixed ring: queueing allocates nothing, so a training
  // step's collectives keep the step loop free of heap allocations.
  Ticket submit(Job job) {
    std::unique_lock<std::mutex> lock(mutex_);
    // Full (a thousand collectives queued): the communication thread drains it, unless a peer died.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
    if (!cv_.wait_until(lock, deadline, [this] { return queued_ < ring_.size(); })) timed_out(lock);
    job.ticket = ++submitted_;
    ring_[(head_ + queued_) % ring_.size()] = job;
    ++queued_;
    cv_.notify_all();
    return submitted_;
  }

  void execute(const Job& job) {
    switch (job.op) {
      case Op::Allreduce: sum_in_pieces(static_cast<float*>(job.data), job.n, job.deterministic); return;
      case Op::ReduceScatter:
        reduce_scatter_in_place(static_cast<float*>(job.data) + job.range.begin, job.range, *job.shards,
                                job.deterministic);
        return;
      case Op::ReduceScatterAccumulate: {
        float* staged = static_cast<float*>(job.data);
        reduce_scatter_in_place(staged, job.range, *job.shards, job.deterministic);
        const FlatRange shard = (*job.shards)[size_t(rank_)], mine = job.range.intersect(shard);
        if (mine.size() == 0) return;
        const float* sums = staged + (mine.begin - job.range.begin);
        float* into = job.sums + (mine.begin - shard.begin);
        for (int64_t j = 0; j < mine.size(); ++j) into[j] += sums[j];
        return;
      }
      case Op::AllgatherShards: {
        // Each rank broadcasts its shard in turn: at two ranks the same traffic as a ring
        // all-gather, and no int displacement limits the size of the buffer.
        float* data = static_cast<float*>(job.data);
        for (int q = 0; q < size_; ++q) {
          const FlatRange shard = (*job.shards)[size_t(q)];
          for_each_chunk(data + shard.begin, shard.size(), kMaxCount, [&](float* p, int count) {
            check(MPI_Bcast(p, count, MPI_FLOAT, q, MPI_COMM_WORLD), "MPI_Bcast");
          });
        }
        return;
      }
      case Op::SendToRoot:
        for_each_chunk(static_cast<const float*>(job.in), job.n, kMessagePiece, [&](const float* p, int count) {
          check(MPI_Send(p, count, MPI_FLOAT, 0, kShardTag, MPI_COMM_WORLD), "MPI_Send");
        });
        return;
      case Op::ReceivePiece: {
        MPI_Status status;
        check(MPI_Recv(job.data, int(job.n), MPI_FLOAT, job.peer, kShardTag, MPI_COMM_WORLD, &status), "MPI_Recv");
        int received = 0;
        MPI_Get_count(&status, MPI_FLOAT, &received);
        require(received == job.n, "rank {}: expected a piece of {} floats from rank {}, received {}", rank_, job.n,
                job.peer, received);
        return;
      }
      case Op::SumDoubles: {  // small, and always in rank order: identical on every rank
        double* data = static_cast<double*>(job.data);
        sum_buffer_.resize(size_t(job.n) * size_t(size_));
        check(MPI_Allgather(data, int(job.n), MPI_DOUBLE, sum_buffer_.data(), int(job.n), MPI_DOUBLE, MPI_COMM_WORLD),
              "MPI_Allgather");
        add_in_rank_order(sum_buffer_.data(), job.n, data);
        return;
      }
      case Op::Broadcast:
        check(MPI_Bcast(job.data, int(job.n), MPI_BYTE, job.peer, MPI_COMM_WORLD), "MPI_Bcast");
        return;
      case Op::Allgather:
        check(MPI_Allgather(job.in, int(job.n), MPI_BYTE, job.data, int(job.n), MPI_BYTE, MPI_COMM_WORLD),
              "MPI_Allgather");
        return;
      case Op::Barrier: check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier"); return;
    }
  }

  // A wait (for a ticket, or for room in the ring) ran past the timeout: the job the communication
  // thread is in never completes, so a peer died or hangs.
  [[noreturn]] void timed_out(std::unique_lock<std::mutex>& lock) {
    const std::string what = describe(running_);
    lock.unlock();
    abort(
        fmt::format("rank {}{}: '{}' {} {} s: another rank died or hangs{} "
                    "(raise comm_timeout_s if steps are legitimately slower){}",
                    rank_, host_of(rank_), what, kPeerTimeoutMarker, timeout_s_, other_ranks(),
                    wait_context_.empty() ? "" : ". " + wait_context_));
  }

  // " on HOST", or "" before the hosts are known.
  std::string host_of(int rank) const {
    return size_t(rank) < hosts_.size() ? " on " + hosts_[size_t(rank)] : std::string();
  }
  // Where the peers run, when they span more than this host (a lost host is then the first suspect):
  // " (rank 1 on h2, rank 2 on h3)", at most a few named.
  std::string other_ranks() const {
    bool elsewhere = false;
    for (const auto& h : hosts_) elsewhere = elsewhere || h != hosts_[size_t(rank_)];
    if (!elsewhere) return "";
    std::string out;
    int named = 0;
    for (int r = 0; r < size_ && named < 8; ++r)
      if (r != rank_) out += fmt::format("{}rank {}{}", named++ ? ", " : " (", r, host_of(r));
    return out + (size_ - 1 > named ? ", ...)" : ")");
  }

  // What a job is, in words: for the error of a wait that timed out.
  std::string describe(const Job& job) const {
    switch (job.op) {
      case Op::Allreduce: return fmt::format("allreduce of {} gradients", job.n);
      case Op::ReduceScatter: return fmt::format("reduce-scatter of {} gradients", job.range.size());
      case Op::ReduceScatterAccumulate:
        return fmt::format("reduce-scatter of {} staged gradients (ZeRO-2)", job.range.size());
      case Op::AllgatherShards: return "all-gather of the updated weights";
      case Op::SendToRoot: return "sending this rank's optimizer-state shard to rank 0";
      case Op::ReceivePiece: return fmt::format("receiving rank {}'s optimizer-state shard", job.peer);
      case Op::SumDoubles: return "allreduce of step totals";
      case Op::Broadcast: return "broadcast";
      case Op::Allgather: return "allgather";
      case Op::Barrier: return "barrier";
    }
    return "collective";
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
    // Every rank's host, for messages that must say where a silent peer runs.
    char host[kHostNameBytes] = {};
    ::gethostname(host, sizeof(host) - 1);
    std::vector<char> hosts(size_t(size_) * kHostNameBytes);
    if (MPI_Allgather(host, kHostNameBytes, MPI_CHAR, hosts.data(), kHostNameBytes, MPI_CHAR, MPI_COMM_WORLD) ==
        MPI_SUCCESS)
      for (int r = 0; r < size_; ++r) hosts_.emplace_back(hosts.data() + size_t(r) * kHostNameBytes);
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int length = 0;
    MPI_Get_library_version(version, &length);
    std::string library(version, strnlen(version, size_t(length)));
    name_ = "MPI: " + library.substr(0, library.find_first_of(",\n"));  // "MPI: Open MPI v4.1.4"
    std::vector<std::string> distinct = hosts_;
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    if (distinct.size() > 1) name_ += fmt::format(", {} hosts: {}", distinct.size(), fmt::join(distinct, ", "));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      initialized_ = true;
    }
    cv_.notify_all();
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [this] { return queued_ > 0 || stopping_; });
        if (queued_ == 0) break;
        job = ring_[head_];
        head_ = (head_ + 1) % ring_.size();
        --queued_;
        running_ = job;
      }
      cv_.notify_all();  // a submit waiting for room
      std::string error;
      try {
        execute(job);
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

  double timeout_s_;
  int rank_ = 0, size_ = 1;
  std::string name_;
  std::thread worker_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Job> ring_ = std::vector<Job>(kQueueCapacity);  // queued jobs: [head_, head_ + queued_)
  size_t head_ = 0, queued_ = 0;
  Job running_;  // the job the communication thread took last
  Ticket submitted_ = 0, completed_ = 0;
  std::string failure_, init_error_;
  bool initialized_ = false, stopping_ = false;
  std::vector<float> gather_buffer_;
  std::vector<double> sum_buffer_;
  std::vector<int> counts_, offsets_, receive_counts_, receive_offsets_;  // used by the communication thread only
  std::vector<std::string> hosts_;                                        // each rank's host name
  static constexpr int kHostNameBytes = 64;
  static constexpr int64_t kMaxCount = int64_t(1) << 30;                  // MPI counts are int
  static constexpr int kShardTag = 17;            // send_to_root's messages (collectives use their own context)
  static constexpr size_t kQueueCapacity = 1024;  // a step queues one job per bucket, and a few
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(double timeout_s) {
  return std::make_unique<MpiCommunicator>(timeout_s);
}

}  // namespace keel::distributed
