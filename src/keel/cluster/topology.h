// Machine topology: packages (sockets), NUMA nodes, core complexes (cores sharing a last-level
// cache), cores, and the PCI tree with its accelerators and NICs, read with hwloc.
//
// The description is a plain struct so that everything inferred from it (the link class between
// two ranks, which devices share a PCIe switch) can be tested on synthetic machines: hwloc builds
// the same struct from this machine, from a synthetic description ("pack:2 numa:2 l3:2 core:4
// pu:2") or from an XML export of another machine (`keel topo --export-xml`, `lstopo f.xml`).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace keel::cluster {

struct Package {
  int os_index = 0;
  std::string model;  // CPUModel from hwloc, empty when unknown
};

struct NumaNode {
  int os_index = 0;
  int package = -1;  // index into Topology::packages; -1 when the node spans packages or has no cores
  uint64_t memory_bytes = 0;
};

// Cores that share the last-level cache: an AMD CCX/CCD, or a whole Intel socket. Threads that
// share it exchange data through the cache instead of the memory controller.
struct CoreComplex {
  int package = -1;
  int cache_level = 0;  // 3 for an L3, 2 where the last shared level is the L2
  uint64_t cache_bytes = 0;
};

struct CpuCore {
  int logical_index = 0;  // hwloc's logical index: what OpenMPI rankfiles and --report-bindings count
  int os_index = 0;
  std::vector<int> pus;   // OS indices of its hardware threads (what taskset and /proc/cpuinfo call CPUs)
  int package = -1;       // index into Topology::packages
  int numa_node = -1;     // index into Topology::numa_nodes
  int core_complex = -1;  // index into Topology::core_complexes; -1 when no cache is shared
};

// One cache level, summarised: `count` instances of `bytes` each, each shared by `cores_each` cores.
struct CacheLevel {
  int level = 0;
  char kind = 'u';  // 'u' unified, 'd' data, 'i' instruction
  uint64_t bytes = 0;
  int count = 0;
  int cores_each = 0;
};

// A PCI host bridge (root complex) or a PCI-to-PCI bridge (a root port, or a port of a PCIe switch).
struct PciBridge {
  bool host = false;
  std::string name;  // "0000:17:00.0" for a PCI bridge, "0000:[16-1f]" (domain:[bus range]) for a host bridge
  int parent = -1;   // index into Topology::bridges; -1 for a host bridge
  int numa_node = -1;
  int package = -1;
};

enum class PciDeviceKind { Gpu, Npu, Nic, Storage, Other };
std::string_view pci_device_kind_name(PciDeviceKind kind);

struct PciDevice {
  std::string bus_id;  // "0000:3b:00.0"
  uint16_t vendor_id = 0;
  uint16_t device_id = 0;
  uint16_t class_id = 0;  // base class << 8 | subclass, as in lspci -n
  PciDeviceKind kind = PciDeviceKind::Other;
  std::string name;        // the OS devices hwloc found on it (eth0, mlx5_0, nvme0n1), or the PCI names
  int parent_bridge = -1;  // index into Topology::bridges; -1 when hwloc attached it without a bridge
  int numa_node = -1;
  int package = -1;
  float link_gbytes_per_s = 0;  // 0 when unknown
};

PciDeviceKind classify_pci_device(uint16_t vendor_id, uint16_t class_id);
inline constexpr uint16_t kHuaweiVendorId = 0x19e5;

struct Topology {
  std::string source;  // "this machine (hwloc 2.9.0)", "synthetic 'pack:2 ...'", "XML file.xml"
  std::vector<Package> packages;
  std::vector<NumaNode> numa_nodes;
  std::vector<CoreComplex> core_complexes;
  std::vector<CpuCore> cores;  // in logical order
  std::vector<CacheLevel> caches;
  std::vector<PciBridge> bridges;
  std::vector<PciDevice> devices;  // in bus order

  int pu_count() const;
  std::vector<int> cores_of_numa_node(int numa_node) const;  // indices into `cores`
  std::vector<int> accelerators() const;                     // indices into `devices`: GPUs and NPUs
  int numa_nodes_with_cores() const;
};

Topology detect_topology();                                   // this machine
Topology synthetic_topology(const std::string& description);  // hwloc synthetic syntax
Topology xml_topology(const std::string& path);               // an hwloc XML export
std::string export_topology_xml();                            // this machine, for xml_topology elsewhere

// --- link classes ------------------------------------------------------------------------------

// Where the traffic between two ranks' CPU cores goes, from closest to farthest.
enum class CpuLink { SameCoreComplex, SameNumaNode, SamePackage, CrossSocket };
// Between two PCI devices. The same ladder as `nvidia-smi topo -m` (PIX/PXB, PHB, NODE, SYS).
enum class DeviceLink { SamePciSwitch, SameRootComplex, SameNumaNode, SamePackage, CrossSocket, Unknown };

std::string_view cpu_link_name(CpuLink link);
std::string_view device_link_name(DeviceLink link);

// The smallest part of the machine holding both core sets (indices into Topology::cores).
CpuLink cpu_link(const Topology& topology, const std::vector<int>& cores_a, const std::vector<int>& cores_b);
// Devices are indices into Topology::devices.
DeviceLink device_link(const Topology& topology, int device_a, int device_b);
// The lowest bridge both devices sit below, -1 when none; the switch or root port they share.
int common_bridge(const Topology& topology, int device_a, int device_b);
// The host bridge above a device, -1 when unknown.
int host_bridge_of(const Topology& topology, int device);

// What `keel topo` prints about the machine: sockets, NUMA nodes, core complexes, caches, the
// accelerators, NICs and storage on PCI, and which of them share a PCIe switch or root complex.
std::string topology_report(const Topology& topology);

// Compact index list: {0,1,2,3,8} -> "0-3,8".
std::string format_index_list(std::vector<int> values);
std::string format_bytes(uint64_t bytes);

}  // namespace keel::cluster
