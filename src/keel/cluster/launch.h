// Where each rank of a data-parallel job runs, and the mpirun command line that puts it there.
//
// Every rank is bound to its own cores, and each rank runs as many threads as it has cores: an
// unbound rank's threads migrate across sockets and fight the other ranks for the same cores.
// Ranks are laid out NUMA domain by NUMA domain (one rank per NUMA domain when the counts
// agree), so consecutive ranks - ring neighbours in an allreduce - are as close as they can be.
// Every server of a job is assumed to look like the machine the plan is made on.
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "keel/cluster/rank_table.h"
#include "keel/cluster/topology.h"

namespace keel::cluster {

struct BindingPlan {
  int ranks_per_node = 1;
  int cores_per_rank = 1;                    // = OMP_NUM_THREADS of each rank
  bool bound = true;                         // false when there are more ranks than cores
  std::vector<std::vector<int>> rank_cores;  // local rank -> indices into Topology::cores
  std::vector<std::string> mpirun_args;      // --map-by ... --bind-to ... (or --bind-to none --oversubscribe)
  std::string description;                   // "one rank per NUMA node, 8 cores each"
};

// The plan for `ranks_per_node` ranks on a machine like `topology`, as mpirun's --map-by places them.
BindingPlan plan_binding(const Topology& topology, int ranks_per_node);
// Ranks driving accelerators (indices into Topology::devices, one per rank): each rank gets cores
// of its device's NUMA node where there are enough, else the plan_binding placement. Expressed as
// a rankfile, not --map-by (mpirun cannot follow devices).
BindingPlan plan_device_binding(const Topology& topology, const std::vector<int>& rank_devices);

// The link class between every pair of ranks: through their accelerators when each rank has one,
// else through their cores. What `keel topo` prints after the machine.
std::string rank_link_report(const Topology& topology, const BindingPlan& plan, const std::vector<int>& rank_devices);

// OpenMPI hostfile lines: `host [slots=N] [max_slots=N]`, '#' comments.
struct HostfileEntry {
  std::string host;
  int slots = 0;  // 0: not given
};
std::vector<HostfileEntry> parse_hostfile(std::string_view text, const std::string& path);

// OpenMPI rankfile for a rank table: `rank <rank_id>=<server_id> slot=<logical cores>`, each NPU's
// rank bound to cores near it (when `topology` has that many NPUs) on a server like `topology`.
std::string rankfile_text(const RankTable& table, const Topology& topology);
// The ranks of a rankfile and the cores each is given: checks it lists ranks 0..N-1 once each.
struct RankfileEntry {
  int rank = 0;
  std::string host;
  int core_count = 0;
};
std::vector<RankfileEntry> parse_rankfile(std::string_view text, const std::string& path);

struct LaunchRequest {
  int world_size = 1;
  std::string hostfile;  // empty: this machine only
  std::string rankfile;  // empty: bind with --map-by from the topology
  std::string recipe;
  std::vector<std::string> overrides;  // --set key=value, passed on to keel train
  std::string resume;                  // --resume, passed on to keel train (empty: none)
  std::string keel_executable;
  bool run_as_root = false;
  // Across hosts: what starts Open MPI's daemon on another host instead of ssh (plm_rsh_agent: it
  // is called as AGENT HOST COMMAND...), and the network (CIDR) the job's TCP traffic must use
  // when hosts have several. Empty: Open MPI's defaults.
  std::string launch_agent;
  std::string network;
};

struct LaunchCommand {
  std::vector<std::string> argv;  // mpirun ... keel train RECIPE ...
  std::string plan_description;
};
// Reads the hostfile and rankfile named in the request.
LaunchCommand launch_command(const Topology& topology, const LaunchRequest& request);

// argv as one line a POSIX shell reads back to the same words.
std::string shell_command_line(const std::vector<std::string>& argv);

}  // namespace keel::cluster
