#include "keel/cluster/launch.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <map>
#include <optional>

#include "keel/core/error.h"
#include "keel/core/file_io.h"

namespace keel::cluster {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

std::vector<std::string_view> lines_of(std::string_view text) {
  std::vector<std::string_view> lines;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    lines.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return lines;
}

std::vector<std::string_view> words_of(std::string_view line) {
  std::vector<std::string_view> words;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r')) ++i;
    size_t start = i;
    while (i < line.size() && line[i] != ' ' && line[i] != '\t' && line[i] != '\r') ++i;
    if (i > start) words.push_back(line.substr(start, i - start));
  }
  return words;
}

std::optional<int> small_number(std::string_view text) {
  int value = 0;
  if (text.empty() || text.size() > 7) return std::nullopt;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < 0) return std::nullopt;
  return value;
}

// Cores [first, first + count) of `cores`.
std::vector<int> slice(const std::vector<int>& cores, int first, int count) {
  return std::vector<int>(cores.begin() + first, cores.begin() + first + count);
}

// Cores grouped by a level of the machine (NUMA node or socket), in machine order; cores hwloc put
// in no group of that level form one more group.
std::vector<std::vector<int>> cores_grouped_by(const Topology& topology, int CpuCore::*level, size_t group_count) {
  std::vector<std::vector<int>> groups(group_count + 1);
  for (size_t i = 0; i < topology.cores.size(); ++i) {
    int g = topology.cores[i].*level;
    groups[g >= 0 && size_t(g) < group_count ? size_t(g) : group_count].push_back(int(i));
  }
  std::erase_if(groups, [](const std::vector<int>& g) { return g.empty(); });
  return groups;
}

constexpr int kMaxRanksPerNode = 4096;

}  // namespace

BindingPlan plan_binding(const Topology& topology, int ranks_per_node) {
  require(ranks_per_node >= 1, "ranks per node: expected at least 1, found {}", ranks_per_node);
  // Far beyond any machine's cores; the bound keeps a typo from planning millions of ranks.
  require(ranks_per_node <= kMaxRanksPerNode, "ranks per node: {} is more than keel places on one machine ({})",
          ranks_per_node, kMaxRanksPerNode);
  const int cores = int(topology.cores.size());
  require(cores >= 1, "{}: the topology has no cores", topology.source);
  BindingPlan plan;
  plan.ranks_per_node = ranks_per_node;
  const int R = ranks_per_node;

  if (R > cores) {
    plan.bound = false;
    plan.cores_per_rank = 1;
    std::vector<int> all(cores);
    for (int i = 0; i < cores; ++i) all[i] = i;
    plan.rank_cores.assign(R, all);
    plan.mpirun_args = {"--bind-to", "none", "--oversubscribe"};
    plan.description =
        fmt::format("{} ranks on {} cores: more ranks than cores, so none is bound and each runs 1 thread", R, cores);
    return plan;
  }

  // The finest level whose groups the ranks divide evenly: NUMA nodes, else sockets.
  struct Level {
    int CpuCore::*member;
    size_t count;
    const char* mpirun_name;  // OpenMPI 4's object names
    const char* name;
  };
  const Level levels[] = {{&CpuCore::numa_node, topology.numa_nodes.size(), "numa", "NUMA node"},
                          {&CpuCore::package, topology.packages.size(), "socket", "socket"}};
  for (const Level& level : levels) {
    auto domains = cores_grouped_by(topology, level.member, level.count);
    const int U = int(domains.size());
    if (R % U != 0) continue;
    const int per_domain = R / U;
    int k = cores;
    for (const auto& d : domains) k = std::min(k, int(d.size()) / per_domain);
    if (k < 1) continue;
    plan.cores_per_rank = k;
    for (const auto& d : domains)
      for (int j = 0; j < per_domain; ++j) plan.rank_cores.push_back(slice(d, j * k, k));
    // ppr:M:<level> fills the first NUMA node (socket) with ranks 0..M-1 before the next, so
    // neighbours share it; PE=k gives each rank k cores and binds it to them.
    plan.mpirun_args = {"--map-by", fmt::format("ppr:{}:{}:PE={}", per_domain, level.mpirun_name, k), "--bind-to",
                        "core"};
    plan.description =
        per_domain == 1 ? fmt::format("one rank per {}, {} core{} each", level.name, k, k == 1 ? "" : "s")
                        : fmt::format("{} ranks per {}, {} core{} each", per_domain, level.name, k, k == 1 ? "" : "s");
    return plan;
  }
  // Ranks that divide neither: equal runs of cores in machine order.
  const int k = cores / R;
  plan.cores_per_rank = k;
  std::vector<int> all(cores);
  for (int i = 0; i < cores; ++i) all[i] = i;
  for (int r = 0; r < R; ++r) plan.rank_cores.push_back(slice(all, r * k, k));
  plan.mpirun_args = {"--map-by", fmt::format("ppr:{}:node:PE={}", R, k), "--bind-to", "core"};
  plan.description = fmt::format(
      "{} ranks per node, {} core{} each in machine order ({} ranks do not divide evenly "
      "among the NUMA nodes or sockets)",
      R, k, k == 1 ? "" : "s", R);
  return plan;
}

BindingPlan plan_device_binding(const Topology& topology, const std::vector<int>& rank_devices) {
  const int R = int(rank_devices.size());
  BindingPlan generic = plan_binding(topology, R);
  std::map<int, std::vector<int>> ranks_of_node;  // NUMA node -> ranks whose device is local to it
  for (int r = 0; r < R; ++r) {
    int d = rank_devices[r];
    require(d >= 0 && size_t(d) < topology.devices.size(), "rank {}: device {} is not one of the {} PCI devices", r, d,
            topology.devices.size());
    int node = topology.devices[d].numa_node;
    if (node < 0) return generic;  // locality unknown: nothing better to do than the generic plan
    ranks_of_node[node].push_back(r);
  }
  if (!generic.bound) return generic;
  int k = int(topology.cores.size());
  for (const auto& [node, ranks] : ranks_of_node)
    k = std::min(k, int(topology.cores_of_numa_node(node).size()) / int(ranks.size()));
  if (k < 1) return generic;  // a NUMA node with more devices than cores

  BindingPlan plan;
  plan.ranks_per_node = R;
  plan.cores_per_rank = k;
  plan.rank_cores.resize(R);
  for (const auto& [node, ranks] : ranks_of_node) {
    auto cores = topology.cores_of_numa_node(node);
    for (size_t j = 0; j < ranks.size(); ++j) plan.rank_cores[ranks[j]] = slice(cores, int(j) * k, k);
  }
  plan.description = fmt::format("each rank on {} core{} of its device's NUMA node", k, k == 1 ? "" : "s");
  return plan;
}

std::string rank_link_report(const Topology& topology, const BindingPlan& plan, const std::vector<int>& rank_devices) {
  std::string out;
  auto line = [&out](std::string text) { out += text + "\n"; };
  const int R = int(plan.rank_cores.size());
  const bool by_device = !rank_devices.empty() && int(rank_devices.size()) == R;
  line(fmt::format("ranks: {} ({}); {} -x OMP_NUM_THREADS={}", R, plan.description,
                   plan.mpirun_args.empty()
                       ? std::string("bound by a rankfile (keel rank-table --rankfile writes one)")
                       : fmt::format("keel launch binds them with {}", fmt::join(plan.mpirun_args, " ")),
                   plan.cores_per_rank));
  for (int r = 0; r < R; ++r) {
    std::vector<int> logical, pus;
    for (int c : plan.rank_cores[r]) {
      logical.push_back(topology.cores[c].logical_index);
      pus.insert(pus.end(), topology.cores[c].pus.begin(), topology.cores[c].pus.end());
    }
    std::string device;
    if (by_device) {
      const PciDevice& d = topology.devices[rank_devices[r]];
      device =
          fmt::format(", {} {}{}", pci_device_kind_name(d.kind), d.bus_id, d.name.empty() ? "" : " (" + d.name + ")");
    }
    line(fmt::format("  rank {}: cores {} (hardware threads {}){}", r, format_index_list(logical),
                     format_index_list(pus), device));
  }
  if (R < 2) {
    line("link classes between ranks: one rank, nothing to link");
    return out;
  }
  if (!plan.bound) {
    line("link classes between ranks: none, the ranks are not bound (more ranks than cores)");
    return out;
  }
  // (closeness, name): closeness orders the classes from nearest to farthest.
  auto link = [&](int a, int b) -> std::pair<int, std::string> {
    if (by_device) {
      DeviceLink l = device_link(topology, rank_devices[a], rank_devices[b]);
      return {int(l), std::string(device_link_name(l))};
    }
    CpuLink l = cpu_link(topology, plan.rank_cores[a], plan.rank_cores[b]);
    return {int(l), std::string(cpu_link_name(l))};
  };
  auto link_name = [&](int a, int b) { return link(a, b).second; };
  line(fmt::format("link classes between ranks (through their {}):", by_device ? "devices' PCIe paths" : "cores"));
  std::map<std::pair<int, std::string>, int> pairs;
  for (int a = 0; a < R; ++a)
    for (int b = a + 1; b < R; ++b) ++pairs[link(a, b)];
  constexpr int kMaxMatrix = 16;  // beyond this a matrix is unreadable; the pair counts still say it
  if (R <= kMaxMatrix) {
    size_t width = 8;
    for (const auto& [key, count] : pairs) width = std::max(width, key.second.size() + 2);
    std::string header = fmt::format("  {:<8}", "");
    for (int b = 0; b < R; ++b) header += fmt::format("{:<{}}", fmt::format("rank {}", b), width);
    while (!header.empty() && header.back() == ' ') header.pop_back();
    line(header);
    for (int a = 0; a < R; ++a) {
      std::string row = fmt::format("  {:<8}", fmt::format("rank {}", a));
      for (int b = 0; b < R; ++b) row += fmt::format("{:<{}}", a == b ? std::string("-") : link_name(a, b), width);
      while (!row.empty() && row.back() == ' ') row.pop_back();
      line(row);
    }
  }
  std::string summary;
  for (const auto& [key, count] : pairs)
    summary += fmt::format("{}{} {}", summary.empty() ? "" : ", ", count, key.second);
  line(fmt::format("  pairs: {}", summary));
  return out;
}

std::vector<HostfileEntry> parse_hostfile(std::string_view text, const std::string& path) {
  std::vector<HostfileEntry> hosts;
  std::map<std::string, int> line_of;
  int number = 0;
  for (std::string_view raw : lines_of(text)) {
    ++number;
    auto words = words_of(trim(raw.substr(0, raw.find('#'))));
    if (words.empty()) continue;
    HostfileEntry entry;
    entry.host = std::string(words[0]);
    require(entry.host.find('=') == std::string::npos, "{}:{}: expected a host name first, found '{}'", path, number,
            entry.host);
    for (size_t i = 1; i < words.size(); ++i) {
      size_t eq = words[i].find('=');
      std::string_view key = words[i].substr(0, eq);
      auto value = eq == std::string_view::npos ? std::nullopt : small_number(words[i].substr(eq + 1));
      if (key != "slots" && key != "max_slots" && key != "max-slots") {
        fail("{}:{}: '{}': expected slots=N or max_slots=N after the host name", path, number, words[i]);
      }
      require(value.has_value(), "{}:{}: '{}': expected a whole number after '='", path, number, words[i]);
      if (key == "slots") entry.slots = *value;
    }
    auto [it, inserted] = line_of.emplace(entry.host, number);
    require(inserted, "{}:{}: host {} is listed twice (first on line {}); give it once with slots=N", path, number,
            entry.host, it->second);
    hosts.push_back(std::move(entry));
  }
  require(!hosts.empty(), "{}: expected one host per line (host [slots=N]), found none", path);
  return hosts;
}

std::string rankfile_text(const RankTable& table, const Topology& topology) {
  std::vector<int> npus;
  for (size_t i = 0; i < topology.devices.size(); ++i)
    if (topology.devices[i].kind == PciDeviceKind::Npu) npus.push_back(int(i));
  std::string out = fmt::format(
      "# OpenMPI rankfile written by keel rank-table: rank <rank_id>=<server_id> slot=<logical cores>,\n"
      "# planned on {}; every server is assumed to look like it.\n",
      topology.source);
  for (const auto& server : table.servers) {
    // Device n is the n-th NPU in PCI bus order, as the driver numbers them.
    std::vector<int> devices;
    for (const auto& d : server.devices) {
      if (size_t(d.device_id) < npus.size()) devices.push_back(npus[d.device_id]);
    }
    BindingPlan plan = devices.size() == server.devices.size() && !devices.empty()
                           ? plan_device_binding(topology, devices)
                           : plan_binding(topology, int(server.devices.size()));
    for (size_t i = 0; i < server.devices.size(); ++i) {
      std::vector<int> logical;
      for (int c : plan.rank_cores[i]) logical.push_back(topology.cores[c].logical_index);
      out +=
          fmt::format("rank {}={} slot={}\n", server.devices[i].rank_id, server.server_id, format_index_list(logical));
    }
  }
  return out;
}

std::vector<RankfileEntry> parse_rankfile(std::string_view text, const std::string& path) {
  std::vector<RankfileEntry> entries;
  std::map<int, int> line_of;
  int number = 0;
  for (std::string_view raw : lines_of(text)) {
    ++number;
    auto words = words_of(trim(raw.substr(0, raw.find('#'))));
    if (words.empty()) continue;
    auto bad = [&](std::string_view why) {
      fail("{}:{}: {}; expected 'rank <N>=<host> slot=<cores>', found '{}'", path, number, why, trim(raw));
    };
    if (words.size() != 3 || words[0] != "rank") bad("not a rank line");
    size_t eq = words[1].find('=');
    if (eq == std::string_view::npos) bad("no '=' after the rank");
    auto rank = small_number(words[1].substr(0, eq));
    if (!rank) bad("the rank is not a whole number");
    RankfileEntry entry;
    entry.rank = *rank;
    entry.host = std::string(words[1].substr(eq + 1));
    if (entry.host.empty()) bad("no host");
    if (words[2].substr(0, 5) != "slot=") bad("no slot=");
    // slot=0-3,8 (logical cores) or slot=1:0-2 (socket 1, its cores 0-2): count the cores.
    std::string_view slots = words[2].substr(5);
    if (size_t colon = slots.find(':'); colon != std::string_view::npos) slots = slots.substr(colon + 1);
    size_t start = 0;
    while (start <= slots.size()) {
      size_t comma = slots.find(',', start);
      std::string_view item =
          slots.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
      size_t dash = item.find('-');
      auto first = small_number(item.substr(0, dash));
      auto last = dash == std::string_view::npos ? first : small_number(item.substr(dash + 1));
      if (!first || !last || *last < *first) bad(fmt::format("'{}' is not a core or a range of cores", item));
      entry.core_count += *last - *first + 1;
      if (comma == std::string_view::npos) break;
      start = comma + 1;
    }
    auto [it, inserted] = line_of.emplace(entry.rank, number);
    if (!inserted) bad(fmt::format("rank {} is already on line {}", entry.rank, it->second));
    entries.push_back(std::move(entry));
  }
  require(!entries.empty(), "{}: expected one 'rank <N>=<host> slot=<cores>' line per rank, found none", path);
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.rank < b.rank; });
  for (size_t i = 0; i < entries.size(); ++i) {
    require(entries[i].rank == int(i), "{}: ranks must be 0-{} with none missing; rank {} is missing", path,
            entries.size() - 1, i);
  }
  return entries;
}

LaunchCommand launch_command(const Topology& topology, const LaunchRequest& request) {
  const int N = request.world_size;
  require(N >= 1, "-n: expected at least 1 rank, found {}", N);
  require(path_exists(request.recipe), "{}: no such recipe file", request.recipe);

  std::vector<HostfileEntry> hosts;
  if (!request.hostfile.empty()) hosts = parse_hostfile(read_file(request.hostfile), request.hostfile);
  const int H = hosts.empty() ? 1 : int(hosts.size());
  require(N % H == 0,
          "{}: {} ranks do not divide evenly over its {} hosts: give -n a multiple of {} so every server "
          "runs the same number of ranks",
          request.hostfile, N, H, H);
  const int per_node = N / H;
  for (const auto& host : hosts) {
    require(host.slots == 0 || host.slots >= per_node,
            "{}: host {} has slots={}, but {} ranks over {} hosts put {} on each: raise its slots", request.hostfile,
            host.host, host.slots, N, H, per_node);
  }

  LaunchCommand command;
  auto& argv = command.argv;
  argv = {"mpirun"};
  if (request.run_as_root) argv.push_back("--allow-run-as-root");  // OpenMPI refuses root without it
  argv.insert(argv.end(), {"-np", std::to_string(N)});
  if (!request.hostfile.empty()) argv.insert(argv.end(), {"--hostfile", request.hostfile});
  if (!request.launch_agent.empty()) argv.insert(argv.end(), {"--mca", "plm_rsh_agent", request.launch_agent});
  if (!request.network.empty())  // both the launch's out-of-band channel and MPI's own messages
    argv.insert(argv.end(), {"--mca", "oob_tcp_if_include", request.network, "--mca", "btl_tcp_if_include",
                             request.network});

  int threads = 1;
  bool bound = true;
  if (!request.rankfile.empty()) {
    auto entries = parse_rankfile(read_file(request.rankfile), request.rankfile);
    require(int(entries.size()) == N, "{}: lists {} ranks, but -n asks for {}", request.rankfile, entries.size(), N);
    threads = entries.front().core_count;
    for (const auto& e : entries) threads = std::min(threads, e.core_count);
    argv.insert(argv.end(), {"--rankfile", request.rankfile});
    command.plan_description = fmt::format("{} ranks bound as {} says, {} thread{} each", N, request.rankfile, threads,
                                           threads == 1 ? "" : "s");
  } else {
    BindingPlan plan = plan_binding(topology, per_node);
    threads = plan.cores_per_rank;
    bound = plan.bound;
    argv.insert(argv.end(), plan.mpirun_args.begin(), plan.mpirun_args.end());
    command.plan_description =
        fmt::format("{} rank{} on {} host{}: {}", N, N == 1 ? "" : "s", H, H == 1 ? "" : "s", plan.description);
  }
  argv.insert(argv.end(), {"-x", fmt::format("OMP_NUM_THREADS={}", threads)});
  // Keep each OpenMP thread on one core of the rank's set instead of wandering inside it.
  if (bound) argv.insert(argv.end(), {"-x", "OMP_PROC_BIND=close", "-x", "OMP_PLACES=cores"});
  argv.insert(argv.end(), {request.keel_executable, "train", request.recipe});
  for (const auto& o : request.overrides) argv.insert(argv.end(), {"--set", o});
  if (!request.resume.empty()) argv.insert(argv.end(), {"--resume", request.resume});
  return command;
}

std::string shell_command_line(const std::vector<std::string>& argv) {
  std::string out;
  for (const auto& word : argv) {
    bool plain = !word.empty() && std::all_of(word.begin(), word.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) ||
             std::string_view("_@%+=:,./-").find(c) != std::string_view::npos;
    });
    if (!out.empty()) out += ' ';
    if (plain) {
      out += word;
    } else {
      out += '\'';
      for (char c : word) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
      out += '\'';
    }
  }
  return out;
}

}  // namespace keel::cluster
