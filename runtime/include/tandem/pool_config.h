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
PoolOptions pool_options(const Config::Cpu& cpu);
// The packed format of a config's CPU experts (cpu.format, cpu.group_size, cpu.zero_point).
PackOptions pack_options(const Config::Cpu& cpu);

}  // namespace tandem
