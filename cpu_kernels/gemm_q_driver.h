// Internal: the loops shared by every ISA's integer (INT8 / INT4) kernels, in the
// style of gemm_bf16_driver.h (internal linkage, one copy per ISA file).
//
// A call quantizes its activation rows once (quantize_rows: per-row scale, int8
// values, per-group sums), then runs the micro-kernel over output panels.
//
// Micro contract:
//   static constexpr int kMaxRows;
//   static void run(int mr, const QuantInput& in, int r0, const PackedWeight& w,
//                   const std::byte* panel, float* t);
// computes, for token rows r0 .. r0 + mr - 1 and the panel's 64 outputs j,
//   t[r][j] = sum over groups g of scale[j][g] * sum_{c in g} (q_w[j][c] - zero[j][g]) * q_a[r][c]
// (int8: one group, zero 0, i.e. scale[j] * the exact integer dot product), without the
// activation scale, which the driver applies.
#pragma once

#include <xmmintrin.h>

#include "gemm_bf16_driver.h"
#include "quant_act.h"

namespace tandem {
namespace {

struct QuantInput {
  const int8_t* q;       // [m x ldq]
  const float* scale;    // [m]
  const int32_t* sums;   // [m x groups]
  int ldq, groups;
  const int8_t* row(int r) const { return q + static_cast<size_t>(r) * ldq; }
};

// This ISA's quantizer (exported per file as quantize_<isa> for the kernel table).
inline void quantize_any(const bf16_t* a, const float* a_f32, int m, int k, int lda, int k_pad, int group, int8_t* q,
                         float* scale, int32_t* sums) {
  if (a)
    quantize_rows(a, m, k, lda, k_pad, group, q, scale, sums);
  else
    quantize_rows(a_f32, m, k, lda, k_pad, group, q, scale, sums);
}

template <typename Args>
QuantInput quantize_input(const PackedWeight& w, const Args& g) {
  if (g.qa) return {g.qa->q.data(), g.qa->scale.data(), g.qa->sums.data(), g.qa->k_pad, g.qa->k_pad / g.qa->group};
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> scale;
  thread_local std::vector<int32_t> sums;
  const int groups = w.k_pad / w.group;
  q.resize(static_cast<size_t>(g.m) * w.k_pad);
  scale.resize(g.m);
  sums.resize(static_cast<size_t>(g.m) * groups);
  if (g.a)
    quantize_rows(g.a, g.m, w.k, g.lda, w.k_pad, w.group, q.data(), scale.data(), sums.data());
  else
    quantize_rows(g.a_f32, g.m, w.k, g.lda, w.k_pad, w.group, q.data(), scale.data(), sums.data());
  return {q.data(), scale.data(), sums.data(), w.k_pad, groups};
}

template <class Micro>
void gemm_q_driver(const PackedWeight& w, const GemmArgs& g) {
  const QuantInput in = quantize_input(w, g);
  const int pe = g.panel_end < 0 ? w.panels : g.panel_end;
  alignas(64) float t[Micro::kMaxRows * kPanel];
  for (int p = g.panel_begin; p < pe; ++p) {
    const int n0 = p * kPanel, nn = std::min(kPanel, w.n - n0);
    for_row_blocks(g.m, Micro::kMaxRows, [&](int r0, int mr) {
      Micro::run(mr, in, r0, w, w.panel_data(p), t);
      store_rows(g, t, mr, r0, n0, nn, in.scale);
    });
  }
}

template <class Micro>
void gate_up_q_driver(const PackedWeight& w, const GateUpArgs& g) {
  const QuantInput in = quantize_input(w, g);
  const int pe = g.panel_end < 0 ? w.panels : g.panel_end;
  alignas(64) float tg[Micro::kMaxRows * kPanel], tu[Micro::kMaxRows * kPanel];
  for (int p = g.panel_begin; p < pe; ++p) {
    const int n0 = p * kPanel, nn = std::min(kPanel, w.n - n0);
    for_row_blocks(g.m, Micro::kMaxRows, [&](int r0, int mr) {
      Micro::run(mr, in, r0, w, w.panel_data(2 * p), tg);
      Micro::run(mr, in, r0, w, w.panel_data(2 * p + 1), tu);
      store_silu_rows(g, tg, tu, mr, r0, n0, nn, in.scale);
    });
  }
}

// Per-panel metadata locations (see the layouts in kernels.h).
inline const float* int8_scales(const PackedWeight& w, const std::byte* panel) {
  return reinterpret_cast<const float*>(panel + static_cast<size_t>(w.k_pad) * kPanel);
}
inline const std::byte* int4_group(const PackedWeight& w, const std::byte* panel, int gi) {
  return panel + gi * w.group_stride;
}
// prefetch_ahead, called for each packed row of nibbles, reaches the nibbles of the group
// kPrefetchAhead bytes ahead but not what follows a group's nibbles (its 64 fp16 scales and, asymmetric, zero
// points): at group 32, 2 of every 18 lines (3 of 19) were left to demand misses from memory.
// Called once per group, this asks for those lines, the same distance ahead.
inline void prefetch_group_tail(const PackedWeight& w, const std::byte* group) {
  const char* ahead = reinterpret_cast<const char*>(group) + kPrefetchAhead;
  for (size_t off = static_cast<size_t>(w.group) * kPanel / 2; off < w.group_stride; off += 64)
    _mm_prefetch(ahead + off, _MM_HINT_T1);
}
inline const uint16_t* int4_scales(const PackedWeight& w, const std::byte* group) {
  return reinterpret_cast<const uint16_t*>(group + static_cast<size_t>(w.group) * kPanel / 2);
}
inline const uint8_t* int4_zeros(const PackedWeight& w, const std::byte* group) {
  return reinterpret_cast<const uint8_t*>(group + static_cast<size_t>(w.group) * kPanel / 2 + kPanel * 2);
}
inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

}  // namespace
}  // namespace tandem
