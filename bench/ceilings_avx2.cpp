// The 256-bit peak loops behind bench/ceilings.h (the AVX2 and AVX-VNNI kernel variants'
// ceilings). Compiled with -mavx2 -mfma; the VEX vpdpbusd is inline asm, so it needs no
// -mavxvnni; callers check cpu_features() first.
#include <immintrin.h>

namespace tandem::bench {

#define TANDEM_FMA5(b0, b1, b2, b3, b4)                                                              \
  __asm__ volatile("vfmadd231ps %[y], %[x], %[a0]\n\tvfmadd231ps %[y], %[x], %[a1]\n\t"            \
                   "vfmadd231ps %[y], %[x], %[a2]\n\tvfmadd231ps %[y], %[x], %[a3]\n\t"            \
                   "vfmadd231ps %[y], %[x], %[a4]\n\t"                                             \
                   : [a0] "+x"(b0), [a1] "+x"(b1), [a2] "+x"(b2), [a3] "+x"(b3), [a4] "+x"(b4)     \
                   : [x] "x"(x), [y] "x"(y))

// 10 vfmadd231ps ymm per iteration on independent accumulators: enough to cover a 4-5
// cycle latency at two per cycle, and with x and y within AVX2's 16 registers (plain
// locals, not an array, so nothing is spilled; see ceilings_avx512.cpp).
double fma_f32_ymm_loop(long iters) {
  const __m256 x = _mm256_set1_ps(1.0000001f), y = _mm256_set1_ps(0.9999999f);
  __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0, c9 = c0;
  for (long i = 0; i < iters; ++i) {
    TANDEM_FMA5(c0, c1, c2, c3, c4);
    TANDEM_FMA5(c5, c6, c7, c8, c9);
  }
  const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)),
                                 _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c4, c5), _mm256_add_ps(c6, c7)),
                                               _mm256_add_ps(c8, c9)));
  float out[8];
  _mm256_storeu_ps(out, s);
  double r = 0;
  for (float f : out) r += f;
  return r;
}
#undef TANDEM_FMA5

// 10 {vex} vpdpbusd ymm per iteration on independent accumulators, as the FMA loop above
// (the same latency and ports on Alder Lake); {vex}: the VEX form the avx_vnni kernels run.
double dpbusd_ymm_loop(long iters) {
  const __m256i x = _mm256_set1_epi8(3), y = _mm256_set1_epi8(-2);
  __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0, c9 = c0;
// %{vex%}: GCC's asm template spelling of the {vex} pseudo-prefix.
#define TANDEM_DP5(b0, b1, b2, b3, b4)                                                             \
  __asm__ volatile("%{vex%} vpdpbusd %[y], %[x], %[a0]\n\t%{vex%} vpdpbusd %[y], %[x], %[a1]\n\t" \
                   "%{vex%} vpdpbusd %[y], %[x], %[a2]\n\t%{vex%} vpdpbusd %[y], %[x], %[a3]\n\t" \
                   "%{vex%} vpdpbusd %[y], %[x], %[a4]\n\t"                                        \
                   : [a0] "+x"(b0), [a1] "+x"(b1), [a2] "+x"(b2), [a3] "+x"(b3), [a4] "+x"(b4)    \
                   : [x] "x"(x), [y] "x"(y))
  for (long i = 0; i < iters; ++i) {
    TANDEM_DP5(c0, c1, c2, c3, c4);
    TANDEM_DP5(c5, c6, c7, c8, c9);
  }
#undef TANDEM_DP5
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
                                     _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c4, c5), _mm256_add_epi32(c6, c7)),
                                                      _mm256_add_epi32(c8, c9)));
  int out[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), s);
  double r = 0;
  for (int v : out) r += v;
  return r;
}

// 8 independent (vpmaddubsw, vpmaddwd by ones, vpaddd) sequences per iteration: the
// pre-VNNI u8 x s8 dot product the AVX2 integer kernels run (32 multiply-adds each).
double maddubs_ymm_loop(long iters) {
  const __m256i x = _mm256_set1_epi8(3), y = _mm256_set1_epi8(-2), one = _mm256_set1_epi16(1);
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  __m256i t0, t1, t2, t3;
  for (long i = 0; i < iters; ++i) {
#define TANDEM_SEQ4(b0, b1, b2, b3)                                                                            \
  __asm__ volatile(                                                                                            \
      "vpmaddubsw %[y], %[x], %[t0]\n\tvpmaddubsw %[y], %[x], %[t1]\n\t"                                       \
      "vpmaddubsw %[y], %[x], %[t2]\n\tvpmaddubsw %[y], %[x], %[t3]\n\t"                                       \
      "vpmaddwd %[one], %[t0], %[t0]\n\tvpmaddwd %[one], %[t1], %[t1]\n\t"                                     \
      "vpmaddwd %[one], %[t2], %[t2]\n\tvpmaddwd %[one], %[t3], %[t3]\n\t"                                     \
      "vpaddd %[t0], %[a0], %[a0]\n\tvpaddd %[t1], %[a1], %[a1]\n\t"                                           \
      "vpaddd %[t2], %[a2], %[a2]\n\tvpaddd %[t3], %[a3], %[a3]\n\t"                                           \
      : [a0] "+x"(b0), [a1] "+x"(b1), [a2] "+x"(b2), [a3] "+x"(b3), [t0] "=&x"(t0), [t1] "=&x"(t1),            \
        [t2] "=&x"(t2), [t3] "=&x"(t3)                                                                         \
      : [x] "x"(x), [y] "x"(y), [one] "x"(one))
    TANDEM_SEQ4(a0, a1, a2, a3);
    TANDEM_SEQ4(a4, a5, a6, a7);
#undef TANDEM_SEQ4
  }
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)),
                                     _mm256_add_epi32(_mm256_add_epi32(a4, a5), _mm256_add_epi32(a6, a7)));
  int out[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), s);
  double r = 0;
  for (int v : out) r += v;
  return r;
}

}  // namespace tandem::bench
