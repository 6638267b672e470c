// tandem/pool_config.h: the glue from a placement config to pool options. It sits above
// both config.h and pool.h, so the pool itself does not depend on the YAML config.
#pragma once

#include "tandem/config.h"
#include "tandem/pool.h"

namespace tandem {

// From the placement config and the topology: one subpool per selected node (all nodes
// by default), split into cpu.virtual_subpools each; cpu.threads threads per subpool
// (0: one per physical core). Errors name the offending key.
PoolOptions pool_options(const Config::Cpu& cpu);

}  // namespace tandem
