// The placement config: every example in configs/ parses; each kind of mistake gets
// the exact message (file:line:col, key path, what is allowed).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <chrono>
#include <future>
#include <memory>
#include <set>
#include <thread>

#include "tandem/config.h"
#include "tandem/pool_config.h"
#include "test_util.h"

namespace tandem {
namespace {

using test::error_of;

std::string err(const std::string& yaml) {
  Errc code{};
  std::string msg = error_of([&] { parse_config(yaml, "p.yaml"); }, &code);
  EXPECT_EQ(code, Errc::invalid_argument) << msg;
  return msg;
}

TEST(Config, EmptyGivesDefaults) {
  Config c = parse_config("", "p.yaml");
  EXPECT_EQ(c.cpu.format, "bf16");
  EXPECT_EQ(c.cpu.isa, "auto");
  EXPECT_EQ(c.cpu.virtual_subpools, 1);
  EXPECT_EQ(c.gpu.device, "auto");
  EXPECT_EQ(c.gpu_index(), -2);
  EXPECT_EQ(c.gpu.hot_experts.policy, HotExpertsConfig::Policy::none);
  EXPECT_EQ(c.buffers.pinned_slots, 2);
  EXPECT_FALSE(c.trace.enabled);
}

TEST(Config, FullFileParses) {
  Config c = parse_config(R"(
version: 1
model:
  path: ckpt/qwen3
cpu:
  format: int4
  group_size: 64
  zero_point: true
  numa_nodes: [0, 1]
  virtual_subpools: 2
  threads: 12
  isa: avx512_bf16
  store: ckpt/qwen3/tandem-int4-g64-zp
gpu:
  device: cuda:1
  hot_experts:
    count: 16
    statistics: stats.json
  deferred_experts: 2
buffers:
  pinned_slots: 3
  max_tokens: 8192
trace:
  path: out/trace.json
  enabled: yes
train:
  backward_format: int8
distributed:
  cpu_experts: shared
  comm: alltoall
  alltoall_from_tokens: 16
)", "p.yaml", "/cfg");
  EXPECT_EQ(c.model.path, "/cfg/ckpt/qwen3");
  EXPECT_EQ(c.cpu.store, "/cfg/ckpt/qwen3/tandem-int4-g64-zp");  // relative to the file, as model.path
  EXPECT_EQ(c.cpu.format, "int4");
  EXPECT_EQ(c.cpu.group_size, 64);
  EXPECT_TRUE(c.cpu.zero_point);
  EXPECT_EQ(c.cpu.numa_nodes, (std::vector<int>{0, 1}));
  EXPECT_EQ(c.cpu.virtual_subpools, 2);
  EXPECT_EQ(c.cpu.threads, 12);
  EXPECT_EQ(c.cpu.isa, "avx512_bf16");
  EXPECT_EQ(c.gpu_index(), 1);
  EXPECT_EQ(c.gpu.hot_experts.policy, HotExpertsConfig::Policy::statistics);
  EXPECT_EQ(c.gpu.hot_experts.count, 16);
  EXPECT_EQ(c.gpu.hot_experts.statistics, "/cfg/stats.json");
  EXPECT_EQ(c.gpu.deferred_experts, 2);
  EXPECT_EQ(c.buffers.pinned_slots, 3);
  EXPECT_EQ(c.buffers.max_tokens, 8192);
  EXPECT_EQ(c.trace.path, "out/trace.json");  // outputs stay relative to the working directory
  EXPECT_TRUE(c.trace.enabled);
  EXPECT_EQ(c.train.backward_format, "int8");
  auto j = nlohmann::json::parse(c.to_json());
  EXPECT_EQ(j["train"]["backward_format"], "int8");
  EXPECT_EQ(c.distributed.cpu_experts, "shared");
  EXPECT_EQ(j["distributed"]["comm"], "alltoall");
  EXPECT_EQ(j["distributed"]["alltoall_from_tokens"], 16);
  EXPECT_EQ(parse_config("distributed:\n  alltoall_from_tokens: auto\n", "p.yaml").distributed.alltoall_from_tokens, 0);
  EXPECT_EQ(nlohmann::json::parse(parse_config("", "p.yaml").to_json())["distributed"]["alltoall_from_tokens"], "auto");
  EXPECT_EQ(j["gpu"]["hot_experts"]["policy"], "statistics");
  EXPECT_EQ(j["cpu"]["numa_nodes"], nlohmann::json({0, 1}));
}

TEST(Config, DenseFormat) {
  EXPECT_EQ(parse_config("", "p.yaml").cpu.dense_format, "auto");
  const Config c = parse_config("cpu:\n  dense_format: int4\n  group_size: 64\n  zero_point: true\n", "p.yaml");
  EXPECT_EQ(c.cpu.dense_format, "int4");
  EXPECT_EQ(c.cpu.format, "bf16");
  EXPECT_EQ(c.cpu.group_size, 64);
  EXPECT_TRUE(c.cpu.zero_point);
  EXPECT_NE(c.to_json().find("\"dense_format\": \"int4\""), std::string::npos) << c.to_json();
}

TEST(Config, HotExpertForms) {
  Config a = parse_config("gpu:\n  hot_experts: 8\n");
  EXPECT_EQ(a.gpu.hot_experts.policy, HotExpertsConfig::Policy::uniform);
  EXPECT_EQ(a.gpu.hot_experts.count, 8);
  Config b = parse_config("gpu:\n  hot_experts:\n    layers: {0: [1, 5], 3: []}\n");
  EXPECT_EQ(b.gpu.hot_experts.policy, HotExpertsConfig::Policy::explicit_lists);
  EXPECT_EQ(b.gpu.hot_experts.layers.at(0), (std::vector<int>{1, 5}));
  EXPECT_TRUE(b.gpu.hot_experts.layers.at(3).empty());
  Config c = parse_config("gpu:\n  device: none\n  hot_experts: {count: 0}\n");
  EXPECT_EQ(c.gpu.hot_experts.policy, HotExpertsConfig::Policy::none);
  EXPECT_EQ(c.gpu_index(), -1);
  EXPECT_EQ(parse_config("gpu: {device: 3}").gpu.device, "cuda:3");
  Config d = parse_config("gpu:\n  hot_experts: {count: 4, dynamic: true, rebalance_steps: 16, hysteresis: 0.5}\n");
  EXPECT_EQ(d.gpu.hot_experts.policy, HotExpertsConfig::Policy::uniform);
  EXPECT_TRUE(d.gpu.hot_experts.dynamic);
  EXPECT_EQ(d.gpu.hot_experts.rebalance_steps, 16);
  EXPECT_EQ(d.gpu.hot_experts.hysteresis, 0.5);
  EXPECT_NE(d.to_json().find("\"rebalance_steps\": 16"), std::string::npos) << d.to_json();
  Config e = parse_config("gpu:\n  hot_experts: {count: 4, dynamic: true}\n");
  EXPECT_EQ(e.gpu.hot_experts.rebalance_steps, 64);
  EXPECT_EQ(e.gpu.hot_experts.hysteresis, 0.25);
  EXPECT_FALSE(parse_config("gpu:\n  hot_experts: 4\n").gpu.hot_experts.dynamic);
  for (const char* text : {"gpu:\n  hot_experts: auto\n", "gpu:\n  hot_experts: {count: auto}\n"}) {
    const Config a = parse_config(text);
    EXPECT_TRUE(a.gpu.hot_experts.auto_count) << text;
    EXPECT_EQ(a.gpu.hot_experts.policy, HotExpertsConfig::Policy::uniform) << text;
    EXPECT_NE(a.to_json().find("\"count\": \"auto\""), std::string::npos) << a.to_json();
  }
  const Config s = parse_config("gpu:\n  hot_experts: {count: auto, statistics: s.json, dynamic: true}\n", "p.yaml", "/cfg");
  EXPECT_EQ(s.gpu.hot_experts.policy, HotExpertsConfig::Policy::statistics);
  EXPECT_TRUE(s.gpu.hot_experts.auto_count && s.gpu.hot_experts.dynamic);
  EXPECT_EQ(err("gpu:\n  hot_experts: {count: many}\n"), "p.yaml:2:24: gpu.hot_experts.count: expected an integer, got 'many'");
}

TEST(Config, UnknownKeys) {
  EXPECT_EQ(err("cpu:\n  formt: int8\n"),
            "p.yaml:2:3: cpu.formt: unknown key; allowed here: format, dense_format, group_size, zero_point, numa_nodes, virtual_subpools, threads, isa, store");
  EXPECT_EQ(err("cpus: {}\n"), "p.yaml:1:1: cpus: unknown key; allowed here: version, model, cpu, gpu, buffers, trace, train, distributed");
  EXPECT_EQ(err("gpu:\n  hot_experts:\n    cnt: 3\n"),
            "p.yaml:3:5: gpu.hot_experts.cnt: unknown key; allowed here: count, statistics, layers, dynamic, "
            "rebalance_steps, hysteresis");
}

TEST(Config, RepeatedKey) {
  EXPECT_EQ(err("cpu:\n  format: int8\n  format: int4\n"), "p.yaml:3:3: cpu.format: given twice");
}

TEST(Config, BadValues) {
  EXPECT_EQ(err("cpu:\n  format: fp8\n"), "p.yaml:2:11: cpu.format: 'fp8' is not one of: bf16, int8, int4, mxfp4");
  EXPECT_EQ(err("cpu:\n  format: int4\n  group_size: 48\n"), "p.yaml:3:15: cpu.group_size: '48' is not one of: 32, 64, 128");
  EXPECT_EQ(err("cpu:\n  group_size: 64\n"),
            "p.yaml:2:15: cpu.group_size: applies only to format or dense_format int4 (format is bf16, dense_format auto)");
  // mxfp4 has its own blocks of 32 and no zero points: int4's keys are refused with it.
  EXPECT_EQ(err("cpu:\n  format: mxfp4\n  group_size: 32\n"),
            "p.yaml:3:15: cpu.group_size: applies only to format or dense_format int4 (format is mxfp4, dense_format auto)");
  EXPECT_EQ(pack_options(parse_config("cpu:\n  format: mxfp4\n", "p.yaml").cpu).e2m1, true);
  EXPECT_EQ(err("cpu:\n  dense_format: fp8\n"),
            "p.yaml:2:17: cpu.dense_format: 'fp8' is not one of: auto, torch, bf16, int8, int4");
  EXPECT_EQ(err("cpu:\n  threads: many\n"), "p.yaml:2:12: cpu.threads: expected an integer, got 'many'");
  EXPECT_EQ(err("cpu:\n  threads: 0\n"), "p.yaml:2:12: cpu.threads: 0 is outside the allowed range [1, 4096]");
  EXPECT_EQ(err("cpu:\n  numa_nodes: [0, 0]\n"), "p.yaml:2:19: cpu.numa_nodes[1]: 0 is listed twice");
  EXPECT_EQ(err("cpu:\n  numa_nodes: []\n"), "p.yaml:2:15: cpu.numa_nodes: the list is empty");
  EXPECT_EQ(err("cpu:\n  isa: avx1024\n"),
            "p.yaml:2:8: cpu.isa: unknown ISA level 'avx1024'; allowed: auto, scalar, avx2, avx512, avx512_vnni, avx512_bf16, amx");
  EXPECT_EQ(err("gpu:\n  device: gpu0\n"), "p.yaml:2:11: gpu.device: 'gpu0' is not one of: auto, none, a device index (0, 1, ...), cuda:N");
  EXPECT_EQ(err("gpu:\n  deferred_experts: -1\n"), "p.yaml:2:21: gpu.deferred_experts: -1 is outside the allowed range [0, 256]");
  EXPECT_EQ(err("buffers:\n  pinned_slots: 9\n"), "p.yaml:2:17: buffers.pinned_slots: 9 is outside the allowed range [1, 4]");
  EXPECT_EQ(err("trace:\n  enabled: maybe\n"), "p.yaml:2:12: trace.enabled: expected true or false, got 'maybe'");
  EXPECT_EQ(err("train:\n  backward_format: int4\n"),
            "p.yaml:2:20: train.backward_format: 'int4' is not one of: bf16, int8");
  // A method that is not built is refused when the config is read, not at the first forward.
  EXPECT_EQ(err("distributed:\n  comm: ring\n"),
            "p.yaml:2:9: distributed.comm: 'ring' is not one of: auto, allgather, alltoall");
  EXPECT_EQ(err("distributed:\n  alltoall_from_tokens: 0\n"),
            "p.yaml:2:25: distributed.alltoall_from_tokens: 0 is outside the allowed range [1, 16777216]");
  EXPECT_EQ(err("distributed:\n  cpu_experts: node\n"),
            "p.yaml:2:16: distributed.cpu_experts: 'node' is not one of: auto, shared, per_rank");
  EXPECT_EQ(err("version: 2\n"), "p.yaml:1:10: version: 2 is outside the allowed range [1, 1]");
  EXPECT_EQ(err("model:\n  path: [a]\n"), "p.yaml:2:9: model.path: expected a non-empty string, got a list");
}

TEST(Config, HotExpertConflicts) {
  EXPECT_EQ(err("gpu:\n  hot_experts:\n    count: 4\n    layers: {0: [1]}\n"),
            "p.yaml:4:13: gpu.hot_experts.layers: explicit per-layer lists exclude 'count' and 'statistics'; give one or the other");
  EXPECT_EQ(err("gpu:\n  hot_experts:\n    statistics: s.json\n"),
            "p.yaml:3:17: gpu.hot_experts.statistics: needs 'count' (how many of the most frequent experts per layer go to the GPU)");
  EXPECT_EQ(err("gpu:\n  hot_experts:\n    layers: {0: [1, 1]}\n"), "p.yaml:3:21: gpu.hot_experts.layers.0[1]: 1 is listed twice");
  EXPECT_EQ(err("gpu:\n  hot_experts:\n    layers: {x: [1]}\n"), "p.yaml:3:14: gpu.hot_experts.layers.x: expected an integer, got 'x'");
  // dynamic hot experts
  EXPECT_EQ(err("gpu:\n  hot_experts: {dynamic: true}\n"),
            "p.yaml:2:26: gpu.hot_experts.dynamic: needs 'count' (how many experts per layer the GPU holds)");
  EXPECT_EQ(err("gpu:\n  hot_experts: {count: 0, dynamic: true}\n"),
            "p.yaml:2:36: gpu.hot_experts.dynamic: given with count 0, so there is nothing to move; set count > 0 or "
            "remove it");
  EXPECT_EQ(err("gpu:\n  hot_experts: {dynamic: true, layers: {0: [1]}}\n"),
            "p.yaml:2:26: gpu.hot_experts.dynamic: dynamic hot experts start from 'count' (uniform or with "
            "'statistics'), not from explicit per-layer lists");
  EXPECT_EQ(err("gpu:\n  hot_experts: {count: 2, rebalance_steps: 8}\n"),
            "p.yaml:2:44: gpu.hot_experts.rebalance_steps: applies only with 'dynamic: true'");
  EXPECT_EQ(err("gpu:\n  hot_experts: {count: 2, dynamic: true, hysteresis: -0.1}\n"),
            "p.yaml:2:54: gpu.hot_experts.hysteresis: -0.1 is outside the allowed range [0, 100]");
  EXPECT_EQ(err("gpu:\n  hot_experts: {count: 2, dynamic: true, hysteresis: lots}\n"),
            "p.yaml:2:54: gpu.hot_experts.hysteresis: expected a number, got 'lots'");
  EXPECT_EQ(err("gpu:\n  hot_experts: {count: 2, dynamic: true, rebalance_steps: 0}\n"),
            "p.yaml:2:59: gpu.hot_experts.rebalance_steps: 0 is outside the allowed range [1, 1073741824]");
  EXPECT_EQ(err("gpu:\n  hot_experts: {count: 2, dynamic: sometimes}\n"),
            "p.yaml:2:36: gpu.hot_experts.dynamic: expected true or false, got 'sometimes'");
}

TEST(Config, StructureErrors) {
  EXPECT_EQ(err("- a\n- b\n"), "p.yaml:1:1: top level: expected a mapping with keys version, model, cpu, gpu, buffers, trace, train, distributed, got a list");
  EXPECT_EQ(err("cpu: bf16\n"),
            "p.yaml:1:6: cpu: expected a mapping with keys format, dense_format, group_size, zero_point, numa_nodes, virtual_subpools, threads, isa, store, got 'bf16'");
  std::string syntax = err("cpu:\n  format: [bf16\n");
  EXPECT_EQ(syntax.rfind("p.yaml:3:1: YAML syntax error: ", 0), 0u) << syntax;
}

TEST(Config, MissingFileIsIoError) {
  Errc code{};
  EXPECT_EQ(error_of([] { load_config("/nonexistent/x.yaml"); }, &code), "cannot read config '/nonexistent/x.yaml': no such file");
  EXPECT_EQ(code, Errc::io);
  // A directory or a FIFO is not a config (and must not read as an empty one, or block).
  test::ScratchDir dir;
  EXPECT_EQ(error_of([&] { load_config(dir.path()); }), "cannot read config '" + dir.path().string() + "': not a regular file");
  ASSERT_EQ(mkfifo((dir / "fifo.yaml").c_str(), 0600), 0);
  EXPECT_EQ(error_of([&] { load_config(dir / "fifo.yaml"); }),
            "cannot read config '" + (dir / "fifo.yaml").string() + "': not a regular file");
}

TEST(Config, OneDocumentOnly) {
  EXPECT_EQ(err("version: 1\n---\ncpu: {format: fp8}\n"), "p.yaml:3:1: top level: a config is one YAML document; this holds 2");
}

TEST(Config, NoSilentDefaults) {
  EXPECT_EQ(err("cpu:\n  format:\n"), "p.yaml:2:3: cpu.format: has no value (remove the key to use the default)");
  EXPECT_EQ(err("cpu:\n  format: !!binary bf16\n"), "p.yaml:2:11: cpu.format: explicit YAML tags are not supported (tag:yaml.org,2002:binary)");
  EXPECT_EQ(err("cpu:\n  threads: \"4\"\n"), "p.yaml:2:12: cpu.threads: expected an integer, got '4'");
  EXPECT_EQ(err("trace:\n  enabled: \"true\"\n"), "p.yaml:2:12: trace.enabled: expected true or false, got 'true'");
  EXPECT_EQ(err("gpu:\n  device: -0\n"), "p.yaml:2:11: gpu.device: '-0' is not one of: auto, none, a device index (0, 1, ...), cuda:N");
  EXPECT_EQ(err("gpu:\n  device: cuda:-1\n"), "p.yaml:2:11: gpu.device: 'cuda:-1' is not one of: auto, none, a device index (0, 1, ...), cuda:N");
  EXPECT_EQ(err("cpu:\n  threads: 99999999999999999999\n"), "p.yaml:2:12: cpu.threads: 99999999999999999999 is outside the allowed range [1, 4096]");
  EXPECT_EQ(err("gpu:\n  hot_experts: {count: 0, statistics: s.json}\n"),
            "p.yaml:2:39: gpu.hot_experts.statistics: given with count 0, so nothing would be chosen from it; set count > 0 or remove it");
}

TEST(Config, InvalidUtf8NeverThrowsFromJson) {
  Config c = parse_config("model:\n  path: a\xff" "b\n");
  EXPECT_NO_THROW(c.to_json());
}

TEST(Config, ShippedExamplesParse) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(TANDEM_SOURCE_DIR "/configs")) {
    if (e.path().extension() != ".yaml") continue;
    EXPECT_NO_THROW(load_config(e.path())) << e.path();
    ++n;
  }
  EXPECT_GE(n, 3);
}

// ---- hostile inputs: each is refused (or read) in bounded time and memory ------------------

// Generous for any machine: every input below takes milliseconds.
constexpr auto kBound = std::chrono::seconds(5);

struct Outcome {
  bool finished = false;  // within kBound
  bool parsed = false;
  Errc code{};
  std::string message;
};

// Parses each input on a thread of its own and waits at most kBound for all of them: a
// parser that loops fails the test instead of hanging the suite (the stuck thread is left
// behind). An exception other than tandem::Error reaches the test through the future.
std::vector<Outcome> parse_all_within(std::vector<std::string> inputs, const ConfigLimits& limits = {}) {
  auto task = std::make_shared<std::packaged_task<std::vector<Outcome>()>>([inputs = std::move(inputs), limits] {
    std::vector<Outcome> out(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      out[i].finished = true;
      try {
        parse_config(inputs[i], "p.yaml", {}, limits);
        out[i].parsed = true;
      } catch (const Error& e) {
        out[i].code = e.code();
        out[i].message = e.message();
      }
    }
    return out;
  });
  std::future<std::vector<Outcome>> done = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  if (done.wait_for(kBound) != std::future_status::ready) return {};
  return done.get();
}

Outcome parse_within(std::string yaml, const ConfigLimits& limits = {}) {
  std::vector<Outcome> o = parse_all_within({std::move(yaml)}, limits);
  return o.empty() ? Outcome{} : o[0];
}

// The error an input gets within kBound ("<no answer>" when it took longer, "<parsed>" when
// it was accepted).
std::string bounded_err(std::string yaml, const ConfigLimits& limits = {}) {
  const Outcome o = parse_within(std::move(yaml), limits);
  if (!o.finished) return "<no answer within the bound>";
  if (o.parsed) return "<parsed>";
  EXPECT_EQ(o.code, Errc::invalid_argument) << o.message;
  return o.message;
}

// yaml-cpp 0.7 looped forever (taking gigabytes) on exactly these among the 1- and 2-
// character printable ASCII files: "," alone, "," followed by any character, " ," and "!,".
TEST(ConfigHostile, InputsThatHungYamlCpp) {
  std::vector<std::string> inputs = {",", " ,", "!,"};
  for (char c = ' '; c <= '~'; ++c) inputs.push_back(std::string{',', c});
  ASSERT_EQ(inputs.size(), 98u);
  const std::vector<Outcome> out = parse_all_within(inputs);
  ASSERT_EQ(out.size(), inputs.size()) << "the parser did not return within the bound";
  for (size_t i = 0; i < inputs.size(); ++i) {
    SCOPED_TRACE("input '" + inputs[i] + "'");
    EXPECT_FALSE(out[i].parsed);
    EXPECT_EQ(out[i].code, Errc::invalid_argument);
    EXPECT_EQ(out[i].message.rfind("p.yaml:1:", 0), 0u) << out[i].message;
    EXPECT_NE(out[i].message.find(": YAML syntax error: "), std::string::npos) << out[i].message;
  }
  EXPECT_EQ(out[0].message,
            "p.yaml:1:1: YAML syntax error: did not find expected node content (while parsing a block node at 1:1)");
}

// Every file of one or two printable characters gets an answer (a config or an error).
TEST(ConfigHostile, EveryShortInputReturns) {
  std::vector<std::string> inputs;
  for (char a = ' '; a <= '~'; ++a) {
    inputs.push_back(std::string(1, a));
    for (char b = ' '; b <= '~'; ++b) inputs.push_back(std::string{a, b});
  }
  const std::vector<Outcome> out = parse_all_within(inputs);
  ASSERT_EQ(out.size(), inputs.size()) << "the parser did not return within the bound";
  for (size_t i = 0; i < inputs.size(); ++i)
    if (!out[i].parsed) EXPECT_EQ(out[i].message.rfind("p.yaml:", 0), 0u) << "'" << inputs[i] << "': " << out[i].message;
}

// Anchors and aliases are refused where they appear: a placement never needs them, and a
// few lines of them expand into a tree of any size ("billion laughs").
TEST(ConfigHostile, AnchorsAndAliasesAreRefused) {
  std::string laughs = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i < 10; ++i) {
    laughs += str_cat("a", i, ": &a", i, " [");
    for (int j = 0; j < 10; ++j) laughs += str_cat(j ? ", " : "", "*a", i - 1);
    laughs += "]\n";
  }
  laughs += "gpu: {hot_experts: {layers: {0: *a9}}}\n";
  EXPECT_EQ(bounded_err(laughs), "p.yaml:1:5: a0: YAML anchors are not supported (&a0); write the value out where it is used");
  EXPECT_EQ(bounded_err("gpu:\n  hot_experts:\n    layers: {0: &ids [1, 2], 1: *ids}\n"),
            "p.yaml:3:17: gpu.hot_experts.layers.0: YAML anchors are not supported (&ids); write the value out where it is used");
  EXPECT_EQ(bounded_err("cpu:\n  numa_nodes: [0, &n 1]\n"),
            "p.yaml:2:19: cpu.numa_nodes[1]: YAML anchors are not supported (&n); write the value out where it is used");
  EXPECT_EQ(bounded_err("cpu: *settings\n"), "p.yaml:1:6: cpu: YAML aliases are not supported (*settings); write the value out");
}

TEST(ConfigHostile, DeepNestingIsRefused) {
  const std::string path32 = [] {
    std::string p;
    for (int i = 0; i < 32; ++i) p += "[0]";
    return p;
  }();
  const std::string over = ": nested more than 32 levels deep, over the limit (TANDEM_CONFIG_MAX_DEPTH raises it)";
  const int n = 200000;
  EXPECT_EQ(bounded_err(std::string(n, '[') + std::string(n, ']')), "p.yaml:1:33: " + path32 + over);
  EXPECT_EQ(bounded_err(std::string(n, '[')), "p.yaml:1:33: " + path32 + over);  // never closed
  std::string block;
  for (int i = 0; i < 1000; ++i) block += std::string(2 * i, ' ') + "a:\n";
  const std::string a32 = "a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a.a";
  EXPECT_EQ(bounded_err(block), "p.yaml:33:65: " + a32 + over);
  std::string flow_maps;
  for (int i = 0; i < n; ++i) flow_maps += "{a: ";
  EXPECT_EQ(bounded_err(flow_maps), "p.yaml:1:129: " + a32 + over);
  // The schema's own depth (4: gpu.hot_experts.layers.N) is far inside the limit.
  ConfigLimits tight;
  tight.max_depth = 3;
  EXPECT_EQ(bounded_err("gpu:\n  hot_experts:\n    layers: {0: [1]}\n", tight),
            "p.yaml:3:13: gpu.hot_experts.layers: nested more than 3 levels deep, over the limit (TANDEM_CONFIG_MAX_DEPTH raises it)");
}

TEST(ConfigHostile, HugeDocumentsAreRefused) {
  // Bytes: checked before anything is parsed.
  EXPECT_EQ(bounded_err("# " + std::string(2 << 20, 'x') + "\n"),
            "p.yaml: the config is 2097155 bytes, over the limit of 1048576 bytes (TANDEM_CONFIG_MAX_BYTES raises it)");
  // Nodes: a list of 300000 one-character items fits in 1 MiB but not in 2^18 nodes.
  std::string many = "cpu:\n  numa_nodes: [";
  for (int i = 0; i < 300000; ++i) many += "0,";
  many += "]\n";
  ASSERT_LT(many.size(), size_t(1) << 20);
  const std::string nodes = bounded_err(many);
  EXPECT_EQ(nodes.rfind("p.yaml:2:", 0), 0u) << nodes;
  EXPECT_NE(nodes.find(": more than 262144 YAML nodes, over the limit (TANDEM_CONFIG_MAX_NODES raises it)"), std::string::npos)
      << nodes;
  // A file is refused by its size without being read: 64 GiB here (sparse, nothing written).
  test::ScratchDir dir;
  const auto big = dir / "big.yaml";
  test::write_file(big, "version: 1\n");
  std::filesystem::resize_file(big, uint64_t(64) << 30);
  auto task = std::make_shared<std::packaged_task<std::string()>>([big] { return test::error_of([&] { load_config(big); }); });
  std::future<std::string> done = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  ASSERT_EQ(done.wait_for(kBound), std::future_status::ready) << "load_config read a 64 GiB file";
  EXPECT_EQ(done.get(), big.string() +
                            ": the config is 68719476736 bytes, over the limit of 1048576 bytes (TANDEM_CONFIG_MAX_BYTES raises it)");
}

// What a large real placement may hold, explicit lists for 256 layers x 256 experts
// (300 KB, 2^16 ids), is well inside the limits and quick.
TEST(ConfigHostile, LargeValidConfigParsesQuickly) {
  std::string yaml = "gpu:\n  hot_experts:\n    layers:\n";
  for (int l = 0; l < 256; ++l) {
    yaml += str_cat("      ", l, ": [");
    for (int e = 0; e < 256; ++e) yaml += str_cat(e ? ", " : "", e);
    yaml += "]\n";
  }
  ASSERT_TRUE(parse_within(yaml).parsed);
  const Config c = parse_config(yaml);
  ASSERT_EQ(c.gpu.hot_experts.layers.size(), 256u);
  EXPECT_EQ(c.gpu.hot_experts.layers.at(255).size(), 256u);
  EXPECT_EQ(c.gpu.hot_experts.layers.at(255).back(), 255);
}

TEST(ConfigHostile, LimitsComeFromTheEnvironment) {
  const std::string yaml = "gpu:\n  hot_experts:\n    layers: {0: [1, 2, 3]}\n";
  {
    test::ScopedEnv env("TANDEM_CONFIG_MAX_DEPTH", "2");
    EXPECT_EQ(err(yaml), "p.yaml:3:5: gpu.hot_experts: nested more than 2 levels deep, over the limit (TANDEM_CONFIG_MAX_DEPTH raises it)");
  }
  {
    test::ScopedEnv env("TANDEM_CONFIG_MAX_NODES", "8");
    EXPECT_EQ(err(yaml), "p.yaml:3:17: more than 8 YAML nodes, over the limit (TANDEM_CONFIG_MAX_NODES raises it)");
  }
  {
    test::ScopedEnv env("TANDEM_CONFIG_MAX_BYTES", "20");
    EXPECT_EQ(err(yaml), "p.yaml: the config is 47 bytes, over the limit of 20 bytes (TANDEM_CONFIG_MAX_BYTES raises it)");
  }
  for (const char* bad : {"0", "-1", "lots", "12k"}) {
    test::ScopedEnv env("TANDEM_CONFIG_MAX_BYTES", bad);
    EXPECT_EQ(err(yaml), str_cat("TANDEM_CONFIG_MAX_BYTES='", bad, "' is not a positive integer"));
  }
  test::ScopedEnv env("TANDEM_CONFIG_MAX_NODES", "1000000");  // raised: 300001 nodes pass
  std::string many = "cpu:\n  numa_nodes: [";
  for (int i = 0; i < 300000; ++i) many += "0,";
  EXPECT_EQ(err(many + "]\n"), "p.yaml:2:18: cpu.numa_nodes[1]: 0 is listed twice");
}

// A config names files by their bytes (a Linux path need not be UTF-8): bytes that are not
// UTF-8 come through unchanged, keys with them are unknown keys like any other.
TEST(ConfigHostile, BytesThatAreNotUtf8PassThrough) {
  EXPECT_EQ(parse_config("model:\n  path: /m/a\xff\xfe" "b\n").model.path, "/m/a\xff\xfe" "b");
  EXPECT_EQ(parse_config("model:\n  path: \"/m/\xc3\xa9\xc3\"\n").model.path, "/m/\xc3\xa9\xc3");
  EXPECT_EQ(err("\xff: 1\n"), "p.yaml:1:1: \xff: unknown key; allowed here: version, model, cpu, gpu, buffers, trace, train, distributed");
  // The characters that carry such bytes through libyaml are refused when written.
  EXPECT_EQ(err("model:\n  path: \xf4\x8f\xbf\xbf\n"), "p.yaml:2:9: YAML syntax error: character U+10FFFF is not allowed in a config");
  EXPECT_EQ(err("cpu:\n  format: b\x01\n"), "p.yaml:2:12: YAML syntax error: control characters are not allowed (character 1)");
}

// The shipped examples read as they did with yaml-cpp (compared once, value by value, with
// its output when the parser was replaced). A change to a shipped config updates this table.
TEST(Config, ShippedExamplesKeepTheirValues) {
  auto summary = [](const Config& c) {
    std::string layers;
    for (const auto& [l, ids] : c.gpu.hot_experts.layers) {
      layers += str_cat(" ", l, ":");
      for (int id : ids) layers += str_cat(id, ",");
    }
    return str_cat(c.version, " model='", c.model.path.string(), "' cpu ", c.cpu.format, "/", c.cpu.group_size, "/",
                   c.cpu.zero_point, " nodes=", c.cpu.numa_nodes.size(), " vsp=", c.cpu.virtual_subpools,
                   " threads=", c.cpu.threads, " isa=", c.cpu.isa, " gpu ", c.gpu.device, " hot=",
                   hot_policy_name(c.gpu.hot_experts.policy), "/", c.gpu.hot_experts.count, "/",
                   c.gpu.hot_experts.statistics.string(), layers, " deferred=", c.gpu.deferred_experts, " buffers ",
                   c.buffers.pinned_slots, "x", c.buffers.max_tokens, " trace ", c.trace.path.string(), "/", c.trace.enabled);
  };
  const std::map<std::string, std::string> want = {
      {"deepseek-v3.yaml", "1 model='' cpu int4/128/0 nodes=0 vsp=1 threads=0 isa=auto gpu cuda:0 hot=none/0/ deferred=2 buffers 2x4096 trace tandem_trace.json/0"},
      {"demo.yaml", "1 model='' cpu bf16/128/0 nodes=0 vsp=2 threads=0 isa=auto gpu auto hot=none/0/ deferred=0 buffers 2x4096 trace tandem_trace.json/0"},
      {"mixtral-8x7b.yaml", "1 model='' cpu int8/128/0 nodes=0 vsp=1 threads=0 isa=auto gpu cuda:0 hot=explicit/0/ 0:0,1, 1:2, deferred=0 buffers 2x4096 trace tandem_trace.json/0"},
      {"qwen3-235b-a22b.yaml", "1 model='' cpu int8/128/0 nodes=0 vsp=1 threads=0 isa=auto gpu cuda:0 hot=uniform/4/ deferred=2 buffers 2x1024 trace tandem_trace.json/0"},
      {"qwen3-30b-a3b.yaml", "1 model='' cpu bf16/128/0 nodes=0 vsp=1 threads=0 isa=auto gpu cuda:0 hot=uniform/16/ deferred=1 buffers 2x1024 trace tandem_trace.json/0"},
  };
  std::set<std::string> seen;
  for (const auto& e : std::filesystem::directory_iterator(TANDEM_SOURCE_DIR "/configs")) {
    if (e.path().extension() != ".yaml") continue;
    const std::string name = e.path().filename().string();
    seen.insert(name);
    ASSERT_TRUE(want.count(name)) << name << " is not in this test's table: add what it should parse to";
    EXPECT_EQ(summary(load_config(e.path())), want.at(name)) << name;
  }
  EXPECT_EQ(seen.size(), want.size());
}

}  // namespace
}  // namespace tandem
