// Internal: the loops shared by every ISA's BF16 kernels. Each gemm_bf16_<isa>.cpp
// includes this with its own Micro (the register-blocked inner kernel). Everything
// here has internal linkage, so each translation unit keeps its own copy compiled
// with its own ISA flags: nothing built for AVX-512 can be merged into a caller
// built for AVX2 (the ODR trap of inline functions shared across flag sets).
//
// Micro contract:
//   static constexpr int kMaxRows;
//   static void run(int mr, const bf16_t* a, int lda, const bf16_t* panel, int k, float* t);
// computes t[r][j] = sum_c a[r][c] * W[panel*64 + j][c] for r < mr <= kMaxRows,
// j < 64, c < k, as fp32, into t (row stride 64).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

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

template <class Micro>
void gemm_driver(const PackedWeight& w, const GemmArgs& g) {
  const int pe = g.panel_end < 0 ? w.panels : g.panel_end;
  alignas(64) float t[Micro::kMaxRows * kPanel];
  for (int p = g.panel_begin; p < pe; ++p) {
    const bf16_t* wp = w.panel(p);
    const int n0 = p * kPanel, nn = std::min(kPanel, w.n - n0);
    for (int r0 = 0; r0 < g.m; r0 += Micro::kMaxRows) {
      const int mr = std::min(Micro::kMaxRows, g.m - r0);
      Micro::run(mr, g.a + static_cast<size_t>(r0) * g.lda, g.lda, wp, w.k, t);
      for (int r = 0; r < mr; ++r) {
        float* c = g.c + static_cast<size_t>(r0 + r) * g.ldc + n0;
        const float* tr = t + r * kPanel;
        const float s = g.row_scale ? g.row_scale[r0 + r] : 1.0f;
        if (g.accumulate) {
          for (int j = 0; j < nn; ++j) c[j] += s * tr[j];
        } else if (g.row_scale) {
          for (int j = 0; j < nn; ++j) c[j] = s * tr[j];
        } else {
          std::memcpy(c, tr, sizeof(float) * nn);
        }
      }
    }
  }
}

template <class Micro>
void gate_up_driver(const PackedWeight& w, const GateUpArgs& g) {
  const int pe = g.panel_end < 0 ? w.panels : g.panel_end;
  alignas(64) float tg[Micro::kMaxRows * kPanel], tu[Micro::kMaxRows * kPanel], h[kPanel];
  for (int p = g.panel_begin; p < pe; ++p) {
    const bf16_t* wg = w.panel(2 * p);
    const bf16_t* wu = w.panel(2 * p + 1);
    const int n0 = p * kPanel, nn = std::min(kPanel, w.n - n0);
    for (int r0 = 0; r0 < g.m; r0 += Micro::kMaxRows) {
      const int mr = std::min(Micro::kMaxRows, g.m - r0);
      const bf16_t* a = g.a + static_cast<size_t>(r0) * g.lda;
      Micro::run(mr, a, g.lda, wg, w.k, tg);
      Micro::run(mr, a, g.lda, wu, w.k, tu);
      for (int r = 0; r < mr; ++r) {
        const size_t row = static_cast<size_t>(r0 + r) * g.ldh + n0;
        if (g.h) {
          silu_mul(tg + r * kPanel, tu + r * kPanel, g.h + row, nn);
        } else {
          silu_mul(tg + r * kPanel, tu + r * kPanel, h, nn);
          for (int j = 0; j < nn; ++j) g.h_bf16[row + j] = round_to_bf16(h[j]);
        }
      }
    }
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

// Dispatches a run(mr, ...) call to the template instantiation for mr.
template <template <int> class Fixed, int Max>
struct RowDispatch {
  static constexpr int kMaxRows = Max;
  static void run(int mr, const bf16_t* a, int lda, const bf16_t* wp, int k, float* t) {
    switch (mr) {
      case 1: Fixed<1>::run(a, lda, wp, k, t); break;
      case 2: if constexpr (Max >= 2) Fixed<2>::run(a, lda, wp, k, t); break;
      case 3: if constexpr (Max >= 3) Fixed<3>::run(a, lda, wp, k, t); break;
      case 4: if constexpr (Max >= 4) Fixed<4>::run(a, lda, wp, k, t); break;
      case 5: if constexpr (Max >= 5) Fixed<5>::run(a, lda, wp, k, t); break;
      case 6: if constexpr (Max >= 6) Fixed<6>::run(a, lda, wp, k, t); break;
      default: break;
    }
  }
};

}  // namespace
}  // namespace tandem
