// The trace recorder: a known workload's spans, parsed back from the Chrome JSON.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "tandem/moe.h"
#include "tandem/pool_config.h"
#include "tandem/trace.h"
#include "test_util.h"

namespace tandem {
namespace {

TEST(Trace, DisabledRecordsNothing) {
  trace::enable(false);
  const size_t before = trace::span_count();
  { trace::Span s("nothing"); }
  EXPECT_EQ(trace::span_count(), before);
}

TEST(Trace, MoeLayerSpansAreWrittenAsChromeJson) {
  test::ScratchDir dir;
  Config::Cpu cpu;
  cpu.virtual_subpools = 2;
  cpu.threads = 1;
  Pool pool(pool_options(cpu));
  MoeLayer layer(pool, {4, 64, 128}, {WeightFormat::int8}, 5);
  std::vector<float> g(128 * 64, 0.01f), d(64 * 128, 0.01f);
  layer.load([&](int) {
    return ExpertSource{{g.data(), SourceType::f32, 128, 64}, {g.data(), SourceType::f32, 128, 64},
                        {d.data(), SourceType::f32, 64, 128}};
  });
  std::vector<bf16_t> x(3 * 64, fp32_to_bf16(0.5f));
  std::vector<int32_t> ids = {0, 1, 1, 2, 3, -1};
  std::vector<float> w(6, 0.5f), out(3 * 64);
  MoeInput in;
  in.x = x.data();
  in.tokens = 3;
  in.ids = ids.data();
  in.top_k = 2;
  in.weights = w.data();
  in.out = out.data();
  trace::enable(true);
  layer.forward(in);
  trace::enable(false);
  trace::write(dir / "t.json");

  std::ifstream f(dir / "t.json");
  const auto j = nlohmann::json::parse(f);
  ASSERT_TRUE(j.contains("traceEvents"));
  EXPECT_EQ(j["otherData"]["clock"], "CLOCK_MONOTONIC");
  std::map<std::string, int> count;
  std::set<std::string> thread_names;
  double layer_begin = 0, layer_end = 0;
  std::vector<std::pair<double, double>> phases;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "M") {
      if (e["name"] == "thread_name") thread_names.insert(e["args"]["name"].get<std::string>());
      continue;
    }
    ASSERT_EQ(e["ph"], "X");
    ASSERT_GE(e["dur"].get<double>(), 0.0);
    const std::string name = e["name"];
    if (!e["args"].contains("layer") || e["args"]["layer"] != 5) continue;
    ++count[name];
    EXPECT_EQ(e["args"]["experts"], 4);
    EXPECT_EQ(e["args"]["tokens"], 3);
    if (name == "moe_layer") {
      layer_begin = e["ts"];
      layer_end = layer_begin + e["dur"].get<double>();
    } else {
      phases.emplace_back(e["ts"].get<double>(), e["ts"].get<double>() + e["dur"].get<double>());
    }
  }
  EXPECT_EQ(count["moe_layer"], 1);
  EXPECT_EQ(count["gather"], 4);        // one per active expert
  EXPECT_EQ(count["gate_up"], 2 * 4);   // 2 subpools x (64-row slice = 1 panel) x 4 experts
  EXPECT_EQ(count["act"], 2 * 4);
  EXPECT_EQ(count["down"], 2 * 4);      // hidden 64 = 1 panel
  EXPECT_EQ(count["merge"], 3);         // 3 tokens x 1 block of 512 columns
  for (auto [b, e] : phases) {          // every phase span nests inside the layer's span
    EXPECT_GE(b, layer_begin - 1);
    EXPECT_LE(e, layer_end + 1);
  }
  EXPECT_TRUE(thread_names.count("subpool 0 worker 0"));
  EXPECT_TRUE(thread_names.count("subpool 1 worker 0"));
}

}  // namespace
}  // namespace tandem
