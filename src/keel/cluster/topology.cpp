#include "keel/cluster/topology.h"

#include <fmt/format.h>
#include <hwloc.h>

#include <algorithm>
#include <map>
#include <set>

#include "keel/core/error.h"
#include "keel/core/file_io.h"

namespace keel::cluster {
namespace {

// --- hwloc -> Topology -------------------------------------------------------------------------

struct HwlocTopology {
  hwloc_topology_t handle = nullptr;
  HwlocTopology() {
    if (hwloc_topology_init(&handle) != 0) fail("hwloc: cannot initialise a topology (out of memory?)");
    // Bridges too: they are how two devices' shared PCIe switch or root complex is found.
    hwloc_topology_set_io_types_filter(handle, HWLOC_TYPE_FILTER_KEEP_ALL);
  }
  ~HwlocTopology() { hwloc_topology_destroy(handle); }
  HwlocTopology(const HwlocTopology&) = delete;
  HwlocTopology& operator=(const HwlocTopology&) = delete;
};

std::string pci_bus_id(const hwloc_obj_attr_u::hwloc_pcidev_attr_s& pci) {
  return fmt::format("{:04x}:{:02x}:{:02x}.{:x}", unsigned(pci.domain), unsigned(pci.bus), unsigned(pci.dev),
                     unsigned(pci.func));
}

std::vector<hwloc_obj_t> objects_of_type(hwloc_topology_t t, hwloc_obj_type_t type) {
  std::vector<hwloc_obj_t> objects;
  for (hwloc_obj_t o = nullptr; (o = hwloc_get_next_obj_by_type(t, type, o)) != nullptr;) objects.push_back(o);
  return objects;
}

// The first of `containers` (lowest index) whose cpuset includes `cpuset`, or -1: a cpuset that
// spans two sockets is in no socket.
int unique_container(hwloc_const_cpuset_t cpuset, const std::vector<hwloc_obj_t>& containers) {
  if (cpuset == nullptr || hwloc_bitmap_iszero(cpuset)) return -1;
  int found = -1;
  for (size_t i = 0; i < containers.size(); ++i) {
    hwloc_const_cpuset_t c = containers[i]->cpuset;
    if (c == nullptr || hwloc_bitmap_iszero(c) || !hwloc_bitmap_isincluded(cpuset, c)) continue;
    // Several NUMA nodes can share a locality (DRAM plus HBM or CXL memory next to the same
    // cores): the first one, the lowest index, is the DRAM node on every machine we know.
    if (found < 0) found = int(i);
  }
  return found;
}

Topology topology_from_hwloc(hwloc_topology_t t, std::string source) {
  Topology topo;
  topo.source = std::move(source);

  auto packages = objects_of_type(t, HWLOC_OBJ_PACKAGE);
  for (hwloc_obj_t p : packages) {
    const char* model = hwloc_obj_get_info_by_name(p, "CPUModel");
    std::string text = model ? model : "";
    while (!text.empty() && text.back() == ' ') text.pop_back();  // some CPUs pad the brand string
    topo.packages.push_back({int(p->os_index), text});
  }
  // Machines without Package objects (some VMs, some ARM boards) are one socket.
  if (packages.empty()) {
    packages.push_back(hwloc_get_root_obj(t));
    topo.packages.push_back({0, ""});
  }

  auto numa_nodes = objects_of_type(t, HWLOC_OBJ_NUMANODE);
  for (hwloc_obj_t n : numa_nodes) {
    NumaNode node;
    node.os_index = int(n->os_index);
    node.package = unique_container(n->cpuset, packages);
    node.memory_bytes = n->attr ? n->attr->numanode.local_memory : 0;
    topo.numa_nodes.push_back(node);
  }

  // Cores; where hwloc has no Core objects, each PU is its own core.
  auto cores = objects_of_type(t, HWLOC_OBJ_CORE);
  if (cores.empty()) cores = objects_of_type(t, HWLOC_OBJ_PU);
  std::map<uint64_t, int> complex_of_cache;  // cache gp_index -> core complex
  for (hwloc_obj_t c : cores) {
    CpuCore core;
    core.logical_index = int(c->logical_index);
    core.os_index = int(c->os_index);
    for (hwloc_obj_t pu = nullptr; (pu = hwloc_get_next_obj_inside_cpuset_by_type(t, c->cpuset, HWLOC_OBJ_PU, pu));)
      core.pus.push_back(int(pu->os_index));
    if (core.pus.empty()) continue;  // disallowed for this process
    core.package = unique_container(c->cpuset, packages);
    core.numa_node = unique_container(c->cpuset, numa_nodes);
    // The core complex is the highest data/unified cache level above the core.
    hwloc_obj_t last_level = nullptr;
    for (hwloc_obj_t a = c->parent; a != nullptr; a = a->parent) {
      if (!hwloc_obj_type_is_dcache(a->type)) continue;
      if (last_level == nullptr || a->attr->cache.depth > last_level->attr->cache.depth) last_level = a;
    }
    if (last_level != nullptr) {
      auto [it, inserted] = complex_of_cache.emplace(last_level->gp_index, int(topo.core_complexes.size()));
      if (inserted) {
        topo.core_complexes.push_back({unique_container(last_level->cpuset, packages),
                                       int(last_level->attr->cache.depth), uint64_t(last_level->attr->cache.size)});
      }
      core.core_complex = it->second;
    }
    topo.cores.push_back(std::move(core));
  }

  for (hwloc_obj_type_t type : {HWLOC_OBJ_L1CACHE, HWLOC_OBJ_L1ICACHE, HWLOC_OBJ_L2CACHE, HWLOC_OBJ_L2ICACHE,
                                HWLOC_OBJ_L3CACHE, HWLOC_OBJ_L4CACHE, HWLOC_OBJ_L5CACHE}) {
    auto caches = objects_of_type(t, type);
    if (caches.empty()) continue;
    hwloc_obj_t first = caches.front();
    CacheLevel level;
    level.level = int(first->attr->cache.depth);
    level.kind = first->attr->cache.type == HWLOC_OBJ_CACHE_INSTRUCTION ? 'i'
                 : first->attr->cache.type == HWLOC_OBJ_CACHE_DATA      ? 'd'
                                                                        : 'u';
    level.bytes = first->attr->cache.size;
    level.count = int(caches.size());
    level.cores_each = hwloc_get_nbobjs_inside_cpuset_by_type(t, first->cpuset, HWLOC_OBJ_CORE);
    if (level.cores_each <= 0) level.cores_each = 1;
    topo.caches.push_back(level);
  }

  // The PCI tree. I/O objects hang below the CPU-side object they are local to.
  std::map<uint64_t, int> bridge_index;  // gp_index -> index into topo.bridges
  std::vector<hwloc_obj_t> bridges;
  for (hwloc_obj_t b = nullptr; (b = hwloc_get_next_bridge(t, b)) != nullptr;) {
    bridge_index[b->gp_index] = int(bridges.size());
    bridges.push_back(b);
  }
  auto locate = [&](hwloc_obj_t io, int& numa, int& package) {
    hwloc_obj_t anchor = hwloc_get_non_io_ancestor_obj(t, io);
    numa = anchor ? unique_container(anchor->cpuset, numa_nodes) : -1;
    package = anchor ? unique_container(anchor->cpuset, packages) : -1;
  };
  for (hwloc_obj_t b : bridges) {
    PciBridge bridge;
    const auto& attr = b->attr->bridge;
    bridge.host = attr.upstream_type == HWLOC_OBJ_BRIDGE_HOST;
    if (bridge.host) {
      bridge.name =
          fmt::format("{:04x}:[{:02x}-{:02x}]", unsigned(attr.downstream.pci.domain),
                      unsigned(attr.downstream.pci.secondary_bus), unsigned(attr.downstream.pci.subordinate_bus));
    } else {
      bridge.name = pci_bus_id(attr.upstream.pci);
    }
    if (b->parent != nullptr && b->parent->type == HWLOC_OBJ_BRIDGE)
      bridge.parent = bridge_index.at(b->parent->gp_index);
    locate(b, bridge.numa_node, bridge.package);
    topo.bridges.push_back(std::move(bridge));
  }
  for (hwloc_obj_t d = nullptr; (d = hwloc_get_next_pcidev(t, d)) != nullptr;) {
    const auto& pci = d->attr->pcidev;
    PciDevice device;
    device.bus_id = pci_bus_id(pci);
    device.vendor_id = pci.vendor_id;
    device.device_id = pci.device_id;
    device.class_id = pci.class_id;
    device.kind = classify_pci_device(pci.vendor_id, pci.class_id);
    device.link_gbytes_per_s = pci.linkspeed;
    for (hwloc_obj_t os = d->io_first_child; os != nullptr; os = os->next_sibling) {
      if (os->type == HWLOC_OBJ_OS_DEVICE && os->name)
        device.name += (device.name.empty() ? "" : ",") + std::string(os->name);
    }
    if (device.name.empty()) {
      const char* product = hwloc_obj_get_info_by_name(d, "PCIDevice");
      if (product) device.name = product;
    }
    if (d->parent != nullptr && d->parent->type == HWLOC_OBJ_BRIDGE)
      device.parent_bridge = bridge_index.at(d->parent->gp_index);
    locate(d, device.numa_node, device.package);
    topo.devices.push_back(std::move(device));
  }
  std::stable_sort(topo.devices.begin(), topo.devices.end(),
                   [](const PciDevice& a, const PciDevice& b) { return a.bus_id < b.bus_id; });
  return topo;
}

// The hwloc release that read the machine, as it recorded it (XML exports carry the exporter's).
std::string hwloc_version_of(hwloc_topology_t t) {
  const char* v = hwloc_obj_get_info_by_name(hwloc_get_root_obj(t), "hwlocVersion");
  return v ? v : "";
}

}  // namespace

std::string_view pci_device_kind_name(PciDeviceKind kind) {
  switch (kind) {
    case PciDeviceKind::Gpu: return "GPU";
    case PciDeviceKind::Npu: return "NPU";
    case PciDeviceKind::Nic: return "NIC";
    case PciDeviceKind::Storage: return "storage";
    case PciDeviceKind::Other: return "other";
  }
  return "other";
}

PciDeviceKind classify_pci_device(uint16_t vendor_id, uint16_t class_id) {
  const unsigned base = class_id >> 8;
  if (base == 0x12) {  // processing accelerator: Ascend NPUs, Gaudi, MI300
    return vendor_id == kHuaweiVendorId ? PciDeviceKind::Npu : PciDeviceKind::Gpu;
  }
  if (base == 0x03) {
    // Display controllers from the GPU makers; the rest are BMC or virtual framebuffers (ASPEED,
    // Matrox, virtio-gpu) that no one trains on.
    bool gpu_vendor = vendor_id == 0x10de || vendor_id == 0x1002 || vendor_id == 0x8086;
    return gpu_vendor ? PciDeviceKind::Gpu : PciDeviceKind::Other;
  }
  if (base == 0x02) return PciDeviceKind::Nic;  // Ethernet, InfiniBand, ...
  if (base == 0x01) return PciDeviceKind::Storage;
  return PciDeviceKind::Other;
}

int Topology::pu_count() const {
  int n = 0;
  for (const auto& c : cores) n += int(c.pus.size());
  return n;
}

std::vector<int> Topology::cores_of_numa_node(int numa_node) const {
  std::vector<int> result;
  for (size_t i = 0; i < cores.size(); ++i)
    if (cores[i].numa_node == numa_node) result.push_back(int(i));
  return result;
}

std::vector<int> Topology::accelerators() const {
  std::vector<int> result;
  for (size_t i = 0; i < devices.size(); ++i)
    if (devices[i].kind == PciDeviceKind::Gpu || devices[i].kind == PciDeviceKind::Npu) result.push_back(int(i));
  return result;
}

int Topology::numa_nodes_with_cores() const {
  std::set<int> nodes;
  for (const auto& c : cores) nodes.insert(c.numa_node);
  return int(nodes.size());
}

Topology detect_topology() {
  HwlocTopology t;
  if (hwloc_topology_load(t.handle) != 0) fail("hwloc: cannot read this machine's topology");
  std::string version = hwloc_version_of(t.handle);
  return topology_from_hwloc(t.handle,
                             version.empty() ? "this machine" : fmt::format("this machine (hwloc {})", version));
}

Topology synthetic_topology(const std::string& description) {
  HwlocTopology t;
  if (hwloc_topology_set_synthetic(t.handle, description.c_str()) != 0 || hwloc_topology_load(t.handle) != 0) {
    fail("synthetic topology '{}': hwloc rejected it; expected levels like 'pack:2 numa:2 l3:2 core:4 pu:2'",
         description);
  }
  return topology_from_hwloc(t.handle, fmt::format("synthetic '{}'", description));
}

Topology xml_topology(const std::string& path) {
  // hwloc's own error for a missing file is a bare -1; say which file.
  require(path_exists(path), "{}: no such file (expected an hwloc XML export, e.g. from keel topo --export-xml)", path);
  HwlocTopology t;
  if (hwloc_topology_set_xml(t.handle, path.c_str()) != 0 || hwloc_topology_load(t.handle) != 0) {
    fail(
        "{}: hwloc cannot load it as a topology (expected an hwloc XML export, from keel topo --export-xml "
        "or lstopo FILE.xml)",
        path);
  }
  std::string version = hwloc_version_of(t.handle);
  return topology_from_hwloc(t.handle, version.empty() ? fmt::format("XML {}", path)
                                                       : fmt::format("XML {} (exported by hwloc {})", path, version));
}

std::string export_topology_xml() {
  HwlocTopology t;
  if (hwloc_topology_load(t.handle) != 0) fail("hwloc: cannot read this machine's topology");
  char* buffer = nullptr;
  int length = 0;
  if (hwloc_topology_export_xmlbuffer(t.handle, &buffer, &length, 0) != 0)
    fail("hwloc: cannot export the topology as XML");
  std::string xml(buffer, length > 0 ? size_t(length - 1) : 0);  // length counts the final NUL
  hwloc_free_xmlbuffer(t.handle, buffer);
  return xml;
}

// --- link classes ------------------------------------------------------------------------------

std::string_view cpu_link_name(CpuLink link) {
  switch (link) {
    case CpuLink::SameCoreComplex: return "same core complex";
    case CpuLink::SameNumaNode: return "same NUMA node";
    case CpuLink::SamePackage: return "same socket";
    case CpuLink::CrossSocket: return "cross-socket";
  }
  return "?";
}

std::string_view device_link_name(DeviceLink link) {
  switch (link) {
    case DeviceLink::SamePciSwitch: return "same PCIe switch";
    case DeviceLink::SameRootComplex: return "same root complex";
    case DeviceLink::SameNumaNode: return "same NUMA node";
    case DeviceLink::SamePackage: return "same socket";
    case DeviceLink::CrossSocket: return "cross-socket";
    case DeviceLink::Unknown: return "unknown";
  }
  return "?";
}

CpuLink cpu_link(const Topology& topology, const std::vector<int>& cores_a, const std::vector<int>& cores_b) {
  std::set<int> complexes, numas, packages;
  for (const auto* list : {&cores_a, &cores_b}) {
    for (int i : *list) {
      require(i >= 0 && size_t(i) < topology.cores.size(), "cpu_link: core {} is not one of the {} cores", i,
              topology.cores.size());
      const CpuCore& c = topology.cores[i];
      complexes.insert(c.core_complex);
      numas.insert(c.numa_node);
      // A single-socket machine is one package even where hwloc found no Package object.
      packages.insert(topology.packages.size() <= 1 ? 0 : c.package);
    }
  }
  if (complexes.size() == 1 && *complexes.begin() >= 0) return CpuLink::SameCoreComplex;
  if (numas.size() == 1 && *numas.begin() >= 0) return CpuLink::SameNumaNode;
  if (packages.size() == 1 && *packages.begin() >= 0) return CpuLink::SamePackage;
  return CpuLink::CrossSocket;
}

namespace {

std::vector<int> bridge_chain(const Topology& topology, int device) {
  std::vector<int> chain;  // from the device's own bridge up to the host bridge
  int b = topology.devices[device].parent_bridge;
  while (b >= 0 && chain.size() <= topology.bridges.size()) {  // the bound guards a malformed cycle
    chain.push_back(b);
    b = topology.bridges[b].parent;
  }
  return chain;
}

void require_device(const Topology& topology, int device) {
  require(device >= 0 && size_t(device) < topology.devices.size(), "device {} is not one of the {} PCI devices", device,
          topology.devices.size());
}

}  // namespace

int common_bridge(const Topology& topology, int device_a, int device_b) {
  require_device(topology, device_a);
  require_device(topology, device_b);
  auto chain_b = bridge_chain(topology, device_b);
  for (int b : bridge_chain(topology, device_a)) {
    if (std::find(chain_b.begin(), chain_b.end(), b) != chain_b.end()) return b;
  }
  return -1;
}

int host_bridge_of(const Topology& topology, int device) {
  require_device(topology, device);
  auto chain = bridge_chain(topology, device);
  return !chain.empty() && topology.bridges[chain.back()].host ? chain.back() : -1;
}

DeviceLink device_link(const Topology& topology, int device_a, int device_b) {
  int shared = common_bridge(topology, device_a, device_b);
  if (shared >= 0) return topology.bridges[shared].host ? DeviceLink::SameRootComplex : DeviceLink::SamePciSwitch;
  const PciDevice& a = topology.devices[device_a];
  const PciDevice& b = topology.devices[device_b];
  if (a.numa_node >= 0 && a.numa_node == b.numa_node) return DeviceLink::SameNumaNode;
  int package_a = topology.packages.size() <= 1 ? 0 : a.package;
  int package_b = topology.packages.size() <= 1 ? 0 : b.package;
  if (package_a < 0 || package_b < 0) return DeviceLink::Unknown;
  return package_a == package_b ? DeviceLink::SamePackage : DeviceLink::CrossSocket;
}

std::string format_index_list(std::vector<int> values) {
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
  std::string out;
  for (size_t i = 0; i < values.size();) {
    size_t j = i;
    while (j + 1 < values.size() && values[j + 1] == values[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += j == i ? fmt::format("{}", values[i]) : fmt::format("{}-{}", values[i], values[j]);
    i = j + 1;
  }
  return out;
}

std::string format_bytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = double(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  if (unit == 0) return fmt::format("{} B", bytes);
  return value == double(uint64_t(value)) ? fmt::format("{} {}", uint64_t(value), units[unit])
                                          : fmt::format("{:.1f} {}", value, units[unit]);
}

}  // namespace keel::cluster

namespace keel::cluster {
namespace {

std::string plural(size_t n, std::string_view one, std::string_view many) {
  return fmt::format("{} {}", n, n == 1 ? one : many);
}

std::vector<int> logical_cores(const Topology& topology, const std::vector<int>& cores) {
  std::vector<int> out;
  for (int i : cores) out.push_back(topology.cores[i].logical_index);
  return out;
}

std::vector<int> pus_of(const Topology& topology, const std::vector<int>& cores) {
  std::vector<int> out;
  for (int i : cores) out.insert(out.end(), topology.cores[i].pus.begin(), topology.cores[i].pus.end());
  return out;
}

bool is_shown(const PciDevice& d) { return d.kind != PciDeviceKind::Other; }

// The bridge right below the host bridge (a root port) above a device: every device under the same
// one shares the PCIe switch behind it. -1 when the device sits directly on the host bridge.
int root_port_of(const Topology& topology, int device) {
  int b = topology.devices[device].parent_bridge, below_host = -1;
  for (size_t steps = 0; b >= 0 && steps <= topology.bridges.size(); ++steps) {
    if (topology.bridges[b].host) return below_host;
    below_host = b;
    b = topology.bridges[b].parent;
  }
  return below_host;
}

std::string device_label(const Topology& topology, int i) {
  const PciDevice& d = topology.devices[i];
  return d.name.empty() ? fmt::format("{} {}", pci_device_kind_name(d.kind), d.bus_id)
                        : fmt::format("{} {} ({})", pci_device_kind_name(d.kind), d.bus_id, d.name);
}

}  // namespace

std::string topology_report(const Topology& topology) {
  std::string out;
  auto line = [&out](std::string text) { out += text + "\n"; };
  line(fmt::format("machine: {}", topology.source));
  line(fmt::format("  {}, {}, {}, {}, {}", plural(topology.packages.size(), "socket", "sockets"),
                   plural(topology.numa_nodes.size(), "NUMA node", "NUMA nodes"),
                   plural(topology.core_complexes.size(), "core complex", "core complexes"),
                   plural(topology.cores.size(), "core", "cores"),
                   plural(size_t(topology.pu_count()), "hardware thread", "hardware threads")));

  for (size_t p = 0; p < topology.packages.size(); ++p) {
    const Package& package = topology.packages[p];
    line(fmt::format("socket {}{}", package.os_index, package.model.empty() ? "" : ": " + package.model));
    for (size_t n = 0; n < topology.numa_nodes.size(); ++n) {
      const NumaNode& node = topology.numa_nodes[n];
      auto cores = topology.cores_of_numa_node(int(n));
      bool here = node.package == int(p) || (node.package < 0 && topology.packages.size() == 1 && !cores.empty());
      if (!here) continue;
      if (cores.empty()) {  // HBM or CXL memory attached next to the DRAM node of these cores
        line(fmt::format("  NUMA node {}: {}, memory only (no cores of its own)", node.os_index,
                         format_bytes(node.memory_bytes)));
        continue;
      }
      line(fmt::format("  NUMA node {}: {}, cores {} (hardware threads {})", node.os_index,
                       format_bytes(node.memory_bytes), format_index_list(logical_cores(topology, cores)),
                       format_index_list(pus_of(topology, cores))));
      std::map<int, std::vector<int>> by_complex;
      for (int c : cores) by_complex[topology.cores[c].core_complex].push_back(c);
      for (const auto& [cx, members] : by_complex) {
        if (cx < 0) continue;
        const CoreComplex& complex = topology.core_complexes[cx];
        line(fmt::format("    core complex {}: L{} {}, cores {}", cx, complex.cache_level,
                         format_bytes(complex.cache_bytes), format_index_list(logical_cores(topology, members))));
      }
    }
  }
  // Nodes not inside one socket: memory-only nodes (HBM, CXL) and nodes spanning sockets.
  for (size_t n = 0; n < topology.numa_nodes.size(); ++n) {
    const NumaNode& node = topology.numa_nodes[n];
    auto cores = topology.cores_of_numa_node(int(n));
    if (node.package >= 0 || (topology.packages.size() == 1 && !cores.empty())) continue;
    line(fmt::format("NUMA node {}: {}, {}", node.os_index, format_bytes(node.memory_bytes),
                     cores.empty() ? std::string("no cores (memory only)")
                                   : "cores " + format_index_list(logical_cores(topology, cores))));
  }

  std::string caches;
  for (const CacheLevel& c : topology.caches) {
    std::string name = fmt::format("L{}{}", c.level, c.kind == 'u' ? "" : std::string(1, c.kind));
    caches += fmt::format("{}{} {} x{} ({} each)", caches.empty() ? "" : ", ", name, format_bytes(c.bytes), c.count,
                          plural(size_t(c.cores_each), "core", "cores"));
  }
  line("caches: " + (caches.empty() ? std::string("none reported") : caches));

  size_t shown = 0;
  for (const auto& d : topology.devices) shown += is_shown(d);
  line(fmt::format("PCI devices: {} ({} listed; bridges, host functions and virtual devices left out)",
                   topology.devices.size(), shown));
  for (size_t i = 0; i < topology.devices.size(); ++i) {
    const PciDevice& d = topology.devices[i];
    if (!is_shown(d)) continue;
    std::string where;
    int port = root_port_of(topology, int(i));
    int host = host_bridge_of(topology, int(i));
    if (port >= 0) where += fmt::format(", root port {}", topology.bridges[port].name);
    if (host >= 0) where += fmt::format(", host bridge {}", topology.bridges[host].name);
    if (d.numa_node >= 0) where += fmt::format(", NUMA node {}", topology.numa_nodes[d.numa_node].os_index);
    if (d.link_gbytes_per_s > 0) where += fmt::format(", {:.1f} GB/s link", d.link_gbytes_per_s);
    line(fmt::format("  {:<12} {:<7} {:04x}:{:04x} {}{}", d.bus_id, pci_device_kind_name(d.kind), d.vendor_id,
                     d.device_id, d.name.empty() ? "-" : d.name, where));
  }
  if (topology.accelerators().empty()) {
    line(
        "accelerators: none (GPUs: display/3D controllers from NVIDIA, AMD, Intel, or processing accelerators; "
        "NPUs: Huawei 0x19e5 processing accelerators)");
  }

  // Which listed devices share a PCIe switch (the same root port) or a host bridge.
  std::map<int, std::vector<int>> by_port, by_host;
  for (size_t i = 0; i < topology.devices.size(); ++i) {
    if (!is_shown(topology.devices[i])) continue;
    int port = root_port_of(topology, int(i));
    if (port >= 0) by_port[port].push_back(int(i));
    int host = host_bridge_of(topology, int(i));
    if (host >= 0) by_host[host].push_back(int(i));
  }
  auto groups = [&](const std::map<int, std::vector<int>>& by, std::string_view what) {
    bool any = false;
    for (const auto& [bridge, members] : by) {
      if (members.size() < 2) continue;
      std::string list;
      for (int m : members) list += (list.empty() ? "" : ", ") + device_label(topology, m);
      line(fmt::format("  {} {}: {}", what, topology.bridges[bridge].name, list));
      any = true;
    }
    if (!any) line(fmt::format("  {}: no two listed devices share one", what));
  };
  line("devices sharing a PCIe switch or a root complex:");
  groups(by_port, "PCIe switch below root port");
  groups(by_host, "root complex (host bridge)");

  // For each accelerator, the NIC it should send through (GPUDirect RDMA / RoCE from the NPU).
  auto accelerators = topology.accelerators();
  for (int a : accelerators) {
    int best = -1;
    DeviceLink best_link = DeviceLink::Unknown;
    for (size_t n = 0; n < topology.devices.size(); ++n) {
      if (topology.devices[n].kind != PciDeviceKind::Nic) continue;
      DeviceLink link = device_link(topology, a, int(n));
      if (best < 0 || int(link) < int(best_link)) best = int(n), best_link = link;
    }
    if (best >= 0) {
      line(fmt::format("  closest NIC to {}: {} ({})", device_label(topology, a), device_label(topology, best),
                       device_link_name(best_link)));
    }
  }
  bool has_npu = std::any_of(topology.devices.begin(), topology.devices.end(),
                             [](const PciDevice& d) { return d.kind == PciDeviceKind::Npu; });
  if (has_npu) {
    line(
        "note: Ascend NPUs talk to each other over HCCS, which is not PCIe and hwloc cannot see; the PCIe classes "
        "above are the path HCCL falls back to (see keel rank-table --topology)");
  }
  return out;
}

}  // namespace keel::cluster
