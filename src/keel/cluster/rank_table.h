// HCCL rank tables (rank_table.json, the documented version "1.0" schema) and the files around
// them: /etc/hccn.conf (each NPU's RoCE address), a servers list for multi-server jobs, and the
// MPI hostfile of the same servers.
//
//   {"version": "1.0", "server_count": "1", "status": "completed",
//    "server_list": [{"server_id": "10.0.0.1", "host_nic_ip": "reserve",
//                     "device": [{"device_id": "0", "device_ip": "192.168.100.101", "rank_id": "0"}, ...]}]}
//
// Every value is a string. A rank table is an untrusted file: check_rank_table reports every
// problem with the entry it is in, and accepts rank_id as an integer too, as tables merged by
// other tools have it.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace keel::cluster {

// How the NPUs inside one server are linked, which decides which device sets may form a job and
// in what order ranks go. rank_table.json has no field for it: HCCL finds the links itself.
//   hccs_full_mesh: every NPU has a direct HCCS link to every other (Atlas 800T A2 / Ascend
//                   910B: 8 NPUs; up to 16 per server): any set of devices is one HCCS domain.
//   pcie:           HCCS islands of 4 joined by PCIe (Atlas 800 training server, Ascend 910:
//                   devices 0-3 and 4-7): a job keeps to one island or takes all 8, as Huawei's
//                   hccl_tools and scheduler require, so only the two island-crossing ring
//                   edges use PCIe.
enum class HcclTopology { HccsFullMesh, Pcie };
HcclTopology hccl_topology_from_name(std::string_view name);  // keel::Error listing the names
std::string_view hccl_topology_name(HcclTopology topology);
// Empty when `device_ids` can form one server's part of a job under `topology`, else why not.
std::string device_set_problem(HcclTopology topology, const std::vector<int>& device_ids);

inline constexpr std::string_view kDeviceIpPlaceholder = "FILL_IN_DEVICE_IP";
inline constexpr const char* kHccnConfPath = "/etc/hccn.conf";

struct RankTableDevice {
  int device_id = 0;
  std::string device_ip;
  int rank_id = 0;
};

struct RankTableServer {
  std::string server_id;
  std::vector<RankTableDevice> devices;
};

struct RankTable {
  std::vector<RankTableServer> servers;
  int device_count() const;
};

// /etc/hccn.conf as hccn_tool writes it: `address_<device>=<ip>` lines (netmask_N, gateway_N,
// netdetect_N and other keys are read past). Returns device -> address.
std::map<int, std::string> parse_hccn_conf(std::string_view text, const std::string& path);
// nullopt when the file does not exist (a machine without NPUs, or a container without the file).
std::optional<std::map<int, std::string>> read_hccn_conf(const std::string& path);

// One server of a multi-server job; one line of a servers file:
//   <server_id> [npus=N] [devices=0,1,2,3] [device_ips=IP,IP,...] [hccn_conf=FILE]
// `slots=N` is read as npus=N so that an OpenMPI hostfile is a servers file too.
struct ServerSpec {
  std::string server_id;
  int npu_count = 0;                    // 0: RankTableRequest::npu_count
  std::vector<int> device_ids;          // empty: 0 .. npu_count-1
  std::vector<std::string> device_ips;  // empty: from hccn_conf, else the placeholder
  std::string hccn_conf;                // that server's /etc/hccn.conf, copied here
  std::string where;                    // "servers.txt:3", for messages
};
std::vector<ServerSpec> parse_servers_file(std::string_view text, const std::string& path);

struct RankTableRequest {
  HcclTopology topology = HcclTopology::HccsFullMesh;
  int npu_count = 0;                           // per server
  std::vector<int> device_ids;                 // single server: --devices
  std::vector<std::string> device_ips;         // single server: --device-ips (wins over hccn.conf)
  std::string server_id;                       // single server: empty = this host's address
  std::vector<ServerSpec> servers;             // --servers; empty = this machine alone
  std::string hccn_conf_path = kHccnConfPath;  // single server
};

struct GeneratedRankTable {
  RankTable table;
  std::vector<std::string> notes;  // what the user must still do (placeholders) or should know
};
GeneratedRankTable build_rank_table(const RankTableRequest& request);

std::string rank_table_json(const RankTable& table);

struct RankTableCheck {
  RankTable table;                  // what could be read
  std::vector<std::string> errors;  // each names its entry: server_list[1].device[3] ...
  std::vector<std::string> notes;   // accepted, but not as the schema has it
  bool ok() const { return errors.empty(); }
};
// `topology` adds the per-server device-set rule of that topology to the checks.
RankTableCheck check_rank_table(std::string_view json, const std::string& path,
                                std::optional<HcclTopology> topology = std::nullopt);
// check_rank_table that throws keel::Error listing every error.
RankTable read_rank_table(const std::string& path, std::optional<HcclTopology> topology = std::nullopt);

// OpenMPI hostfile for the same servers: `<server_id> slots=<devices>` per line.
std::string hostfile_text(const RankTable& table);

// This host's first non-loopback IPv4 address (what hccl_tools uses as server_id); empty if none.
std::string local_host_address();
bool is_ip_address(std::string_view text);

}  // namespace keel::cluster
