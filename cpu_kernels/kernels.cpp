// The kernel list (kernel_list.inc) expanded into the kernels' declarations and
// kernel_list(), the tables chosen from it by feature set, and the validated entry
// points. No ISA flags here: the wide code lives in the per-ISA files and is only
// reached through a line whose features the hardware was checked for.
#include <cmath>
#include <cstring>
#include "tandem/kernels.h"

#include <span>
#include <type_traits>
#include <vector>

#include "tandem/error.h"

namespace tandem {

// Declarations of every listed kernel (defined in its ISA file).
#define TANDEM_DECLARE_GEMM(fmt, isa)                             \
  void gemm_##fmt##_##isa(const PackedWeight&, const GemmArgs&); \
  void gate_up_##fmt##_##isa(const PackedWeight&, const GateUpArgs&);
#define TANDEM_DECLARE_bf16(isa) TANDEM_DECLARE_GEMM(bf16, isa)
#define TANDEM_DECLARE_int8(isa) TANDEM_DECLARE_GEMM(int8, isa)
#define TANDEM_DECLARE_int4(isa) TANDEM_DECLARE_GEMM(int4, isa)
#define TANDEM_DECLARE_quantize(isa) \
  void quantize_##isa(const bf16_t*, const float*, int, int, int, int, int, int8_t*, float*, int32_t*);
#define TANDEM_DECLARE_silu_mul(isa) \
  void silu_mul_##isa(const float*, const float*, float*, int); \
  void sigmoid_##isa(const float*, float*, int);                  \
  void clamped_swiglu_##isa(const float*, const float*, float*, int, float, float, float);
#define TANDEM_ISA(suffix, ...)
#define TANDEM_KERNEL(family, isa, from_m, name) TANDEM_DECLARE_##family(isa)
#include "kernel_list.inc"
#undef TANDEM_KERNEL
#undef TANDEM_ISA

namespace {

// The features each suffix's flags enable, as needs_<suffix>.
namespace isa_features {
using enum Feature;
#define TANDEM_ISA(suffix, ...) constexpr FeatureSet needs_##suffix{__VA_ARGS__};
#define TANDEM_KERNEL(family, isa, from_m, name)
#include "kernel_list.inc"
#undef TANDEM_KERNEL
#undef TANDEM_ISA
}  // namespace isa_features

#define TANDEM_ENTRY_GEMM(fmt, isa, name) \
  KernelVariant{name, gemm_##fmt##_##isa, gate_up_##fmt##_##isa, std::string_view(#isa) == "amx"}, nullptr, nullptr, nullptr
#define TANDEM_ENTRY_bf16(isa, name) TANDEM_ENTRY_GEMM(bf16, isa, name)
#define TANDEM_ENTRY_int8(isa, name) TANDEM_ENTRY_GEMM(int8, isa, name)
#define TANDEM_ENTRY_int4(isa, name) TANDEM_ENTRY_GEMM(int4, isa, name)
#define TANDEM_ENTRY_quantize(isa, name) KernelVariant{name, nullptr, nullptr}, quantize_##isa, nullptr, nullptr
#define TANDEM_ENTRY_silu_mul(isa, name) \
  KernelVariant{name, nullptr, nullptr}, nullptr, silu_mul_##isa, sigmoid_##isa, clamped_swiglu_##isa
constexpr KernelListEntry kList[] = {
#define TANDEM_ISA(suffix, ...)
#define TANDEM_KERNEL(family, isa, from_m, name) \
  {KernelFamily::family, #isa, isa_features::needs_##isa, from_m, TANDEM_ENTRY_##family(isa, name)},
#include "kernel_list.inc"
#undef TANDEM_KERNEL
#undef TANDEM_ISA
};
#undef TANDEM_ENTRY_silu_mul
#undef TANDEM_ENTRY_quantize
#undef TANDEM_ENTRY_int4
#undef TANDEM_ENTRY_int8
#undef TANDEM_ENTRY_bf16
#undef TANDEM_ENTRY_GEMM

// For one family: the variant for small m, and the one preferred from large_from_m on.
struct Choice {
  const KernelListEntry* small = nullptr;
  const KernelListEntry* large = nullptr;
};

Choice choose(KernelFamily family, FeatureSet usable) {
  Choice c;
  for (const KernelListEntry& e : kList) {
    if (e.family != family || !usable.contains(e.needs)) continue;
    if (e.from_m > 1) {
      c.large = &e;
    } else {
      c.small = &e;
      c.large = nullptr;  // preferred at every m over the earlier large-m line
    }
  }
  TANDEM_CHECK(c.small, Errc::internal, "kernel_list.inc: no ", family_name(family),
               " line runs on every CPU (its first line must need no feature and have from_m 1)");
  return c;
}

FormatKernels format_kernels(KernelFamily family, FeatureSet usable) {
  const Choice c = choose(family, usable);
  if (!c.large) return {c.small->kernel, c.small->kernel, 1 << 30};
  return {c.small->kernel, c.large->kernel, c.large->from_m};
}

void check_panels(const char* op, const PackedWeight& w, int begin, int end) {
  const int e = end < 0 ? w.panels : end;
  TANDEM_CHECK(begin >= 0 && begin <= e && e <= w.panels, Errc::invalid_argument, op, ": panel range [", begin, ", ",
               end, ") is outside the weight's ", w.panels, " panels");
}

}  // namespace

std::string_view family_name(KernelFamily f) noexcept {
  switch (f) {
    case KernelFamily::bf16: return "bf16";
    case KernelFamily::int8: return "int8";
    case KernelFamily::int4: return "int4";
    case KernelFamily::quantize: return "quantize";
    case KernelFamily::silu_mul: return "silu_mul";
  }
  return "unknown";
}

std::span<const KernelListEntry> kernel_list() { return kList; }

const KernelListEntry* find_kernel(KernelFamily family, std::string_view name) {
  for (const KernelListEntry& e : kList)
    if (e.family == family && name == e.name()) return &e;
  return nullptr;
}

KernelTable select_kernels(IsaLevel cap, const CpuFeatures& f) {
  const FeatureSet usable = feature_set(f) & level_allows(cap);
  return {cap,
          isa_name(cap).data(),
          format_kernels(KernelFamily::bf16, usable),
          format_kernels(KernelFamily::int8, usable),
          format_kernels(KernelFamily::int4, usable),
          choose(KernelFamily::quantize, usable).small->quantize,
          choose(KernelFamily::silu_mul, usable).small->silu_mul,
          choose(KernelFamily::silu_mul, usable).small->sigmoid,
          choose(KernelFamily::silu_mul, usable).small->clamped_swiglu};
}

KernelTable with_kernel(KernelTable table, const KernelListEntry& e) {
  const auto missing = missing_features(e.needs);
  TANDEM_CHECK(missing.empty(), Errc::unsupported, family_name(e.family), " kernel ", e.name(), " needs ",
               missing.front(), ", which this CPU lacks");
  switch (e.family) {
    case KernelFamily::bf16: table.bf16 = {e.kernel, e.kernel, 1 << 30}; break;
    case KernelFamily::int8: table.int8 = {e.kernel, e.kernel, 1 << 30}; break;
    case KernelFamily::int4: table.int4 = {e.kernel, e.kernel, 1 << 30}; break;
    case KernelFamily::quantize: table.quantize = e.quantize; break;
    case KernelFamily::silu_mul:
      table.silu_mul = e.silu_mul;
      table.sigmoid = e.sigmoid;
      table.clamped_swiglu = e.clamped_swiglu;
      break;
  }
  return table;
}

const KernelTable& kernel_table(IsaLevel level) {
  const auto missing = missing_features(level);
  TANDEM_CHECK(missing.empty(), Errc::unsupported, "kernels for ", isa_name(level), " need ", missing.front(),
               ", which this CPU lacks");
  static const auto tables = [] {
    std::vector<KernelTable> t;
    for (IsaLevel l : all_isa_levels()) t.push_back(select_kernels(l, cpu_features()));
    return t;
  }();
  return tables[static_cast<size_t>(level)];
}

const KernelTable& kernels() {
  static const KernelTable& t = kernel_table(effective_isa());
  return t;
}

namespace {

template <typename Args>
void check_input(const char* op, const PackedWeight& w, const Args& g) {
  TANDEM_CHECK((g.a != nullptr) + (g.a_f32 != nullptr) + (g.qa != nullptr) == 1, Errc::invalid_argument, op,
               ": give exactly one input (bf16 a, fp32 a_f32 or quantized qa)");
  if (g.qa) {
    TANDEM_CHECK(w.format != WeightFormat::bf16, Errc::invalid_argument, op,
                 ": quantized activations are for int8 / int4 weights, this one is bf16");
    TANDEM_CHECK(g.qa->matches(w), Errc::invalid_argument, op, ": quantized activations (k ", g.qa->k, ", group ",
                 g.qa->group, ") were prepared for another layout than this weight's (k ", w.k, ", group ", w.group, ")");
    TANDEM_CHECK(g.qa->m >= g.m, Errc::invalid_argument, op, ": quantized activations hold ", g.qa->m, " rows, m = ", g.m);
    return;
  }
  TANDEM_CHECK(g.lda >= w.k, Errc::invalid_argument, op, ": lda = ", g.lda, " is smaller than k = ", w.k);
}

}  // namespace

size_t row_tile_row_bytes(const PackedWeight& w) {
  return w.format == WeightFormat::bf16 ? 2 * static_cast<size_t>(w.k) : static_cast<size_t>(w.k_pad);
}

size_t row_tiles_bytes(int m, size_t row_bytes) { return static_cast<size_t>((m + 15) / 16) * 16 * row_bytes; }

void pack_row_tiles(const void* a, size_t lda_bytes, int m, size_t row_bytes, std::byte* out) {
  TANDEM_CHECK(row_bytes % 64 == 0, Errc::invalid_argument, "pack_row_tiles: a row of ", row_bytes,
               " bytes is not a whole number of 64-byte steps");
  const size_t steps = row_bytes / 64, tile = 16 * 64;
  const auto* src = static_cast<const std::byte*>(a);
  for (int r = 0; r < (m + 15) / 16 * 16; ++r) {
    std::byte* dst = out + static_cast<size_t>(r / 16) * steps * tile + static_cast<size_t>(r % 16) * 64;
    if (r >= m) {
      for (size_t s = 0; s < steps; ++s) std::memset(dst + s * tile, 0, 64);
      continue;
    }
    const std::byte* row = src + static_cast<size_t>(r) * lda_bytes;
    for (size_t s = 0; s < steps; ++s) std::memcpy(dst + s * tile, row + s * 64, 64);
  }
}

bool takes_row_tiles(const KernelVariant& v, const PackedWeight& w) {
  if (!v.row_tiles) return false;
  if (w.format == WeightFormat::bf16) return w.k % 32 == 0;
  if (w.format == WeightFormat::int4) return w.group >= 64;
  return true;
}

void QuantizedActs::prepare(const PackedWeight& w, int rows) {
  TANDEM_CHECK(w.format != WeightFormat::bf16, Errc::invalid_argument,
               "QuantizedActs: bf16 weights take bf16 activations, not quantized ones");
  TANDEM_CHECK(rows >= 0, Errc::invalid_argument, "QuantizedActs: rows = ", rows, " is negative");
  m = rows;
  k = w.k;
  k_pad = w.k_pad;
  group = w.group;
  q.resize(static_cast<size_t>(rows) * k_pad);
  scale.resize(rows);
  sums.resize(static_cast<size_t>(rows) * (k_pad / group));
}

namespace {

template <typename T>
void quantize_range(QuantizedActs& qa, const T* a, int lda, int r0, int r1, const KernelTable* kt) {
  TANDEM_CHECK(qa.k_pad > 0, Errc::invalid_argument, "quantize_activations: call QuantizedActs::prepare first");
  TANDEM_CHECK(0 <= r0 && r0 <= r1 && r1 <= qa.m, Errc::invalid_argument, "quantize_activations: rows [", r0, ", ", r1,
               ") are outside the prepared ", qa.m);
  TANDEM_CHECK(a != nullptr && lda >= qa.k, Errc::invalid_argument, "quantize_activations: null input or lda = ", lda,
               " below k = ", qa.k);
  const size_t groups = static_cast<size_t>(qa.k_pad / qa.group);
  const bf16_t* ab = nullptr;
  const float* af = nullptr;
  if constexpr (std::is_same_v<T, bf16_t>) ab = a + static_cast<size_t>(r0) * lda;
  else af = a + static_cast<size_t>(r0) * lda;
  (kt ? *kt : kernels()).quantize(ab, af, r1 - r0, qa.k, lda, qa.k_pad, qa.group, qa.q.data() + static_cast<size_t>(r0) * qa.k_pad,
                     qa.scale.data() + r0, qa.sums.data() + r0 * groups);
}

}  // namespace

void quantize_activations(QuantizedActs& qa, const bf16_t* a, int lda, int r0, int r1, const KernelTable* kt) {
  quantize_range(qa, a, lda, r0, r1, kt);
}
void quantize_activations(QuantizedActs& qa, const float* a, int lda, int r0, int r1, const KernelTable* kt) {
  quantize_range(qa, a, lda, r0, r1, kt);
}

void check_gate_act(const std::string& what, const GateAct& act) {
  if (!act.plain())
    TANDEM_CHECK(std::isfinite(act.alpha) && std::isfinite(act.limit) && std::isfinite(act.up_offset) && act.limit > 0,
                 Errc::invalid_argument, what, ": a clamped SwiGLU needs a finite alpha, up_offset and positive limit, "
                 "not alpha = ", act.alpha, ", limit = ", act.limit, ", up_offset = ", act.up_offset);
}

void check_gate_act(const char* what, const GateUpArgs& g) {
  TANDEM_CHECK(!g.gate_bias == !g.up_bias, Errc::invalid_argument, what, ": give both biases (gate and up) or neither");
  check_gate_act(std::string(what), g.act);
}

void gemm(const PackedWeight& w, const GemmArgs& g) {
  TANDEM_CHECK(!w.gate_up, Errc::invalid_argument, "gemm: the weight is a fused gate_up pack; use gate_up()");
  TANDEM_CHECK(g.m >= 0, Errc::invalid_argument, "gemm: m = ", g.m, " is negative");
  if (g.m == 0) return;
  check_input("gemm", w, g);
  TANDEM_CHECK(g.c != nullptr, Errc::invalid_argument, "gemm: null output pointer");
  TANDEM_CHECK(g.ldc >= w.n, Errc::invalid_argument, "gemm: ldc = ", g.ldc, " is smaller than n = ", w.n);
  check_panels("gemm", w, g.panel_begin, g.panel_end);
  kernels().of(w.format).pick(g.m).gemm(w, g);
}

void gate_up(const PackedWeight& w, const GateUpArgs& g) {
  TANDEM_CHECK(w.gate_up, Errc::invalid_argument, "gate_up: the weight is not a gate_up pack (pack_gate_up)");
  TANDEM_CHECK(g.m >= 0, Errc::invalid_argument, "gate_up: m = ", g.m, " is negative");
  if (g.m == 0) return;
  check_input("gate_up", w, g);
  TANDEM_CHECK((g.h != nullptr) != (g.h_bf16 != nullptr), Errc::invalid_argument,
               "gate_up: give exactly one output (fp32 h or bf16 h_bf16)");
  TANDEM_CHECK(g.ldh >= w.n, Errc::invalid_argument, "gate_up: ldh = ", g.ldh, " is smaller than n = ", w.n);
  check_panels("gate_up", w, g.panel_begin, g.panel_end);
  check_gate_act("gate_up", g);
  kernels().of(w.format).pick(g.m).gate_up(w, g);
}

}  // namespace tandem
