// tandem/cpu_features.h: what the CPU and the OS let tandem's kernels use.
//
// Detection runs once (cpuid for the instructions, XGETBV/XCR0 for the register
// state the OS saves, arch_prctl(ARCH_REQ_XCOMP_PERM) for AMX tile data). The file
// that implements it is compiled without ISA flags, so nothing wide runs before
// the check. The user caps kernels with an IsaLevel; the environment variable
// TANDEM_ISA (scalar, avx2, avx512, avx512_vnni, avx512_bf16, amx) lowers the level
// for tests and comparisons. It can never raise it above the hardware: asking for a
// level the machine lacks throws tandem::Error naming the missing feature. Within
// the cap, kernels are chosen by feature set (kernels.h, cpu_kernels/kernel_list.inc):
// a level allows its own features plus the off-chain ones that fit under it
// (level_allows), so TANDEM_ISA=avx2 means "the AVX2 kernels, plus the AVX-VNNI ones
// when the CPU has AVX-VNNI".
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

namespace tandem {

struct CpuFeatures {
  std::string vendor;  // "GenuineIntel", "AuthenticAMD", ...
  std::string brand;   // "AMD EPYC 9B45 ..."
  // Instructions usable now: cpuid says the CPU has them AND the OS saves their state.
  bool avx = false, avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512dq = false, avx512bw = false, avx512vl = false;
  bool avx512_vnni = false, avx512_bf16 = false, avx512_fp16 = false;
  bool avx_vnni = false;
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;
  // OS state (XCR0 bits, AMX permission), for explaining why a feature is off.
  bool os_avx = false, os_avx512 = false, os_amx = false;
  unsigned long long xcr0 = 0;
  // Present in cpuid but unusable because the OS does not enable its state.
  std::vector<std::string> disabled_by_os;
};

// Ordered capability levels; each includes everything below it.
//   avx2        AVX2 + FMA + F16C
//   avx512      + AVX-512 F/DQ/BW/VL
//   avx512_vnni + AVX512_VNNI (vpdpbusd)
//   avx512_bf16 + AVX512_BF16 (vdpbf16ps)
//   amx         + AMX tile/BF16/INT8, with tile permission granted by the kernel
enum class IsaLevel { scalar = 0, avx2, avx512, avx512_vnni, avx512_bf16, amx };

// The features a kernel can require, in the order messages list missing ones.
// avx_vnni (VEX-encoded vpdpbusd on 256-bit registers: Alder Lake and later desktops,
// Sapphire Rapids, Zen 5) is off the level chain: AVX2 CPUs may have it or not, and
// AVX-512 CPUs may lack it (Ice Lake, Zen 4).
enum class Feature : uint8_t {
  avx2, fma, f16c, avx512f, avx512dq, avx512bw, avx512vl, avx512_vnni, avx512_bf16, avx_vnni,
  amx_tile, amx_bf16, amx_int8,
};
inline constexpr int kFeatureCount = 13;
std::string_view feature_name(Feature f) noexcept;

// A set of Features (bit i is Feature i).
struct FeatureSet {
  uint32_t bits = 0;
  constexpr FeatureSet() = default;
  constexpr FeatureSet(Feature f) : bits(1u << static_cast<int>(f)) {}
  constexpr FeatureSet(std::initializer_list<Feature> fs) {
    for (Feature f : fs) bits |= 1u << static_cast<int>(f);
  }
  constexpr bool contains(FeatureSet o) const { return (bits & o.bits) == o.bits; }
  constexpr bool has(Feature f) const { return contains(FeatureSet(f)); }
  constexpr FeatureSet operator|(FeatureSet o) const { return from_bits(bits | o.bits); }
  constexpr FeatureSet operator&(FeatureSet o) const { return from_bits(bits & o.bits); }
  constexpr bool operator==(const FeatureSet&) const = default;
  static constexpr FeatureSet from_bits(uint32_t b) {
    FeatureSet s;
    s.bits = b;
    return s;
  }
};
// Feature names joined by ", " ("avx2, fma, f16c"); "none" for the empty set.
std::string feature_list(FeatureSet s);

std::string_view isa_name(IsaLevel level) noexcept;
// Parses a level name; throws tandem::Error (invalid_argument) listing the allowed names.
IsaLevel parse_isa(std::string_view name);
// All levels in order, for tests that run every kernel at every available level.
const std::vector<IsaLevel>& all_isa_levels();

// The hardware as detected (cached after the first call; thread-safe).
const CpuFeatures& cpu_features();
// Highest level the hardware supports.
IsaLevel hardware_isa();
// The features usable on a CPU, as a set.
FeatureSet feature_set(const CpuFeatures& f);
// What a level needs: its own features and those of every level below it.
FeatureSet level_requires(IsaLevel level);
// What kernels may use under a level (the user's cap): level_requires(level) plus the
// off-chain features that fit under it, which is avx_vnni from avx2 on. A kernel runs
// under a cap when the CPU has every feature it needs and the cap allows them all.
FeatureSet level_allows(IsaLevel level);
// Features a level needs that this machine lacks (empty when the level is supported).
std::vector<std::string> missing_features(IsaLevel level, const CpuFeatures& f = cpu_features());
// Features of `need` that this machine lacks, in Feature order.
std::vector<std::string> missing_features(FeatureSet need, const CpuFeatures& f = cpu_features());
// One explicit request ("auto" -> the hardware level) checked against the hardware:
// tandem::Error (unsupported) above it, (invalid_argument) for an unknown name; `origin`
// names where the request came from in the message ("cpu.isa", "TANDEM_ISA", ...).
IsaLevel resolve_isa(std::string_view requested, std::string_view origin = "TANDEM_ISA");
// THE rule for choosing kernels, applied wherever kernels are chosen (engine, MoE
// layers, LoRA layers, the host stream's hot experts, Python models): the config's
// cpu.isa (`requested`, "auto" = the hardware's level), lowered by TANDEM_ISA when that
// is set, capped by the hardware; either one asking for more than the hardware has is an
// error naming it (`origin` for the config's value, e.g. "configs/x.yaml: cpu.isa").
IsaLevel select_isa(std::string_view requested = "auto", std::string_view origin = "cpu.isa");
// select_isa("auto"): the hardware's level, or TANDEM_ISA's when set.
IsaLevel effective_isa();

// Detection from raw register values, exposed for tests of the decoding logic.
struct CpuidRegs {
  unsigned max_leaf = 0;
  unsigned l1_ecx = 0, l1_edx = 0;      // leaf 1
  unsigned l7_ebx = 0, l7_ecx = 0, l7_edx = 0;  // leaf 7 subleaf 0
  unsigned l7s1_eax = 0;                 // leaf 7 subleaf 1
  unsigned long long xcr0 = 0;
  bool amx_permission = false;
};
CpuFeatures decode_features(const CpuidRegs& r);

}  // namespace tandem
