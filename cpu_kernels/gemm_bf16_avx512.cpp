// BF16 kernels for AVX-512 without AVX512_BF16 (Skylake-X, Cascade Lake, Ice Lake): each
// 32-bit pair of the packed panel is split into two fp32 vectors (even k: shift left
// 16; odd k: mask the high half) and multiplied with FMA.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma.
#include <immintrin.h>

#include "gemm_bf16_driver.h"

namespace tandem {
namespace {

// The rows as fp32 (row stride ld = 2 * pairs, a zero after an odd k), so each FMA's
// activation is a broadcast from memory: a load, where a broadcast from a general
// register (vmovd + vpbroadcastd) takes the vector ports the FMAs and the conversions
// need (on Ice Lake and Skylake-X two ports do all three).
inline float* rows_f32(const bf16_t* a, int lda, int k, int mr, size_t ld) {
  thread_local std::vector<float> buf;
  buf.resize(ld * mr);
  float* const xs = buf.data();
  for (int r = 0; r < mr; ++r) {
    const bf16_t* ar = a + static_cast<size_t>(r) * lda;
    float* xr = xs + r * ld;
    int c = 0;
    for (; c + 16 <= k; c += 16) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ar + c));
      _mm512_storeu_ps(xr + c, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)));
    }
    for (; c < k; ++c) xr[c] = from_bf16(ar[c]);
    if (k & 1) xr[k] = 0.0f;
  }
  return xs;
}

template <int MR>
struct FmaFixed {
  static void run(const bf16_t* a, int lda, const bf16_t* wp, int k, float* t, const PanelPrefetch& pf) {
    const int pairs = (k + 1) / 2;
    const size_t ld = static_cast<size_t>(pairs) * 2;
    const float* const xs = rows_f32(a, lda, k, MR, ld);
    __m512 acc[MR][4];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_setzero_ps();
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    const __m512i* w = reinterpret_cast<const __m512i*>(wp);
    for (int p = 0; p < pairs; ++p) {
      pf(p);
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) {
        const __m512i v = _mm512_load_si512(w + 4 * p + b);
        const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) acc[r][b] = _mm512_fmadd_ps(we, _mm512_set1_ps(xs[r * ld + 2 * p]), acc[r][b]);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) acc[r][b] = _mm512_fmadd_ps(wo, _mm512_set1_ps(xs[r * ld + 2 * p + 1]), acc[r][b]);
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
