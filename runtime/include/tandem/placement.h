// tandem/placement.h: placement policy. Which experts of a layer go on the device
// (choose_hot_experts, from the config's gpu.hot_experts) and the routing statistics
// that policy reads (load_routing_statistics) and the hybrid scheduler writes
// (HybridMoe::write_statistics -> save_routing_statistics). Its own unit so the policy
// (and later the cost model) can change without touching the scheduler.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <vector>

#include "tandem/config.h"

namespace tandem {

// Routed counts per model layer, [experts] each.
struct RoutingStatistics {
  int experts = 0;
  std::map<int, std::vector<uint64_t>> layers;
};
RoutingStatistics load_routing_statistics(const std::filesystem::path& path);
void save_routing_statistics(const RoutingStatistics& stats, const std::filesystem::path& path);

// The hot experts of model layer `layer` under the config's policy (ascending ids):
// explicit lists as given; `count` most-routed per the statistics file (ties: lower id);
// or, with a count and no statistics, `count` experts spread evenly over the ids.
// Errors name the config key or the statistics file.
std::vector<int> choose_hot_experts(const HotExpertsConfig& config, int layer, int experts,
                                    const RoutingStatistics* stats = nullptr);

}  // namespace tandem
