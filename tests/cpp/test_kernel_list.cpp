// The kernel list (cpu_kernels/kernel_list.inc) and the tables chosen from it: well-formed
// lines, the choice by feature set under a level (on made-up CPUs, so an Alder Lake or
// a Sapphire Rapids is checked here too), forcing one variant, and the per-variant tests
// of the two helper families (activation quantizer, SiLU epilogue); the gemm / gate_up
// families have theirs in test_kernels_bf16.cpp and test_kernels_int.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <type_traits>

#include "kernel_variants.h"
#include "tandem/cpu_features.h"
#include "tandem/error.h"
#include "tandem/kernels.h"
#include "test_util.h"

namespace tandem {
namespace {

constexpr KernelFamily kFamilies[] = {KernelFamily::bf16, KernelFamily::int8, KernelFamily::int4,
                                      KernelFamily::quantize, KernelFamily::silu_mul};

// A CPU (as detection would report it) with exactly these features.
CpuFeatures cpu_with(FeatureSet s) {
  CpuFeatures f;
  bool* flags[kFeatureCount] = {&f.avx2,        &f.fma,         &f.f16c,     &f.avx512f,  &f.avx512dq,
                                &f.avx512bw,    &f.avx512vl,    &f.avx512_vnni, &f.avx512_bf16, &f.avx_vnni,
                                &f.amx_tile,    &f.amx_bf16,    &f.amx_int8};
  for (int i = 0; i < kFeatureCount; ++i) *flags[i] = s.has(static_cast<Feature>(i));
  return f;
}
// Every feature of the level chain (no AVX-VNNI: Zen 4, Ice Lake; with AMX for the top).
CpuFeatures chain_cpu() { return cpu_with(level_requires(IsaLevel::amx)); }
// Alder Lake: AVX2 with AVX-VNNI, no AVX-512.
CpuFeatures alder_lake() { return cpu_with(level_requires(IsaLevel::avx2) | Feature::avx_vnni); }
// Sapphire Rapids: everything.
CpuFeatures sapphire_rapids() { return cpu_with(level_requires(IsaLevel::amx) | Feature::avx_vnni); }

// The line of `family` whose function is p, by name ("?" if none).
template <typename Fn>
std::string name_of(KernelFamily family, Fn p) {
  for (const KernelListEntry& e : kernel_list()) {
    if (e.family != family) continue;
    if constexpr (std::is_same_v<Fn, QuantizeFn>) {
      if (e.quantize == p) return e.name();
    } else {
      if (e.silu_mul == p) return e.name();
    }
  }
  return "?";
}

std::string describe(KernelFamily family, const FormatKernels& k) {
  for (const KernelVariant* v : {&k.small, &k.large}) {
    const KernelListEntry* e = find_kernel(family, v->name);
    EXPECT_TRUE(e && e->kernel.gemm == v->gemm && e->kernel.gate_up == v->gate_up)
        << family_name(family) << " " << v->name << ": functions are not that line's";
  }
  std::string s = str_cat(family_name(family), "=", k.small.name);
  if (k.large_from_m < (1 << 30)) s += str_cat("|", k.large.name, "@", k.large_from_m);
  return s;
}

// "bf16=avx512_bf16|amx_bf16@8 int8=... int4=... quantize=... silu_mul=...".
std::string describe(const KernelTable& t) {
  return str_cat(describe(KernelFamily::bf16, t.bf16), " ", describe(KernelFamily::int8, t.int8), " ",
                 describe(KernelFamily::int4, t.int4), " quantize=", name_of(KernelFamily::quantize, t.quantize),
                 " silu_mul=", name_of(KernelFamily::silu_mul, t.silu_mul));
}

TEST(KernelList, LinesAreWellFormed) {
  for (KernelFamily family : kFamilies) {
    const auto lines = test::list_entries({family});
    ASSERT_FALSE(lines.empty()) << family_name(family);
    EXPECT_EQ(lines.front()->needs, FeatureSet()) << family_name(family) << ": the first line must run everywhere";
    EXPECT_EQ(lines.front()->from_m, 1) << family_name(family);
    std::set<std::string> names;
    for (const KernelListEntry* e : lines) {
      SCOPED_TRACE(test::variant_name(*e, true));
      EXPECT_TRUE(names.insert(e->name()).second) << "duplicate name";
      EXPECT_GE(e->from_m, 1);
      const bool gemm_family = family == KernelFamily::bf16 || family == KernelFamily::int8 || family == KernelFamily::int4;
      EXPECT_EQ(e->kernel.gemm != nullptr && e->kernel.gate_up != nullptr, gemm_family);
      EXPECT_EQ(e->quantize != nullptr, family == KernelFamily::quantize);
      EXPECT_EQ(e->silu_mul != nullptr, family == KernelFamily::silu_mul);
      EXPECT_EQ(e->sigmoid != nullptr, family == KernelFamily::silu_mul);
      if (!gemm_family) EXPECT_EQ(e->from_m, 1) << "the helpers have no large-m variant";
    }
  }
  // A suffix names one set of flags, so all its lines need the same features.
  for (const KernelListEntry& a : kernel_list())
    for (const KernelListEntry& b : kernel_list())
      if (std::string(a.isa) == b.isa) EXPECT_EQ(a.needs, b.needs) << a.isa;
}

// On a CPU without AVX-VNNI the choice by feature set gives exactly the tables that were
// kept by hand per level before the list (same names, same functions), AMX from the m
// where it measured faster (bf16 every m, int8 from 2, int4 from 4).
TEST(KernelList, ChainCpuGetsTheLevelTables) {
  const CpuFeatures f = chain_cpu();
  const std::pair<IsaLevel, const char*> want[] = {
      {IsaLevel::scalar, "bf16=scalar int8=scalar int4=scalar quantize=scalar silu_mul=scalar"},
      {IsaLevel::avx2, "bf16=avx2 int8=avx2 int4=avx2 quantize=avx2 silu_mul=avx2"},
      {IsaLevel::avx512, "bf16=avx512 int8=avx512 int4=avx512 quantize=avx512 silu_mul=avx512"},
      {IsaLevel::avx512_vnni,
       "bf16=avx512 int8=avx512_vnni int4=avx512_vnni quantize=avx512_vnni silu_mul=avx512"},
      {IsaLevel::avx512_bf16,
       "bf16=avx512_bf16 int8=avx512_vnni int4=avx512_vnni quantize=avx512_vnni silu_mul=avx512_bf16"},
      {IsaLevel::amx,
       "bf16=avx512_bf16|amx_bf16@3 int8=avx512_vnni|amx_int8@8 int4=avx512_vnni|amx_int4@8 quantize=avx512_vnni "
       "silu_mul=avx512_bf16"},
  };
  for (const auto& [level, tables] : want) {
    const KernelTable t = select_kernels(level, f);
    EXPECT_EQ(describe(t), tables) << isa_name(level);
    EXPECT_EQ(t.level, level);
    EXPECT_EQ(std::string(t.name), isa_name(level));
  }
}

// AVX-VNNI is off the chain: an AVX2 CPU that has it runs its integer kernels from avx2
// on; below that cap (scalar) it does not.
TEST(KernelList, AvxVnniRunsOnAnAvx2Cpu) {
  const CpuFeatures f = alder_lake();
  EXPECT_EQ(describe(select_kernels(IsaLevel::avx2, f)),
            "bf16=avx2 int8=avx_vnni int4=avx_vnni quantize=avx_vnni silu_mul=avx2");
  EXPECT_EQ(describe(select_kernels(IsaLevel::scalar, f)),
            "bf16=scalar int8=scalar int4=scalar quantize=scalar silu_mul=scalar");
}

// With AVX-512 as well, AVX-VNNI runs only where the user caps at avx2
// (TANDEM_ISA=avx2); from avx512 on the wider kernels come later in the list and win.
TEST(KernelList, WiderKernelsWinOverAvxVnni) {
  const CpuFeatures f = sapphire_rapids();
  EXPECT_EQ(describe(select_kernels(IsaLevel::avx2, f)),
            "bf16=avx2 int8=avx_vnni int4=avx_vnni quantize=avx_vnni silu_mul=avx2");
  EXPECT_EQ(describe(select_kernels(IsaLevel::avx512, f)),
            "bf16=avx512 int8=avx512 int4=avx512 quantize=avx512 silu_mul=avx512");
  EXPECT_EQ(describe(select_kernels(IsaLevel::amx, f)), describe(select_kernels(IsaLevel::amx, chain_cpu())));
}

// Whether table t runs line e (for some m).
bool runs(const KernelTable& t, const KernelListEntry& e) {
  switch (e.family) {
    case KernelFamily::quantize: return t.quantize == e.quantize;
    case KernelFamily::silu_mul: return t.silu_mul == e.silu_mul && t.sigmoid == e.sigmoid;
    default: {
      const FormatKernels& k = e.family == KernelFamily::bf16 ? t.bf16 : e.family == KernelFamily::int8 ? t.int8 : t.int4;
      return k.small.gemm == e.kernel.gemm || k.large.gemm == e.kernel.gemm;
    }
  }
}

// A level never admits a feature above it, whatever the CPU has.
TEST(KernelList, LevelCapsTheChoice) {
  const CpuFeatures f = sapphire_rapids();
  for (IsaLevel level : all_isa_levels()) {
    const KernelTable t = select_kernels(level, f);
    for (const KernelListEntry& e : kernel_list())
      if (runs(t, e))
        EXPECT_TRUE(level_allows(level).contains(e.needs))
            << isa_name(level) << " chose " << test::variant_name(e, true) << ", which needs " << feature_list(e.needs);
  }
}

// The live tables are the choice for this CPU.
TEST(KernelList, KernelTableIsTheChoiceForThisCpu) {
  for (IsaLevel level : all_isa_levels()) {
    if (!missing_features(level).empty()) continue;
    EXPECT_EQ(describe(kernel_table(level)), describe(select_kernels(level, cpu_features()))) << isa_name(level);
  }
}

TEST(KernelList, WithKernelForcesOneVariant) {
  const KernelTable base = kernel_table(IsaLevel::scalar);
  for (const KernelListEntry& e : kernel_list()) {
    SCOPED_TRACE(test::variant_name(e, true));
    const auto missing = missing_features(e.needs);
    if (!missing.empty()) {
      Errc code{};
      EXPECT_EQ(test::error_of([&] { with_kernel(base, e); }, &code),
                str_cat(family_name(e.family), " kernel ", e.name(), " needs ", missing.front(), ", which this CPU lacks"));
      EXPECT_EQ(code, Errc::unsupported);
      continue;
    }
    const KernelTable t = with_kernel(base, e);
    EXPECT_TRUE(runs(t, e));
    if (e.family == KernelFamily::bf16 || e.family == KernelFamily::int8 || e.family == KernelFamily::int4) {
      const FormatKernels& k = e.family == KernelFamily::bf16 ? t.bf16 : e.family == KernelFamily::int8 ? t.int8 : t.int4;
      for (int m : {1, 8, 1000}) EXPECT_EQ(k.pick(m).gemm, e.kernel.gemm) << m;
    }
    for (const KernelListEntry& other : kernel_list())  // the rest of the table stays the base's
      if (other.family != e.family) EXPECT_EQ(runs(t, other), runs(base, other)) << test::variant_name(other, true);
  }
}

// ---- per-variant: the activation quantizer ---------------------------------------------

class KernelsQuantize : public ::testing::TestWithParam<const KernelListEntry*> {
 protected:
  void SetUp() override { TANDEM_SKIP_UNLESS_CPU_RUNS(*GetParam()); }
};

// Every step of the quantizer is exactly rounded (max, a multiply, round to nearest
// even), so each ISA's copy must give the reference's bits: q, scales and sums.
TEST_P(KernelsQuantize, GivesTheReferenceBits) {
  const uint64_t seed = test::test_seed();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  const int m = 7, k = 200, lda = 203, k_pad = 256;
  std::vector<float> af(static_cast<size_t>(m) * lda);
  for (auto& x : af) x = d(rng);
  for (int c = 0; c < k; ++c) af[static_cast<size_t>(2) * lda + c] = 0.f;  // zero row: scale 0
  af[static_cast<size_t>(4) * lda + 17] = NAN;                            // NaN row: scale NaN
  af[static_cast<size_t>(5) * lda + k - 1] = -INFINITY;
  std::vector<bf16_t> ab(af.size());
  fp32_to_bf16(af.data(), ab.data(), af.size());
  for (int group : {32, 64, 256}) {
    const int groups = k_pad / group;
    for (bool fp32 : {false, true}) {
      std::vector<int8_t> q0(static_cast<size_t>(m) * k_pad, 99), q1 = q0;
      std::vector<float> s0(m), s1(m);
      std::vector<int32_t> u0(static_cast<size_t>(m) * groups), u1(u0.size());
      if (fp32) {
        quantize_activations(af.data(), m, k, lda, k_pad, group, q0.data(), s0.data(), u0.data());
        GetParam()->quantize(nullptr, af.data(), m, k, lda, k_pad, group, q1.data(), s1.data(), u1.data());
      } else {
        quantize_activations(ab.data(), m, k, lda, k_pad, group, q0.data(), s0.data(), u0.data());
        GetParam()->quantize(ab.data(), nullptr, m, k, lda, k_pad, group, q1.data(), s1.data(), u1.data());
      }
      SCOPED_TRACE(str_cat("group ", group, fp32 ? " fp32" : " bf16", " seed=", seed));
      EXPECT_EQ(q1, q0);
      EXPECT_EQ(std::memcmp(s1.data(), s0.data(), sizeof(float) * m), 0) << "scales differ";
      EXPECT_TRUE(std::isnan(s1[4]) && std::isnan(s1[5]));
      EXPECT_EQ(u1, u0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, KernelsQuantize, ::testing::ValuesIn(test::list_entries({KernelFamily::quantize})),
                         [](const auto& info) { return test::variant_name(*info.param, false); });

// ---- per-variant: the SiLU epilogue ----------------------------------------------------

class KernelsSiluMul : public ::testing::TestWithParam<const KernelListEntry*> {
 protected:
  void SetUp() override { TANDEM_SKIP_UNLESS_CPU_RUNS(*GetParam()); }
  static constexpr double kU = 1.0 / (1 << 24);
  static constexpr int n = 1000;  // vector bodies and a tail at every width
  const uint64_t seed = test::test_seed();
  std::mt19937_64 rng{seed};
  std::normal_distribution<float> d{0.f, 4.f};
};

// silu(g) * u against fp64 on the same fp32 inputs: the exp polynomial (about 1 ulp),
// the add, the divide and the multiply give a few ulp (the gate_up tests' allowance).
TEST_P(KernelsSiluMul, MatchesReference) {
  std::vector<float> g(n), u(n), h(n + 1, -7.f);
  for (int j = 0; j < n; ++j) g[j] = d(rng), u[j] = d(rng);
  g[10] = -100.f;  // exp's argument clamped
  g[11] = 95.f;
  g[12] = NAN;
  u[13] = NAN;
  GetParam()->silu_mul(g.data(), u.data(), h.data(), n);
  for (int j = 0; j < n; ++j) {
    if (j == 12 || j == 13) {
      EXPECT_TRUE(std::isnan(h[j])) << j;
      continue;
    }
    const double want = double(g[j]) / (1 + std::exp(-double(g[j]))) * u[j];
    ASSERT_LE(std::abs(h[j] - want), 8 * kU * std::abs(want) + 1e-30) << "g=" << g[j] << " u=" << u[j] << " seed=" << seed;
  }
  EXPECT_EQ(h[n], -7.f) << "wrote past n";
}

// sigmoid against fp64: the same exponential, an add and a divide (a few ulp); where exp's
// argument is clamped (x < -87.3) the result is below 2e-38 instead of smaller still.
TEST_P(KernelsSiluMul, SigmoidMatchesReference) {
  std::vector<float> x(n), s(n + 1, -7.f);
  for (int j = 0; j < n; ++j) x[j] = d(rng);
  x[10] = -100.f;
  x[11] = 95.f;
  x[12] = NAN;
  x[13] = INFINITY;
  x[14] = -INFINITY;
  GetParam()->sigmoid(x.data(), s.data(), n);
  EXPECT_TRUE(std::isnan(s[12]));
  EXPECT_EQ(s[13], 1.f);
  EXPECT_LE(s[14], 2e-38f);
  for (int j = 0; j < n; ++j) {
    if (j >= 12 && j <= 14) continue;
    const double want = 1 / (1 + std::exp(-double(x[j])));
    ASSERT_LE(std::abs(s[j] - want), 8 * kU * want + 2e-38) << "x=" << x[j] << " seed=" << seed;
  }
  EXPECT_EQ(s[n], -7.f) << "wrote past n";
}

INSTANTIATE_TEST_SUITE_P(Variants, KernelsSiluMul, ::testing::ValuesIn(test::list_entries({KernelFamily::silu_mul})),
                         [](const auto& info) { return test::variant_name(*info.param, false); });

}  // namespace
}  // namespace tandem
