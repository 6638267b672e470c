// CPU feature detection. Compiled WITHOUT ISA flags (see cpu_kernels/CMakeLists.txt):
// only cpuid/xgetbv inline asm runs here, never a wide instruction.
#include "tandem/cpu_features.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <utility>

#include "tandem/error.h"

namespace tandem {
namespace {

constexpr unsigned long long kXcr0Sse = 1ull << 1, kXcr0Avx = 1ull << 2;
constexpr unsigned long long kXcr0Opmask = 1ull << 5, kXcr0ZmmHi256 = 1ull << 6,
                             kXcr0Hi16Zmm = 1ull << 7;
constexpr unsigned long long kXcr0TileCfg = 1ull << 17, kXcr0TileData = 1ull << 18;

constexpr bool bit(unsigned reg, int b) { return (reg >> b) & 1u; }

unsigned long long read_xcr0() {
  unsigned eax, edx;
  // xgetbv with ecx=0; only executed after cpuid reports OSXSAVE.
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}

// Linux keeps AMX tile data disabled per process until it is requested.
bool request_amx_permission() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr int kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
  unsigned long long bitmask = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &bitmask) != 0) return false;
  return (bitmask >> kXfeatureXtiledata) & 1ull;
#else
  return false;
#endif
}

CpuFeatures detect() {
  CpuidRegs r;
  unsigned a, b, c, d;
  std::array<char, 13> vendor{};
  r.max_leaf = __get_cpuid_max(0, nullptr);
  __cpuid(0, a, b, c, d);
  std::memcpy(vendor.data(), &b, 4);
  std::memcpy(vendor.data() + 4, &d, 4);
  std::memcpy(vendor.data() + 8, &c, 4);
  if (r.max_leaf >= 1) {
    __cpuid_count(1, 0, a, b, c, d);
    r.l1_ecx = c;
    r.l1_edx = d;
  }
  if (r.max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    r.l7_ebx = b;
    r.l7_ecx = c;
    r.l7_edx = d;
    unsigned max_sub = a;
    if (max_sub >= 1) {
      __cpuid_count(7, 1, a, b, c, d);
      r.l7s1_eax = a;
    }
  }
  const bool osxsave = bit(r.l1_ecx, 27);
  if (osxsave) r.xcr0 = read_xcr0();
  const bool cpu_amx = bit(r.l7_edx, 24);
  if (cpu_amx && (r.xcr0 & kXcr0TileData)) r.amx_permission = request_amx_permission();

  CpuFeatures f = decode_features(r);
  f.vendor = vendor.data();
  std::array<unsigned, 12> brand{};
  if (__get_cpuid_max(0x80000000u, nullptr) >= 0x80000004u) {
    for (unsigned i = 0; i < 3; ++i)
      __cpuid(0x80000002u + i, brand[4 * i], brand[4 * i + 1], brand[4 * i + 2], brand[4 * i + 3]);
    std::string s(reinterpret_cast<const char*>(brand.data()), 48);
    s = s.c_str();  // stop at the first NUL
    auto first = s.find_first_not_of(' '), last = s.find_last_not_of(' ');
    f.brand = first == std::string::npos ? "" : s.substr(first, last - first + 1);
  }
  return f;
}

struct LevelInfo {
  IsaLevel level;
  const char* name;
};
constexpr LevelInfo kLevels[] = {
    {IsaLevel::scalar, "scalar"},           {IsaLevel::avx2, "avx2"},
    {IsaLevel::avx512, "avx512"},           {IsaLevel::avx512_vnni, "avx512_vnni"},
    {IsaLevel::avx512_bf16, "avx512_bf16"}, {IsaLevel::amx, "amx"},
};

std::string allowed_levels() {
  std::string s = "auto";
  for (const auto& l : kLevels) s += str_cat(", ", l.name);
  return s;
}

}  // namespace

CpuFeatures decode_features(const CpuidRegs& r) {
  CpuFeatures f;
  f.xcr0 = r.xcr0;
  const bool osxsave = bit(r.l1_ecx, 27);
  f.os_avx = osxsave && (r.xcr0 & (kXcr0Sse | kXcr0Avx)) == (kXcr0Sse | kXcr0Avx);
  const unsigned long long zmm = kXcr0Opmask | kXcr0ZmmHi256 | kXcr0Hi16Zmm;
  f.os_avx512 = f.os_avx && (r.xcr0 & zmm) == zmm;
  f.os_amx = osxsave && (r.xcr0 & (kXcr0TileCfg | kXcr0TileData)) == (kXcr0TileCfg | kXcr0TileData) &&
             r.amx_permission;

  auto gate = [&](bool cpu, bool os, const char* name) {
    if (cpu && !os) f.disabled_by_os.emplace_back(name);
    return cpu && os;
  };
  f.avx = gate(bit(r.l1_ecx, 28), f.os_avx, "avx");
  f.fma = gate(bit(r.l1_ecx, 12), f.os_avx, "fma");
  f.f16c = gate(bit(r.l1_ecx, 29), f.os_avx, "f16c");
  f.avx2 = gate(bit(r.l7_ebx, 5), f.os_avx, "avx2");
  f.avx_vnni = gate(bit(r.l7s1_eax, 4), f.os_avx, "avx_vnni");
  f.avx512f = gate(bit(r.l7_ebx, 16), f.os_avx512, "avx512f");
  f.avx512dq = gate(bit(r.l7_ebx, 17), f.os_avx512, "avx512dq");
  f.avx512bw = gate(bit(r.l7_ebx, 30), f.os_avx512, "avx512bw");
  f.avx512vl = gate(bit(r.l7_ebx, 31), f.os_avx512, "avx512vl");
  f.avx512_vnni = gate(bit(r.l7_ecx, 11), f.os_avx512, "avx512_vnni");
  f.avx512_fp16 = gate(bit(r.l7_edx, 23), f.os_avx512, "avx512_fp16");
  f.avx512_bf16 = gate(bit(r.l7s1_eax, 5), f.os_avx512, "avx512_bf16");
  f.amx_tile = gate(bit(r.l7_edx, 24), f.os_amx, "amx_tile");
  f.amx_bf16 = gate(bit(r.l7_edx, 22), f.os_amx, "amx_bf16");
  f.amx_int8 = gate(bit(r.l7_edx, 25), f.os_amx, "amx_int8");
  return f;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

std::string_view isa_name(IsaLevel level) noexcept {
  for (const auto& l : kLevels)
    if (l.level == level) return l.name;
  return "unknown";
}

IsaLevel parse_isa(std::string_view name) {
  for (const auto& l : kLevels)
    if (name == l.name) return l.level;
  TANDEM_FAIL(Errc::invalid_argument, "unknown ISA level '", name, "'; allowed: ", allowed_levels());
}

const std::vector<IsaLevel>& all_isa_levels() {
  static const std::vector<IsaLevel> levels = [] {
    std::vector<IsaLevel> v;
    for (const auto& l : kLevels) v.push_back(l.level);
    return v;
  }();
  return levels;
}

std::string_view feature_name(Feature f) noexcept {
  static constexpr const char* kNames[kFeatureCount] = {
      "avx2",        "fma",         "f16c",     "avx512f",  "avx512dq", "avx512bw", "avx512vl",
      "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
  };
  const int i = static_cast<int>(f);
  return i < kFeatureCount ? kNames[i] : "unknown";
}

std::string feature_list(FeatureSet s) {
  std::string out;
  for (int i = 0; i < kFeatureCount; ++i)
    if (s.has(static_cast<Feature>(i))) out += str_cat(out.empty() ? "" : ", ", feature_name(static_cast<Feature>(i)));
  return out.empty() ? "none" : out;
}

FeatureSet feature_set(const CpuFeatures& f) {
  using enum Feature;
  const std::pair<bool, Feature> have[] = {
      {f.avx2, avx2},         {f.fma, fma},           {f.f16c, f16c},         {f.avx512f, avx512f},
      {f.avx512dq, avx512dq}, {f.avx512bw, avx512bw}, {f.avx512vl, avx512vl}, {f.avx512_vnni, avx512_vnni},
      {f.avx512_bf16, avx512_bf16}, {f.avx_vnni, avx_vnni}, {f.amx_tile, amx_tile}, {f.amx_bf16, amx_bf16},
      {f.amx_int8, amx_int8},
  };
  FeatureSet s;
  for (const auto& [yes, feature] : have)
    if (yes) s = s | feature;
  return s;
}

FeatureSet level_requires(IsaLevel level) {
  using enum Feature;
  // What each level adds to the one below it.
  static constexpr FeatureSet kAdds[] = {
      {},
      {avx2, fma, f16c},
      {avx512f, avx512dq, avx512bw, avx512vl},
      {avx512_vnni},
      {avx512_bf16},
      {amx_tile, amx_bf16, amx_int8},
  };
  FeatureSet s;
  for (int l = 0; l <= static_cast<int>(level) && l < static_cast<int>(std::size(kAdds)); ++l) s = s | kAdds[l];
  return s;
}

FeatureSet level_allows(IsaLevel level) {
  // AVX-VNNI is AVX2 code plus one instruction: any cap that admits AVX2 kernels
  // admits it, and where the CPU also has AVX-512 the list's order still prefers the
  // 512-bit kernels.
  const FeatureSet off_chain = level >= IsaLevel::avx2 ? FeatureSet(Feature::avx_vnni) : FeatureSet();
  return level_requires(level) | off_chain;
}

std::vector<std::string> missing_features(FeatureSet need, const CpuFeatures& f) {
  const FeatureSet have = feature_set(f);
  std::vector<std::string> missing;
  for (int i = 0; i < kFeatureCount; ++i) {
    const auto feature = static_cast<Feature>(i);
    if (need.has(feature) && !have.has(feature)) missing.emplace_back(feature_name(feature));
  }
  return missing;
}

std::vector<std::string> missing_features(IsaLevel level, const CpuFeatures& f) {
  return missing_features(level_requires(level), f);
}

IsaLevel hardware_isa() {
  static const IsaLevel level = [] {
    IsaLevel best = IsaLevel::scalar;
    for (const auto& l : kLevels)
      if (missing_features(l.level).empty()) best = l.level;
    return best;
  }();
  return level;
}

IsaLevel resolve_isa(std::string_view requested, std::string_view origin) {
  if (requested.empty() || requested == "auto") return hardware_isa();
  IsaLevel level;
  try {
    level = parse_isa(requested);
  } catch (const Error& e) {
    TANDEM_FAIL(Errc::invalid_argument, origin, ": ", e.message());
  }
  auto missing = missing_features(level);
  if (!missing.empty()) {
    std::string names;
    for (const auto& m : missing) names += (names.empty() ? "" : ", ") + m;
    const auto& f = cpu_features();
    std::string why;
    for (const auto& m : missing)
      for (const auto& d : f.disabled_by_os)
        if (m == d) why = str_cat(" (the CPU has ", m, " but the OS does not enable its register state; XCR0=0x", std::hex, f.xcr0, ")");
    TANDEM_FAIL(Errc::unsupported, origin, "=", requested, " asks for more than this CPU provides: missing ",
                names, why, "; the highest level here is ", isa_name(hardware_isa()));
  }
  return level;
}

IsaLevel select_isa(std::string_view requested, std::string_view origin) {
  IsaLevel level = resolve_isa(requested, origin);
  const char* env = std::getenv("TANDEM_ISA");
  if (env && *env) level = std::min(level, resolve_isa(env, "TANDEM_ISA"));
  return level;
}

IsaLevel effective_isa() { return select_isa("auto", "TANDEM_ISA"); }

}  // namespace tandem
