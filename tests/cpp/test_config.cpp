// The placement config: every example in configs/ parses; each kind of mistake gets
// the exact message (file:line:col, key path, what is allowed).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include "tandem/config.h"
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
)", "p.yaml", "/cfg");
  EXPECT_EQ(c.model.path, "/cfg/ckpt/qwen3");
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
  auto j = nlohmann::json::parse(c.to_json());
  EXPECT_EQ(j["gpu"]["hot_experts"]["policy"], "statistics");
  EXPECT_EQ(j["cpu"]["numa_nodes"], nlohmann::json({0, 1}));
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
}

TEST(Config, UnknownKeys) {
  EXPECT_EQ(err("cpu:\n  formt: int8\n"),
            "p.yaml:2:3: cpu.formt: unknown key; allowed here: format, group_size, zero_point, numa_nodes, virtual_subpools, threads, isa");
  EXPECT_EQ(err("cpus: {}\n"), "p.yaml:1:1: cpus: unknown key; allowed here: version, model, cpu, gpu, buffers, trace");
  EXPECT_EQ(err("gpu:\n  hot_experts:\n    cnt: 3\n"),
            "p.yaml:3:5: gpu.hot_experts.cnt: unknown key; allowed here: count, statistics, layers");
}

TEST(Config, RepeatedKey) {
  EXPECT_EQ(err("cpu:\n  format: int8\n  format: int4\n"), "p.yaml:3:3: cpu.format: given twice");
}

TEST(Config, BadValues) {
  EXPECT_EQ(err("cpu:\n  format: fp8\n"), "p.yaml:2:11: cpu.format: 'fp8' is not one of: bf16, int8, int4");
  EXPECT_EQ(err("cpu:\n  format: int4\n  group_size: 48\n"), "p.yaml:3:15: cpu.group_size: '48' is not one of: 32, 64, 128");
  EXPECT_EQ(err("cpu:\n  group_size: 64\n"), "p.yaml:2:15: cpu.group_size: applies only to format int4 (format is bf16)");
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
}

TEST(Config, StructureErrors) {
  EXPECT_EQ(err("- a\n- b\n"), "p.yaml:1:1: top level: expected a mapping with keys version, model, cpu, gpu, buffers, trace, got a list");
  EXPECT_EQ(err("cpu: bf16\n"),
            "p.yaml:1:6: cpu: expected a mapping with keys format, group_size, zero_point, numa_nodes, virtual_subpools, threads, isa, got 'bf16'");
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

}  // namespace
}  // namespace tandem
