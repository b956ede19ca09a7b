// distributed::Communicator: the collectives data parallel needs, behind one interface so that MPI
// (today) and NCCL/HCCL (later) are interchangeable. Collectives are queued and executed in
// submission order by one communication thread, so the training thread can start a bucket's
// allreduce and keep computing the backward pass (overlap), then wait only for what it needs.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "keel/core/compute_event.h"
#include "keel/core/flat_range.h"

namespace keel::distributed {

using Ticket = uint64_t;  // identifies a submitted collective; wait(ticket) blocks until it is done

// The largest message keel hands to MPI, in floats (16 MB), for two reasons that agree on the size:
// - memory: send_to_root streams a rank's shard to rank 0 in pieces this size, so rank 0 never
//   holds more than one piece of another rank's state;
// - speed: Open MPI's allreduce allocates a scratch buffer as large as the message on every call;
//   above glibc's largest mmap threshold (32 MB) that is a fresh mmap, page-faulted and unmapped
//   each time (a 98 MB embedding gradient took 0.26 s instead of 0.025 s in a VM). Reductions go
//   to MPI in pieces this size, which reuse heap memory and are large enough for latency to be noise.
inline constexpr int64_t kMessagePiece = int64_t(4) << 20;

// In the error of a wait that ran past comm_timeout_s (a rank died, hangs or its host is lost):
// `keel launch` ends the job when a rank says it, whatever mpirun still waits for.
inline constexpr std::string_view kPeerTimeoutMarker = "did not complete within";

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;  // "single process", "MPI (Open MPI 4.1.4)", ...

  // In-place sum over ranks of n floats. With `deterministic`, every rank adds the contributions
  // in rank order 0..size-1, so results are bit-identical whatever the timing or algorithm.
  // `after`: the compute event that wrote `data` (kernels/backend.h); the collective must not read
  // it before the event. Communicators of host memory fed by the CPU backends find it complete.
  virtual Ticket allreduce_sum_async(float* data, int64_t n, bool deterministic, ComputeEvent after = {}) = 0;
  virtual void wait(Ticket ticket) = 0;
  void allreduce_sum_and_wait(float* data, int64_t n, bool deterministic = false) {
    wait(allreduce_sum_async(data, n, deterministic));
  }

  // ZeRO-1's collectives over a flat buffer split into `shards` (one per rank, contiguous, in rank
  // order; see keel::shard_ranges). `shards` must stay alive until the collective completes.
  //
  // Reduce-scatter of data[range]: afterwards the part of `range` inside this rank's shard holds the
  // sum over ranks (in place); the rest of `range` is left undefined. `deterministic` as above.
  virtual Ticket reduce_scatter_sum_async(float* data, FlatRange range, const std::vector<FlatRange>& shards,
                                          bool deterministic, ComputeEvent after = {}) = 0;
  // ZeRO-2's reduce-scatter, from a staging buffer into an accumulator: staged[0, range.size())
  // holds this rank's contribution to `range` of the flat buffer; afterwards, for every element j
  // of `range` inside this rank's shard, shard_sums[j - shard.begin] += the sum over ranks of
  // element j (added as reduce_scatter_sum_async adds, then accumulated). `staged` is scratch
  // until the collective completes.
  virtual Ticket reduce_scatter_accumulate_async(float* staged, FlatRange range, const std::vector<FlatRange>& shards,
                                                 float* shard_sums, bool deterministic, ComputeEvent after = {}) = 0;
  // In-place all-gather: every rank's shard of `data` is copied to every other rank.
  virtual Ticket allgather_shards_async(float* data, const std::vector<FlatRange>& shards) = 0;

  // Point-to-point, to stream a rank's shard of the optimizer state to rank 0 for a checkpoint
  // (see ShardReader): send_to_root sends n floats to rank 0 as consecutive messages of
  // kMessagePiece floats (the last one shorter), blocking until rank 0 has taken them all; rank 0
  // takes each message with receive_piece, `count` being that message's size.
  virtual void send_to_root(const float* data, int64_t n) = 0;
  virtual void receive_piece(int source, float* out, int64_t count) = 0;

  // Sum of a step's totals (losses, token counts, gradient squares) in doubles: small, blocking,
  // always in rank order.
  virtual void allreduce_totals(double* data, int64_t n) = 0;
  // Every rank receives root's bytes.
  virtual void broadcast(void* data, int64_t bytes, int root) = 0;
  // Each rank contributes `bytes` bytes; `out` receives size() * bytes, rank-major.
  virtual void allgather(const void* in, void* out, int64_t bytes) = 0;
  virtual void barrier() = 0;
  // Ends the whole job with an error (other ranks are terminated by the launcher).
  [[noreturn]] virtual void abort(const std::string& message) = 0;

  // What the job did last that can legitimately keep a peer away from the next collective (rank 0
  // writing a checkpoint while the others wait): a wait that times out names it, so a slow save
  // is not mistaken for a hung rank. "" clears it. Set and read on the training thread.
  void set_wait_context(std::string context) { wait_context_ = std::move(context); }

 protected:
  std::string wait_context_;
};

// The communicator for this process: MPI when started by mpirun (Open MPI's OMPI_COMM_WORLD_SIZE
// or PMI_SIZE in the environment), otherwise a single process that needs no MPI runtime at all.
// `timeout_s` bounds every wait: a rank that died or hangs ends the job with an error naming the
// operation instead of a silent hang.
std::unique_ptr<Communicator> make_communicator(double timeout_s);
bool launched_by_mpi();

}  // namespace keel::distributed
