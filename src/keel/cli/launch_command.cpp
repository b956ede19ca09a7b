// keel launch -n N [--hostfile F] [--rankfile F] [--dry-run] RECIPE [--set key=value ...]
// Runs `keel train` under mpirun with every rank bound to its own cores (see dist/launch.h).
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <system_error>

#include "keel/cli/child_process.h"
#include "keel/cli/commands.h"
#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/cluster/launch.h"
#include "keel/cluster/topology.h"

namespace keel::cli {
namespace {

struct LaunchOptions {
  int ranks = 0;
  std::string hostfile;
  std::string rankfile;
  std::string machine_xml;
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
      cmd.add_flag("--dry-run", o->dry_run, "Print the mpirun command instead of running it");
      cmd.add_option("recipe", o->recipe, "Recipe file (TOML)")->required();
      cmd.add_option("--set", o->overrides, "Override a recipe key: --set key=value (repeatable)");
      return [o] {
        cluster::Topology topology =
            o->machine_xml.empty() ? cluster::detect_topology() : cluster::xml_topology(o->machine_xml);
        cluster::LaunchRequest request;
        request.world_size = o->ranks;
        request.hostfile = o->hostfile;
        request.rankfile = o->rankfile;
        request.recipe = o->recipe;
        request.overrides = o->overrides;
        request.keel_executable = this_executable();
        request.run_as_root = ::geteuid() == 0;
        cluster::LaunchCommand command = cluster::launch_command(topology, request);
        if (o->dry_run) {
          fmt::print("# {}\n{}\n", command.plan_description, cluster::shell_command_line(command.argv));
          return 0;
        }
        require_on_path(command.argv.front());
        fmt::print(stderr, "keel launch: {}\n{}\n", command.plan_description,
                   cluster::shell_command_line(command.argv));
        std::fflush(stdout);
        std::fflush(stderr);
        std::vector<char*> argv;
        for (auto& word : command.argv) argv.push_back(word.data());
        argv.push_back(nullptr);
        ::execvp(argv[0], argv.data());
        fail("cannot run {}: {}", command.argv.front(), std::system_category().message(errno));
      };
    }};

}  // namespace
}  // namespace keel::cli
