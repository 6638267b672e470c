// BF16 kernels for AVX2 + FMA (Haswell .. Zen 3): as the AVX-512 fallback, on 256-bit
// vectors; one token row at a time (16 ymm registers hold one row's 64 outputs).
// Compiled with -mavx2 -mfma -mf16c.
#include <immintrin.h>

#include "gemm_bf16_driver.h"

namespace tandem {
namespace {

template <int MR>
struct Avx2Fixed {
  static void run(const bf16_t* a, int lda, const bf16_t* wp, int k, float* t, const PanelPrefetch& pf) {
    static_assert(MR == 1);
    __m256 acc[8];
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) acc[b] = _mm256_setzero_ps();
    const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    const __m256i* w = reinterpret_cast<const __m256i*>(wp);
    for (int p = 0; p < (k + 1) / 2; ++p) {
      pf(p);
      const uint32_t x = load_pair(a, 2 * p, k);
      const __m256 ae = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(x << 16)));
      const __m256 ao = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(x & 0xffff0000u)));
#pragma GCC unroll 8
      for (int b = 0; b < 8; ++b) {
        const __m256i v = _mm256_load_si256(w + 8 * p + b);
        acc[b] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), ae, acc[b]);
        acc[b] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, hi)), ao, acc[b]);
      }
    }
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) _mm256_store_ps(t + 8 * b, acc[b]);
    (void)lda;
  }
};

using Micro = RowDispatch<Avx2Fixed, 1>;

}  // namespace

void gemm_bf16_avx2(const PackedWeight& w, const GemmArgs& g) { gemm_driver<Micro>(w, g); }
void gate_up_bf16_avx2(const PackedWeight& w, const GateUpArgs& g) { gate_up_driver<Micro>(w, g); }
void silu_mul_avx2(const float* g, const float* u, float* h, int n) { silu_mul(g, u, h, n); }
void sigmoid_avx2(const float* x, float* out, int n) { sigmoid(x, out, n); }
void clamped_swiglu_avx2(const float* g, const float* u, float* h, int n, float alpha, float limit, float offset) {
  clamped_swiglu(g, u, h, n, alpha, limit, offset);
}

}  // namespace tandem
