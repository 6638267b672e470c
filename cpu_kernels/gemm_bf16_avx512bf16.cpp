// BF16 kernels with AVX512_BF16: vdpbf16ps multiplies a pair of bf16 values per fp32
// lane and adds both products into the accumulator, so one packed k-pair row of a
// panel (64 outputs x 2) is four instructions per token row.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16.
#include <immintrin.h>

#include "gemm_bf16_driver.h"

namespace tandem {
namespace {

inline __m512 dp(__m512 acc, __m512i a, __m512i w) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)w);
}

template <int MR>
struct DpFixed {
  static void run(const bf16_t* a, int lda, const bf16_t* wp, int k, float* t, const PanelPrefetch& pf) {
    // At few rows a single accumulator per output vector would be bound by the
    // instruction latency; two sets (even / odd k-pairs) keep the loads streaming.
    constexpr bool kTwoSets = MR <= 2;
    __m512 acc[MR][4], acc2[MR][4];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) acc[r][b] = acc2[r][b] = _mm512_setzero_ps();
    const int kp = k / 2;
    const __m512i* w = reinterpret_cast<const __m512i*>(wp);
    int p = 0;
    if constexpr (kTwoSets) {
      for (; p + 1 < kp; p += 2) {
        pf(p);
        pf(p + 1);
        const __m512i w0 = _mm512_load_si512(w + 4 * p), w1 = _mm512_load_si512(w + 4 * p + 1),
                      w2 = _mm512_load_si512(w + 4 * p + 2), w3 = _mm512_load_si512(w + 4 * p + 3);
        const __m512i v0 = _mm512_load_si512(w + 4 * p + 4), v1 = _mm512_load_si512(w + 4 * p + 5),
                      v2 = _mm512_load_si512(w + 4 * p + 6), v3 = _mm512_load_si512(w + 4 * p + 7);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const bf16_t* ar = a + static_cast<size_t>(r) * lda;
          uint32_t x0, x1;
          std::memcpy(&x0, ar + 2 * p, 4);
          std::memcpy(&x1, ar + 2 * p + 2, 4);
          const __m512i a0 = _mm512_set1_epi32(static_cast<int>(x0)), a1 = _mm512_set1_epi32(static_cast<int>(x1));
          acc[r][0] = dp(acc[r][0], a0, w0);
          acc[r][1] = dp(acc[r][1], a0, w1);
          acc[r][2] = dp(acc[r][2], a0, w2);
          acc[r][3] = dp(acc[r][3], a0, w3);
          acc2[r][0] = dp(acc2[r][0], a1, v0);
          acc2[r][1] = dp(acc2[r][1], a1, v1);
          acc2[r][2] = dp(acc2[r][2], a1, v2);
          acc2[r][3] = dp(acc2[r][3], a1, v3);
        }
      }
    }
    // Remaining full pairs, then the odd-k tail (its weight column is zero-padded).
    for (; p < (k + 1) / 2; ++p) {
      pf(p);
      const __m512i w0 = _mm512_load_si512(w + 4 * p), w1 = _mm512_load_si512(w + 4 * p + 1),
                    w2 = _mm512_load_si512(w + 4 * p + 2), w3 = _mm512_load_si512(w + 4 * p + 3);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512i a0 = _mm512_set1_epi32(static_cast<int>(load_pair(a + static_cast<size_t>(r) * lda, 2 * p, k)));
        acc[r][0] = dp(acc[r][0], a0, w0);
        acc[r][1] = dp(acc[r][1], a0, w1);
        acc[r][2] = dp(acc[r][2], a0, w2);
        acc[r][3] = dp(acc[r][3], a0, w3);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) {
        const __m512 s = kTwoSets ? _mm512_add_ps(acc[r][b], acc2[r][b]) : acc[r][b];
        _mm512_store_ps(t + r * kPanel + 16 * b, s);
      }
  }
};

using Micro = RowDispatch<DpFixed, 6>;

}  // namespace

void gemm_bf16_avx512bf16(const PackedWeight& w, const GemmArgs& g) { gemm_driver<Micro>(w, g); }
void gate_up_bf16_avx512bf16(const PackedWeight& w, const GateUpArgs& g) { gate_up_driver<Micro>(w, g); }
void silu_mul_avx512bf16(const float* g, const float* u, float* h, int n) { silu_mul(g, u, h, n); }
void sigmoid_avx512bf16(const float* x, float* out, int n) { sigmoid(x, out, n); }
void clamped_swiglu_avx512bf16(const float* g, const float* u, float* h, int n, float alpha, float limit, float offset) {
  clamped_swiglu(g, u, h, n, alpha, limit, offset);
}

}  // namespace tandem
