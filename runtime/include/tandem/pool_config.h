// tandem/pool_config.h: the glue from a placement config's cpu section to the pool's and
// the packs' options. It sits above config.h, pool.h and kernels.h, so neither the pool nor
// the kernels depend on the YAML config.
#pragma once

#include "tandem/config.h"
#include "tandem/kernels.h"
#include "tandem/pool.h"

namespace tandem {

// From the placement config and the topology: one subpool per selected node (all nodes
// by default), split into cpu.virtual_subpools each; cpu.threads threads per subpool
// (0: one per physical core). Errors name the offending key.
// reserved_cores: with cpu.threads auto, the first subpool leaves that many of its cores to
// threads that are not the pool's: the one driving a GPU (it spins in the CUDA driver while
// the stream runs) and CUDA's host-function thread. A worker sharing a core with them is
// descheduled for whole time slices, and every task waits for its slowest worker: on an
// H200 machine (16 cores), 16 workers made a hybrid decode layer 6.6 ms, 15 made it 0.52 ms.
PoolOptions pool_options(const Config::Cpu& cpu, int reserved_cores = 0);
// The packed format of a config's CPU experts (cpu.format, cpu.group_size, cpu.zero_point).
PackOptions pack_options(const Config::Cpu& cpu);

}  // namespace tandem
