#include "tandem/placement.h"

#include <algorithm>
#include <fstream>
#include <numeric>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tandem/error.h"
#include "tandem/fileio.h"

namespace tandem {

namespace {
constexpr const char* kStatsFormat = "tandem.routing_statistics";
}

void save_routing_statistics(const RoutingStatistics& stats, const std::filesystem::path& path) {
  TANDEM_CHECK(stats.experts >= 1, Errc::invalid_argument, "routing statistics: experts = ", stats.experts,
               " must be positive");
  for (const auto& [l, c] : stats.layers)
    TANDEM_CHECK(static_cast<int>(c.size()) == stats.experts, Errc::invalid_argument, "routing statistics: layer ", l,
                 " has ", c.size(), " counts, not ", stats.experts);
  nlohmann::json j;
  j["format"] = kStatsFormat;
  j["version"] = 1;
  j["experts"] = stats.experts;
  nlohmann::json layers = nlohmann::json::object();
  for (const auto& [l, c] : stats.layers) layers[std::to_string(l)] = c;
  j["layers"] = layers;
  write_file_atomic(path, j.dump(1) + "\n", "routing statistics");
}

RoutingStatistics load_routing_statistics(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  TANDEM_CHECK(in.good(), Errc::io, "routing statistics: cannot read ", path.string());
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, false);
  const std::string f = path.string();
  TANDEM_CHECK(!j.is_discarded() && j.is_object(), Errc::bad_format, f, ": not a JSON object");
  TANDEM_CHECK(j.value("format", "") == kStatsFormat, Errc::bad_format, f, ": \"format\" is not \"", kStatsFormat, "\"");
  TANDEM_CHECK(j.value("version", 0) == 1, Errc::bad_format, f, ": \"version\" must be 1");
  TANDEM_CHECK(j.contains("experts") && j["experts"].is_number_integer() && j["experts"].get<int64_t>() >= 1 &&
                   j["experts"].get<int64_t>() <= (1 << 20),
               Errc::bad_format, f, ": \"experts\" must be an integer in [1, 2^20]");
  TANDEM_CHECK(j.contains("layers") && j["layers"].is_object(), Errc::bad_format, f,
               ": \"layers\" must map layer numbers to count lists");
  RoutingStatistics st;
  st.experts = j["experts"].get<int>();
  for (const auto& [key, v] : j["layers"].items()) {
    int layer = -1;
    if (!key.empty() && key.size() <= 9 && std::all_of(key.begin(), key.end(), [](char ch) { return ch >= '0' && ch <= '9'; }) &&
        (key == "0" || key[0] != '0'))
      layer = std::stoi(key);
    TANDEM_CHECK(layer >= 0, Errc::bad_format, f, ": layers.\"", key, "\": not a layer number");
    TANDEM_CHECK(v.is_array() && static_cast<int>(v.size()) == st.experts, Errc::bad_format, f, ": layers.", key,
                 ": must list ", st.experts, " counts");
    std::vector<uint64_t> c;
    for (const auto& x : v) {
      TANDEM_CHECK(x.is_number_unsigned() || (x.is_number_integer() && x.get<int64_t>() >= 0), Errc::bad_format, f,
                   ": layers.", key, ": counts must be non-negative integers");
      c.push_back(x.get<uint64_t>());
    }
    st.layers[layer] = std::move(c);
  }
  return st;
}

std::vector<int> choose_hot_experts(const HotExpertsConfig& c, int layer, int experts, const RoutingStatistics* stats) {
  using P = HotExpertsConfig::Policy;
  std::vector<int> out;
  switch (c.policy) {
    case P::none: return out;
    case P::explicit_lists: {
      auto it = c.layers.find(layer);
      if (it == c.layers.end()) return out;
      for (int e : it->second)
        TANDEM_CHECK(e >= 0 && e < experts, Errc::invalid_argument, "gpu.hot_experts.layers.", layer, ": expert ", e,
                     " is outside [0, ", experts, ")");
      out = it->second;
      std::sort(out.begin(), out.end());
      TANDEM_CHECK(std::adjacent_find(out.begin(), out.end()) == out.end(), Errc::invalid_argument,
                   "gpu.hot_experts.layers.", layer, ": an expert is listed twice");
      break;
    }
    case P::uniform: {
      const int n = std::min(c.count, experts);
      for (int i = 0; i < n; ++i) out.push_back(static_cast<int>(static_cast<int64_t>(i) * experts / n));
      break;
    }
    case P::statistics: {
      TANDEM_CHECK(stats != nullptr, Errc::invalid_argument, "gpu.hot_experts.statistics: ", c.statistics.string(),
                   " was not loaded");
      TANDEM_CHECK(stats->experts == experts, Errc::invalid_argument, "gpu.hot_experts.statistics: ",
                   c.statistics.string(), " counts ", stats->experts, " experts per layer, the model has ", experts);
      auto it = stats->layers.find(layer);
      TANDEM_CHECK(it != stats->layers.end(), Errc::invalid_argument, "gpu.hot_experts.statistics: ",
                   c.statistics.string(), " has no counts for layer ", layer);
      TANDEM_CHECK(static_cast<int>(it->second.size()) == experts, Errc::invalid_argument,
                   "gpu.hot_experts.statistics: ", c.statistics.string(), ": layer ", layer, " has ", it->second.size(),
                   " counts, not ", experts);
      std::vector<int> order(experts);
      std::iota(order.begin(), order.end(), 0);
      const auto& cnt = it->second;
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return cnt[a] > cnt[b]; });
      out.assign(order.begin(), order.begin() + std::min(c.count, experts));
      break;
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

int hot_count_for_budget(uint64_t budget_bytes, int moe_layers, const MoeShape& shape) {
  TANDEM_CHECK(moe_layers >= 1, Errc::invalid_argument, "hot experts: ", moe_layers, " MoE layers");
  const uint64_t per_expert = 6ull * static_cast<uint64_t>(shape.hidden) * static_cast<uint64_t>(shape.inter);
  const uint64_t n = budget_bytes / (per_expert * static_cast<uint64_t>(moe_layers));
  return static_cast<int>(std::min<uint64_t>(n, static_cast<uint64_t>(shape.experts)));
}

uint64_t hot_auto_reserve(uint64_t device_total_bytes) {
  return std::max<uint64_t>(uint64_t{2} << 30, device_total_bytes / 10);
}

std::vector<int> rebalance_hot_experts(const std::vector<int>& hot, const std::vector<double>& score,
                                       double hysteresis) {
  const int E = static_cast<int>(score.size());
  TANDEM_CHECK(hysteresis >= 0, Errc::invalid_argument, "rebalance: hysteresis ", hysteresis, " is negative");
  std::vector<uint8_t> is_hot(E, 0);
  for (int e : hot) {
    TANDEM_CHECK(e >= 0 && e < E && !is_hot[e], Errc::invalid_argument, "rebalance: hot expert ", e,
                 " is outside [0, ", E, ") or listed twice");
    is_hot[e] = 1;
  }
  // "a ranks above b": higher score, or the same score and the lower id.
  auto above = [&](int a, int b) { return score[a] > score[b] || (score[a] == score[b] && a < b); };
  std::vector<int> in(hot), out;
  for (int e = 0; e < E; ++e)
    if (!is_hot[e]) out.push_back(e);
  std::sort(in.begin(), in.end(), [&](int a, int b) { return above(b, a); });  // weakest hot first
  std::sort(out.begin(), out.end(), above);                                     // strongest cold first
  for (size_t i = 0; i < in.size() && i < out.size(); ++i) {
    if (!(score[out[i]] > (1 + hysteresis) * score[in[i]])) break;
    std::swap(in[i], out[i]);
  }
  std::sort(in.begin(), in.end());
  return in;
}

}  // namespace tandem
