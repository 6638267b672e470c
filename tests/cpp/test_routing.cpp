// The hot / cold / deferred split, hot expert placement and the routing statistics files.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "tandem/config.h"
#include "tandem/error.h"
#include "tandem/hybrid.h"
#include "tandem/routing.h"
#include "test_util.h"

namespace tandem {
namespace {

constexpr size_t npos = std::string::npos;

// ---- split ----------------------------------------------------------------------------

template <typename Id>
void check_split_random(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uw(0.01f, 1.f);
  std::uniform_real_distribution<double> u01(0, 1);
  int cases = 0, deferred_total = 0, tie_checks = 0;
  for (int E : {1, 4, 16, 128}) {
    for (int K = 1; K <= std::min(E, 8); ++K) {
      for (int D = 0; D <= K; ++D) {
        const int tokens = std::uniform_int_distribution<int>(1, 12)(rng);
        const double p_hot = std::array<double, 4>{0.0, 0.3, 0.7, 1.0}[std::uniform_int_distribution<int>(0, 3)(rng)];
        const bool coarse = u01(rng) < 0.5;  // weights from {0.25, 0.5, 0.75}: many ties
        SCOPED_TRACE(testing::Message() << "experts " << E << " top_k " << K << " deferred " << D << " tokens " << tokens
                                        << " p_hot " << p_hot << " coarse " << coarse << " id bytes " << sizeof(Id)
                                        << " seed " << seed);
        std::vector<uint8_t> mask(E);
        for (auto& m : mask) m = u01(rng) < p_hot ? static_cast<uint8_t>(1 + rng() % 255) : 0;
        std::vector<Id> ids(size_t(tokens) * K);
        std::vector<float> w(ids.size());
        for (int t = 0; t < tokens; ++t) {
          std::vector<int> perm(E);
          std::iota(perm.begin(), perm.end(), 0);
          std::shuffle(perm.begin(), perm.end(), rng);
          for (int k = 0; k < K; ++k) {
            ids[size_t(t) * K + k] = u01(rng) < 0.2 ? Id(-1) : Id(perm[k]);
            w[size_t(t) * K + k] = coarse ? 0.25f * (1 + rng() % 3) : uw(rng);
          }
        }
        std::vector<int32_t> hot(ids.size(), -7), cold(ids.size(), -7), def(ids.size(), -7);
        SplitSpec s{E, K, D};
        split(ids.data(), w.data(), tokens, mask.data(), s, hot.data(), cold.data(), def.data());
        for (int t = 0; t < tokens; ++t) {
          const size_t o = size_t(t) * K;
          int n_cold_in = 0, n_def = 0;
          for (int k = 0; k < K; ++k) {
            const int32_t id = static_cast<int32_t>(ids[o + k]);
            if (id < 0) {
              EXPECT_EQ(hot[o + k], -1) << "token " << t << " slot " << k;
              EXPECT_EQ(cold[o + k], -1) << "token " << t << " slot " << k;
              EXPECT_EQ(def[o + k], -1) << "token " << t << " slot " << k;
              continue;
            }
            const int places = (hot[o + k] == id) + (cold[o + k] == id) + (def[o + k] == id);
            const int empties = (hot[o + k] == -1) + (cold[o + k] == -1) + (def[o + k] == -1);
            EXPECT_EQ(places, 1) << "token " << t << " slot " << k;
            EXPECT_EQ(empties, 2) << "token " << t << " slot " << k;
            EXPECT_EQ(hot[o + k] == id, mask[id] != 0) << "token " << t << " slot " << k;
            n_cold_in += mask[id] == 0;
            n_def += def[o + k] == id;
          }
          EXPECT_EQ(n_def, std::min(D, n_cold_in)) << "token " << t;
          deferred_total += n_def;
          for (int d = 0; d < K; ++d) {
            if (def[o + d] < 0) continue;
            for (int c = 0; c < K; ++c) {
              if (cold[o + c] < 0) continue;
              EXPECT_LE(w[o + d], w[o + c]) << "token " << t << ": deferred slot " << d << " outweighs cold slot " << c;
              if (w[o + d] == w[o + c]) {  // ties: the later slot is deferred
                EXPECT_GT(d, c) << "token " << t;
                ++tie_checks;
              }
            }
          }
        }
        ++cases;
      }
    }
  }
  EXPECT_GT(deferred_total, 0);
  EXPECT_GT(tie_checks, 0);  // the tie rule was exercised
  EXPECT_GT(cases, 50);
}

TEST(RoutingSplit, RandomSlotsInt32) { check_split_random<int32_t>(test::test_seed()); }
TEST(RoutingSplit, RandomSlotsInt64) { check_split_random<int64_t>(test::test_seed() + 1); }

TEST(RoutingSplit, WorkedExample) {
  // one token, experts 8, hot {1, 7}; cold 3 (0.4), 2 (0.1), 5 (0.3), 6 (0.1); deferred 2
  // -> the two lowest cold weights, 0.1 twice: slots 4 and 6 (ties: the later slot first,
  // then the next lowest, which is the earlier 0.1).
  const int32_t ids[7] = {3, 1, 7, -1, 2, 5, 6};
  const float w[7] = {0.4f, 0.9f, 0.2f, 0.5f, 0.1f, 0.3f, 0.1f};
  uint8_t mask[8] = {0, 1, 0, 0, 0, 0, 0, 1};
  int32_t hot[7], cold[7], def[7];
  split(ids, w, 1, mask, SplitSpec{8, 7, 2}, hot, cold, def);
  EXPECT_EQ(std::vector<int32_t>(hot, hot + 7), (std::vector<int32_t>{-1, 1, 7, -1, -1, -1, -1}));
  EXPECT_EQ(std::vector<int32_t>(cold, cold + 7), (std::vector<int32_t>{3, -1, -1, -1, -1, 5, -1}));
  EXPECT_EQ(std::vector<int32_t>(def, def + 7), (std::vector<int32_t>{-1, -1, -1, -1, 2, -1, 6}));
  // deferred 0: nothing deferred
  split(ids, w, 1, mask, SplitSpec{8, 7, 0}, hot, cold, def);
  EXPECT_EQ(std::vector<int32_t>(cold, cold + 7), (std::vector<int32_t>{3, -1, -1, -1, 2, 5, 6}));
  EXPECT_EQ(std::vector<int32_t>(def, def + 7), std::vector<int32_t>(7, -1));
  // deferred = top_k: every cold expert deferred, the hot ones stay
  split(ids, w, 1, mask, SplitSpec{8, 7, 7}, hot, cold, def);
  EXPECT_EQ(std::vector<int32_t>(hot, hot + 7), (std::vector<int32_t>{-1, 1, 7, -1, -1, -1, -1}));
  EXPECT_EQ(std::vector<int32_t>(cold, cold + 7), std::vector<int32_t>(7, -1));
  EXPECT_EQ(std::vector<int32_t>(def, def + 7), (std::vector<int32_t>{3, -1, -1, -1, 2, 5, 6}));
}

TEST(RoutingSplit, BadSpecsAndIdsAreRefusedByPosition) {
  std::string msg = test::error_of([] { validate_split(SplitSpec{8, 2, 3}); });
  EXPECT_NE(msg.find("deferred_experts = 3"), npos) << msg;
  msg = test::error_of([] { validate_split(SplitSpec{8, 2, -1}); });
  EXPECT_NE(msg.find("deferred_experts = -1"), npos) << msg;
  msg = test::error_of([] { validate_split(SplitSpec{0, 2, 0}); });
  EXPECT_NE(msg.find("experts = 0"), npos) << msg;
  EXPECT_NO_THROW(validate_split(SplitSpec{8, 2, 2}));

  uint8_t mask[4] = {1, 0, 0, 0};
  const float w[4] = {0.5f, 0.5f, 0.5f, 0.5f};
  int32_t hot[4], cold[4], def[4];
  const int32_t* no_ids = nullptr;  // the spec is checked before any id is read
  msg = test::error_of([&] { split(no_ids, w, 0, mask, SplitSpec{4, 2, 3}, hot, cold, def); });
  EXPECT_NE(msg.find("deferred_experts = 3"), npos) << msg;
  const int32_t ids32[4] = {0, 1, 4, 2};
  msg = test::error_of([&] { split(ids32, w, 2, mask, SplitSpec{4, 2, 0}, hot, cold, def); });
  EXPECT_NE(msg.find("ids[1, 0] = 4"), npos) << msg;
  const int32_t neg[4] = {0, 1, 2, -2};
  msg = test::error_of([&] { split(neg, w, 2, mask, SplitSpec{4, 2, 0}, hot, cold, def); });
  EXPECT_NE(msg.find("ids[1, 1] = -2"), npos) << msg;
  const int64_t ids64[4] = {0, int64_t(1) << 40, 1, 2};
  msg = test::error_of([&] { split(ids64, w, 2, mask, SplitSpec{4, 2, 0}, hot, cold, def); });
  EXPECT_NE(msg.find("ids[0, 1] = 1099511627776"), npos) << msg;
  const int64_t ok64[4] = {0, -1, 3, 2};
  EXPECT_NO_THROW(split(ok64, w, 2, mask, SplitSpec{4, 2, 1}, hot, cold, def));
  EXPECT_EQ(hot[0], 0);
  EXPECT_EQ(cold[2], 3);  // token 1: 3 and 2 cold with equal weights; the later slot is deferred
  EXPECT_EQ(def[2], -1);
  EXPECT_EQ(def[3], 2);
}

// ---- placement ------------------------------------------------------------------------

HotExpertsConfig uniform(int count) {
  HotExpertsConfig c;
  c.policy = HotExpertsConfig::Policy::uniform;
  c.count = count;
  return c;
}

TEST(PlacementChoose, NoneAndUniform) {
  EXPECT_TRUE(choose_hot_experts(HotExpertsConfig{}, 0, 16).empty());
  EXPECT_EQ(choose_hot_experts(uniform(4), 0, 16), (std::vector<int>{0, 4, 8, 12}));
  EXPECT_EQ(choose_hot_experts(uniform(4), 9, 16), (std::vector<int>{0, 4, 8, 12}));  // same for every layer
  std::vector<int> all(16);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(choose_hot_experts(uniform(40), 0, 16), all);
  EXPECT_EQ(choose_hot_experts(uniform(16), 0, 16), all);
  EXPECT_EQ(choose_hot_experts(uniform(1), 0, 16), (std::vector<int>{0}));
  // every count: ascending, distinct, in range, and spread evenly (gaps differ by at most 1)
  for (int E : {1, 3, 8, 60, 128}) {
    for (int n = 1; n <= E + 2; ++n) {
      SCOPED_TRACE(testing::Message() << "experts " << E << " count " << n);
      const auto h = choose_hot_experts(uniform(n), 0, E);
      ASSERT_EQ(static_cast<int>(h.size()), std::min(n, E));
      EXPECT_EQ(h.front(), 0);
      EXPECT_LT(h.back(), E);
      int gmin = E, gmax = 0;
      for (size_t i = 0; i < h.size(); ++i) {
        const int next = i + 1 < h.size() ? h[i + 1] : h[0] + E;  // wrap around
        EXPECT_LT(h[i], next);
        gmin = std::min(gmin, next - h[i]);
        gmax = std::max(gmax, next - h[i]);
      }
      EXPECT_LE(gmax - gmin, 1);
    }
  }
  // the parsed shorthand means the same
  const Config cfg = parse_config("version: 1\ngpu:\n  hot_experts: 4\n");
  EXPECT_EQ(cfg.gpu.hot_experts.policy, HotExpertsConfig::Policy::uniform);
  EXPECT_EQ(choose_hot_experts(cfg.gpu.hot_experts, 3, 16), (std::vector<int>{0, 4, 8, 12}));
}

TEST(PlacementRebalance, SwapsOnlyPastTheHysteresis) {
  // 8 experts, hot {0, 1}.
  std::vector<double> s = {10, 2, 0, 0, 0, 0, 9, 30};
  EXPECT_EQ(rebalance_hot_experts({0, 1}, s, 0.25), (std::vector<int>{0, 7}));  // 30 > 1.25 x 2; 9 < 1.25 x 10
  EXPECT_EQ(rebalance_hot_experts({0, 1}, s, 20.0), (std::vector<int>{0, 1}));  // 30 < 21 x 2: no swap
  EXPECT_EQ(rebalance_hot_experts({0, 1}, s, 0.0), (std::vector<int>{0, 7}));   // 9 < 10: 0 stays
  s[6] = 13;  // 13 > 1.25 x 10: both hot experts go, the strongest cold one replaces the weakest hot one
  EXPECT_EQ(rebalance_hot_experts({0, 1}, s, 0.25), (std::vector<int>{6, 7}));
  // never routed: a hot expert with score 0 gives way to any routed one, not to another 0
  EXPECT_EQ(rebalance_hot_experts({2, 3}, {0, 0, 0, 0, 0, 1}, 0.25), (std::vector<int>{2, 5}));
  EXPECT_EQ(rebalance_hot_experts({2, 3}, {0, 0, 0, 0, 0, 0}, 0.0), (std::vector<int>{2, 3}));
  // equal scores never swap, whatever the ids
  EXPECT_EQ(rebalance_hot_experts({4, 5}, {7, 7, 7, 7, 7, 7}, 0.0), (std::vector<int>{4, 5}));
  // empty and full sets
  EXPECT_TRUE(rebalance_hot_experts({}, {1, 2, 3}, 0.25).empty());
  EXPECT_EQ(rebalance_hot_experts({0, 1, 2}, {1, 2, 3}, 0.25), (std::vector<int>{0, 1, 2}));
  EXPECT_NE(test::error_of([] { rebalance_hot_experts({1, 1}, {1, 2, 3}, 0.25); }).find("listed twice"), npos);
  EXPECT_NE(test::error_of([] { rebalance_hot_experts({3}, {1, 2, 3}, 0.25); }).find("outside"), npos);
}

TEST(PlacementAuto, CountFromTheBudget) {
  const MoeShape s{128, 2048, 768};               // qwen3-30b: one expert is 9 MiB on the device
  const uint64_t expert = 6ull * 2048 * 768;      // bytes
  EXPECT_EQ(hot_count_for_budget(0, 48, s), 0);
  EXPECT_EQ(hot_count_for_budget(48 * expert - 1, 48, s), 0);
  EXPECT_EQ(hot_count_for_budget(48 * expert, 48, s), 1);
  EXPECT_EQ(hot_count_for_budget(48 * expert * 17 + 5, 48, s), 17);
  EXPECT_EQ(hot_count_for_budget(uint64_t{1} << 50, 48, s), 128);  // never more than the layer has
  EXPECT_EQ(hot_auto_reserve(0), uint64_t{2} << 30);
  EXPECT_EQ(hot_auto_reserve(uint64_t{140} << 30), uint64_t{14} << 30);
  EXPECT_NE(test::error_of([&] { hot_count_for_budget(1, 0, s); }).find("MoE layers"), npos);
}

TEST(PlacementChoose, ExplicitLists) {
  HotExpertsConfig c;
  c.policy = HotExpertsConfig::Policy::explicit_lists;
  c.layers[0] = {5, 1, 9};
  c.layers[2] = {};
  c.layers[3] = {3, 16};
  EXPECT_EQ(choose_hot_experts(c, 0, 16), (std::vector<int>{1, 5, 9}));
  EXPECT_TRUE(choose_hot_experts(c, 1, 16).empty());
  EXPECT_TRUE(choose_hot_experts(c, 2, 16).empty());
  const std::string msg = test::error_of([&] { choose_hot_experts(c, 3, 16); });
  EXPECT_NE(msg.find("gpu.hot_experts.layers"), npos) << msg;
  EXPECT_NE(msg.find("16"), npos) << msg;
  EXPECT_EQ(choose_hot_experts(c, 3, 17), (std::vector<int>{3, 16}));

  const Config cfg = parse_config("version: 1\ngpu:\n  hot_experts:\n    layers: {0: [7, 2], 4: [3]}\n");
  EXPECT_EQ(cfg.gpu.hot_experts.policy, HotExpertsConfig::Policy::explicit_lists);
  EXPECT_EQ(choose_hot_experts(cfg.gpu.hot_experts, 0, 8), (std::vector<int>{2, 7}));
  EXPECT_EQ(choose_hot_experts(cfg.gpu.hot_experts, 4, 8), (std::vector<int>{3}));
  EXPECT_TRUE(choose_hot_experts(cfg.gpu.hot_experts, 1, 8).empty());
}

HotExpertsConfig by_statistics(int count) {
  HotExpertsConfig c;
  c.policy = HotExpertsConfig::Policy::statistics;
  c.count = count;
  c.statistics = "stats.json";
  return c;
}

TEST(PlacementChoose, Statistics) {
  RoutingStatistics st;
  st.experts = 6;
  st.layers[0] = {5, 9, 9, 1, 7, 0};
  st.layers[4] = {1, 4, 0, 4, 4, 2};
  EXPECT_EQ(choose_hot_experts(by_statistics(3), 0, 6, &st), (std::vector<int>{1, 2, 4}));
  EXPECT_EQ(choose_hot_experts(by_statistics(1), 0, 6, &st), (std::vector<int>{1}));       // tie 1 / 2: lower id
  EXPECT_EQ(choose_hot_experts(by_statistics(2), 4, 6, &st), (std::vector<int>{1, 3}));    // ties 1 / 3 / 4
  EXPECT_EQ(choose_hot_experts(by_statistics(4), 4, 6, &st), (std::vector<int>{1, 3, 4, 5}));
  EXPECT_EQ(choose_hot_experts(by_statistics(10), 4, 6, &st), (std::vector<int>{0, 1, 2, 3, 4, 5}));

  // random counts against a reference (sort by count descending, then id)
  const uint64_t seed = test::test_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 50; ++trial) {
    const int E = std::uniform_int_distribution<int>(1, 128)(rng);
    const int n = std::uniform_int_distribution<int>(1, E)(rng);
    SCOPED_TRACE(testing::Message() << "trial " << trial << " experts " << E << " count " << n << " seed " << seed);
    RoutingStatistics r;
    r.experts = E;
    auto& cnt = r.layers[trial];
    for (int e = 0; e < E; ++e) cnt.push_back(rng() % 20);  // small range: many ties
    std::vector<int> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return cnt[a] != cnt[b] ? cnt[a] > cnt[b] : a < b; });
    std::vector<int> want(order.begin(), order.begin() + n);
    std::sort(want.begin(), want.end());
    EXPECT_EQ(choose_hot_experts(by_statistics(n), trial, E, &r), want);
  }

  std::string msg = test::error_of([&] { choose_hot_experts(by_statistics(2), 0, 6, nullptr); });
  EXPECT_NE(msg.find("gpu.hot_experts.statistics"), npos) << msg;
  EXPECT_NE(msg.find("stats.json"), npos) << msg;
  msg = test::error_of([&] { choose_hot_experts(by_statistics(2), 0, 8, &st); });
  EXPECT_NE(msg.find("stats.json"), npos) << msg;
  EXPECT_NE(msg.find("6 experts"), npos) << msg;
  EXPECT_NE(msg.find("8"), npos) << msg;
  msg = test::error_of([&] { choose_hot_experts(by_statistics(2), 7, 6, &st); });
  EXPECT_NE(msg.find("stats.json"), npos) << msg;
  EXPECT_NE(msg.find("layer 7"), npos) << msg;
}

TEST(PlacementChoose, StatisticsFromAParsedConfigAndFile) {
  test::ScratchDir dir;
  const Config cfg = parse_config("version: 1\ngpu:\n  hot_experts:\n    count: 2\n    statistics: s.json\n", "p.yaml",
                                  dir.path());
  const HotExpertsConfig& h = cfg.gpu.hot_experts;
  EXPECT_EQ(h.policy, HotExpertsConfig::Policy::statistics);
  EXPECT_EQ(h.count, 2);
  EXPECT_EQ(h.statistics, (dir.path() / "s.json").lexically_normal());
  RoutingStatistics st;
  st.experts = 4;
  st.layers[1] = {10, 30, 20, 30};
  save_routing_statistics(st, h.statistics);
  const RoutingStatistics loaded = load_routing_statistics(h.statistics);
  EXPECT_EQ(choose_hot_experts(h, 1, 4, &loaded), (std::vector<int>{1, 3}));
  const std::string msg = test::error_of([&] { choose_hot_experts(h, 0, 4, &loaded); });
  EXPECT_NE(msg.find("s.json"), npos) << msg;
  EXPECT_NE(msg.find("layer 0"), npos) << msg;
}

// ---- statistics files -----------------------------------------------------------------

std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(PlacementStatistics, SaveLoadRoundTrip) {
  test::ScratchDir dir;
  RoutingStatistics st;
  st.experts = 5;
  st.layers[0] = {0, 1, 2, 3, 4};
  st.layers[3] = {std::numeric_limits<uint64_t>::max(), 1ull << 53, 7, 0, 99};
  st.layers[47] = {1, 1, 1, 1, 1};
  const auto path = dir / "stats.json";
  save_routing_statistics(st, path);
  const RoutingStatistics back = load_routing_statistics(path);
  EXPECT_EQ(back.experts, 5);
  EXPECT_EQ(back.layers, st.layers);

  const nlohmann::json j = nlohmann::json::parse(read_text(path));  // throws if not JSON
  EXPECT_EQ(j.at("format"), "tandem.routing_statistics");
  EXPECT_EQ(j.at("experts"), 5);
  EXPECT_TRUE(j.at("layers").contains("47"));

  // empty statistics round-trip too
  RoutingStatistics empty;
  empty.experts = 3;
  save_routing_statistics(empty, dir / "empty.json");
  const RoutingStatistics e2 = load_routing_statistics(dir / "empty.json");
  EXPECT_EQ(e2.experts, 3);
  EXPECT_TRUE(e2.layers.empty());
}

TEST(PlacementStatistics, SavingReplacesTheFileAtomically) {
  test::ScratchDir dir;
  const auto path = dir / "stats.json";
  test::write_file(path, std::string(10000, 'x'));  // longer than what replaces it
  RoutingStatistics a;
  a.experts = 2;
  a.layers[0] = {1, 2};
  save_routing_statistics(a, path);
  RoutingStatistics b;
  b.experts = 3;
  b.layers[5] = {3, 2, 1};
  save_routing_statistics(b, path);
  const RoutingStatistics back = load_routing_statistics(path);
  EXPECT_EQ(back.experts, 3);
  EXPECT_EQ(back.layers, b.layers);
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) names.push_back(entry.path().filename());
  EXPECT_EQ(names, std::vector<std::string>{"stats.json"});  // no *.tmp* left behind
  // a directory that does not exist: an error naming the file, nothing created
  const std::string msg = test::error_of([&] { save_routing_statistics(a, dir / "nope" / "s.json"); });
  EXPECT_NE(msg.find("routing statistics"), npos) << msg;
  EXPECT_NE(msg.find("s.json"), npos) << msg;
}

TEST(PlacementStatistics, BadFilesAreRefusedNamingFileAndProblem) {
  test::ScratchDir dir;
  auto load_error = [&](const std::string& name, const std::string& text) {
    const auto p = dir / name;
    test::write_file(p, text);
    return test::error_of([&] { load_routing_statistics(p); });
  };
  const auto missing = dir / "missing.json";
  std::string msg = test::error_of([&] { load_routing_statistics(missing); });
  EXPECT_NE(msg.find(missing.string()), npos) << msg;
  EXPECT_NE(msg.find("cannot read"), npos) << msg;

  msg = load_error("text.json", "this is not json {");
  EXPECT_NE(msg.find("text.json"), npos) << msg;
  EXPECT_NE(msg.find("not a JSON object"), npos) << msg;

  msg = load_error("array.json", "[1, 2, 3]");
  EXPECT_NE(msg.find("array.json"), npos) << msg;
  EXPECT_NE(msg.find("not a JSON object"), npos) << msg;

  const std::string good_tail = R"(, "version": 1, "experts": 3, "layers": {"0": [1, 2, 3]}})";
  msg = load_error("format.json", R"({"format": "tandem.something_else")" + good_tail);
  EXPECT_NE(msg.find("format.json"), npos) << msg;
  EXPECT_NE(msg.find("\"format\""), npos) << msg;
  msg = load_error("noformat.json", R"({"version": 1, "experts": 3, "layers": {}})");
  EXPECT_NE(msg.find("noformat.json"), npos) << msg;
  EXPECT_NE(msg.find("\"format\""), npos) << msg;

  const std::string head = R"({"format": "tandem.routing_statistics", "version": 1, "experts": 3, "layers": )";
  msg = load_error("length.json", head + R"({"0": [1, 2, 3], "12": [1, 2]}})");
  EXPECT_NE(msg.find("length.json"), npos) << msg;
  EXPECT_NE(msg.find("layers.12"), npos) << msg;
  EXPECT_NE(msg.find("3 counts"), npos) << msg;

  msg = load_error("negative.json", head + R"({"2": [1, -4, 3]}})");
  EXPECT_NE(msg.find("negative.json"), npos) << msg;
  EXPECT_NE(msg.find("layers.2"), npos) << msg;
  EXPECT_NE(msg.find("non-negative"), npos) << msg;

  msg = load_error("fraction.json", head + R"({"2": [1, 2.5, 3]}})");
  EXPECT_NE(msg.find("non-negative integers"), npos) << msg;

  msg = load_error("key.json", head + R"({"x1": [1, 2, 3]}})");
  EXPECT_NE(msg.find("key.json"), npos) << msg;
  EXPECT_NE(msg.find("x1"), npos) << msg;

  msg = load_error("experts.json", R"({"format": "tandem.routing_statistics", "version": 1, "experts": 0, "layers": {}})");
  EXPECT_NE(msg.find("\"experts\""), npos) << msg;

  // and the well-formed variant of the same text loads
  test::write_file(dir / "ok.json", head + R"({"2": [1, 0, 3]}})");
  const RoutingStatistics ok = load_routing_statistics(dir / "ok.json");
  EXPECT_EQ(ok.experts, 3);
  EXPECT_EQ(ok.layers.at(2), (std::vector<uint64_t>{1, 0, 3}));
}

// ---- config ---------------------------------------------------------------------------

TEST(PlacementConfig, DeferralNeedsTwoPinnedSlots) {
  const std::string msg =
      test::error_of([] { parse_config("version: 1\ngpu:\n  deferred_experts: 1\nbuffers:\n  pinned_slots: 1\n"); });
  EXPECT_NE(msg.find("buffers.pinned_slots"), npos) << msg;
  EXPECT_NE(msg.find("deferred_experts"), npos) << msg;
  // either alone is fine
  EXPECT_NO_THROW(parse_config("version: 1\ngpu:\n  deferred_experts: 1\nbuffers:\n  pinned_slots: 2\n"));
  EXPECT_NO_THROW(parse_config("version: 1\ngpu:\n  deferred_experts: 0\nbuffers:\n  pinned_slots: 1\n"));
  // the default pinned_slots (2) allows deferral
  const Config c = parse_config("version: 1\ngpu:\n  deferred_experts: 1\n");
  EXPECT_EQ(c.gpu.deferred_experts, 1);
  EXPECT_GE(c.buffers.pinned_slots, 2);
}

}  // namespace
}  // namespace tandem
