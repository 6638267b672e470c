// BF16 kernels for AVX2 + FMA (Haswell .. Zen 3): as the AVX-512 fallback, on 256-bit
// vectors. Each 32-bit pair of the packed panel is split into two fp32 vectors (even k:
// shift left 16; odd k: mask the high half) and multiplied with FMA.
//
// Sixteen ymm registers. One row's 64 outputs take eight accumulators, so a single row
// streams the whole panel at once (decode, where the read is the bound). From two rows
// on, each row block does the panel in two halves of 32 outputs: 2 x 4 accumulators, the
// pair's two converted weight vectors and the rows' broadcast activations, read from an
// fp32 copy of the rows made once per call. A weight vector's conversion (two integer
// instructions) then serves four FMAs instead of two, and the panel is read once per two
// rows instead of once per row; at 8-512 rows that was 1.06-1.48x faster (bench/RESULTS.md).
// The sums are taken in the same order either way, so the bits do not depend on the rows.
// Compiled with -mavx2 -mfma -mf16c.
#include <immintrin.h>

#include "gemm_bf16_driver.h"

namespace tandem {
namespace {

template <int MR>
struct Avx2Fixed {
  static void run(const bf16_t* a, int lda, const bf16_t* wp, int k, float* t, const PanelPrefetch& pf) {
    if constexpr (MR == 1)
      one_row(a, wp, k, t, pf);
    else
      rows(a, lda, wp, k, t, pf);
  }

  static void one_row(const bf16_t* a, const bf16_t* wp, int k, float* t, const PanelPrefetch& pf) {
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
  }

  static void rows(const bf16_t* a, int lda, const bf16_t* wp, int k, float* t, const PanelPrefetch& pf) {
    const int pairs = (k + 1) / 2;
    // The rows as fp32 (row stride 2 * pairs, a zero after an odd k), so each FMA's
    // activation is one vbroadcastss.
    thread_local std::vector<float> buf;
    const size_t ld = static_cast<size_t>(pairs) * 2;
    buf.resize(ld * MR);
    float* const xs = buf.data();
    for (int r = 0; r < MR; ++r) {
      const bf16_t* ar = a + static_cast<size_t>(r) * lda;
      float* xr = xs + r * ld;
      int c = 0;
      for (; c + 8 <= k; c += 8) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ar + c));
        _mm256_storeu_ps(xr + c, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)));
      }
      for (; c < k; ++c) xr[c] = from_bf16(ar[c]);
      if (k & 1) xr[k] = 0.0f;
    }
    const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    const __m256i* w = reinterpret_cast<const __m256i*>(wp);
    for (int half = 0; half < 2; ++half) {
      __m256 acc[MR][4];
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int b = 0; b < 4; ++b) acc[r][b] = _mm256_setzero_ps();
      for (int p = 0; p < pairs; ++p) {
        if (half == 0) pf(p);
        __m256 ae[MR], ao[MR];
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          ae[r] = _mm256_broadcast_ss(xs + r * ld + 2 * p);
          ao[r] = _mm256_broadcast_ss(xs + r * ld + 2 * p + 1);
        }
#pragma GCC unroll 4
        for (int b = 0; b < 4; ++b) {
          const __m256i v = _mm256_load_si256(w + 8 * p + 4 * half + b);
          const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
          const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) acc[r][b] = _mm256_fmadd_ps(we, ae[r], acc[r][b]);
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) acc[r][b] = _mm256_fmadd_ps(wo, ao[r], acc[r][b]);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int b = 0; b < 4; ++b) _mm256_store_ps(t + r * kPanel + 32 * half + 8 * b, acc[r][b]);
    }
  }
};

using Micro = RowDispatch<Avx2Fixed, 2>;

}  // namespace

void gemm_bf16_avx2(const PackedWeight& w, const GemmArgs& g) { gemm_driver<Micro>(w, g); }
void gate_up_bf16_avx2(const PackedWeight& w, const GateUpArgs& g) { gate_up_driver<Micro>(w, g); }
void silu_mul_avx2(const float* g, const float* u, float* h, int n) { silu_mul(g, u, h, n); }
void sigmoid_avx2(const float* x, float* out, int n) { sigmoid(x, out, n); }
void clamped_swiglu_avx2(const float* g, const float* u, float* h, int n, float alpha, float limit, float offset) {
  clamped_swiglu(g, u, h, n, alpha, limit, offset);
}

}  // namespace tandem
