#include "keel/train/sync_overlap.h"

#include <fmt/format.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>

#include "keel/core/threads.h"

namespace keel::train {

HostCores host_cores(int ranks) {
  HostCores c;
  c.online = std::max(1, int(::sysconf(_SC_NPROCESSORS_ONLN)));
  cpu_set_t mask;
  c.usable = ::sched_getaffinity(0, sizeof(mask), &mask) == 0 ? std::max(1, CPU_COUNT(&mask)) : c.online;
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  c.ranks_on_host = local && std::atoi(local) > 0 ? std::atoi(local) : std::max(1, ranks);
  c.compute_threads = max_threads();
  return c;
}

OverlapDecision decide_overlap(recipe::OverlapGradSync setting, const HostCores& c) {
  const std::string facts = fmt::format("{} rank(s) on this host of {} CPUs, {} compute thread(s) each, {} CPU(s) usable "
                                        "by this rank",
                                        c.ranks_on_host, c.online, c.compute_threads, c.usable);
  if (setting == recipe::OverlapGradSync::True)
    return {true, "gradient buckets sync during the backward pass (overlap_grad_sync = true)"};
  if (setting == recipe::OverlapGradSync::False)
    return {false, "gradient buckets sync after the backward pass (overlap_grad_sync = false)"};
  const int wanted = c.compute_threads + 1;  // the compute threads and the communication thread
  if (c.online >= c.ranks_on_host * wanted && c.usable >= wanted)
    return {true, fmt::format("gradient buckets sync during the backward pass (overlap_grad_sync = auto: {}; a CPU "
                              "to spare per rank for the communication thread)",
                              facts)};
  return {false, fmt::format("gradient buckets sync after the backward pass (overlap_grad_sync = auto: {}; no CPU to "
                             "spare for the communication thread, whose progress would slow the backward pass; set "
                             "overlap_grad_sync = true to overlap anyway)",
                             facts)};
}

}  // namespace keel::train
