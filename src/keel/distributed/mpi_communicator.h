// The MPI implementation of distributed::Communicator (Open MPI from Debian).
#pragma once
#include <cstdint>
#include <memory>

#include "keel/distributed/communicator.h"

namespace keel::distributed {

// Reductions go to MPI in pieces of at most this many floats (16 MB). Open MPI's allreduce
// allocates a scratch buffer as large as the message on every call; above glibc's largest mmap
// threshold (32 MB) that is a fresh mmap, page-faulted and unmapped each time: a 98 MB embedding
// gradient took 0.26 s to all-reduce instead of 0.025 s (page faults cost most in a virtual
// machine). Pieces this size reuse heap memory, and are large enough that per-call latency is noise.
inline constexpr int64_t kMpiReducePiece = int64_t(4) << 20;

std::unique_ptr<Communicator> make_mpi_communicator(double timeout_s);

}  // namespace keel::distributed
