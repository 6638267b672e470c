// BF16 kernels for AVX-512 without AVX512_BF16 (Skylake-X, Ice Lake, Zen 3-): each
// 32-bit pair of the packed panel is split into two fp32 vectors (even k: shift left
// 16; odd k: mask the high half) and multiplied with FMA.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma.
#include <immintrin.h>

#include "gemm_bf16_driver.h"

namespace tandem {
namespace {

template <int MR>
struct FmaFixed {
  static void run(const bf16_t* a, int lda, const bf16_t* wp, int k, float* t, const PanelPrefetch& pf) {
    __m512 acc[MR][4];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_setzero_ps();
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    const __m512i* w = reinterpret_cast<const __m512i*>(wp);
    for (int p = 0; p < (k + 1) / 2; ++p) {
      pf(p);
      __m512 we[4], wo[4];
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) {
        const __m512i v = _mm512_load_si512(w + 4 * p + b);
        we[b] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        wo[b] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const uint32_t x = load_pair(a + static_cast<size_t>(r) * lda, 2 * p, k);
        const __m512 ae = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(x << 16)));
        const __m512 ao = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(x & 0xffff0000u)));
#pragma GCC unroll 4
        for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_fmadd_ps(wo[b], ao, _mm512_fmadd_ps(we[b], ae, acc[r][b]));
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) _mm512_store_ps(t + r * kPanel + 16 * b, acc[r][b]);
  }
};

using Micro = RowDispatch<FmaFixed, 4>;

}  // namespace

void gemm_bf16_avx512(const PackedWeight& w, const GemmArgs& g) { gemm_driver<Micro>(w, g); }
void gate_up_bf16_avx512(const PackedWeight& w, const GateUpArgs& g) { gate_up_driver<Micro>(w, g); }
void silu_mul_avx512(const float* g, const float* u, float* h, int n) { silu_mul(g, u, h, n); }
void sigmoid_avx512(const float* x, float* out, int n) { sigmoid(x, out, n); }
void clamped_swiglu_avx512(const float* g, const float* u, float* h, int n, float alpha, float limit, float offset) {
  clamped_swiglu(g, u, h, n, alpha, limit, offset);
}

}  // namespace tandem
