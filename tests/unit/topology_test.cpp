// Topology and rank placement on machines described to hwloc (synthetic strings, XML with a PCIe
// tree) or built by hand, so the inference is tested without the hardware it is about.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sched.h>

#include <algorithm>
#include <thread>

#include "keel/core/file_io.h"
#include "keel/cluster/launch.h"
#include "keel/cluster/topology.h"
#include "test_support.h"

using namespace keel::cluster;
using keel::testing::expect_keel_error;
using keel::testing::TempDir;

namespace {

// Two sockets x two NUMA nodes x two L3 complexes x 4 cores x 2 hardware threads (an EPYC-like box).
const char* kTwoSocket = "pack:2 numa:2 l3:2 core:4 pu:2";

// One core `os` (one hardware thread) in XML; gp_index values only have to be unique.
std::string core_xml(int os) {
  return fmt::format(
      R"(<object type="Core" os_index="{0}" cpuset="0x{1:08x}" complete_cpuset="0x{1:08x}" gp_index="{2}">)"
      R"(<object type="PU" os_index="{0}" cpuset="0x{1:08x}" complete_cpuset="0x{1:08x}" gp_index="{3}"/></object>)",
      os, 1u << os, 1000 + 2 * os, 1001 + 2 * os);
}

std::string bridge_xml(int gp, const char* bus, const char* range, int depth, const std::string& children) {
  return fmt::format(
      R"(<object type="Bridge" gp_index="{}" bridge_type="1-1" depth="{}" bridge_pci="0000:[{}]" pci_busid="{}" )"
      R"(pci_type="0604 [8086:2030] [0000:0000] 00" pci_link_speed="15.75">{}</object>)",
      gp, depth, range, bus, children);
}

std::string device_xml(int gp, const char* bus, const char* type, const std::string& children = "") {
  return fmt::format(
      R"(<object type="PCIDev" gp_index="{}" pci_busid="{}" pci_type="{}" pci_link_speed="31.5">{}</object>)", gp, bus,
      type, children);
}

const char* kH100 = "0302 [10de:2330] [10de:16c1] a1";
const char* kAscend910 = "1200 [19e5:d801] [19e5:0100] 20";

// Socket 0 (cores 0-3, NUMA 0) has two host bridges: the first with a PCIe switch holding GPUs
// 03 and 04 and the NIC, a second root port with GPU 06, and the BMC's VGA; the second with an
// Ascend NPU. Socket 1 (cores 4-7, NUMA 1) has GPU 81.
std::string two_socket_gpu_xml() {
  std::string cores0, cores1;
  for (int c = 0; c < 4; ++c) cores0 += core_xml(c);
  for (int c = 4; c < 8; ++c) cores1 += core_xml(c);
  std::string pci_switch =
      bridge_xml(102, "0000:01:00.0", "02-05", 1,
                 bridge_xml(103, "0000:02:00.0", "03-03", 2, device_xml(104, "0000:03:00.0", kH100)) +
                     bridge_xml(105, "0000:02:01.0", "04-04", 2, device_xml(106, "0000:04:00.0", kH100)) +
                     bridge_xml(107, "0000:02:02.0", "05-05", 2,
                                device_xml(108, "0000:05:00.0", "0207 [15b3:101b] [15b3:0007] 00",
                                           R"(<object type="OSDev" gp_index="109" name="mlx5_0" osdev_type="3"/>)")));
  std::string host0 = R"(<object type="Bridge" gp_index="100" bridge_type="0-1" depth="0" bridge_pci="0000:[00-0f]">)" +
                      bridge_xml(101, "0000:00:01.0", "01-05", 0, pci_switch) +
                      bridge_xml(110, "0000:00:02.0", "06-06", 0, device_xml(111, "0000:06:00.0", kH100)) +
                      device_xml(112, "0000:00:1f.0", "0300 [1a03:2000] [1a03:2000] 52") + "</object>";
  std::string host1 = R"(<object type="Bridge" gp_index="120" bridge_type="0-1" depth="0" bridge_pci="0000:[10-1f]">)" +
                      bridge_xml(121, "0000:10:01.0", "11-11", 0, device_xml(122, "0000:11:00.0", kAscend910)) +
                      "</object>";
  std::string host2 = R"(<object type="Bridge" gp_index="130" bridge_type="0-1" depth="0" bridge_pci="0000:[80-8f]">)" +
                      bridge_xml(131, "0000:80:01.0", "81-81", 0, device_xml(132, "0000:81:00.0", kH100)) + "</object>";
  return fmt::format(R"(<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE topology SYSTEM "hwloc2.dtd">
<topology version="2.0">
<object type="Machine" os_index="0" cpuset="0x000000ff" complete_cpuset="0x000000ff" allowed_cpuset="0x000000ff" nodeset="0x00000003" complete_nodeset="0x00000003" allowed_nodeset="0x00000003" gp_index="1">
<object type="Package" os_index="0" cpuset="0x0000000f" complete_cpuset="0x0000000f" nodeset="0x00000001" complete_nodeset="0x00000001" gp_index="2">
<info name="CPUModel" value="Test CPU   "/>
<object type="NUMANode" os_index="0" cpuset="0x0000000f" complete_cpuset="0x0000000f" nodeset="0x00000001" complete_nodeset="0x00000001" gp_index="3" local_memory="68719476736"/>
<object type="L3Cache" cpuset="0x0000000f" complete_cpuset="0x0000000f" gp_index="4" cache_size="33554432" depth="3" cache_linesize="64" cache_associativity="16" cache_type="0">{}</object>
{}{}
</object>
<object type="Package" os_index="1" cpuset="0x000000f0" complete_cpuset="0x000000f0" nodeset="0x00000002" complete_nodeset="0x00000002" gp_index="20">
<object type="NUMANode" os_index="1" cpuset="0x000000f0" complete_cpuset="0x000000f0" nodeset="0x00000002" complete_nodeset="0x00000002" gp_index="21" local_memory="68719476736"/>
<object type="L3Cache" cpuset="0x000000f0" complete_cpuset="0x000000f0" gp_index="22" cache_size="33554432" depth="3" cache_linesize="64" cache_associativity="16" cache_type="0">{}</object>
{}
</object>
</object>
</topology>
)",
                     cores0, host0, host1, cores1, host2);
}

int device_at(const Topology& t, const std::string& bus_id) {
  for (size_t i = 0; i < t.devices.size(); ++i)
    if (t.devices[i].bus_id == bus_id) return int(i);
  ADD_FAILURE() << "no device " << bus_id;
  return -1;
}

Topology gpu_machine(const TempDir& dir) {
  keel::write_file_atomic(dir / "machine.xml", two_socket_gpu_xml());
  return xml_topology(dir / "machine.xml");
}

}  // namespace

// --- CPU side --------------------------------------------------------------------------------------

TEST(Topology, SyntheticTwoSocketLayout) {
  Topology t = synthetic_topology(kTwoSocket);
  EXPECT_EQ(t.packages.size(), 2u);
  EXPECT_EQ(t.numa_nodes.size(), 4u);
  EXPECT_EQ(t.core_complexes.size(), 8u);
  ASSERT_EQ(t.cores.size(), 32u);
  EXPECT_EQ(t.pu_count(), 64);
  EXPECT_EQ(t.numa_nodes_with_cores(), 4);
  // Core 13: socket 0, NUMA node 1, the second L3 of that node.
  EXPECT_EQ(t.cores[13].package, 0);
  EXPECT_EQ(t.cores[13].numa_node, 1);
  EXPECT_EQ(t.cores[13].core_complex, 3);
  EXPECT_EQ(t.cores[13].pus, (std::vector<int>{26, 27}));
  EXPECT_EQ(t.numa_nodes[2].package, 1);
  EXPECT_EQ(t.cores_of_numa_node(3).front(), 24);
  ASSERT_FALSE(t.caches.empty());
  EXPECT_EQ(t.caches.back().level, 3);
  EXPECT_EQ(t.caches.back().cores_each, 4);
}

TEST(Topology, CpuLinkClasses) {
  Topology t = synthetic_topology(kTwoSocket);
  EXPECT_EQ(cpu_link(t, {0}, {3}), CpuLink::SameCoreComplex);
  EXPECT_EQ(cpu_link(t, {0}, {4}), CpuLink::SameNumaNode);
  EXPECT_EQ(cpu_link(t, {0}, {8}), CpuLink::SamePackage);
  EXPECT_EQ(cpu_link(t, {0}, {16}), CpuLink::CrossSocket);
  EXPECT_EQ(cpu_link(t, {0, 1}, {2, 3}), CpuLink::SameCoreComplex);
  EXPECT_EQ(cpu_link(t, {0, 1, 2, 3}, {4, 5, 6, 7}), CpuLink::SameNumaNode);
  // A rank spanning both sockets is cross-socket from every other rank.
  EXPECT_EQ(cpu_link(t, {15, 16}, {17}), CpuLink::CrossSocket);
  EXPECT_EQ(cpu_link_name(CpuLink::SameCoreComplex), "same core complex");
  expect_keel_error([&] { cpu_link(t, {0}, {32}); }, {"core 32", "32 cores"});
}

TEST(Topology, NoSharedCacheMeansNoCoreComplex) {
  Topology t = synthetic_topology("pack:1 core:4 pu:1");
  ASSERT_EQ(t.cores.size(), 4u);
  EXPECT_EQ(t.cores[0].core_complex, -1);
  EXPECT_EQ(cpu_link(t, {0}, {1}), CpuLink::SameNumaNode);
}

TEST(Topology, MemoryOnlyNumaNodesHoldNoRanks) {
  // HBM or CXL memory: a second NUMA node per socket with no cores of its own.
  Topology t = synthetic_topology("pack:2 [numa] [numa] core:2 pu:1");
  EXPECT_EQ(t.numa_nodes.size(), 4u);
  EXPECT_EQ(t.numa_nodes_with_cores(), 2);
  EXPECT_EQ(t.cores[2].numa_node, 2);
  EXPECT_NE(topology_report(t).find("NUMA node 3: 0 B, memory only (no cores of its own)"), std::string::npos)
      << topology_report(t);
  EXPECT_EQ(plan_binding(t, 2).mpirun_args[1], "ppr:1:numa:PE=2");
}

TEST(Topology, BadSourcesAreKeelErrors) {
  expect_keel_error([] { synthetic_topology("sockets:two"); }, {"synthetic topology 'sockets:two'", "pack:2"});
  TempDir dir;
  expect_keel_error([&] { xml_topology(dir / "missing.xml"); }, {"missing.xml", "no such file"});
  keel::write_file_atomic(dir / "bad.xml", "<topology><object type=");
  expect_keel_error([&] { xml_topology(dir / "bad.xml"); }, {"bad.xml", "hwloc cannot load it"});
}

TEST(Topology, ThisMachine) {
  Topology t = detect_topology();
  ASSERT_FALSE(t.cores.empty());
  EXPECT_FALSE(t.numa_nodes.empty());
  EXPECT_GE(t.pu_count(), int(t.cores.size()));
  EXPECT_LE(t.pu_count(), int(std::max(1u, std::thread::hardware_concurrency())));
  std::string report = topology_report(t);
  EXPECT_NE(report.find(fmt::format("{} hardware thread", t.pu_count())), std::string::npos) << report;
  // An export of this machine reads back as the same machine.
  TempDir dir;
  keel::write_file_atomic(dir / "this.xml", export_topology_xml());
  Topology again = xml_topology(dir / "this.xml");
  EXPECT_EQ(again.cores.size(), t.cores.size());
  EXPECT_EQ(again.devices.size(), t.devices.size());
}

// --- PCI side ----------------------------------------------------------------------------------

TEST(Topology, ClassifiesPciDevices) {
  EXPECT_EQ(classify_pci_device(0x10de, 0x0302), PciDeviceKind::Gpu);    // H100: 3D controller
  EXPECT_EQ(classify_pci_device(0x1002, 0x0380), PciDeviceKind::Gpu);    // MI250
  EXPECT_EQ(classify_pci_device(0x19e5, 0x1200), PciDeviceKind::Npu);    // Ascend 910
  EXPECT_EQ(classify_pci_device(0x19e5, 0x0200), PciDeviceKind::Nic);    // Huawei Hi1822 NIC, not an NPU
  EXPECT_EQ(classify_pci_device(0x1a03, 0x0300), PciDeviceKind::Other);  // ASPEED BMC VGA
  EXPECT_EQ(classify_pci_device(0x15b3, 0x0207), PciDeviceKind::Nic);    // ConnectX InfiniBand
  EXPECT_EQ(classify_pci_device(0x144d, 0x0108), PciDeviceKind::Storage);
}

TEST(Topology, PcieTreeFromXml) {
  TempDir dir;
  Topology t = gpu_machine(dir);
  ASSERT_EQ(t.cores.size(), 8u);
  EXPECT_EQ(t.packages[0].model, "Test CPU");  // trailing padding trimmed
  ASSERT_EQ(t.devices.size(), 7u);
  int gpu03 = device_at(t, "0000:03:00.0"), gpu04 = device_at(t, "0000:04:00.0"), nic = device_at(t, "0000:05:00.0");
  int gpu06 = device_at(t, "0000:06:00.0"), npu = device_at(t, "0000:11:00.0"), gpu81 = device_at(t, "0000:81:00.0");
  int vga = device_at(t, "0000:00:1f.0");
  EXPECT_EQ(t.devices[nic].kind, PciDeviceKind::Nic);
  EXPECT_EQ(t.devices[nic].name, "mlx5_0");
  EXPECT_EQ(t.devices[npu].kind, PciDeviceKind::Npu);
  EXPECT_EQ(t.devices[vga].kind, PciDeviceKind::Other);
  EXPECT_EQ(t.accelerators(), (std::vector<int>{gpu03, gpu04, gpu06, npu, gpu81}));
  EXPECT_EQ(t.devices[gpu81].numa_node, 1);
  EXPECT_EQ(t.devices[gpu81].package, 1);

  EXPECT_EQ(device_link(t, gpu03, gpu04), DeviceLink::SamePciSwitch);
  EXPECT_EQ(device_link(t, gpu03, nic), DeviceLink::SamePciSwitch);
  EXPECT_EQ(device_link(t, gpu03, gpu06), DeviceLink::SameRootComplex);
  EXPECT_EQ(device_link(t, gpu06, npu), DeviceLink::SameNumaNode);  // other host bridge, same socket
  EXPECT_EQ(device_link(t, gpu03, gpu81), DeviceLink::CrossSocket);
  EXPECT_EQ(t.bridges[common_bridge(t, gpu03, gpu04)].name, "0000:01:00.0");  // the switch's upstream port
  EXPECT_EQ(t.bridges[host_bridge_of(t, npu)].name, "0000:[10-1f]");
  EXPECT_EQ(common_bridge(t, gpu03, gpu81), -1);

  std::string report = topology_report(t);
  EXPECT_NE(
      report.find("PCIe switch below root port 0000:00:01.0: GPU 0000:03:00.0, GPU 0000:04:00.0, NIC 0000:05:00.0"),
      std::string::npos)
      << report;
  EXPECT_NE(report.find("closest NIC to GPU 0000:81:00.0: NIC 0000:05:00.0 (mlx5_0) (cross-socket)"),
            std::string::npos);
  EXPECT_NE(report.find("HCCS"), std::string::npos);          // the NPU note
  EXPECT_EQ(report.find("0000:00:1f.0"), std::string::npos);  // the BMC's VGA is not listed
}

TEST(Topology, DeviceLinksFromAHandBuiltDescription) {
  // One socket, two NUMA nodes (sub-NUMA clustering), two host bridges, no locality for a third.
  Topology t;
  t.packages = {{0, ""}};
  t.numa_nodes = {{0, 0, 0}, {1, 0, 0}};
  t.bridges = {{true, "0000:[00-7f]", -1, 0, 0}, {true, "0000:[80-ff]", -1, 1, 0}};
  t.devices.resize(3);
  t.devices[0].parent_bridge = 0, t.devices[0].numa_node = 0, t.devices[0].package = 0;
  t.devices[1].parent_bridge = 1, t.devices[1].numa_node = 1, t.devices[1].package = 0;
  EXPECT_EQ(device_link(t, 0, 1), DeviceLink::SamePackage);
  EXPECT_EQ(device_link(t, 0, 2), DeviceLink::SamePackage);  // one socket: nowhere else to be
  t.packages.push_back({1, ""});
  EXPECT_EQ(device_link(t, 0, 2), DeviceLink::Unknown);
  expect_keel_error([&] { device_link(t, 0, 3); }, {"device 3", "3 PCI devices"});
}

TEST(Topology, FormatsLists) {
  EXPECT_EQ(format_index_list({8, 0, 1, 2, 3, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(format_index_list({}), "");
  EXPECT_EQ(format_bytes(48 * 1024), "48 KiB");
  EXPECT_EQ(format_bytes(uint64_t(3) << 29), "1.5 GiB");
}

// --- rank placement ----------------------------------------------------------------------------

TEST(Binding, OneRankPerNumaNode) {
  Topology t = synthetic_topology(kTwoSocket);
  BindingPlan plan = plan_binding(t, 4);
  EXPECT_EQ(plan.mpirun_args, (std::vector<std::string>{"--map-by", "ppr:1:numa:PE=8", "--bind-to", "core"}));
  EXPECT_EQ(plan.cores_per_rank, 8);
  ASSERT_EQ(plan.rank_cores.size(), 4u);
  EXPECT_EQ(plan.rank_cores[1].front(), 8);
  EXPECT_EQ(plan.rank_cores[1].back(), 15);
  EXPECT_NE(plan.description.find("one rank per NUMA node"), std::string::npos);
  // Neighbouring ranks share a socket; the two halves of the job are cross-socket.
  EXPECT_EQ(cpu_link(t, plan.rank_cores[0], plan.rank_cores[1]), CpuLink::SamePackage);
  EXPECT_EQ(cpu_link(t, plan.rank_cores[1], plan.rank_cores[2]), CpuLink::CrossSocket);
}

TEST(Binding, SeveralRanksPerNumaNodeThenSocketThenMachine) {
  Topology t = synthetic_topology(kTwoSocket);
  EXPECT_EQ(plan_binding(t, 8).mpirun_args[1], "ppr:2:numa:PE=4");
  EXPECT_EQ(cpu_link(t, plan_binding(t, 8).rank_cores[0], plan_binding(t, 8).rank_cores[1]), CpuLink::SameNumaNode);
  EXPECT_EQ(plan_binding(t, 2).mpirun_args[1], "ppr:1:socket:PE=16");
  BindingPlan six = plan_binding(t, 6);
  EXPECT_EQ(six.mpirun_args[1], "ppr:3:socket:PE=5");
  EXPECT_EQ(six.rank_cores[3].front(), 16);  // the second socket starts afresh
  BindingPlan five = plan_binding(t, 5);
  EXPECT_EQ(five.mpirun_args[1], "ppr:5:node:PE=6");
  EXPECT_EQ(five.rank_cores[4], (std::vector<int>{24, 25, 26, 27, 28, 29}));
}

TEST(Binding, MoreRanksThanCoresAreNotBound) {
  Topology t = synthetic_topology("pack:1 core:2 pu:1");
  BindingPlan plan = plan_binding(t, 3);
  EXPECT_FALSE(plan.bound);
  EXPECT_EQ(plan.cores_per_rank, 1);
  EXPECT_EQ(plan.mpirun_args, (std::vector<std::string>{"--bind-to", "none", "--oversubscribe"}));
  expect_keel_error([&] { plan_binding(t, 0); }, {"at least 1"});
  expect_keel_error([&] { plan_binding(t, 5000); }, {"5000 is more than keel places on one machine"});
  EXPECT_NE(rank_link_report(t, plan, {}).find("none, the ranks are not bound"), std::string::npos);
}

TEST(Binding, RanksSitNearTheirDevices) {
  TempDir dir;
  Topology t = gpu_machine(dir);
  // Rank 0 drives the socket-1 GPU, ranks 1-2 two socket-0 GPUs.
  std::vector<int> devices = {device_at(t, "0000:81:00.0"), device_at(t, "0000:03:00.0"), device_at(t, "0000:04:00.0")};
  BindingPlan plan = plan_device_binding(t, devices);
  EXPECT_EQ(plan.cores_per_rank, 2);
  EXPECT_EQ(plan.rank_cores[0], (std::vector<int>{4, 5}));
  EXPECT_EQ(plan.rank_cores[1], (std::vector<int>{0, 1}));
  EXPECT_EQ(plan.rank_cores[2], (std::vector<int>{2, 3}));
  std::string report = rank_link_report(t, plan, devices);
  EXPECT_NE(report.find("through their devices' PCIe paths"), std::string::npos) << report;
  EXPECT_NE(report.find("pairs: 1 same PCIe switch, 2 cross-socket"), std::string::npos) << report;
}

TEST(Binding, RankLinkReportThroughCores) {
  Topology t = synthetic_topology(kTwoSocket);
  std::string report = rank_link_report(t, plan_binding(t, 4), {});
  EXPECT_NE(report.find("ranks: 4 (one rank per NUMA node, 8 cores each)"), std::string::npos) << report;
  EXPECT_NE(report.find("rank 1: cores 8-15 (hardware threads 16-31)"), std::string::npos) << report;
  EXPECT_NE(report.find("pairs: 2 same socket, 4 cross-socket"), std::string::npos) << report;
}

// --- launch ------------------------------------------------------------------------------------

namespace {

LaunchRequest request_for(const TempDir& dir, int ranks) {
  keel::write_file_atomic(dir / "r.toml", "max_steps = 1\n");
  LaunchRequest r;
  r.world_size = ranks;
  r.recipe = dir / "r.toml";
  r.keel_executable = "/opt/keel/keel";
  r.run_as_root = true;
  r.overrides = {"dp_degree=4"};
  return r;
}

}  // namespace

TEST(Launch, MpirunCommandFromTheTopology) {
  TempDir dir;
  Topology t = synthetic_topology(kTwoSocket);
  LaunchCommand c = launch_command(t, request_for(dir, 4));
  std::vector<std::string> expected = {"mpirun",
                                       "--allow-run-as-root",
                                       "-np",
                                       "4",
                                       "--map-by",
                                       "ppr:1:numa:PE=8",
                                       "--bind-to",
                                       "core",
                                       "-x",
                                       "OMP_NUM_THREADS=8",
                                       "-x",
                                       "OMP_PROC_BIND=close",
                                       "-x",
                                       "OMP_PLACES=cores",
                                       "/opt/keel/keel",
                                       "train",
                                       dir / "r.toml",
                                       "--set",
                                       "dp_degree=4"};
  EXPECT_EQ(c.argv, expected);
  LaunchRequest user = request_for(dir, 4);
  user.run_as_root = false;
  EXPECT_EQ(launch_command(t, user).argv[1], "-np");
}

TEST(Launch, HostfileSpreadsRanksEvenly) {
  TempDir dir;
  Topology t = synthetic_topology(kTwoSocket);
  keel::write_file_atomic(dir / "hosts", "# two servers\n10.0.0.1 slots=4\n10.0.0.2 slots=4 max_slots=8\n");
  LaunchRequest r = request_for(dir, 8);
  r.hostfile = dir / "hosts";
  LaunchCommand c = launch_command(t, r);
  EXPECT_NE(std::find(c.argv.begin(), c.argv.end(), "ppr:1:numa:PE=8"), c.argv.end());  // 4 per host
  EXPECT_NE(std::find(c.argv.begin(), c.argv.end(), "--hostfile"), c.argv.end());
  r.world_size = 7;
  expect_keel_error([&] { launch_command(t, r); }, {"hosts", "7 ranks do not divide evenly", "2 hosts"});
  r.world_size = 10;
  expect_keel_error([&] { launch_command(t, r); }, {"host 10.0.0.1 has slots=4", "5 on each"});
}

TEST(Launch, RankfileBindsInstead) {
  TempDir dir;
  Topology t = synthetic_topology(kTwoSocket);
  keel::write_file_atomic(dir / "ranks", "rank 0=10.0.0.1 slot=0-3\nrank 1=10.0.0.1 slot=1:0,1,2\n");
  LaunchRequest r = request_for(dir, 2);
  r.rankfile = dir / "ranks";
  LaunchCommand c = launch_command(t, r);
  EXPECT_NE(std::find(c.argv.begin(), c.argv.end(), "OMP_NUM_THREADS=3"), c.argv.end());
  EXPECT_EQ(std::find(c.argv.begin(), c.argv.end(), "--map-by"), c.argv.end());
  r.world_size = 3;
  expect_keel_error([&] { launch_command(t, r); }, {"lists 2 ranks, but -n asks for 3"});
}

TEST(Launch, BadInputsNameTheirPlace) {
  TempDir dir;
  Topology t = synthetic_topology(kTwoSocket);
  LaunchRequest r = request_for(dir, 2);
  r.recipe = dir / "missing.toml";
  expect_keel_error([&] { launch_command(t, r); }, {"missing.toml", "no such recipe"});
  expect_keel_error([] { parse_hostfile("a slots=2\nb cores=4\n", "h"); }, {"h:2", "cores=4", "slots=N"});
  expect_keel_error([] { parse_hostfile("a\na slots=1\n", "h"); }, {"h:2", "host a is listed twice", "line 1"});
  expect_keel_error([] { parse_hostfile("a slots=x\n", "h"); }, {"h:1", "whole number"});
  expect_keel_error([] { parse_hostfile("# nothing\n", "h"); }, {"h: expected one host"});
  expect_keel_error([] { parse_rankfile("rank 0=a slot=0\nrank 2=a slot=1\n", "rf"); }, {"rf", "rank 1 is missing"});
  expect_keel_error([] { parse_rankfile("rank 0=a slot=0\nrank 0=a slot=1\n", "rf"); }, {"rf:2", "already on line 1"});
  expect_keel_error([] { parse_rankfile("rank 0=a slot=3-1\n", "rf"); }, {"rf:1", "'3-1'"});
  expect_keel_error([] { parse_rankfile("rank 0 a\n", "rf"); }, {"rf:1", "expected 'rank <N>=<host> slot=<cores>'"});
}

TEST(Launch, ShellQuoting) {
  EXPECT_EQ(shell_command_line({"mpirun", "-x", "OMP_NUM_THREADS=8", "a b", "it's", ""}),
            "mpirun -x OMP_NUM_THREADS=8 'a b' 'it'\\''s' ''");
}
