// Internal: pieces shared by the 512-bit integer kernels (gemm_q_avx512.cpp and
// gemm_q_avx512vnni.cpp); include only from files compiled with AVX-512 flags.
// Internal linkage, like the drivers: each file keeps its own copy under its own flags.
//
// The INT4 micro-kernel is the same in both but for how four u8 x s8 products are
// added into an int32 lane (vpdpbusd, or vpmaddubsw + vpmaddwd before VNNI), which the
// file passes in as Dot::apply.
#pragma once

#include <immintrin.h>

#include "gemm_q_driver.h"

namespace tandem {
namespace {

inline __m512i bcast(const int8_t* p) { return _mm512_set1_epi32(load_i32(p)); }

// Accumulators are kept in a vector type without __m512i's may_alias attribute: with
// it, GCC 12 keeps arrays of them in memory and stores every accumulator on every
// iteration (a third of the peak); without it they stay in registers.
using acc_t = int __attribute__((vector_size(64)));
inline __m512i as_m512i(acc_t v) { return reinterpret_cast<__m512i>(v); }

template <class Dot, int MR>
struct Int4Zmm {
  static void run(const QuantInput& in, int r0, const PackedWeight& w, const std::byte* panel, float* t) {
    if (w.e2m1 && w.symmetric)
      body<true, true>(in, r0, w, panel, t);
    else if (w.e2m1)
      body<true, false>(in, r0, w, panel, t);
    else if (w.symmetric)
      body<false, true>(in, r0, w, panel, t);
    else
      body<false, false>(in, r0, w, panel, t);
  }
  // E2m1: each nibble goes through the MXFP4 code table (one vpshufb) before its product.
  // Symmetric: one zero point for every column, so a row's correction zero * sum(q_a) is
  // one number per group, and the group's accumulators start from minus it (the epilogue
  // then only converts and scales). The integer sums are the same either way.
  template <bool E2m1, bool Symmetric>
  static void body(const QuantInput& in, int r0, const PackedWeight& w, const std::byte* panel, float* t) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2m1Lut)));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) _mm512_store_ps(t + r * kPanel + 16 * b, _mm512_setzero_ps());
    for (int gi = 0; gi < in.groups; ++gi) {
      const std::byte* gb = int4_group(w, panel, gi);
      const __m512i* wp = reinterpret_cast<const __m512i*>(gb);
      prefetch_group_tail(w, gb);
      acc_t acc[MR][4];
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const int start = Symmetric ? -w.fixed_zero() * in.sums[static_cast<size_t>(r0 + r) * in.groups + gi] : 0;
#pragma GCC unroll 4
        for (int b = 0; b < 4; ++b) acc[r][b] = acc_t{} + start;
      }
      const int c0 = gi * w.group;
      for (int o = 0; o < w.group / 8; ++o) {
        prefetch_ahead(wp + 4 * o);
        __m512i lo[4], hi[4];
#pragma GCC unroll 4
        for (int b = 0; b < 4; ++b) {
          const __m512i v = _mm512_load_si512(wp + 4 * o + b);
          lo[b] = _mm512_and_si512(v, low4);
          hi[b] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          if constexpr (E2m1) {
            lo[b] = _mm512_shuffle_epi8(lut, lo[b]);
            hi[b] = _mm512_shuffle_epi8(lut, hi[b]);
          }
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const int8_t* a = in.row(r0 + r) + c0 + 8 * o;
          const __m512i x0 = bcast(a), x1 = bcast(a + 4);
#pragma GCC unroll 4
          for (int b = 0; b < 4; ++b) acc[r][b] = Dot::apply(Dot::apply(acc[r][b], lo[b], x0), hi[b], x1);
        }
      }
      const uint16_t* sc = int4_scales(w, gb);
      const uint8_t* zp = int4_zeros(w, gb);
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) {
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 16 * b)));
        const __m512i z = Symmetric ? __m512i{} : _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(zp + 16 * b)));
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          __m512i d = as_m512i(acc[r][b]);
          if constexpr (!Symmetric)
            d = _mm512_sub_epi32(d, _mm512_mullo_epi32(z, _mm512_set1_epi32(in.sums[static_cast<size_t>(r0 + r) * in.groups + gi])));
          float* tr = t + r * kPanel + 16 * b;
          _mm512_store_ps(tr, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, _mm512_load_ps(tr)));
        }
      }
    }
  }
};

}  // namespace
}  // namespace tandem
