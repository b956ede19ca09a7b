// keel rank-table --npu-count N [--topology hccs_full_mesh|pcie] [--out rank_table.json] ...
// keel rank-table --check FILE [--topology ...]
// Either way, --hostfile / --rankfile also write the OpenMPI files for the same servers.
#include <fmt/format.h>

#include <iostream>
#include <memory>
#include <optional>
#include <stdexcept>

#include "keel/cli/commands.h"
#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/cluster/launch.h"
#include "keel/cluster/rank_table.h"
#include "keel/cluster/topology.h"

namespace keel::cli {
namespace {

struct RankTableOptions {
  std::string check;
  int npu_count = 0;
  std::vector<int> devices;
  std::string topology;
  std::string server_id;
  std::vector<std::string> device_ips;
  std::string hccn_conf = cluster::kHccnConfPath;
  std::string servers;
  std::string out = "rank_table.json";
  std::string hostfile;
  std::string rankfile;
  std::string machine_xml;
};

bool same_table(const cluster::RankTable& a, const cluster::RankTable& b) {
  if (a.servers.size() != b.servers.size()) return false;
  for (size_t s = 0; s < a.servers.size(); ++s) {
    const auto& x = a.servers[s];
    const auto& y = b.servers[s];
    if (x.server_id != y.server_id || x.devices.size() != y.devices.size()) return false;
    for (size_t d = 0; d < x.devices.size(); ++d) {
      if (x.devices[d].device_id != y.devices[d].device_id || x.devices[d].device_ip != y.devices[d].device_ip ||
          x.devices[d].rank_id != y.devices[d].rank_id)
        return false;
    }
  }
  return true;
}

std::string summary(const cluster::RankTable& table) {
  int n = table.device_count();
  return fmt::format("{} server{}, {} device{} (ranks 0-{})", table.servers.size(),
                     table.servers.size() == 1 ? "" : "s", n, n == 1 ? "" : "s", n - 1);
}

void write_mpi_files(const RankTableOptions& o, const cluster::RankTable& table) {
  if (!o.hostfile.empty()) {
    write_file_atomic(o.hostfile, cluster::hostfile_text(table));
    fmt::print(stderr, "wrote {}: OpenMPI hostfile for keel launch --hostfile\n", o.hostfile);
  }
  if (!o.rankfile.empty()) {
    cluster::Topology machine =
        o.machine_xml.empty() ? cluster::detect_topology() : cluster::xml_topology(o.machine_xml);
    write_file_atomic(o.rankfile, cluster::rankfile_text(table, machine));
    fmt::print(stderr, "wrote {}: OpenMPI rankfile for keel launch --rankfile (cores planned on {})\n", o.rankfile,
               machine.source);
  }
}

int check(const RankTableOptions& o) {
  std::optional<cluster::HcclTopology> topology;
  if (!o.topology.empty()) topology = cluster::hccl_topology_from_name(o.topology);
  cluster::RankTableCheck result = cluster::check_rank_table(read_file(o.check), o.check, topology);
  for (const auto& note : result.notes) fmt::print(stderr, "note: {}\n", note);
  if (!result.ok()) {
    std::string message = fmt::format("{}: not a valid rank table ({} problem{}):", o.check, result.errors.size(),
                                      result.errors.size() == 1 ? "" : "s");
    for (const auto& e : result.errors) message += "\n  " + e;
    throw Error(message);
  }
  fmt::print("{}: valid rank table, version 1.0: {}\n", o.check, summary(result.table));
  write_mpi_files(o, result.table);
  return 0;
}

int generate(const RankTableOptions& o) {
  cluster::RankTableRequest request;
  request.topology = cluster::hccl_topology_from_name(o.topology.empty() ? "hccs_full_mesh" : o.topology);
  require(o.npu_count >= 0, "--npu-count: expected a positive count, found {}", o.npu_count);
  request.npu_count = o.npu_count;
  request.device_ids = o.devices;
  request.device_ips = o.device_ips;
  request.server_id = o.server_id;
  request.hccn_conf_path = o.hccn_conf;
  if (!o.servers.empty()) request.servers = cluster::parse_servers_file(read_file(o.servers), o.servers);
  cluster::GeneratedRankTable generated = cluster::build_rank_table(request);
  std::string json = cluster::rank_table_json(generated.table);

  // Read back what was written: the writer and the validator must agree on every field.
  cluster::RankTableCheck self = cluster::check_rank_table(json, o.out);
  if (!same_table(self.table, generated.table))
    throw std::logic_error("rank-table: the written table reads back differently");

  if (o.out == "-") {
    fmt::print("{}", json);
  } else {
    write_file_atomic(o.out, json);
  }
  fmt::print(stderr, "{}{}: {}, topology {}\n", o.out == "-" ? "rank table" : "wrote ", o.out == "-" ? "" : o.out,
             summary(generated.table), cluster::hccl_topology_name(request.topology));
  for (const auto& note : generated.notes) fmt::print(stderr, "note: {}\n", note);
  if (o.out != "-") fmt::print(stderr, "use it with: export RANK_TABLE_FILE={}\n", o.out);
  write_mpi_files(o, generated.table);
  return 0;
}

const CommandRegistration kRankTable{
    "rank-table", "Write an HCCL rank_table.json (version 1.0) for the NPUs, or --check one",
    [](CLI::App& cmd) -> CommandAction {
      auto o = std::make_shared<RankTableOptions>();
      auto* check_option =
          cmd.add_option("--check", o->check, "Validate an existing rank table instead of writing one");
      auto* npus = cmd.add_option("--npu-count", o->npu_count, "NPUs per server (devices 0..N-1 unless --devices)");
      auto* devices = cmd.add_option("--devices", o->devices, "Device ids to use, e.g. 4,5,6,7")->delimiter(',');
      cmd.add_option("--topology", o->topology,
                     "How a server's NPUs are linked: hccs_full_mesh (default; e.g. Atlas 800T A2) or pcie (HCCS "
                     "islands of 4 joined by PCIe, e.g. Atlas 800 with Ascend 910)");
      auto* server_id = cmd.add_option("--server-id", o->server_id,
                                       "This server's IP address (default: its first non-loopback IPv4)");
      auto* device_ips =
          cmd.add_option("--device-ips", o->device_ips, "Each device's RoCE IP, in device order: a,b,c,...")
              ->delimiter(',');
      cmd.add_option("--hccn-conf", o->hccn_conf, "Where device IPs are read from when --device-ips is not given")
          ->capture_default_str();
      auto* servers = cmd.add_option(
          "--servers", o->servers,
          "Servers file, one line each: <server_id> [npus=N] [devices=...] [device_ips=...] [hccn_conf=F]");
      cmd.add_option("--out", o->out, "Where to write the table ('-' for stdout)")->capture_default_str();
      cmd.add_option("--hostfile", o->hostfile, "Also write an OpenMPI hostfile for the same servers");
      cmd.add_option("--rankfile", o->rankfile, "Also write an OpenMPI rankfile binding each rank near its NPU");
      cmd.add_option(
          "--machine-xml", o->machine_xml,
          "Plan the rankfile's cores on this hwloc XML (keel topo --export-xml on a server) instead of here");
      // --check reads a table; the options that describe one to write make no sense with it.
      for (auto* writing : {npus, devices, server_id, device_ips, servers}) check_option->excludes(writing);
      return [o] { return o->check.empty() ? generate(*o) : check(*o); };
    }};

}  // namespace
}  // namespace keel::cli
