// Internal: the loops shared by every ISA's BF16 kernels. Each gemm_bf16_<isa>.cpp
// includes this with its own Micro (the register-blocked inner kernel). Everything
// here has internal linkage, so each translation unit keeps its own copy compiled
// with its own ISA flags: nothing built for AVX-512 can be merged into a caller
// built for AVX2 (the ODR trap of inline functions shared across flag sets).
//
// Micro contract:
//   static constexpr int kMaxRows;
//   static void run(int mr, const bf16_t* a, int lda, const bf16_t* panel, int k, float* t,
//                   const PanelPrefetch& pf);
// computes t[r][j] = sum_c a[r][c] * W[panel*64 + j][c] for r < mr <= kMaxRows,
// j < 64, c < k, as fp32, into t (row stride 64), calling pf(p) once at each k-pair step p.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <xmmintrin.h>

#include "bf16_round.h"
#include "tandem/kernels.h"

namespace tandem {
namespace {

// exp(x) for x in [-87.3, 88.7] (Cephes' expf polynomial; about 1 ulp), written
// without calls or branches so the loops below vectorize.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}

// silu(g) * u; NaN in g or u propagates (the clamp inside exp_approx keeps x's NaN
// out of the integer path, and g itself carries it to the result).
inline void silu_mul(const float* g, const float* u, float* out, int n) {
  for (int j = 0; j < n; ++j) out[j] = g[j] / (1.0f + exp_approx(-g[j])) * u[j];
}
// A clamped SwiGLU (GateAct::Kind::clamped), with silu_mul's exponential. std::min /
// std::max return their first argument for NaN, so NaN in g or u propagates.
inline void clamped_swiglu(const float* g, const float* u, float* out, int n, float alpha, float limit, float offset) {
  for (int j = 0; j < n; ++j) {
    const float gc = std::min(g[j], limit), uc = std::min(std::max(u[j], -limit), limit);
    out[j] = gc / (1.0f + exp_approx(-alpha * gc)) * (uc + offset);
  }
}
// 1 / (1 + exp(-x)) with silu_mul's exponential; NaN stays NaN (exp_approx's clamp
// would otherwise turn it into a number).
inline void sigmoid(const float* x, float* out, int n) {
  for (int j = 0; j < n; ++j) {
    const float s = 1.0f / (1.0f + exp_approx(-x[j]));
    out[j] = x[j] == x[j] ? s : x[j];
  }
}

// Writes a micro-kernel's rows t[r][0..nn) (row stride ld, a panel's 64 by default) into
// C at (r0, n0), each row times row_scale (if given) and act_scale (the integer kernels'
// activation scale).
template <typename Args>
inline void store_rows(const Args& g, const float* t, int mr, int r0, int n0, int nn, const float* act_scale,
                       int ld = kPanel) {
  for (int r = 0; r < mr; ++r) {
    float* c = g.c + static_cast<size_t>(r0 + r) * g.ldc + n0;
    const float* tr = t + r * ld;
    float s = g.row_scale ? g.row_scale[r0 + r] : 1.0f;
    if (act_scale) s *= act_scale[r0 + r];
    if (g.accumulate) {
      for (int j = 0; j < nn; ++j) c[j] += s * tr[j];
    } else if (g.row_scale || act_scale) {
      for (int j = 0; j < nn; ++j) c[j] = s * tr[j];
    } else {
      std::memcpy(c, tr, sizeof(float) * nn);
    }
  }
}

// Writes silu(gate) * up (or g.act's activation) for rows t[r] (row stride ld) into H
// (fp32 or bf16), scaling both by act_scale[r0 + r] first when given and adding g's
// biases (outputs n0 + j) before the activation.
template <typename Args>
inline void store_silu_rows(const Args& g, float* tg, float* tu, int mr, int r0, int n0, int nn, const float* act_scale,
                            int ld = kPanel) {
  alignas(64) float h[kPanel];
  for (int r = 0; r < mr; ++r) {
    float* gr = tg + r * ld;
    float* ur = tu + r * ld;
    if (act_scale) {
      const float s = act_scale[r0 + r];
      for (int j = 0; j < nn; ++j) {
        gr[j] *= s;
        ur[j] *= s;
      }
    }
    if (g.gate_bias) {
      const float* gb = g.gate_bias + n0;
      const float* ub = g.up_bias + n0;
      for (int j = 0; j < nn; ++j) {
        gr[j] += gb[j];
        ur[j] += ub[j];
      }
    }
    const size_t row = static_cast<size_t>(r0 + r) * g.ldh + n0;
    float* dst = g.h ? g.h + row : h;
    if (g.act.plain())
      silu_mul(gr, ur, dst, nn);
    else
      clamped_swiglu(gr, ur, dst, nn, g.act.alpha, g.act.limit, g.act.up_offset);
    if (!g.h)
      for (int j = 0; j < nn; ++j) g.h_bf16[row + j] = round_to_bf16(h[j]);
  }
}

// Calls f(r0, mr) for m rows in blocks of at most `max`. From three blocks on, the blocks'
// sizes differ by at most one (larger first): 32 rows in blocks of at most 6 are 6 6 5 5 5 5,
// not 6 6 6 6 6 2. Every block streams the whole weight panel, from the caches once the first
// block has read it, and a short last block costs nearly a full one: on Zen 4 (AVX512_BF16,
// qwen3-235b's expert, bench_kernels) 25 rows took 2915 us against 2630 for 24, the one-row
// block as much as 2.6 rows of a full one; balanced, 25-33 rows ran 2-10% faster (10 of 10
// pairs). Up to two blocks the first stays full: it is the one that reads the panel from
// memory, and at those row counts the call is bound by that read, which hides its rows'
// arithmetic.
inline int row_blocks(int m, int max) { return (m + max - 1) / max; }  // for_row_blocks' count
template <class F>
inline void for_row_blocks(int m, int max, F&& f) {
  const int blocks = row_blocks(m, max);
  for (int b = 0, r0 = 0; b < blocks; ++b) {
    const int left = blocks - b, mr = blocks <= 2 ? std::min(max, m - r0) : (m - r0 + left - 1) / left;
    f(r0, mr);
    r0 += mr;
  }
}

// The bf16 input of a call: a itself, or a_f32 rounded into a per-thread buffer.
template <typename Args>
inline const bf16_t* bf16_input(const Args& g, int k, int& lda) {
  lda = g.lda;
  if (g.a) return g.a;
  thread_local std::vector<bf16_t> buf;
  buf.resize(static_cast<size_t>(g.m) * k);
  for (int r = 0; r < g.m; ++r)
    for (int c = 0; c < k; ++c) buf[static_cast<size_t>(r) * k + c] = round_to_bf16(g.a_f32[static_cast<size_t>(r) * g.lda + c]);
  lda = k;
  return buf.data();
}

// Asks for the packed row (256 bytes) 8 KB after `row`: the next groups of the panel,
// or the next panel. Without it the hardware prefetcher alone kept an INT4 decode at
// 55-62% of the read bandwidth; with it, 77-92%, and INT8 88-100% instead of 79-84%
// (bench_kernels, AMX Xeon, 2 threads). The BF16 kernels gained as much: AVX512_BF16 at
// 1 / 2 / 4 / 8 rows 1.39x / 1.45x / 1.61x / 1.53x (qwen3-30b's expert cut into the engine's
// calls of one panel pair, 2 threads, alternated per step, the same machine). Every
// kernel that streams packed rows calls it once per row.
constexpr size_t kPrefetchAhead = 8192;
inline void prefetch_ahead(const void* row) {
  const char* p = static_cast<const char*>(row) + kPrefetchAhead;
#pragma GCC unroll 4
  for (int b = 0; b < 4; ++b) _mm_prefetch(p + 64 * b, _MM_HINT_T1);
}

// What a micro-kernel call prefetches (into L2) while it streams a panel: at k-pair step p,
// `lines` cache lines from at + p * step. A panel's first row block reads the panel from
// memory and prefetches it 8 KB ahead (prefetch_ahead's distance, 4 lines a step); its later
// blocks read it from L2 and share the prefetching of the next panel the call streams (a k-pair
// row is 4 lines: one block prefetches all 4 a step, two blocks 2 each, three or more 1 each on
// the first four), so that panel's first block finds it in L2 rather than running at the
// memory's pace (Zen 4, 2 cores: a step's 256 bytes every ~24 cycles is ~40 GB/s per core,
// more than the machine reads).
struct PanelPrefetch {
  const char* at = nullptr;
  size_t step = 0;
  int lines = 0;
  void operator()(int p) const {
    const char* q = at + static_cast<size_t>(p) * step;
    for (int l = 0; l < lines; ++l) _mm_prefetch(q + 64 * l, _MM_HINT_T1);
  }
  // Row block `block` (0 first) of `blocks` in a call on a panel of `pairs` k-pairs at `panel`,
  // `next` the panel the call streams after it (null: none).
  static PanelPrefetch for_block(const bf16_t* panel, const bf16_t* next, int block, int blocks, int pairs) {
    constexpr int kLines = kPanel * 2 * sizeof(bf16_t) / 64;  // lines per k-pair row: 4
    if (block == 0) return {reinterpret_cast<const char*>(panel) + kPrefetchAhead, 64 * kLines, kLines};
    const int lines = (kLines + blocks - 2) / (blocks - 1);  // ceil(4 / later blocks)
    if (next == nullptr || (block - 1) * lines >= kLines) return {};
    return {reinterpret_cast<const char*>(next) + static_cast<size_t>(block - 1) * pairs * lines * 64,
            static_cast<size_t>(lines) * 64, lines};
  }
};

template <class Micro>
void gemm_driver(const PackedWeight& w, const GemmArgs& g) {
  const int pe = g.panel_end < 0 ? w.panels : g.panel_end;
  int lda;
  const bf16_t* a = bf16_input(g, w.k, lda);
  alignas(64) float t[Micro::kMaxRows * kPanel];
  const int blocks = row_blocks(g.m, Micro::kMaxRows);
  for (int p = g.panel_begin; p < pe; ++p) {
    const bf16_t* wp = w.panel(p);
    const bf16_t* next = p + 1 < pe ? w.panel(p + 1) : nullptr;
    const int n0 = p * kPanel, nn = std::min(kPanel, w.n - n0);
    int block = 0;
    for_row_blocks(g.m, Micro::kMaxRows, [&](int r0, int mr) {
      Micro::run(mr, a + static_cast<size_t>(r0) * lda, lda, wp, w.k, t,
                 PanelPrefetch::for_block(wp, next, block++, blocks, w.k_pairs));
      store_rows(g, t, mr, r0, n0, nn, nullptr);
    });
  }
}

template <class Micro>
void gate_up_driver(const PackedWeight& w, const GateUpArgs& g) {
  const int pe = g.panel_end < 0 ? w.panels : g.panel_end;
  int lda;
  const bf16_t* a0 = bf16_input(g, w.k, lda);
  alignas(64) float tg[Micro::kMaxRows * kPanel], tu[Micro::kMaxRows * kPanel];
  const int blocks = row_blocks(g.m, Micro::kMaxRows);
  for (int p = g.panel_begin; p < pe; ++p) {
    const bf16_t* wg = w.panel(2 * p);
    const bf16_t* wu = w.panel(2 * p + 1);
    const bf16_t* next_g = p + 1 < pe ? w.panel(2 * p + 2) : nullptr;
    const bf16_t* next_u = p + 1 < pe ? w.panel(2 * p + 3) : nullptr;
    const int n0 = p * kPanel, nn = std::min(kPanel, w.n - n0);
    int block = 0;
    for_row_blocks(g.m, Micro::kMaxRows, [&](int r0, int mr) {
      const bf16_t* a = a0 + static_cast<size_t>(r0) * lda;
      Micro::run(mr, a, lda, wg, w.k, tg, PanelPrefetch::for_block(wg, next_g, block, blocks, w.k_pairs));
      Micro::run(mr, a, lda, wu, w.k, tu, PanelPrefetch::for_block(wu, next_u, block, blocks, w.k_pairs));
      ++block;
      store_silu_rows(g, tg, tu, mr, r0, n0, nn, nullptr);
    });
  }
}

// Reads a[c] and a[c + 1] as one 32-bit pair; at the odd-k tail, a[c] alone (the
// packed weight holds 0 for the missing column, and a row's memory may end at a[c]).
inline uint32_t load_pair(const bf16_t* a, int c, int k) {
  if (c + 1 < k) {
    uint32_t v;
    std::memcpy(&v, a + c, 4);
    return v;
  }
  return a[c];
}

// Dispatches run(mr, args...) to the instantiation Fixed<mr>::run(args...).
template <template <int> class Fixed, int Max>
struct RowDispatch {
  static constexpr int kMaxRows = Max;
  template <int R = 1, class... A>
  static void run(int mr, A&&... args) {
    if constexpr (R <= Max) {
      if (mr == R) {
        Fixed<R>::run(args...);
      } else {
        run<R + 1>(mr, args...);
      }
    }
  }
};

}  // namespace
}  // namespace tandem
