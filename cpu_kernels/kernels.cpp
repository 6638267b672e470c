// Kernel tables per ISA level and the validated entry points. No ISA flags here:
// the wide code lives in the per-ISA files and is only reached through a table
// whose level the hardware was checked for.
#include "tandem/kernels.h"

#include <type_traits>

#include "tandem/error.h"

namespace tandem {

#define TANDEM_DECLARE(fmt, isa)                                  \
  void gemm_##fmt##_##isa(const PackedWeight&, const GemmArgs&); \
  void gate_up_##fmt##_##isa(const PackedWeight&, const GateUpArgs&);
TANDEM_DECLARE(bf16, ref)
TANDEM_DECLARE(bf16, avx2)
TANDEM_DECLARE(bf16, avx512)
TANDEM_DECLARE(bf16, avx512bf16)
TANDEM_DECLARE(bf16, amx)
TANDEM_DECLARE(int8, ref)
TANDEM_DECLARE(int8, avx2)
TANDEM_DECLARE(int8, avx512)
TANDEM_DECLARE(int8, avx512vnni)
TANDEM_DECLARE(int8, amx)
TANDEM_DECLARE(int4, ref)
TANDEM_DECLARE(int4, avx2)
TANDEM_DECLARE(int4, avx512)
TANDEM_DECLARE(int4, avx512vnni)
#undef TANDEM_DECLARE
void quantize_ref(const bf16_t*, const float*, int, int, int, int, int, int8_t*, float*, int32_t*);
void quantize_avx2(const bf16_t*, const float*, int, int, int, int, int, int8_t*, float*, int32_t*);
void quantize_avx512(const bf16_t*, const float*, int, int, int, int, int, int8_t*, float*, int32_t*);
void quantize_avx512vnni(const bf16_t*, const float*, int, int, int, int, int, int8_t*, float*, int32_t*);

namespace {

#define TANDEM_VARIANT(name, fmt, isa) \
  KernelVariant { name, gemm_##fmt##_##isa, gate_up_##fmt##_##isa }

// One kernel set for every m.
FormatKernels all_m(KernelVariant v) { return {v, v, 1 << 30}; }

// Token rows from which AMX beats the AVX-512 kernels: below it a tile is mostly
// padding and decode is bound by the weight stream either way.
constexpr int kAmxFromM = 8;

// One row per level, in level order. A level without kernels of its own for a format
// reuses the best lower variant; the variant's name says which code actually runs.
const KernelTable kTables[] = {
    {IsaLevel::scalar, "scalar", all_m(TANDEM_VARIANT("scalar", bf16, ref)), all_m(TANDEM_VARIANT("scalar", int8, ref)),
     all_m(TANDEM_VARIANT("scalar", int4, ref)), quantize_ref},
    {IsaLevel::avx2, "avx2", all_m(TANDEM_VARIANT("avx2", bf16, avx2)), all_m(TANDEM_VARIANT("avx2", int8, avx2)),
     all_m(TANDEM_VARIANT("avx2", int4, avx2)), quantize_avx2},
    {IsaLevel::avx512, "avx512", all_m(TANDEM_VARIANT("avx512", bf16, avx512)),
     all_m(TANDEM_VARIANT("avx512", int8, avx512)), all_m(TANDEM_VARIANT("avx512", int4, avx512)), quantize_avx512},
    {IsaLevel::avx512_vnni, "avx512_vnni", all_m(TANDEM_VARIANT("avx512", bf16, avx512)),
     all_m(TANDEM_VARIANT("avx512_vnni", int8, avx512vnni)), all_m(TANDEM_VARIANT("avx512_vnni", int4, avx512vnni)),
     quantize_avx512vnni},
    {IsaLevel::avx512_bf16, "avx512_bf16", all_m(TANDEM_VARIANT("avx512_bf16", bf16, avx512bf16)),
     all_m(TANDEM_VARIANT("avx512_vnni", int8, avx512vnni)), all_m(TANDEM_VARIANT("avx512_vnni", int4, avx512vnni)),
     quantize_avx512vnni},
    {IsaLevel::amx, "amx",
     {TANDEM_VARIANT("avx512_bf16", bf16, avx512bf16), TANDEM_VARIANT("amx_bf16", bf16, amx), kAmxFromM},
     {TANDEM_VARIANT("avx512_vnni", int8, avx512vnni), TANDEM_VARIANT("amx_int8", int8, amx), kAmxFromM},
     all_m(TANDEM_VARIANT("avx512_vnni", int4, avx512vnni)), quantize_avx512vnni},
};
#undef TANDEM_VARIANT

void check_panels(const char* op, const PackedWeight& w, int begin, int end) {
  const int e = end < 0 ? w.panels : end;
  TANDEM_CHECK(begin >= 0 && begin <= e && e <= w.panels, Errc::invalid_argument, op, ": panel range [", begin, ", ",
               end, ") is outside the weight's ", w.panels, " panels");
}

}  // namespace

const KernelTable& kernel_table(IsaLevel level) {
  const auto missing = missing_features(level);
  TANDEM_CHECK(missing.empty(), Errc::unsupported, "kernels for ", isa_name(level), " need ", missing.front(),
               ", which this CPU lacks");
  return kTables[static_cast<int>(level)];
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
  kernels().of(w.format).pick(g.m).gate_up(w, g);
}

}  // namespace tandem
