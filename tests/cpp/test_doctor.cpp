#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <thread>

#include "tandem/cpu_features.h"
#include "tandem/doctor.h"
#include "tandem/gpu_info.h"
#include "tandem/topology.h"
#include "test_util.h"

namespace tandem {
namespace {

TEST(Topology, CountsAreConsistent) {
  const Topology& t = topology();
  ASSERT_GE(t.nodes.size(), 1u);
  int cores = 0, pus = 0;
  for (const auto& n : t.nodes) {
    cores += static_cast<int>(n.cores.size());
    for (const auto& c : n.cores) {
      EXPECT_FALSE(c.pus.empty());
      pus += static_cast<int>(c.pus.size());
    }
  }
  EXPECT_EQ(cores, t.cores);
  EXPECT_EQ(pus, t.pus);
  EXPECT_GE(t.cores, 1);
  EXPECT_LE(t.pus, static_cast<int>(std::thread::hardware_concurrency()) * 2);
}

TEST(Gpu, ReportNeverThrowsAndExplainsAbsence) {
  gpu::GpuReport r = gpu::query_gpus(true);
  if (r.gpus.empty()) {
    EXPECT_FALSE(r.status.empty());
    EXPECT_NE(r.status, "ok");
  } else {
    for (const auto& g : r.gpus) EXPECT_TRUE(g.kernel_ok) << g.name << ": " << g.kernel_error;
  }
}

TEST(Doctor, ReportMatchesDetection) {
  DoctorReport r = run_doctor();
  auto j = nlohmann::json::parse(r.json);
  EXPECT_EQ(j["cpu"]["hardware_isa"], std::string(isa_name(hardware_isa())));
  EXPECT_EQ(j["cpu"]["features"]["avx512_bf16"], cpu_features().avx512_bf16);
  EXPECT_EQ(j["topology"]["cores"], topology().cores);
  EXPECT_EQ(j["ok"], r.ok);
  EXPECT_NE(r.text.find("Topology"), std::string::npos);
  EXPECT_NE(r.text.find("GPU"), std::string::npos);
}

TEST(Doctor, ValidatesConfig) {
  test::ScratchDir dir;
  test::write_file(dir / "bad.yaml", "cpu:\n  format: bf15\n");
  DoctorReport bad = run_doctor((dir / "bad.yaml").string(), false);
  EXPECT_FALSE(bad.ok);
  auto j = nlohmann::json::parse(bad.json);
  EXPECT_EQ(j["config"]["valid"], false);
  EXPECT_EQ(j["config"]["error"], (dir / "bad.yaml").string() + ":2:11: cpu.format: 'bf15' is not one of: bf16, int8, int4");

  test::write_file(dir / "misfit.yaml", "cpu:\n  numa_nodes: [0, 7]\nmodel:\n  path: nowhere\n");
  DoctorReport misfit = run_doctor((dir / "misfit.yaml").string(), false);
  auto m = nlohmann::json::parse(misfit.json);
  EXPECT_EQ(m["config"]["valid"], true);
  EXPECT_FALSE(misfit.ok);
  const auto problems = m["config"]["problems"].dump();
  EXPECT_NE(problems.find("cpu.numa_nodes: node 7 does not exist here"), std::string::npos) << problems;
  EXPECT_NE(problems.find("model.path: '" + (dir / "nowhere").string() + "' does not exist"), std::string::npos) << problems;

  test::write_file(dir / "good.yaml", "cpu:\n  format: int8\ngpu:\n  device: none\n");
  DoctorReport good = run_doctor((dir / "good.yaml").string(), false);
  EXPECT_TRUE(good.ok) << good.text;
}

}  // namespace
}  // namespace tandem
