#include "tandem/pool_config.h"

#include <algorithm>

#include "tandem/error.h"
#include "tandem/topology.h"

namespace tandem {

PoolOptions pool_options(const Config::Cpu& cpu, int reserved_cores) {
  const Topology& topo = topology();
  TANDEM_CHECK(!topo.nodes.empty(), Errc::internal, "pool: the topology lists no NUMA node");
  std::vector<const NumaNodeInfo*> nodes;
  if (cpu.numa_nodes.empty()) {
    for (const auto& n : topo.nodes)
      if (!n.cores.empty()) nodes.push_back(&n);
  } else {
    for (int id : cpu.numa_nodes) {
      const NumaNodeInfo* found = nullptr;
      for (const auto& n : topo.nodes)
        if (n.os_index == id) found = &n;
      TANDEM_CHECK(found && !found->cores.empty(), Errc::invalid_argument, "cpu.numa_nodes: node ", id,
                   found ? " has no cores this process may use" : " does not exist on this machine");
      nodes.push_back(found);
    }
  }
  TANDEM_CHECK(cpu.virtual_subpools >= 1, Errc::invalid_argument, "cpu.virtual_subpools = ", cpu.virtual_subpools,
               " must be at least 1");
  TANDEM_CHECK(cpu.threads >= 0, Errc::invalid_argument, "cpu.threads = ", cpu.threads, " must be >= 0");
  PoolOptions o;
  for (const NumaNodeInfo* n : nodes) {
    const int cores = static_cast<int>(n->cores.size());
    int pus = 0;
    for (const auto& core : n->cores) pus += static_cast<int>(core.pus.size());
    // More threads in one subpool than the node has logical CPUs would only make them
    // take turns (and spin against each other at every phase barrier): refused, not
    // clamped, so what the config says is what runs.
    TANDEM_CHECK(cpu.threads <= pus, Errc::invalid_argument, "cpu.threads = ", cpu.threads, " exceeds the ", pus,
                 " logical CPUs of NUMA node ", n->os_index, " this process may use; lower it or leave it auto");
    const int v = cpu.virtual_subpools;
    for (int s = 0; s < v; ++s) {
      SubpoolSpec sp;
      sp.numa_node = n->os_index;
      // Each virtual subpool takes its share of the node's cores; with more subpools than
      // cores (tests on small machines) they share cores round-robin.
      int threads = cpu.threads > 0 ? cpu.threads : std::max(1, cores / v);
      if (cpu.threads == 0 && o.subpools.empty() && cores >= v) threads = std::max(1, threads - reserved_cores);
      const int first = cores >= v ? s * (cores / v) : s % cores;
      for (int t = 0; t < threads; ++t) sp.cpus.push_back(n->cores[(first + t) % cores].pus.front());
      sp.threads = threads;
      o.subpools.push_back(std::move(sp));
    }
  }
  return o;
}

PackOptions pack_options(const Config::Cpu& cpu) {
  return pack_options(cpu.format, cpu.group_size, cpu.zero_point);
}

}  // namespace tandem
