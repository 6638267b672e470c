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
#include "tandem/experts.h"

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

// gpu.hot_experts count: auto. Experts per layer that `budget_bytes` of device memory hold
// for `moe_layers` layers of `shape` (each hot expert is gate, up and down in bf16 on the
// device: 6 * hidden * intermediate bytes), at most all of them.
int hot_count_for_budget(uint64_t budget_bytes, int moe_layers, const MoeShape& shape);
// The device memory that count: auto leaves to the rest of the model's growth (KV cache,
// activations): the larger of 2 GiB and a tenth of the device.
uint64_t hot_auto_reserve(uint64_t device_total_bytes);

// Dynamic hot experts (gpu.hot_experts.dynamic): one layer's hot set after a rebalance.
// `hot`: the current set (ascending ids), `score[e]`: expert e's decayed routed count. The
// set keeps its size; the highest-scored cold expert replaces the lowest-scored hot one
// while its score exceeds (1 + hysteresis) times the hot one's (ties: the lower id counts
// as higher), so near-equal experts do not trade places back and forth. Ascending ids.
std::vector<int> rebalance_hot_experts(const std::vector<int>& hot, const std::vector<double>& score,
                                       double hysteresis);

}  // namespace tandem
