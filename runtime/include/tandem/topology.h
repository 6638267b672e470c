// tandem/topology.h: the machine's NUMA nodes, physical cores and memory (hwloc).
//
// Only the CPUs this process may run on are listed (cgroups and affinity masks
// are respected), so thread pools built from it never pin to a forbidden core.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tandem {

struct CoreInfo {
  int os_index = -1;      // the core's id as the OS numbers it
  std::vector<int> pus;   // hardware threads (logical CPU ids) of this core
};

struct NumaNodeInfo {
  int os_index = -1;          // node id, as numactl/libnuma number it
  uint64_t memory_bytes = 0;  // local memory
  std::vector<CoreInfo> cores;
};

struct Topology {
  int packages = 0;
  int cores = 0;             // physical cores usable by this process
  int pus = 0;               // logical CPUs usable by this process
  uint64_t total_memory = 0; // bytes, all nodes
  std::vector<NumaNodeInfo> nodes;
  bool numa_binding = false; // libnuma reports the kernel's NUMA API available
  std::string hwloc_version;
};

// Detected once and cached; thread-safe.
const Topology& topology();

}  // namespace tandem
