#include "harness.h"

#include <omp.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "tandem/error.h"

namespace tandem::bench {

void expert_step(int threads, const std::vector<const PackedWeight*>& gate_up, const std::vector<const PackedWeight*>& down,
                 int m, const bf16_t* a, bf16_t* h, float* out, const float* rw, QuantizedActs& q_in, QuantizedActs& q_mid,
                 const KernelTable* table) {
  if (gate_up.empty()) return;
  const KernelTable& kt = table ? *table : kernels();
  const bool quant = gate_up[0]->format != WeightFormat::bf16;
  const int hidden = gate_up[0]->k, inter = gate_up[0]->n;
  if (quant) {
    q_in.prepare(*gate_up[0], m);
    q_mid.prepare(*down[0], m);
  }
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int r0 = m * t / nt, r1 = m * (t + 1) / nt;
    if (quant) {  // the input is the same for every expert
      quantize_activations(q_in, a, hidden, r0, r1, &kt);
#pragma omp barrier
    }
    for (size_t i = 0; i < gate_up.size(); ++i) {
      const PackedWeight& wg = *gate_up[i];
      GateUpArgs ga;
      if (quant) ga.qa = &q_in;
      else ga.a = a;
      ga.m = m;
      ga.lda = hidden;
      ga.h_bf16 = h;
      ga.ldh = inter;
      ga.panel_begin = wg.panels * t / nt;
      ga.panel_end = wg.panels * (t + 1) / nt;
      kt.of(wg.format).pick(m).gate_up(wg, ga);
#pragma omp barrier
      if (quant) {
        quantize_activations(q_mid, h, inter, r0, r1, &kt);
#pragma omp barrier
      }
      const PackedWeight& wd = *down[i];
      GemmArgs da;
      if (quant) da.qa = &q_mid;
      else da.a = h;
      da.m = m;
      da.lda = inter;
      da.c = out;
      da.ldc = hidden;
      da.accumulate = true;
      da.row_scale = rw;
      da.panel_begin = wd.panels * t / nt;
      da.panel_end = wd.panels * (t + 1) / nt;
      kt.of(wd.format).pick(m).gemm(wd, da);
#pragma omp barrier
    }
  }
}

bool use_variant(KernelTable& table, WeightFormat format, std::string_view name) {
  const KernelFamily family = family_of(format);
  const KernelListEntry* e = find_kernel(family, name);
  if (!e) {
    std::string known;
    for (const KernelListEntry& k : kernel_list())
      if (k.family == family) known += (known.empty() ? "" : ", ") + std::string(k.name());
    std::fprintf(stderr, "unknown %s kernel variant '%s'; known: %s\n", std::string(format_name(format)).c_str(),
                 std::string(name).c_str(), known.c_str());
    return false;
  }
  try {
    table = with_kernel(table, *e);
    if (const KernelListEntry* q = find_kernel(KernelFamily::quantize, name)) table = with_kernel(table, *q);
  } catch (const Error& err) {
    std::fprintf(stderr, "%s\n", err.message().c_str());
    return false;
  }
  return true;
}

std::string kernels_line(const FormatKernels& fk) {
  if (!std::strcmp(fk.small.name, fk.large.name)) return std::string(fk.small.name) + " at every m";
  return std::string(fk.small.name) + " (m < " + std::to_string(fk.large_from_m) + "), " + fk.large.name;
}

}  // namespace tandem::bench
