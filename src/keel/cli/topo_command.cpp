// keel topo [--ranks N] [--xml FILE | --synthetic DESCRIPTION] [--export-xml FILE]
#include <fmt/format.h>

#include <memory>

#include "keel/cli/commands.h"
#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/cluster/launch.h"
#include "keel/cluster/topology.h"

namespace keel::cli {
namespace {

struct TopoOptions {
  int ranks = 0;
  std::string xml;
  std::string synthetic;
  std::string export_xml;
};

// With no --ranks: one rank per accelerator, else per NUMA node, else per core complex - the
// units a data-parallel job is laid out in.
int default_ranks(const cluster::Topology& topology) {
  if (!topology.accelerators().empty()) return int(topology.accelerators().size());
  if (topology.numa_nodes_with_cores() > 1) return topology.numa_nodes_with_cores();
  return std::max<int>(1, int(topology.core_complexes.size()));
}

const CommandRegistration kTopo{
    "topo", "Show the machine's topology (sockets, NUMA, caches, PCI devices) and the link class between ranks",
    [](CLI::App& cmd) -> CommandAction {
      auto options = std::make_shared<TopoOptions>();
      cmd.add_option("--ranks", options->ranks,
                     "Ranks to place and compare (default: one per accelerator, else per NUMA node, else per core "
                     "complex)");
      auto* xml = cmd.add_option("--xml", options->xml, "Read the topology from an hwloc XML export instead");
      cmd.add_option("--synthetic", options->synthetic,
                     "Use an hwloc synthetic topology instead, e.g. 'pack:2 numa:2 l3:2 core:4 pu:2'")
          ->excludes(xml);
      cmd.add_option("--export-xml", options->export_xml,
                     "Write this machine's topology as hwloc XML (for --xml, or rank-table --machine-xml, elsewhere)");
      return [options] {
        require(options->ranks >= 0, "--ranks: expected a positive number of ranks, found {}", options->ranks);
        if (!options->export_xml.empty()) {
          write_file_atomic(options->export_xml, cluster::export_topology_xml());
          fmt::print("wrote {}\n", options->export_xml);
          return 0;
        }
        cluster::Topology topology = !options->xml.empty()         ? cluster::xml_topology(options->xml)
                                     : !options->synthetic.empty() ? cluster::synthetic_topology(options->synthetic)
                                                                   : cluster::detect_topology();
        fmt::print("{}", cluster::topology_report(topology));
        int ranks = options->ranks > 0 ? options->ranks : default_ranks(topology);
        auto accelerators = topology.accelerators();
        std::vector<int> rank_devices;
        if (!accelerators.empty() && ranks <= int(accelerators.size()))
          rank_devices.assign(accelerators.begin(), accelerators.begin() + ranks);
        cluster::BindingPlan plan = rank_devices.empty() ? cluster::plan_binding(topology, ranks)
                                                         : cluster::plan_device_binding(topology, rank_devices);
        fmt::print("{}", cluster::rank_link_report(topology, plan, rank_devices));
        return 0;
      };
    }};

}  // namespace
}  // namespace keel::cli
