#include "tandem/topology.h"

#include <hwloc.h>
#include <numa.h>

#include <memory>

#include "tandem/error.h"

namespace tandem {
namespace {

Topology detect() {
  hwloc_topology_t topo;
  TANDEM_CHECK(hwloc_topology_init(&topo) == 0, Errc::internal, "hwloc_topology_init failed");
  std::unique_ptr<hwloc_topology, void (*)(hwloc_topology_t)> guard(topo, hwloc_topology_destroy);
  TANDEM_CHECK(hwloc_topology_load(topo) == 0, Errc::io, "hwloc could not read the machine topology");

  Topology t;
  unsigned v = hwloc_get_api_version();
  t.hwloc_version = str_cat(v >> 16, ".", (v >> 8) & 0xff, ".", v & 0xff);
  t.packages = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PACKAGE);
  t.cores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
  t.pus = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PU);
  t.total_memory = hwloc_get_root_obj(topo)->total_memory;

  const int nnodes = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
  for (int i = 0; i < nnodes; ++i) {
    hwloc_obj_t node = hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, i);
    NumaNodeInfo n;
    n.os_index = static_cast<int>(node->os_index);
    n.memory_bytes = node->attr ? node->attr->numanode.local_memory : 0;
    for (int c = 0; c < t.cores; ++c) {
      hwloc_obj_t core = hwloc_get_obj_by_type(topo, HWLOC_OBJ_CORE, c);
      if (!core->cpuset || !hwloc_bitmap_isincluded(core->cpuset, node->cpuset)) continue;
      CoreInfo ci;
      ci.os_index = static_cast<int>(core->os_index);
      int pu = -1;
      while ((pu = hwloc_bitmap_next(core->cpuset, pu)) != -1) ci.pus.push_back(pu);
      n.cores.push_back(std::move(ci));
    }
    t.nodes.push_back(std::move(n));
  }
  t.numa_binding = numa_available() >= 0;
  return t;
}

}  // namespace

const Topology& topology() {
  static const Topology t = detect();
  return t;
}

}  // namespace tandem
