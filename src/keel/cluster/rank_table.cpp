#include "keel/core/json_text.h"
#include "keel/cluster/rank_table.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <simdjson.h>

#include <algorithm>
#include <charconv>
#include <set>

#include "keel/core/error.h"
#include "keel/core/file_io.h"

namespace keel::cluster {
namespace {

namespace dom = simdjson::dom;

constexpr int kMaxDeviceId = 63;         // device ids are small: 0-7 per server today, 0-15 on A3
constexpr int kMaxFullMeshDevices = 16;  // the largest HCCS server (Atlas A3, 16 NPUs)
constexpr int kPcieIslandSize = 4;       // Atlas 800 (Ascend 910): HCCS islands 0-3 and 4-7
constexpr int kPcieServerDevices = 8;
constexpr int64_t kMaxRank = (int64_t(1) << 31) - 1;

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

// A non-negative decimal made of digits only (no sign, no spaces), at most `max`.
std::optional<int64_t> decimal(std::string_view text, int64_t max) {
  if (text.empty() || text.size() > 18) return std::nullopt;
  int64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || text.front() == '-' || text.front() == '+')
    return std::nullopt;
  if (value < 0 || value > max) return std::nullopt;
  return value;
}

std::vector<std::string_view> split(std::string_view text, char separator) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    size_t end = text.find(separator, start);
    parts.push_back(trim(text.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start)));
    if (end == std::string_view::npos) return parts;
    start = end + 1;
  }
}

}  // namespace

// --- topologies --------------------------------------------------------------------------------

HcclTopology hccl_topology_from_name(std::string_view name) {
  if (name == "hccs_full_mesh") return HcclTopology::HccsFullMesh;
  if (name == "pcie") return HcclTopology::Pcie;
  fail(
      "topology '{}': expected hccs_full_mesh (every NPU of a server linked to every other by HCCS, e.g. Atlas "
      "800T A2) or pcie (HCCS islands of 4 joined by PCIe, e.g. Atlas 800 with Ascend 910)",
      name);
}

std::string_view hccl_topology_name(HcclTopology topology) {
  return topology == HcclTopology::Pcie ? "pcie" : "hccs_full_mesh";
}

std::string device_set_problem(HcclTopology topology, const std::vector<int>& device_ids) {
  if (device_ids.empty()) return "no devices";
  std::set<int> unique(device_ids.begin(), device_ids.end());
  if (unique.size() != device_ids.size()) return "a device appears twice";
  if (*unique.begin() < 0) return fmt::format("device {} is not a device id (0 or more)", *unique.begin());
  int limit = topology == HcclTopology::Pcie ? kPcieServerDevices - 1 : kMaxFullMeshDevices - 1;
  if (*unique.rbegin() > limit) {
    return fmt::format("device {} does not exist in a {} server (devices 0-{})", *unique.rbegin(),
                       hccl_topology_name(topology), limit);
  }
  if (topology == HcclTopology::HccsFullMesh) return "";
  if (int(unique.size()) == kPcieServerDevices) return "";
  int island = *unique.begin() / kPcieIslandSize;
  for (int d : unique) {
    if (d / kPcieIslandSize != island) {
      return fmt::format(
          "devices {} span the two HCCS islands (0-3 and 4-7) of a pcie server: use up to 4 devices "
          "from one island, or all 8",
          fmt::join(device_ids, ","));
    }
  }
  return "";
}

int RankTable::device_count() const {
  int n = 0;
  for (const auto& s : servers) n += int(s.devices.size());
  return n;
}

bool is_ip_address(std::string_view text) {
  if (text.empty() || text.size() > 64) return false;
  std::string s(text);
  unsigned char buffer[sizeof(in6_addr)];
  return inet_pton(AF_INET, s.c_str(), buffer) == 1 || inet_pton(AF_INET6, s.c_str(), buffer) == 1;
}

std::string local_host_address() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "";
  std::string found;
  for (ifaddrs* a = list; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    if ((a->ifa_flags & IFF_LOOPBACK) || !(a->ifa_flags & IFF_UP)) continue;
    char text[INET_ADDRSTRLEN];
    auto* in = reinterpret_cast<sockaddr_in*>(a->ifa_addr);
    if (inet_ntop(AF_INET, &in->sin_addr, text, sizeof text)) found = text;
  }
  freeifaddrs(list);
  return found;
}

// --- hccn.conf and servers files ----------------------------------------------------------------

std::map<int, std::string> parse_hccn_conf(std::string_view text, const std::string& path) {
  std::map<int, std::string> addresses;
  std::map<int, int> line_of;
  int number = 0;
  for (std::string_view raw : split(text, '\n')) {
    ++number;
    std::string_view line = trim(raw);
    if (line.empty() || line.front() == '#') continue;
    size_t eq = line.find('=');
    if (eq == std::string_view::npos) {
      fail("{}:{}: expected key=value (e.g. address_0=192.168.100.101), found '{}'", path, number, line);
    }
    std::string_view key = trim(line.substr(0, eq)), value = trim(line.substr(eq + 1));
    if (key.substr(0, 8) != "address_") continue;  // netmask_N, gateway_N, netdetect_N, ...
    auto device = decimal(key.substr(8), kMaxDeviceId);
    if (!device) fail("{}:{}: key '{}': expected address_<device id 0-{}>", path, number, key, kMaxDeviceId);
    if (!is_ip_address(value)) fail("{}:{}: {}: expected an IP address, found '{}'", path, number, key, value);
    if (auto it = line_of.find(int(*device)); it != line_of.end()) {
      fail("{}:{}: {} given twice (first on line {})", path, number, key, it->second);
    }
    line_of[int(*device)] = number;
    addresses[int(*device)] = std::string(value);
  }
  return addresses;
}

std::optional<std::map<int, std::string>> read_hccn_conf(const std::string& path) {
  if (!path_exists(path)) return std::nullopt;
  return parse_hccn_conf(read_file(path), path);
}

std::vector<ServerSpec> parse_servers_file(std::string_view text, const std::string& path) {
  std::vector<ServerSpec> servers;
  int number = 0;
  for (std::string_view raw : split(text, '\n')) {
    ++number;
    std::string_view line = trim(raw.substr(0, raw.find('#')));
    if (line.empty()) continue;
    ServerSpec spec;
    spec.where = fmt::format("{}:{}", path, number);
    std::string spaced(line);
    std::replace(spaced.begin(), spaced.end(), '\t', ' ');
    std::vector<std::string_view> words;
    for (std::string_view w : split(spaced, ' '))
      if (!w.empty()) words.push_back(w);
    spec.server_id = std::string(words.front());
    if (spec.server_id.find('=') != std::string::npos) {
      fail("{}: expected the server's IP address first, then key=value settings; found '{}'", spec.where,
           spec.server_id);
    }
    std::set<std::string_view> seen;
    for (size_t i = 1; i < words.size(); ++i) {
      size_t eq = words[i].find('=');
      if (eq == std::string_view::npos) fail("{}: expected key=value, found '{}'", spec.where, words[i]);
      std::string_view key = words[i].substr(0, eq), value = words[i].substr(eq + 1);
      if (!seen.insert(key == "slots" ? "npus" : key).second) fail("{}: '{}' given twice", spec.where, key);
      if (key == "npus" || key == "slots") {
        auto n = decimal(value, kMaxFullMeshDevices);
        if (!n || *n == 0)
          fail("{}: {}: expected a device count 1-{}, found '{}'", spec.where, key, kMaxFullMeshDevices, value);
        spec.npu_count = int(*n);
      } else if (key == "max_slots") {
        // OpenMPI hostfile key; says nothing about NPUs.
      } else if (key == "devices") {
        for (std::string_view d : split(value, ',')) {
          auto id = decimal(d, kMaxDeviceId);
          if (!id)
            fail("{}: devices: expected device ids 0-{} separated by commas, found '{}'", spec.where, kMaxDeviceId,
                 value);
          spec.device_ids.push_back(int(*id));
        }
      } else if (key == "device_ips") {
        for (std::string_view ip : split(value, ',')) {
          if (!is_ip_address(ip)) fail("{}: device_ips: '{}' is not an IP address", spec.where, ip);
          spec.device_ips.emplace_back(ip);
        }
      } else if (key == "hccn_conf") {
        spec.hccn_conf = std::string(value);
      } else {
        fail("{}: unknown key '{}': expected npus=, devices=, device_ips= or hccn_conf=", spec.where, key);
      }
    }
    servers.push_back(std::move(spec));
  }
  require(!servers.empty(), "{}: expected one line per server (<server_id> [npus=N] ...), found none", path);
  return servers;
}

// --- generating --------------------------------------------------------------------------------

GeneratedRankTable build_rank_table(const RankTableRequest& request) {
  GeneratedRankTable result;
  std::vector<ServerSpec> specs = request.servers;
  bool single = specs.empty();
  if (single) {
    ServerSpec spec;
    spec.server_id = request.server_id.empty() ? local_host_address() : request.server_id;
    if (spec.server_id.empty()) {
      fail("cannot find this host's IP address for server_id: give it with --server-id");
    }
    spec.npu_count = request.npu_count;
    spec.device_ids = request.device_ids;
    spec.device_ips = request.device_ips;
    spec.where = "this server";
    specs.push_back(std::move(spec));
  } else {
    require(request.device_ips.empty() && request.device_ids.empty() && request.server_id.empty(),
            "--device-ips, --devices and --server-id describe one server: with --servers give device_ips=, "
            "devices= on each server's line");
  }

  std::set<std::string> server_ids, device_ips;
  int rank = 0;
  for (const ServerSpec& spec : specs) {
    require(is_ip_address(spec.server_id), "{}: server_id '{}': expected the server's IP address (HCCL's server_id)",
            spec.where, spec.server_id);
    require(server_ids.insert(spec.server_id).second, "{}: server {} is listed twice", spec.where, spec.server_id);

    int npus = spec.npu_count > 0 ? spec.npu_count : request.npu_count;
    std::vector<int> ids = spec.device_ids;
    if (ids.empty()) {
      require(npus > 0, "{}: how many NPUs? give --npu-count{}", spec.where,
              single ? " or --devices" : " or npus= on its line");
      for (int d = 0; d < npus; ++d) ids.push_back(d);
    } else {
      require(npus <= 0 || npus == int(ids.size()), "{}: {} NPUs asked for, but {} devices listed ({})", spec.where,
              npus, ids.size(), fmt::join(ids, ","));
    }
    if (std::string problem = device_set_problem(request.topology, ids); !problem.empty()) {
      fail("{}: --topology {}: {}", spec.where, hccl_topology_name(request.topology), problem);
    }
    // Device addresses: given explicitly, else the server's hccn.conf, else the placeholder.
    std::optional<std::map<int, std::string>> hccn;
    std::string hccn_path = single ? request.hccn_conf_path : spec.hccn_conf;
    if (!hccn_path.empty()) {
      hccn = read_hccn_conf(hccn_path);
      if (!hccn && !single) fail("{}: hccn_conf={}: no such file", spec.where, hccn_path);
    }
    std::vector<std::string> ips = spec.device_ips;
    if (!ips.empty()) {
      require(ips.size() == ids.size(), "{}: {} device IPs given for {} devices ({})", spec.where, ips.size(),
              ids.size(), fmt::join(ids, ","));
      if (hccn) {
        for (size_t i = 0; i < ids.size(); ++i) {
          auto it = hccn->find(ids[i]);
          if (it != hccn->end() && it->second != ips[i]) {
            result.notes.push_back(fmt::format("{}: device {}: using the given IP {}, not {} from {}", spec.where,
                                               ids[i], ips[i], it->second, hccn_path));
          }
        }
      }
    } else {
      std::vector<int> missing;
      for (int d : ids) {
        if (hccn && hccn->count(d)) {
          ips.push_back(hccn->at(d));
        } else {
          ips.emplace_back(kDeviceIpPlaceholder);
          missing.push_back(d);
        }
      }
      if (!missing.empty()) {
        result.notes.push_back(fmt::format(
            "server {}: no address for device{} {}{}: device_ip is \"{}\"; replace it with address_<device> from "
            "/etc/hccn.conf on that server (hccn_tool -i <device> -ip -g), or give {}",
            spec.server_id, missing.size() == 1 ? "" : "s", fmt::join(missing, ","),
            hccn                ? fmt::format(" in {}", hccn_path)
            : hccn_path.empty() ? std::string()
                                : fmt::format(" ({} not found)", hccn_path),
            kDeviceIpPlaceholder, single ? "--device-ips" : "device_ips= or hccn_conf= on its line"));
      }
    }

    RankTableServer server;
    server.server_id = spec.server_id;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ips[i] != kDeviceIpPlaceholder) {
        require(device_ips.insert(ips[i]).second, "{}: device {}: IP {} is already used by another device", spec.where,
                ids[i], ips[i]);
      }
      server.devices.push_back({ids[i], ips[i], 0});
    }
    // pcie: island by island, so that ring neighbours share an island and only two ring edges
    // cross PCIe. (Each device keeps its own address: the order changes after they are paired.)
    if (request.topology == HcclTopology::Pcie) {
      std::sort(server.devices.begin(), server.devices.end(),
                [](const RankTableDevice& a, const RankTableDevice& b) { return a.device_id < b.device_id; });
    }
    for (auto& device : server.devices) device.rank_id = rank++;
    result.table.servers.push_back(std::move(server));
  }
  return result;
}

std::string rank_table_json(const RankTable& table) {
  std::string out = "{\n";
  out += "    \"version\": \"1.0\",\n";
  out += fmt::format("    \"server_count\": \"{}\",\n", table.servers.size());
  out += "    \"server_list\": [";
  for (size_t s = 0; s < table.servers.size(); ++s) {
    const RankTableServer& server = table.servers[s];
    out += s == 0 ? "\n" : ",\n";
    out += "        {\n";
    out += fmt::format("            \"server_id\": \"{}\",\n", json_escaped(server.server_id));
    out += "            \"device\": [";
    for (size_t d = 0; d < server.devices.size(); ++d) {
      const RankTableDevice& device = server.devices[d];
      out += d == 0 ? "\n" : ",\n";
      out += fmt::format("                {{\"device_id\": \"{}\", \"device_ip\": \"{}\", \"rank_id\": \"{}\"}}",
                         device.device_id, json_escaped(device.device_ip), device.rank_id);
    }
    out += "\n            ],\n";
    // hccl_tools and Huawei's template carry it; HCCL reads it as "not used".
    out += "            \"host_nic_ip\": \"reserve\"\n";
    out += "        }";
  }
  out += "\n    ],\n";
  out += "    \"status\": \"completed\"\n";
  out += "}\n";
  return out;
}

std::string hostfile_text(const RankTable& table) {
  std::string out = "# OpenMPI hostfile written by keel rank-table: one line per server, one slot per NPU\n";
  for (const auto& server : table.servers) out += fmt::format("{} slots={}\n", server.server_id, server.devices.size());
  return out;
}

// --- checking ----------------------------------------------------------------------------------

namespace {

// The fields of one JSON object, with duplicate keys reported (JSON parsers disagree on which
// duplicate wins, so a table with one means different things to different tools).
std::map<std::string_view, dom::element> fields_of(dom::object object, const std::string& where,
                                                   std::vector<std::string>& errors) {
  std::map<std::string_view, dom::element> fields;
  for (dom::key_value_pair kv : object) {
    if (!fields.emplace(kv.key, kv.value).second)
      errors.push_back(fmt::format("{}: key \"{}\" appears twice", where, kv.key));
  }
  return fields;
}

std::optional<dom::element> field(const std::map<std::string_view, dom::element>& fields, std::string_view key) {
  auto it = fields.find(key);
  if (it == fields.end()) return std::nullopt;
  return it->second;
}

}  // namespace

namespace {

// check_rank_table's walk over one table, a step per level of the schema (the top level, a
// server, a device, its rank), collecting every problem rather than stopping at the first, with
// the cross-entry state (ids seen so far, where) in members.
class RankTableChecker {
 public:
  RankTableChecker(const std::string& path, std::optional<HcclTopology> topology) : path_(path), topology_(topology) {}

  RankTableCheck run(std::string_view json) {
    dom::parser parser;
    dom::element root;
    if (auto e = parser.parse(json.data(), json.size()).get(root)) {
      error(fmt::format("{}: expected valid JSON: {}", path_, simdjson::error_message(e)));
      return std::move(check_);
    }
    dom::object top;
    if (root.get_object().get(top)) {
      error(fmt::format("{}: expected a JSON object at the top level, found {}", path_, json_type_name(root)));
      return std::move(check_);
    }
    auto fields = fields_of(top, path_, check_.errors);
    const std::optional<int64_t> server_count = check_header(fields);
    auto list = field(fields, "server_list");
    dom::array servers;
    if (!list) {
      error(fmt::format("{}: \"server_list\" is missing (expected an array of servers)", path_));
      return std::move(check_);
    }
    if (list->get_array().get(servers)) {
      error(fmt::format("{}: \"server_list\": expected an array of servers, found {}", path_, json_describe(*list)));
      return std::move(check_);
    }
    const size_t server_total = servers.size();
    if (server_total == 0) error(fmt::format("{}: \"server_list\" is empty (expected at least one server)", path_));
    if (server_count && size_t(*server_count) != server_total) {
      error(fmt::format("{}: \"server_count\" is \"{}\" but server_list has {} server{}", path_, *server_count,
                        server_total, server_total == 1 ? "" : "s"));
    }
    size_t s = 0;
    for (dom::element server : servers) check_server(server, s++);
    check_ranks_contiguous();
    return std::move(check_);
  }

 private:
  using Fields = std::map<std::string_view, dom::element>;

  void error(std::string text) { check_.errors.push_back(std::move(text)); }

  // A required string field; nullopt (and an error) when absent or not a string.
  std::optional<std::string_view> string_field(const Fields& f, std::string_view key, const std::string& where,
                                               std::string_view example) {
    auto v = field(f, key);
    if (!v) {
      error(fmt::format("{}: \"{}\" is missing (expected a string such as \"{}\")", where, key, example));
      return std::nullopt;
    }
    std::string_view s;
    if (v->get_string().get(s)) {
      error(fmt::format("{}: \"{}\": expected a string such as \"{}\", found {}", where, key, example,
                        json_describe(*v)));
      return std::nullopt;
    }
    return s;
  }

  // version, status and server_count; returns the count when it reads as one.
  std::optional<int64_t> check_header(const Fields& fields) {
    if (auto version = string_field(fields, "version", path_, "1.0"); version && *version != "1.0") {
      error(fmt::format("{}: \"version\": expected \"1.0\" (the schema keel reads and writes), found \"{}\"", path_,
                        *version));
    }
    if (auto status = string_field(fields, "status", path_, "completed"); status && *status != "completed") {
      error(
          fmt::format("{}: \"status\": expected \"completed\", found \"{}\" (HCCL waits on a table that is not "
                      "completed; \"initializing\" means the scheduler has not finished writing it)",
                      path_, *status));
    }
    std::optional<int64_t> server_count;
    if (auto count = string_field(fields, "server_count", path_, "1")) {
      server_count = decimal(*count, kMaxRank);
      if (!server_count)
        error(fmt::format("{}: \"server_count\": expected a count such as \"2\", found \"{}\"", path_, *count));
    }
    return server_count;
  }

  void check_server(dom::element element, size_t index) {
    std::string where = fmt::format("{}: server_list[{}]", path_, index);
    dom::object object;
    if (element.get_object().get(object)) {
      error(fmt::format("{}: expected an object with server_id and device, found {}", where, json_describe(element)));
      return;
    }
    auto fields = fields_of(object, where, check_.errors);
    RankTableServer server;
    if (auto id = string_field(fields, "server_id", where, "10.0.0.1")) {
      server.server_id = std::string(*id);
      where += fmt::format(" (server_id \"{}\")", server.server_id);
      if (!is_ip_address(*id)) error(fmt::format("{}: server_id: expected the server's IP address", where));
      auto [it, inserted] = server_where_.emplace(server.server_id, where);
      if (!inserted) error(fmt::format("{}: server_id duplicates {}", where, it->second));
    }
    auto device_list = field(fields, "device");
    dom::array devices;
    if (!device_list) {
      error(fmt::format("{}: \"device\" is missing (expected an array of devices)", where));
    } else if (device_list->get_array().get(devices)) {
      error(fmt::format("{}: \"device\": expected an array of devices, found {}", where, json_describe(*device_list)));
    } else {
      if (devices.size() == 0) error(fmt::format("{}: \"device\" is empty (expected at least one device)", where));
      listed_ += int64_t(devices.size());
      std::map<int64_t, std::string> device_where;  // device_id -> first entry on this server
      size_t d = 0;
      for (dom::element device : devices)
        if (auto checked = check_device(device, fmt::format("{}.device[{}]", where, d++), server, device_where))
          server.devices.push_back(std::move(*checked));
      check_device_set(where, device_where);
    }
    check_.table.servers.push_back(std::move(server));
  }

  // The device when every field of it reads; errors for each that does not.
  std::optional<RankTableDevice> check_device(dom::element element, std::string entry, const RankTableServer& server,
                                              std::map<int64_t, std::string>& device_where) {
    dom::object object;
    if (element.get_object().get(object)) {
      error(fmt::format("{}: expected an object with device_id, device_ip and rank_id, found {}", entry,
                        json_describe(element)));
      return std::nullopt;
    }
    auto fields = fields_of(object, entry, check_.errors);
    RankTableDevice device;
    bool complete = true;
    if (auto id = string_field(fields, "device_id", entry, "0")) {
      auto value = decimal(*id, kMaxDeviceId);
      if (!value) {
        error(fmt::format("{}: device_id: expected a device number 0-{}, found \"{}\"", entry, kMaxDeviceId, *id));
        complete = false;
      } else {
        device.device_id = int(*value);
        entry += fmt::format(" (device_id \"{}\")", *value);
        auto [it, inserted] = device_where.emplace(*value, entry);
        if (!inserted) error(fmt::format("{}: device_id duplicates {}", entry, it->second));
      }
    } else {
      complete = false;
    }
    if (auto ip = string_field(fields, "device_ip", entry, "192.168.100.101")) {
      device.device_ip = std::string(*ip);
      if (*ip == kDeviceIpPlaceholder) {
        error(
            fmt::format("{}: device_ip is still the placeholder \"{}\": replace it with address_{} from "
                        "/etc/hccn.conf on server {}",
                        entry, kDeviceIpPlaceholder, device.device_id, server.server_id));
      } else if (!is_ip_address(*ip)) {
        error(fmt::format("{}: device_ip: expected an IP address, found \"{}\"", entry, *ip));
      } else {
        auto [it, inserted] = ip_where_.emplace(device.device_ip, entry);
        if (!inserted) error(fmt::format("{}: device_ip {} duplicates {}", entry, *ip, it->second));
      }
    } else {
      complete = false;
    }
    const std::optional<int64_t> rank = read_rank(fields, entry);
    if (rank) {
      device.rank_id = int(*rank);
      auto [it, inserted] = rank_where_.emplace(*rank, entry);
      if (!inserted) error(fmt::format("{}: rank_id {} duplicates {}", entry, *rank, it->second));
    } else {
      all_ranks_read_ = false;
      complete = false;
    }
    return complete ? std::optional(std::move(device)) : std::nullopt;
  }

  // rank_id: a string per the schema; an integer is accepted, as merged tables have it.
  std::optional<int64_t> read_rank(const Fields& fields, const std::string& entry) {
    auto v = field(fields, "rank_id");
    if (!v) {
      error(fmt::format("{}: \"rank_id\" is missing (expected a string such as \"0\")", entry));
      return std::nullopt;
    }
    if (v->is_string()) {
      std::string_view text = v->get_string().value_unsafe();
      auto rank = decimal(text, kMaxRank);
      if (!rank) error(fmt::format("{}: rank_id: expected a rank such as \"0\", found \"{}\"", entry, text));
      return rank;
    }
    if (!v->is_int64() && !v->is_uint64()) {
      error(fmt::format("{}: rank_id: expected a string such as \"0\", found {}", entry, json_describe(*v)));
      return std::nullopt;
    }
    int64_t value = 0;
    uint64_t unsigned_value = 0;
    bool fits = v->is_int64() ? (v->get_int64().get(value) == simdjson::SUCCESS)
                              : (v->get_uint64().get(unsigned_value) == simdjson::SUCCESS &&
                                 unsigned_value <= uint64_t(kMaxRank) && (value = int64_t(unsigned_value), true));
    if (!fits || value < 0 || value > kMaxRank) {
      error(fmt::format("{}: rank_id: expected a non-negative rank, found {}", entry, json_describe(*v)));
      return std::nullopt;
    }
    if (!integer_rank_noted_) {
      check_.notes.push_back(
          fmt::format("{}: rank_id is an integer; HCCL's schema has strings (\"{}\"), "
                      "keel accepts both",
                      entry, value));
      integer_rank_noted_ = true;
    }
    return value;
  }

  // --topology: the server's devices must form a set that topology can connect.
  void check_device_set(const std::string& where, const std::map<int64_t, std::string>& device_where) {
    if (!topology_ || device_where.empty()) return;
    std::vector<int> ids;
    for (const auto& [id, ignored] : device_where) ids.push_back(int(id));
    if (std::string problem = device_set_problem(*topology_, ids); !problem.empty())
      error(fmt::format("{}: --topology {}: {}", where, hccl_topology_name(*topology_), problem));
  }

  // Ranks must be exactly 0 .. N-1 for the N devices listed.
  void check_ranks_contiguous() {
    if (rank_where_.empty()) return;
    std::vector<int64_t> missing;
    for (int64_t r = 0; r < listed_ && missing.size() <= 10; ++r)
      if (!rank_where_.count(r)) missing.push_back(r);
    for (const auto& [rank, where] : rank_where_) {
      if (rank >= listed_) {
        error(fmt::format("{}: rank_id {} is out of range: the table lists {} devices, so ranks must be 0-{}", where,
                          rank, listed_, listed_ - 1));
      }
    }
    if (!missing.empty() && all_ranks_read_) {
      error(fmt::format("{}: ranks are not contiguous: no device has rank_id {}{} (expected 0-{}, one per device)",
                        path_, fmt::join(missing.begin(), missing.begin() + std::min<size_t>(missing.size(), 10), ", "),
                        missing.size() > 10 ? ", ..." : "", listed_ - 1));
    }
  }

  const std::string& path_;
  std::optional<HcclTopology> topology_;
  RankTableCheck check_;
  std::map<std::string, std::string> server_where_;  // server_id -> first entry
  std::map<std::string, std::string> ip_where_;      // device_ip -> first entry
  std::map<int64_t, std::string> rank_where_;        // rank_id -> first entry
  bool integer_rank_noted_ = false;
  int64_t listed_ = 0;          // device entries, well-formed or not: the ranks must be 0 .. listed-1
  bool all_ranks_read_ = true;  // a gap left by an unreadable rank_id is that entry's error, not another
};

}  // namespace

RankTableCheck check_rank_table(std::string_view json, const std::string& path, std::optional<HcclTopology> topology) {
  return RankTableChecker(path, topology).run(json);
}

RankTable read_rank_table(const std::string& path, std::optional<HcclTopology> topology) {
  std::string text = read_file(path);
  RankTableCheck check = check_rank_table(text, path, topology);
  if (!check.ok()) {
    std::string message = fmt::format("{}: not a valid rank table ({} problem{}):", path, check.errors.size(),
                                      check.errors.size() == 1 ? "" : "s");
    for (const auto& e : check.errors) message += "\n  " + e;
    throw Error(message);
  }
  return check.table;
}

}  // namespace keel::cluster
