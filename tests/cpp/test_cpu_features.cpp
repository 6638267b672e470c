#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

#include "tandem/cpu_features.h"
#include "tandem/error.h"
#include "test_util.h"

namespace tandem {
namespace {

using test::ScopedEnv;

std::set<std::string> proc_cpuinfo_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) == 0) {
      std::istringstream ss(line.substr(line.find(':') + 1));
      std::set<std::string> flags;
      for (std::string f; ss >> f;) flags.insert(f);
      return flags;
    }
  }
  return {};
}

// The kernel's view (/proc/cpuinfo lists what the CPU has AND the kernel enables)
// must agree with our own cpuid + XCR0 decoding, flag by flag.
TEST(CpuFeatures, AgreesWithProcCpuinfo) {
  auto flags = proc_cpuinfo_flags();
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags on this system";
  const CpuFeatures& f = cpu_features();
  struct { const char* flag; bool ours; } rows[] = {
      {"avx", f.avx}, {"avx2", f.avx2}, {"fma", f.fma}, {"f16c", f.f16c},
      {"avx512f", f.avx512f}, {"avx512dq", f.avx512dq}, {"avx512bw", f.avx512bw},
      {"avx512vl", f.avx512vl}, {"avx512_vnni", f.avx512_vnni}, {"avx512_bf16", f.avx512_bf16},
      {"avx512_fp16", f.avx512_fp16}, {"avx_vnni", f.avx_vnni}, {"amx_tile", f.amx_tile},
      {"amx_bf16", f.amx_bf16}, {"amx_int8", f.amx_int8},
  };
  for (const auto& r : rows) EXPECT_EQ(r.ours, flags.count(r.flag) > 0) << r.flag;
}

TEST(CpuFeatures, DecodeRequiresOsState) {
  CpuidRegs r;
  r.l1_ecx = (1u << 27) | (1u << 28) | (1u << 12);  // OSXSAVE, AVX, FMA
  r.l7_ebx = (1u << 5) | (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);  // AVX2, AVX-512 F/DQ/BW/VL
  r.xcr0 = 0x7;  // x87, SSE, AVX: the OS does not save ZMM state
  CpuFeatures f = decode_features(r);
  EXPECT_TRUE(f.avx2);
  EXPECT_TRUE(f.fma);
  EXPECT_FALSE(f.avx512f);
  EXPECT_EQ(f.disabled_by_os, (std::vector<std::string>{"avx512f", "avx512dq", "avx512bw", "avx512vl"}));
  r.xcr0 = 0xe7;
  f = decode_features(r);
  EXPECT_TRUE(f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq);
  EXPECT_TRUE(f.disabled_by_os.empty());
}

TEST(CpuFeatures, DecodeAmxNeedsXcr0AndPermission) {
  CpuidRegs r;
  r.l1_ecx = 1u << 27;
  r.l7_edx = (1u << 22) | (1u << 24) | (1u << 25);
  r.xcr0 = 0xe7 | (1ull << 17) | (1ull << 18);
  r.amx_permission = false;
  EXPECT_FALSE(decode_features(r).amx_tile);
  r.amx_permission = true;
  CpuFeatures f = decode_features(r);
  EXPECT_TRUE(f.amx_tile && f.amx_bf16 && f.amx_int8);
  r.xcr0 = 0xe7;
  EXPECT_FALSE(decode_features(r).amx_bf16);
}

TEST(CpuFeatures, MissingFeaturesPerLevel) {
  CpuFeatures none;
  EXPECT_TRUE(missing_features(IsaLevel::scalar, none).empty());
  EXPECT_EQ(missing_features(IsaLevel::avx2, none), (std::vector<std::string>{"avx2", "fma", "f16c"}));
  CpuFeatures zen;
  zen.avx2 = zen.fma = zen.f16c = zen.avx512f = zen.avx512dq = zen.avx512bw = zen.avx512vl = true;
  zen.avx512_vnni = zen.avx512_bf16 = true;
  EXPECT_TRUE(missing_features(IsaLevel::avx512_bf16, zen).empty());
  EXPECT_EQ(missing_features(IsaLevel::amx, zen), (std::vector<std::string>{"amx_tile", "amx_bf16", "amx_int8"}));
}

// AVX-VNNI is off the chain: no level requires it, every level from avx2 on allows it.
TEST(CpuFeatures, LevelsRequireTheChainAndAllowAvxVnniFromAvx2) {
  using enum Feature;
  EXPECT_EQ(level_requires(IsaLevel::scalar), FeatureSet());
  EXPECT_EQ(level_requires(IsaLevel::avx2), (FeatureSet{avx2, fma, f16c}));
  EXPECT_EQ(level_requires(IsaLevel::avx512_vnni), (FeatureSet{avx2, fma, f16c, avx512f, avx512dq, avx512bw, avx512vl, avx512_vnni}));
  EXPECT_EQ(feature_list(level_requires(IsaLevel::amx)),
            "avx2, fma, f16c, avx512f, avx512dq, avx512bw, avx512vl, avx512_vnni, avx512_bf16, amx_tile, amx_bf16, amx_int8");
  EXPECT_EQ(level_allows(IsaLevel::scalar), FeatureSet());
  for (IsaLevel l : all_isa_levels()) {
    EXPECT_FALSE(level_requires(l).has(avx_vnni)) << isa_name(l);
    if (l >= IsaLevel::avx2) EXPECT_EQ(level_allows(l), level_requires(l) | avx_vnni) << isa_name(l);
  }
  CpuFeatures alder_lake;
  alder_lake.avx2 = alder_lake.fma = alder_lake.f16c = alder_lake.avx_vnni = true;
  EXPECT_EQ(feature_set(alder_lake), (FeatureSet{avx2, fma, f16c, avx_vnni}));
  EXPECT_TRUE(missing_features(level_allows(IsaLevel::avx2), alder_lake).empty());
  EXPECT_EQ(missing_features(FeatureSet{avx2, avx512f, avx_vnni, amx_int8}, CpuFeatures{}),
            (std::vector<std::string>{"avx2", "avx512f", "avx_vnni", "amx_int8"}));
  EXPECT_EQ(feature_list(FeatureSet()), "none");
}

TEST(CpuFeatures, HardwareLevelIsHighestSupported) {
  const IsaLevel hw = hardware_isa();
  for (IsaLevel l : all_isa_levels()) {
    if (static_cast<int>(l) <= static_cast<int>(hw)) EXPECT_TRUE(missing_features(l).empty()) << isa_name(l);
    else EXPECT_FALSE(missing_features(l).empty()) << isa_name(l);
  }
}

TEST(CpuFeatures, OverrideLowersLevel) {
  ScopedEnv env("TANDEM_ISA", "scalar");
  EXPECT_EQ(effective_isa(), IsaLevel::scalar);
}

TEST(CpuFeatures, UnsetOverrideMeansHardware) {
  ScopedEnv env("TANDEM_ISA", nullptr);
  EXPECT_EQ(effective_isa(), hardware_isa());
  ScopedEnv env2("TANDEM_ISA", "auto");
  EXPECT_EQ(effective_isa(), hardware_isa());
}

TEST(CpuFeatures, OverrideAboveHardwareFailsNamingTheFeature) {
  IsaLevel above = IsaLevel::amx;
  if (hardware_isa() == IsaLevel::amx) GTEST_SKIP() << "this machine has every level";
  for (IsaLevel l : all_isa_levels())
    if (static_cast<int>(l) == static_cast<int>(hardware_isa()) + 1) above = l;
  ScopedEnv env("TANDEM_ISA", std::string(isa_name(above)).c_str());
  try {
    effective_isa();
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::unsupported);
    std::string want = str_cat("TANDEM_ISA=", isa_name(above), " asks for more than this CPU provides: missing ");
    EXPECT_EQ(e.message().rfind(want, 0), 0u) << e.message();
    for (const auto& m : missing_features(above)) EXPECT_NE(e.message().find(m), std::string::npos) << m;
    EXPECT_NE(e.message().find(str_cat("the highest level here is ", isa_name(hardware_isa()))), std::string::npos);
  }
}

TEST(CpuFeatures, UnknownLevelListsAllowed) {
  ScopedEnv env("TANDEM_ISA", "avx1024");
  try {
    effective_isa();
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_EQ(e.message(), "TANDEM_ISA: unknown ISA level 'avx1024'; allowed: auto, scalar, avx2, avx512, avx512_vnni, avx512_bf16, amx");
  }
}

// The one rule every kernel choice follows: the config's level, lowered by TANDEM_ISA,
// capped by the hardware (above it from either side is an error naming that side).
TEST(CpuFeatures, SelectIsaIsConfigLoweredByEnvironment) {
  const IsaLevel hw = hardware_isa();
  for (IsaLevel c : all_isa_levels()) {
    if (c > hw) continue;
    {
      ScopedEnv env("TANDEM_ISA", nullptr);
      EXPECT_EQ(select_isa(isa_name(c)), c) << isa_name(c);
      EXPECT_EQ(select_isa("auto"), hw);
    }
    for (IsaLevel e : all_isa_levels()) {
      if (e > hw) continue;
      ScopedEnv env("TANDEM_ISA", std::string(isa_name(e)).c_str());
      EXPECT_EQ(select_isa(isa_name(c)), std::min(c, e)) << "cpu.isa " << isa_name(c) << ", TANDEM_ISA " << isa_name(e);
      EXPECT_EQ(select_isa("auto"), e);
    }
  }
}

TEST(CpuFeatures, SelectIsaAboveHardwareNamesItsOrigin) {
  if (hardware_isa() == IsaLevel::amx) GTEST_SKIP() << "this machine has every level";
  const std::string above(isa_name(static_cast<IsaLevel>(static_cast<int>(hardware_isa()) + 1)));
  {
    ScopedEnv env("TANDEM_ISA", "scalar");  // a lower override does not excuse the config
    try {
      select_isa(above, "x.yaml: cpu.isa");
      FAIL() << "no throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::unsupported);
      EXPECT_EQ(e.message().rfind(str_cat("x.yaml: cpu.isa=", above, " asks for more"), 0), 0u) << e.message();
    }
  }
  ScopedEnv env("TANDEM_ISA", above.c_str());
  try {
    select_isa("scalar", "x.yaml: cpu.isa");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.message().rfind(str_cat("TANDEM_ISA=", above, " asks for more"), 0), 0u) << e.message();
  }
}

TEST(CpuFeatures, ParseRoundTrip) {
  for (IsaLevel l : all_isa_levels()) EXPECT_EQ(parse_isa(isa_name(l)), l);
}

}  // namespace
}  // namespace tandem
