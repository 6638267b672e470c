// bench/peak.h: which instruction's peak a benchmark compares a kernel variant with.
//
// "% of peak" means something only against the instruction the kernel's inner loop
// really runs, so the ceiling follows the KernelVariant the benchmark selected
// (kernel_table(level).of(format).pick(m)), not the CPU's best instruction:
//   BF16  "avx512_bf16" vdpbf16ps zmm; "avx512" / "avx2" widen bf16 to fp32 and run
//         vfmadd231ps (zmm / ymm): on a CPU without AVX512_BF16 (Ice Lake, Zen 3) or
//         with TANDEM_ISA lowered, that is the peak.
//   INT8/INT4  "avx512_vnni" vpdpbusd zmm; "avx_vnni" the VEX vpdpbusd ymm; "avx512" /
//         "avx2" the pre-VNNI sequence vpmaddubsw + vpmaddwd + vpaddd (zmm / ymm).
//   "amx_bf16" tdpbf16ps; "amx_int8" / "amx_int4" tdpbsud (INT4 nibbles are unpacked to
//         int8 tiles), register-resident tile products in the kernels' 2 x 2 blocking.
//   "scalar" no vector peak.
// A ratio whose peak is missing, zero or not finite prints as "n/a", never inf or nan.
#pragma once

#include <cmath>
#include <cstdio>
#include <string>
#include <string_view>

#include "tandem/kernels.h"

namespace tandem::bench {

enum class PeakInsn {
  none, fma_f32_ymm, fma_f32_zmm, dpbf16_zmm, maddubs_ymm, maddubs_zmm, dpbusd_zmm, dpbusd_ymm, amx_bf16, amx_int8
};

struct PeakChoice {
  PeakInsn insn = PeakInsn::none;
  std::string name;  // what the ratio is against ("vdpbf16ps zmm"), or why there is none
};

inline PeakChoice peak_for_variant(std::string_view variant, WeightFormat format) {
  const bool integer = format != WeightFormat::bf16;
  if (variant == "amx_bf16" && !integer) return {PeakInsn::amx_bf16, "AMX tdpbf16ps"};
  if ((variant == "amx_int8" || variant == "amx_int4") && integer) return {PeakInsn::amx_int8, "AMX tdpbsud"};
  if (variant == "avx512_bf16" && !integer) return {PeakInsn::dpbf16_zmm, "vdpbf16ps zmm"};
  if (variant == "avx512_vnni" && integer) return {PeakInsn::dpbusd_zmm, "vpdpbusd zmm"};
  if (variant == "avx_vnni" && integer) return {PeakInsn::dpbusd_ymm, "{vex} vpdpbusd ymm"};
  if (variant == "avx512")
    return integer ? PeakChoice{PeakInsn::maddubs_zmm, "vpmaddubsw+vpmaddwd+vpaddd zmm"}
                   : PeakChoice{PeakInsn::fma_f32_zmm, "vfmadd231ps zmm (fp32)"};
  if (variant == "avx2")
    return integer ? PeakChoice{PeakInsn::maddubs_ymm, "vpmaddubsw+vpmaddwd+vpaddd ymm"}
                   : PeakChoice{PeakInsn::fma_f32_ymm, "vfmadd231ps ymm (fp32)"};
  return {PeakInsn::none, std::string(variant) + ": no vector peak"};
}

// "  42%" (width 5 + '%'), or "  n/a" when the peak is not a positive finite number.
inline std::string percent_of(double value, double peak) {
  const double r = 100.0 * value / peak;
  if (!(peak > 0) || !std::isfinite(r) || !std::isfinite(value)) return "  n/a";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%5.0f%%", r);
  return buf;
}

}  // namespace tandem::bench
