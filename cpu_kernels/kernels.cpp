// Kernel tables per ISA level and the validated entry points. No ISA flags here:
// the wide code lives in the per-ISA files and is only reached through a table
// whose level the hardware was checked for.
#include "tandem/kernels.h"

#include "tandem/error.h"

namespace tandem {

void gemm_bf16_ref(const PackedWeight&, const GemmArgs&);
void gate_up_bf16_ref(const PackedWeight&, const GateUpArgs&);
void gemm_bf16_avx2(const PackedWeight&, const GemmArgs&);
void gate_up_bf16_avx2(const PackedWeight&, const GateUpArgs&);
void gemm_bf16_avx512(const PackedWeight&, const GemmArgs&);
void gate_up_bf16_avx512(const PackedWeight&, const GateUpArgs&);
void gemm_bf16_avx512bf16(const PackedWeight&, const GemmArgs&);
void gate_up_bf16_avx512bf16(const PackedWeight&, const GateUpArgs&);

namespace {

// One row per level, in level order. A level without kernels of its own reuses the
// best lower variant; the name says which code actually runs.
const KernelTable kTables[] = {
    {IsaLevel::scalar, "scalar", gemm_bf16_ref, gate_up_bf16_ref},
    {IsaLevel::avx2, "avx2", gemm_bf16_avx2, gate_up_bf16_avx2},
    {IsaLevel::avx512, "avx512", gemm_bf16_avx512, gate_up_bf16_avx512},
    {IsaLevel::avx512_vnni, "avx512", gemm_bf16_avx512, gate_up_bf16_avx512},
    {IsaLevel::avx512_bf16, "avx512_bf16", gemm_bf16_avx512bf16, gate_up_bf16_avx512bf16},
    {IsaLevel::amx, "avx512_bf16", gemm_bf16_avx512bf16, gate_up_bf16_avx512bf16},
};

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

void gemm(const PackedWeight& w, const GemmArgs& g) {
  TANDEM_CHECK(!w.gate_up, Errc::invalid_argument, "gemm: the weight is a fused gate_up pack; use gate_up()");
  TANDEM_CHECK(g.m >= 0, Errc::invalid_argument, "gemm: m = ", g.m, " is negative");
  if (g.m == 0) return;
  TANDEM_CHECK(g.a && g.c, Errc::invalid_argument, "gemm: null ", g.a ? "output" : "input", " pointer");
  TANDEM_CHECK(g.lda >= w.k, Errc::invalid_argument, "gemm: lda = ", g.lda, " is smaller than k = ", w.k);
  TANDEM_CHECK(g.ldc >= w.n, Errc::invalid_argument, "gemm: ldc = ", g.ldc, " is smaller than n = ", w.n);
  check_panels("gemm", w, g.panel_begin, g.panel_end);
  kernels().gemm_bf16(w, g);
}

void gate_up(const PackedWeight& w, const GateUpArgs& g) {
  TANDEM_CHECK(w.gate_up, Errc::invalid_argument, "gate_up: the weight is not a gate_up pack (pack_gate_up_bf16)");
  TANDEM_CHECK(g.m >= 0, Errc::invalid_argument, "gate_up: m = ", g.m, " is negative");
  if (g.m == 0) return;
  TANDEM_CHECK(g.a != nullptr, Errc::invalid_argument, "gate_up: null input pointer");
  TANDEM_CHECK((g.h != nullptr) != (g.h_bf16 != nullptr), Errc::invalid_argument,
               "gate_up: give exactly one output (fp32 h or bf16 h_bf16)");
  TANDEM_CHECK(g.lda >= w.k, Errc::invalid_argument, "gate_up: lda = ", g.lda, " is smaller than k = ", w.k);
  TANDEM_CHECK(g.ldh >= w.n, Errc::invalid_argument, "gate_up: ldh = ", g.ldh, " is smaller than n = ", w.n);
  check_panels("gate_up", w, g.panel_begin, g.panel_end);
  kernels().gate_up_bf16(w, g);
}

}  // namespace tandem
