// The wide loops behind bench/ceilings.h. Compiled with -mavx512f -mavx512bw
// -mavx512vnni -mavx512bf16; callers check cpu_features() first.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace tandem::bench {

uint64_t read_slice_avx512(const void* p, size_t bytes) {
  const auto* q = static_cast<const __m512i*>(p);
  __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
  const size_t n = bytes / 64;
  for (size_t i = 0; i + 4 <= n; i += 4) {
    a = _mm512_xor_si512(a, _mm512_load_si512(q + i));
    b = _mm512_xor_si512(b, _mm512_load_si512(q + i + 1));
    c = _mm512_xor_si512(c, _mm512_load_si512(q + i + 2));
    d = _mm512_xor_si512(d, _mm512_load_si512(q + i + 3));
  }
  a = _mm512_xor_si512(_mm512_xor_si512(a, b), _mm512_xor_si512(c, d));
  return static_cast<uint64_t>(_mm512_reduce_add_epi64(a));
}

// 16 independent accumulators: enough to cover a 4-6 cycle latency at two
// instructions per cycle. Written as one asm block per iteration so the compiler
// can neither fold the loop nor spill the accumulators to the stack.
// Plain locals, not an array: an array makes the compiler store every accumulator
// back to the stack each iteration, and the stores then bound the loop.
#define TANDEM_ACC8(insn, b0, b1, b2, b3, b4, b5, b6, b7)                                    \
  __asm__ volatile(insn " %[y], %[x], %[a0]\n\t" insn " %[y], %[x], %[a1]\n\t"                \
                   insn " %[y], %[x], %[a2]\n\t" insn " %[y], %[x], %[a3]\n\t"                \
                   insn " %[y], %[x], %[a4]\n\t" insn " %[y], %[x], %[a5]\n\t"                \
                   insn " %[y], %[x], %[a6]\n\t" insn " %[y], %[x], %[a7]\n\t"                \
                   : [a0] "+v"(b0), [a1] "+v"(b1), [a2] "+v"(b2), [a3] "+v"(b3),              \
                     [a4] "+v"(b4), [a5] "+v"(b5), [a6] "+v"(b6), [a7] "+v"(b7)               \
                   : [x] "v"(x), [y] "v"(y))
// asm allows 30 operands and "+v" counts twice, so 16 accumulators take two statements.
#define TANDEM_PEAK_BODY(V, zero, insn)                                                       \
  V c0 = zero, c1 = zero, c2 = zero, c3 = zero, c4 = zero, c5 = zero, c6 = zero, c7 = zero;   \
  V c8 = zero, c9 = zero, c10 = zero, c11 = zero, c12 = zero, c13 = zero, c14 = zero,         \
    c15 = zero;                                                                               \
  for (long i = 0; i < iters; ++i) {                                                          \
    TANDEM_ACC8(insn, c0, c1, c2, c3, c4, c5, c6, c7);                                        \
    TANDEM_ACC8(insn, c8, c9, c10, c11, c12, c13, c14, c15);                                  \
  }                                                                                           \
  const V all[16] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15};   \
  return sum_lanes(all)

namespace {
template <typename V>
double sum_lanes(const V (&a)[16]) {
  float out[16 * 16];
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + 16 * i, (__m512i)a[i]);
  double s = 0;
  for (float f : out) s += f;
  return s;
}
}  // namespace

double fma_f32_loop(long iters) {
  const __m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(0.9999999f);
  TANDEM_PEAK_BODY(__m512, _mm512_setzero_ps(), "vfmadd231ps");
}

double dpbf16_loop(long iters) {
  const __m512i x = _mm512_set1_epi16(0x3f80), y = _mm512_set1_epi16(0x3f81);
  TANDEM_PEAK_BODY(__m512, _mm512_setzero_ps(), "vdpbf16ps");
}

double dpbusd_loop(long iters) {
  const __m512i x = _mm512_set1_epi8(3), y = _mm512_set1_epi8(-2);
  TANDEM_PEAK_BODY(__m512i, _mm512_setzero_si512(), "vpdpbusd");
}

// 8 independent (vpmaddubsw, vpmaddwd by ones, vpaddd) sequences per iteration: the
// pre-VNNI u8 x s8 dot product of the AVX-512 integer kernels (64 multiply-adds each).
double maddubs_zmm_loop(long iters) {
  const __m512i x = _mm512_set1_epi8(3), y = _mm512_set1_epi8(-2), one = _mm512_set1_epi16(1);
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  __m512i t0, t1, t2, t3;
  for (long i = 0; i < iters; ++i) {
#define TANDEM_SEQ4(b0, b1, b2, b3)                                                                  \
  __asm__ volatile("vpmaddubsw %[y], %[x], %[t0]\n\tvpmaddubsw %[y], %[x], %[t1]\n\t"             \
                   "vpmaddubsw %[y], %[x], %[t2]\n\tvpmaddubsw %[y], %[x], %[t3]\n\t"             \
                   "vpmaddwd %[one], %[t0], %[t0]\n\tvpmaddwd %[one], %[t1], %[t1]\n\t"           \
                   "vpmaddwd %[one], %[t2], %[t2]\n\tvpmaddwd %[one], %[t3], %[t3]\n\t"           \
                   "vpaddd %[t0], %[a0], %[a0]\n\tvpaddd %[t1], %[a1], %[a1]\n\t"                 \
                   "vpaddd %[t2], %[a2], %[a2]\n\tvpaddd %[t3], %[a3], %[a3]\n\t"                 \
                   : [a0] "+v"(b0), [a1] "+v"(b1), [a2] "+v"(b2), [a3] "+v"(b3), [t0] "=&v"(t0),  \
                     [t1] "=&v"(t1), [t2] "=&v"(t2), [t3] "=&v"(t3)                               \
                   : [x] "v"(x), [y] "v"(y), [one] "v"(one))
    TANDEM_SEQ4(a0, a1, a2, a3);
    TANDEM_SEQ4(a4, a5, a6, a7);
#undef TANDEM_SEQ4
  }
  const __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                                     _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
  return static_cast<double>(_mm512_reduce_add_epi32(s));
}

}  // namespace tandem::bench
