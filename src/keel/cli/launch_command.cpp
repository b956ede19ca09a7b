// keel launch -n N [--hostfile F [--launch-agent CMD] [--network CIDR]] [--rankfile F] [--dry-run] RECIPE
//             [--set key=value ...] [--resume DIR|auto]
// Runs `keel train` under mpirun with every rank bound to its own cores (see cluster/launch.h), and
// ends the job when a rank reports a lost peer even if mpirun would wait on.
#include <fmt/format.h>
#include <unistd.h>

#include <memory>

#include "keel/cli/child_process.h"
#include "keel/cli/commands.h"
#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/cluster/launch.h"
#include "keel/cluster/topology.h"
#include "keel/distributed/communicator.h"

namespace keel::cli {
namespace {

struct LaunchOptions {
  int ranks = 0;
  std::string hostfile;
  std::string rankfile;
  std::string machine_xml;
  std::string launch_agent, network, resume;
  bool dry_run = false;
  std::string recipe;
  std::vector<std::string> overrides;
};

const CommandRegistration kLaunch{
    "launch", "Run keel train on N ranks under mpirun, each bound to its own cores",
    [](CLI::App& cmd) -> CommandAction {
      auto o = std::make_shared<LaunchOptions>();
      cmd.add_option("-n,--np", o->ranks, "Number of ranks (the world size; the recipe's dp_degree must match)")
          ->required();
      cmd.add_option("--hostfile", o->hostfile, "OpenMPI hostfile (keel rank-table --hostfile writes one)");
      cmd.add_option("--rankfile", o->rankfile, "OpenMPI rankfile to bind with instead of the topology's plan");
      cmd.add_option("--machine-xml", o->machine_xml, "Plan the binding on this hwloc XML instead of this machine");
      cmd.add_option("--launch-agent", o->launch_agent,
                     "Command that starts Open MPI on another host instead of ssh, called as CMD HOST COMMAND... "
                     "(Open MPI's plm_rsh_agent)");
      cmd.add_option("--network", o->network,
                     "Network for the job's TCP traffic between hosts, as CIDR (e.g. 10.1.0.0/16), when hosts have "
                     "several");
      cmd.add_flag("--dry-run", o->dry_run, "Print the mpirun command instead of running it");
      cmd.add_option("recipe", o->recipe, "Recipe file (TOML)")->required();
      cmd.add_option("--set", o->overrides, "Override a recipe key: --set key=value (repeatable)");
      cmd.add_option("--resume", o->resume, "Passed on to keel train: a checkpoint directory, or auto");
      return [o] {
        cluster::Topology topology =
            o->machine_xml.empty() ? cluster::detect_topology() : cluster::xml_topology(o->machine_xml);
        cluster::LaunchRequest request;
        request.world_size = o->ranks;
        request.hostfile = o->hostfile;
        request.rankfile = o->rankfile;
        request.recipe = o->recipe;
        request.overrides = o->overrides;
        request.resume = o->resume;
        request.keel_executable = this_executable();
        request.run_as_root = ::geteuid() == 0;
        request.launch_agent = o->launch_agent;
        request.network = o->network;
        cluster::LaunchCommand command = cluster::launch_command(topology, request);
        if (o->dry_run) {
          fmt::print("# {}\n{}\n", command.plan_description, cluster::shell_command_line(command.argv));
          return 0;
        }
        require_on_path(command.argv.front());
        fmt::print(stderr, "keel launch: {}\n{}\n", command.plan_description,
                   cluster::shell_command_line(command.argv));
        // A rank that gives up on a silent peer (comm_timeout_s) has said which and exits; mpirun may
        // then wait minutes for the daemon of a host whose link is down: it gets two seconds.
        return run_supervised(command.argv, std::string(distributed::kPeerTimeoutMarker), 2.0);
      };
    }};

}  // namespace
}  // namespace keel::cli
