// The benchmarks' "% of peak" follows the instruction the selected kernel variant runs
// (bench/peak.h), and a ratio without a measured peak prints "n/a", never inf or nan.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "peak.h"
#include "tandem/cpu_features.h"
#include "tandem/kernels.h"

namespace tandem::bench {
namespace {

TEST(BenchPeak, FollowsTheVariantsInstruction) {
  const WeightFormat bf16 = WeightFormat::bf16, int8 = WeightFormat::int8, int4 = WeightFormat::int4;
  EXPECT_EQ(peak_for_variant("avx512_bf16", bf16).insn, PeakInsn::dpbf16_zmm);
  // BF16 without vdpbf16ps (Ice Lake, or TANDEM_ISA=avx512): the kernels run fp32 FMA.
  EXPECT_EQ(peak_for_variant("avx512", bf16).insn, PeakInsn::fma_f32_zmm);
  EXPECT_EQ(peak_for_variant("avx2", bf16).insn, PeakInsn::fma_f32_ymm);
  EXPECT_EQ(peak_for_variant("avx512_vnni", int8).insn, PeakInsn::dpbusd_zmm);
  EXPECT_EQ(peak_for_variant("avx512_vnni", int4).insn, PeakInsn::dpbusd_zmm);
  EXPECT_EQ(peak_for_variant("avx512", int8).insn, PeakInsn::maddubs_zmm);
  EXPECT_EQ(peak_for_variant("avx2", int4).insn, PeakInsn::maddubs_ymm);
  EXPECT_EQ(peak_for_variant("avx_vnni", int8).insn, PeakInsn::dpbusd_ymm);
  EXPECT_EQ(peak_for_variant("avx_vnni", int4).insn, PeakInsn::dpbusd_ymm);
  EXPECT_EQ(peak_for_variant("amx_bf16", bf16).insn, PeakInsn::amx_bf16);
  EXPECT_EQ(peak_for_variant("amx_int8", int8).insn, PeakInsn::amx_int8);
  EXPECT_EQ(peak_for_variant("amx_int4", int4).insn, PeakInsn::amx_int8);  // nibbles unpacked to int8 tiles
  EXPECT_EQ(peak_for_variant("scalar", bf16).insn, PeakInsn::none);
}

// Every variant of every level this CPU runs maps to an instruction that level has (so
// the measured peak is never 0 for a ratio that is printed), or to none.
TEST(BenchPeak, EveryAvailableVariantHasAPeakItsLevelProvides) {
  for (int l = 0; l <= static_cast<int>(hardware_isa()); ++l) {
    const IsaLevel level = static_cast<IsaLevel>(l);
    const KernelTable& kt = kernel_table(level);
    for (WeightFormat f : {WeightFormat::bf16, WeightFormat::int8, WeightFormat::int4})
      for (const KernelVariant* v : {&kt.of(f).small, &kt.of(f).large}) {
        const PeakInsn insn = peak_for_variant(v->name, f).insn;
        SCOPED_TRACE(::testing::Message() << isa_name(level) << " " << format_name(f) << " " << v->name);
        switch (insn) {
          case PeakInsn::dpbf16_zmm: EXPECT_GE(level, IsaLevel::avx512_bf16); break;
          case PeakInsn::dpbusd_zmm: EXPECT_GE(level, IsaLevel::avx512_vnni); break;
          case PeakInsn::fma_f32_zmm:
          case PeakInsn::maddubs_zmm: EXPECT_GE(level, IsaLevel::avx512); break;
          case PeakInsn::fma_f32_ymm:
          case PeakInsn::maddubs_ymm: EXPECT_GE(level, IsaLevel::avx2); break;
          case PeakInsn::dpbusd_ymm: EXPECT_GE(level, IsaLevel::avx2); EXPECT_TRUE(cpu_features().avx_vnni); break;
          case PeakInsn::amx_bf16:
          case PeakInsn::amx_int8: EXPECT_EQ(level, IsaLevel::amx); break;
          case PeakInsn::none: EXPECT_EQ(level, IsaLevel::scalar); break;
        }
      }
  }
}

TEST(BenchPeak, PercentNeverPrintsInfOrNan) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  EXPECT_EQ(percent_of(0.42, 1.0), "   42%");
  EXPECT_EQ(percent_of(5.0, 0.0), "  n/a");
  EXPECT_EQ(percent_of(5.0, -1.0), "  n/a");
  EXPECT_EQ(percent_of(5.0, nan), "  n/a");
  EXPECT_EQ(percent_of(nan, 1.0), "  n/a");
  EXPECT_EQ(percent_of(inf, 1.0), "  n/a");
  EXPECT_EQ(percent_of(1.0, inf), "    0%");
}

}  // namespace
}  // namespace tandem::bench
