// HCCL rank tables: what keel writes must satisfy the version "1.0" schema (checked here
// independently of keel's own validator), and every kind of broken table must be reported with
// the entry it is in.
#include <gtest/gtest.h>
#include <simdjson.h>

#include <set>

#include "keel/core/file_io.h"
#include "keel/cluster/launch.h"
#include "keel/cluster/rank_table.h"
#include "keel/cluster/topology.h"
#include "test_support.h"

using namespace keel::cluster;
using keel::testing::expect_keel_error;
using keel::testing::TempDir;

namespace {

const char* kHccnConf = R"(# written by hccn_tool
address_0=192.168.100.101
netmask_0=255.255.255.0
netdetect_0=192.168.100.1
address_1=192.168.101.101
netmask_1=255.255.255.0
address_2 = 192.168.102.101
address_3=192.168.103.101

address_4=192.168.100.102
address_5=192.168.101.102
address_6=192.168.102.102
address_7=192.168.103.102
)";

// The documented schema, checked field by field without keel's validator: exactly these keys,
// every value a string, counts and ranks consistent.
void expect_schema(const std::string& json) {
  simdjson::dom::parser parser;
  simdjson::dom::element root;
  ASSERT_EQ(parser.parse(json).get(root), simdjson::SUCCESS) << json;
  simdjson::dom::object top = root.get_object().value();
  std::set<std::string> keys;
  for (auto kv : top) keys.insert(std::string(kv.key));
  EXPECT_EQ(keys, (std::set<std::string>{"version", "server_count", "server_list", "status"}));
  EXPECT_EQ(std::string_view(top["version"].get_string().value()), "1.0");
  EXPECT_EQ(std::string_view(top["status"].get_string().value()), "completed");
  simdjson::dom::array servers = top["server_list"].get_array().value();
  EXPECT_EQ(std::string(top["server_count"].get_string().value()), std::to_string(servers.size()));
  std::set<std::string> ranks;
  size_t devices_total = 0;
  // Named, not iterated straight off get_object().value(): that is a reference into a temporary.
  for (simdjson::dom::element s : servers) {
    std::set<std::string> server_keys;
    simdjson::dom::object server = s.get_object().value();
    for (auto kv : server) {
      server_keys.insert(std::string(kv.key));
      if (kv.key != "device") {
        EXPECT_TRUE(kv.value.is_string()) << kv.key;
      }
    }
    EXPECT_EQ(server_keys, (std::set<std::string>{"server_id", "device", "host_nic_ip"}));
    simdjson::dom::array devices = server["device"].get_array().value();
    for (simdjson::dom::element d : devices) {
      std::set<std::string> device_keys;
      simdjson::dom::object device = d.get_object().value();
      for (auto kv : device) {
        device_keys.insert(std::string(kv.key));
        EXPECT_TRUE(kv.value.is_string()) << kv.key << " must be a string";
      }
      EXPECT_EQ(device_keys, (std::set<std::string>{"device_id", "device_ip", "rank_id"}));
      ranks.insert(std::string(device["rank_id"].get_string().value()));
      ++devices_total;
    }
  }
  for (size_t r = 0; r < devices_total; ++r) EXPECT_TRUE(ranks.count(std::to_string(r))) << "rank " << r;
}

// A valid two-server table to break in one place at a time.
std::string two_servers(
    const std::string& server_count = R"("2")", const std::string& status = R"("completed")",
    const std::string& device_1_1 = R"({"device_id": "1", "device_ip": "10.1.0.2", "rank_id": "3"})") {
  return R"({"version": "1.0", "server_count": )" + server_count + R"(, "status": )" + status + R"(,
  "server_list": [
    {"server_id": "10.0.0.1", "device": [
      {"device_id": "0", "device_ip": "10.0.0.101", "rank_id": "0"},
      {"device_id": "1", "device_ip": "10.0.0.102", "rank_id": "1"}]},
    {"server_id": "10.0.0.2", "device": [
      {"device_id": "0", "device_ip": "10.1.0.1", "rank_id": "2"},
      )" +
         device_1_1 + R"(]}]})";
}

std::vector<std::string> errors_of(const std::string& json, std::optional<HcclTopology> topology = std::nullopt) {
  return check_rank_table(json, "t.json", topology).errors;
}

// Exactly one error, containing every fragment.
void expect_one_error(const std::string& json, std::initializer_list<std::string> fragments) {
  auto errors = errors_of(json);
  ASSERT_EQ(errors.size(), 1u) << (errors.empty() ? std::string("no error") : errors[0] + " | " + errors.back());
  for (const auto& f : fragments) EXPECT_NE(errors[0].find(f), std::string::npos) << errors[0] << "\nlacks: " << f;
}

RankTableRequest single_server(int npus, const std::string& hccn) {
  RankTableRequest r;
  r.npu_count = npus;
  r.server_id = "10.0.0.1";
  r.hccn_conf_path = hccn;
  return r;
}

}  // namespace

// --- hccn.conf ---------------------------------------------------------------------------------

TEST(HccnConf, ReadsDeviceAddresses) {
  TempDir dir;
  keel::write_file_atomic(dir / "hccn.conf", kHccnConf);
  auto addresses = read_hccn_conf(dir / "hccn.conf");
  ASSERT_TRUE(addresses.has_value());
  EXPECT_EQ(addresses->size(), 8u);
  EXPECT_EQ(addresses->at(2), "192.168.102.101");  // spaces around '=' tolerated
  EXPECT_EQ(addresses->at(7), "192.168.103.102");
  EXPECT_FALSE(read_hccn_conf(dir / "absent.conf").has_value());
}

TEST(HccnConf, BadLinesNameFileAndLine) {
  expect_keel_error([] { parse_hccn_conf("address_0=192.168.1.1\naddress_x=1.2.3.4\n", "h.conf"); },
                    {"h.conf:2", "address_x", "address_<device id"});
  expect_keel_error([] { parse_hccn_conf("address_0=192.168.1.300\n", "h.conf"); }, {"h.conf:1", "192.168.1.300"});
  expect_keel_error([] { parse_hccn_conf("address_0=1.1.1.1\naddress_0=1.1.1.2\n", "h.conf"); },
                    {"h.conf:2", "given twice", "line 1"});
  expect_keel_error([] { parse_hccn_conf("address_0 192.168.1.1\n", "h.conf"); }, {"h.conf:1", "key=value"});
}

// --- writing -----------------------------------------------------------------------------------

TEST(RankTableWriter, SingleServerFromHccnConf) {
  TempDir dir;
  keel::write_file_atomic(dir / "hccn.conf", kHccnConf);
  GeneratedRankTable g = build_rank_table(single_server(4, dir / "hccn.conf"));
  EXPECT_TRUE(g.notes.empty());
  std::string json = rank_table_json(g.table);
  expect_schema(json);
  RankTableCheck check = check_rank_table(json, "out.json", HcclTopology::HccsFullMesh);
  EXPECT_TRUE(check.ok()) << (check.errors.empty() ? "" : check.errors[0]);
  ASSERT_EQ(check.table.servers.size(), 1u);
  const auto& devices = check.table.servers[0].devices;
  ASSERT_EQ(devices.size(), 4u);
  EXPECT_EQ(check.table.servers[0].server_id, "10.0.0.1");
  EXPECT_EQ(devices[3].device_id, 3);
  EXPECT_EQ(devices[3].device_ip, "192.168.103.101");
  EXPECT_EQ(devices[3].rank_id, 3);
  EXPECT_NE(json.find(R"("device_id": "3", "device_ip": "192.168.103.101", "rank_id": "3")"), std::string::npos)
      << json;
}

TEST(RankTableWriter, PlaceholderWithoutAddresses) {
  TempDir dir;
  GeneratedRankTable g = build_rank_table(single_server(2, dir / "absent.conf"));
  ASSERT_EQ(g.notes.size(), 1u);
  EXPECT_NE(g.notes[0].find("FILL_IN_DEVICE_IP"), std::string::npos) << g.notes[0];
  EXPECT_NE(g.notes[0].find("devices 0,1"), std::string::npos) << g.notes[0];
  std::string json = rank_table_json(g.table);
  expect_schema(json);
  // Left as is, the check refuses it, naming each device.
  auto errors = errors_of(json);
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_NE(
      errors[1].find("server_list[0] (server_id \"10.0.0.1\").device[1] (device_id \"1\"): device_ip is still the "
                     "placeholder"),
      std::string::npos)
      << errors[1];
}

TEST(RankTableWriter, GivenDeviceIpsWinAndConflictsAreNoted) {
  TempDir dir;
  keel::write_file_atomic(dir / "hccn.conf", kHccnConf);
  RankTableRequest r = single_server(2, dir / "hccn.conf");
  r.device_ips = {"192.168.100.101", "172.16.0.9"};
  GeneratedRankTable g = build_rank_table(r);
  EXPECT_EQ(g.table.servers[0].devices[1].device_ip, "172.16.0.9");
  ASSERT_EQ(g.notes.size(), 1u);
  EXPECT_NE(g.notes[0].find("device 1: using the given IP 172.16.0.9, not 192.168.101.101"), std::string::npos);
  r.device_ips = {"192.168.100.101"};
  expect_keel_error([&] { build_rank_table(r); }, {"1 device IPs given for 2 devices"});
  r.device_ips = {"192.168.100.101", "192.168.100.101"};
  expect_keel_error([&] { build_rank_table(r); }, {"device 1", "already used"});
}

TEST(RankTableWriter, TopologiesDecideTheDeviceSets) {
  TempDir dir;
  RankTableRequest r = single_server(8, dir / "absent.conf");
  r.topology = HcclTopology::Pcie;
  EXPECT_EQ(build_rank_table(r).table.device_count(), 8);
  r.npu_count = 0;
  r.device_ids = {7, 6, 5, 4};  // one island, given out of order: ranks go in device order
  r.device_ips = {"10.0.0.7", "10.0.0.6", "10.0.0.5", "10.0.0.4"};  // each device keeps its address
  auto table = build_rank_table(r).table;
  EXPECT_EQ(table.servers[0].devices[0].device_id, 4);
  EXPECT_EQ(table.servers[0].devices[0].device_ip, "10.0.0.4");
  EXPECT_EQ(table.servers[0].devices[0].rank_id, 0);
  EXPECT_EQ(table.servers[0].devices[3].device_ip, "10.0.0.7");
  r.device_ips = {};
  r.device_ids = {2, 3, 4, 5};
  expect_keel_error([&] { build_rank_table(r); }, {"--topology pcie", "span the two HCCS islands", "2,3,4,5"});
  r.device_ids = {0, 8};
  expect_keel_error([&] { build_rank_table(r); }, {"device 8 does not exist in a pcie server"});
  r.device_ids = {-1, 0};
  expect_keel_error([&] { build_rank_table(r); }, {"device -1 is not a device id"});
  r.device_ids = {1, 1};
  expect_keel_error([&] { build_rank_table(r); }, {"a device appears twice"});
  r.device_ids = {2, 3, 4, 5};
  r.topology = HcclTopology::HccsFullMesh;
  EXPECT_EQ(build_rank_table(r).table.device_count(), 4);
  r.device_ids = {};
  r.npu_count = 16;
  EXPECT_EQ(build_rank_table(r).table.device_count(), 16);
  r.npu_count = 17;
  expect_keel_error([&] { build_rank_table(r); }, {"device 16 does not exist in a hccs_full_mesh server"});
  r.npu_count = 0;
  expect_keel_error([&] { build_rank_table(r); }, {"how many NPUs", "--npu-count"});
  r.npu_count = 4;
  r.device_ids = {0, 1};
  expect_keel_error([&] { build_rank_table(r); }, {"4 NPUs asked for, but 2 devices listed"});
  r.device_ids = {};
  r.server_id = "node-1";
  expect_keel_error([&] { build_rank_table(r); }, {"server_id 'node-1'", "IP address"});
  EXPECT_EQ(hccl_topology_from_name("pcie"), HcclTopology::Pcie);
  expect_keel_error([] { hccl_topology_from_name("nvlink"); }, {"topology 'nvlink'", "hccs_full_mesh", "pcie"});
}

TEST(RankTableWriter, SeveralServersFromAServersFile) {
  TempDir dir;
  keel::write_file_atomic(dir / "node2-hccn.conf", kHccnConf);
  std::string servers =
      "# server_id  settings\n"
      "10.0.0.1 npus=2 device_ips=192.168.1.1,192.168.1.2\n"
      "10.0.0.2 slots=2 hccn_conf=" +
      dir / "node2-hccn.conf" +
      "   # an OpenMPI-style slots count\n"
      "10.0.0.3\tdevices=4,5\n";  // tab-separated, as hand-written files often are
  RankTableRequest r;
  r.topology = HcclTopology::Pcie;
  r.servers = parse_servers_file(servers, "servers.txt");
  GeneratedRankTable g = build_rank_table(r);
  ASSERT_EQ(g.table.servers.size(), 3u);
  EXPECT_EQ(g.table.servers[1].devices[1].device_ip, "192.168.101.101");
  EXPECT_EQ(g.table.servers[2].devices[1].device_id, 5);
  EXPECT_EQ(g.table.servers[2].devices[1].rank_id, 5);
  ASSERT_EQ(g.notes.size(), 1u);  // server 3 has no addresses
  EXPECT_NE(g.notes[0].find("server 10.0.0.3"), std::string::npos) << g.notes[0];
  expect_schema(rank_table_json(g.table));
  EXPECT_EQ(hostfile_text(g.table).substr(hostfile_text(g.table).find('\n') + 1),
            "10.0.0.1 slots=2\n10.0.0.2 slots=2\n10.0.0.3 slots=2\n");

  expect_keel_error([] { parse_servers_file("10.0.0.1 npus=2\n10.0.0.1 npus=2 gpus=1\n", "s.txt"); },
                    {"s.txt:2", "unknown key 'gpus'"});
  expect_keel_error([] { parse_servers_file("10.0.0.1 npus=0\n", "s.txt"); }, {"s.txt:1", "npus", "1-16"});
  expect_keel_error([] { parse_servers_file("10.0.0.1 device_ips=1.2.3\n", "s.txt"); }, {"s.txt:1", "'1.2.3'"});
  expect_keel_error([] { parse_servers_file("npus=2\n", "s.txt"); }, {"s.txt:1", "IP address first"});
  expect_keel_error([] { parse_servers_file("\n# none\n", "s.txt"); }, {"s.txt", "found none"});
  RankTableRequest twice;
  twice.npu_count = 1;
  twice.servers = parse_servers_file("10.0.0.1\n10.0.0.1\n", "s.txt");
  expect_keel_error([&] { build_rank_table(twice); }, {"s.txt:2", "listed twice"});
  twice.servers = parse_servers_file("10.0.0.1\n", "s.txt");
  twice.device_ips = {"1.1.1.1"};
  expect_keel_error([&] { build_rank_table(twice); }, {"with --servers give device_ips="});
  RankTableRequest missing_conf;
  missing_conf.npu_count = 1;
  missing_conf.servers = parse_servers_file("10.0.0.1 hccn_conf=/nonexistent/hccn.conf\n", "s.txt");
  expect_keel_error([&] { build_rank_table(missing_conf); }, {"s.txt:1", "/nonexistent/hccn.conf", "no such file"});
}

TEST(RankTableWriter, MpiRankfileMatchesTheTable) {
  TempDir dir;
  RankTableRequest r;
  r.npu_count = 4;
  r.servers = parse_servers_file("10.0.0.1\n10.0.0.2\n", "s.txt");
  RankTable table = build_rank_table(r).table;
  Topology machine = synthetic_topology("pack:2 numa:1 core:8 pu:2");
  std::string text = rankfile_text(table, machine);
  auto entries = parse_rankfile(text, "rankfile");
  ASSERT_EQ(entries.size(), 8u);
  EXPECT_EQ(entries[5].host, "10.0.0.2");
  EXPECT_EQ(entries[5].core_count, 4);  // 16 cores, 4 ranks per server
  EXPECT_NE(text.find("rank 7=10.0.0.2 slot=12-15"), std::string::npos) << text;
}

// --- checking ----------------------------------------------------------------------------------

TEST(RankTableCheck, AcceptsAValidTable) {
  RankTableCheck check = check_rank_table(two_servers(), "t.json");
  EXPECT_TRUE(check.ok()) << (check.errors.empty() ? "" : check.errors[0]);
  EXPECT_TRUE(check.notes.empty());
  EXPECT_EQ(check.table.device_count(), 4);
  EXPECT_EQ(check.table.servers[1].devices[1].rank_id, 3);
}

TEST(RankTableCheck, IntegerRankIdsAreAcceptedWithANote) {
  RankTableCheck check = check_rank_table(
      two_servers(R"("2")", R"("completed")", R"({"device_id": "1", "device_ip": "10.1.0.2", "rank_id": 3})"),
      "t.json");
  EXPECT_TRUE(check.ok()) << (check.errors.empty() ? "" : check.errors[0]);
  ASSERT_EQ(check.notes.size(), 1u);
  EXPECT_NE(check.notes[0].find("rank_id is an integer"), std::string::npos);
  EXPECT_EQ(check.table.servers[1].devices[1].rank_id, 3);
}

TEST(RankTableCheck, StatusVersionAndCounts) {
  expect_one_error(two_servers(R"("2")", R"("initializing")"),
                   {"t.json: \"status\": expected \"completed\"", "initializing"});
  expect_one_error(two_servers(R"("3")"), {"\"server_count\" is \"3\" but server_list has 2 servers"});
  expect_one_error(two_servers(R"(2)"), {"\"server_count\": expected a string such as \"1\", found integer 2"});
  expect_one_error(two_servers(R"("two")"), {"\"server_count\": expected a count", "\"two\""});
  std::string v12 = two_servers();
  v12.replace(v12.find("\"1.0\""), 5, "\"1.2\"");
  expect_one_error(v12, {"\"version\": expected \"1.0\"", "\"1.2\""});
  std::string no_version = two_servers();
  const std::string version_field = "\"version\": \"1.0\", ";
  no_version.replace(no_version.find(version_field), version_field.size(), "");
  expect_one_error(no_version, {"\"version\" is missing"});
}

TEST(RankTableCheck, DuplicateAndMissingRanks) {
  // A duplicate leaves a gap: both are reported.
  auto errors = errors_of(
      two_servers(R"("2")", R"("completed")", R"({"device_id": "1", "device_ip": "10.1.0.2", "rank_id": "1"})"));
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_NE(errors[0].find("server_list[1] (server_id \"10.0.0.2\").device[1] (device_id \"1\"): rank_id 1 duplicates "
                           "t.json: server_list[0] (server_id \"10.0.0.1\").device[1]"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("no device has rank_id 3"), std::string::npos) << errors[1];
  // Rank 3 missing, rank 4 instead: out of range and a gap, both reported.
  errors = errors_of(
      two_servers(R"("2")", R"("completed")", R"({"device_id": "1", "device_ip": "10.1.0.2", "rank_id": "4"})"));
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_NE(
      errors[0].find("device[1] (device_id \"1\"): rank_id 4 is out of range: the table lists 4 devices, so ranks "
                     "must be 0-3"),
      std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("ranks are not contiguous: no device has rank_id 3"), std::string::npos) << errors[1];
  expect_one_error(
      two_servers(R"("2")", R"("completed")", R"({"device_id": "1", "device_ip": "10.1.0.2", "rank_id": -3})"),
      {"device[1] (device_id \"1\"): rank_id: expected a non-negative rank, found integer -3"});
  expect_one_error(
      two_servers(R"("2")", R"("completed")", R"({"device_id": "1", "device_ip": "10.1.0.2", "rank_id": "x3"})"),
      {"rank_id: expected a rank such as \"0\", found \"x3\""});
  expect_one_error(
      two_servers(R"("2")", R"("completed")", R"({"device_id": "1", "device_ip": "10.1.0.2", "rank_id": 3.0})"),
      {"rank_id: expected a string such as \"0\", found number 3.0"});
  // An unreadable rank_id is the one error: the gap it leaves is not reported again.
  expect_one_error(two_servers(R"("2")", R"("completed")", R"({"device_id": "1", "device_ip": "10.1.0.2"})"),
                   {"device[1] (device_id \"1\"): \"rank_id\" is missing"});
}

TEST(RankTableCheck, DuplicateDevicesServersAndAddresses) {
  expect_one_error(
      two_servers(R"("2")", R"("completed")", R"({"device_id": "0", "device_ip": "10.1.0.2", "rank_id": "3"})"),
      {"server_list[1] (server_id \"10.0.0.2\").device[1] (device_id \"0\"): device_id duplicates",
       ".device[0] (device_id \"0\")"});
  expect_one_error(
      two_servers(R"("2")", R"("completed")", R"({"device_id": "1", "device_ip": "10.0.0.101", "rank_id": "3"})"),
      {"device[1] (device_id \"1\"): device_ip 10.0.0.101 duplicates t.json: server_list[0]"});
  std::string same_server = two_servers();
  same_server.replace(same_server.find("10.0.0.2"), 8, "10.0.0.1");
  expect_one_error(same_server,
                   {"server_list[1] (server_id \"10.0.0.1\"): server_id duplicates t.json: server_list[0]"});
  std::string bad_server = two_servers();
  bad_server.replace(bad_server.find("10.0.0.2"), 8, "node-two");
  expect_one_error(bad_server,
                   {"server_list[1] (server_id \"node-two\"): server_id: expected the server's IP address"});
  expect_one_error(
      two_servers(R"("2")", R"("completed")", R"({"device_id": 1, "device_ip": "10.1.0.2", "rank_id": "3"})"),
      {"server_list[1] (server_id \"10.0.0.2\").device[1]: \"device_id\": expected a string such as \"0\", "
       "found integer 1"});
  expect_one_error(
      two_servers(R"("2")", R"("completed")", R"({"device_id": "1", "device_ip": "10.1.0", "rank_id": "3"})"),
      {"device_ip: expected an IP address, found \"10.1.0\""});
  expect_one_error(two_servers(R"("2")", R"("completed")",
                               R"({"device_id": "1", "device_id": "1", "device_ip": "10.1.0.2", "rank_id": "3"})"),
                   {"device[1]: key \"device_id\" appears twice"});
}

TEST(RankTableCheck, StructuralProblems) {
  expect_one_error("{\"version\": ", {"t.json: expected valid JSON"});
  expect_one_error("[]", {"expected a JSON object at the top level, found array"});
  expect_one_error(R"({"version": "1.0", "server_count": "0", "status": "completed", "server_list": []})",
                   {"\"server_list\" is empty"});
  expect_one_error(R"({"version": "1.0", "server_count": "1", "status": "completed"})", {"\"server_list\" is missing"});
  expect_one_error(R"({"version": "1.0", "server_count": "1", "status": "completed", "server_list": {}})",
                   {"\"server_list\": expected an array of servers, found object"});
  expect_one_error(R"({"version": "1.0", "server_count": "1", "status": "completed", "server_list": ["10.0.0.1"]})",
                   {"server_list[0]: expected an object with server_id and device, found string"});
  expect_one_error(
      R"({"version": "1.0", "server_count": "1", "status": "completed", "server_list": [{"server_id": "10.0.0.1", "device": []}]})",
      {"server_list[0] (server_id \"10.0.0.1\"): \"device\" is empty"});
  expect_one_error(
      R"({"version": "1.0", "server_count": "1", "status": "completed", "server_list": [{"server_id": "10.0.0.1"}]})",
      {"\"device\" is missing"});
  expect_one_error(
      R"({"version": "1.0", "server_count": "1", "status": "completed", "server_list": [{"server_id": "10.0.0.1", "device": [7]}]})",
      {"device[0]: expected an object with device_id, device_ip and rank_id, found integer 7"});
}

TEST(RankTableCheck, TopologyRuleOnRequest) {
  std::string table = R"({"version": "1.0", "server_count": "1", "status": "completed", "server_list": [
      {"server_id": "10.0.0.1", "device": [
        {"device_id": "3", "device_ip": "10.0.0.101", "rank_id": "0"},
        {"device_id": "4", "device_ip": "10.0.0.102", "rank_id": "1"}]}]})";
  EXPECT_TRUE(errors_of(table).empty());
  EXPECT_TRUE(errors_of(table, HcclTopology::HccsFullMesh).empty());
  auto errors = errors_of(table, HcclTopology::Pcie);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].find("server_list[0] (server_id \"10.0.0.1\"): --topology pcie: devices 3,4 span"),
            std::string::npos)
      << errors[0];
}

TEST(RankTableCheck, ReadRankTableListsEveryProblem) {
  TempDir dir;
  keel::write_file_atomic(dir / "bad.json", two_servers(R"("3")", R"("initializing")"));
  expect_keel_error([&] { read_rank_table(dir / "bad.json"); },
                    {"bad.json: not a valid rank table (2 problems)", "\"status\"", "\"server_count\""});
  keel::write_file_atomic(dir / "good.json", two_servers());
  EXPECT_EQ(read_rank_table(dir / "good.json").device_count(), 4);
  expect_keel_error([&] { read_rank_table(dir / "absent.json"); }, {"absent.json"});
}

TEST(RankTable, IpAddresses) {
  EXPECT_TRUE(is_ip_address("192.168.100.101"));
  EXPECT_TRUE(is_ip_address("fe80::1"));
  EXPECT_FALSE(is_ip_address("192.168.100"));
  EXPECT_FALSE(is_ip_address(" 10.0.0.1"));
  EXPECT_FALSE(is_ip_address(""));
}
