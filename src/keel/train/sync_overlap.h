// Whether a data-parallel step overlaps its gradient sync with the backward pass.
//
// Overlapping starts each bucket's collective as soon as the backward pass has made its gradients
// final; the communication thread then drives MPI's progress while compute goes on. That pays
// only when the thread has a core of its own: on a host whose cores are all taken by the ranks'
// compute threads it steals cycles from the backward pass, and the step got slower (bench model,
// dp = 2 on 2 cores, one thread per rank: 5.88 s after the backward pass, 6.21 s overlapped,
// docs/performance-log.md) even though the exposed sync fell. overlap_grad_sync = "auto" (the
// default) therefore overlaps only when the host has a core to spare per rank.
#pragma once
#include <string>

#include "keel/recipe/recipe.h"

namespace keel::train {

struct HostCores {
  int online = 1;          // logical CPUs the host has online
  int usable = 1;          // CPUs this process may run on (its affinity mask)
  int ranks_on_host = 1;   // this job's processes on this host
  int compute_threads = 1; // each rank's compute threads (OpenMP)
};

// This process's view: sysconf, sched_getaffinity, Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE (else
// `ranks`, as if every rank shared this host), omp_get_max_threads.
HostCores host_cores(int ranks);

struct OverlapDecision {
  bool overlap = false;
  std::string reason;  // printed at the start of a data-parallel run
};

// `setting`: the recipe's overlap_grad_sync. With Auto, overlap when every rank on the host can
// have compute_threads + 1 cores, and this process may use that many.
OverlapDecision decide_overlap(recipe::OverlapGradSync setting, const HostCores& cores);

}  // namespace keel::train
