// Internal: pieces shared by the 256-bit integer kernels (gemm_q_avx2.cpp and
// gemm_q_avxvnni.cpp); include only from files compiled with AVX2 flags. Internal
// linkage, like the drivers: each file keeps its own copy under its own flags.
//
// The INT4 micro-kernel is the same in both but for how four u8 x s8 products are added
// into an int32 lane (vpmaddubsw + vpmaddwd on AVX2, the VEX vpdpbusd with AVX-VNNI),
// which the file passes in as Dot::apply. The integer sums are exact either way, so both
// give the same bits.
#pragma once

#include <immintrin.h>

#include "gemm_q_driver.h"

namespace tandem {
namespace {

inline __m256i bcast(const int8_t* p) { return _mm256_set1_epi32(load_i32(p)); }

// Accumulator type without __m256i's may_alias attribute, so GCC keeps arrays of
// them in registers (see gemm_q_zmm.h).
using acc_t = int __attribute__((vector_size(32)));
inline __m256i as_m256i(acc_t v) { return reinterpret_cast<__m256i>(v); }

// One token row at a time: a row's 64 outputs are eight ymm accumulators (a second row
// would need eight more of the sixteen ymm registers).
template <class Dot, int MR>
struct Int4Ymm {
  static_assert(MR == 1);
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
  // Symmetric: the group's accumulators start from -zero * sum(q_a) (gemm_q_zmm.h).
  // Dot::kPairs16 (vpmaddubsw): the u8 x s8 pair sums of two k-steps (four vpmaddubsw,
  // each pair at most 2 * 24 * 127 in magnitude, so four sum to at most 24384) are added
  // in int16 and widened once (vpmaddwd by ones + vpaddd), instead of once per vpmaddubsw.
  template <bool E2m1, bool Symmetric>
  static void body(const QuantInput& in, int r0, const PackedWeight& w, const std::byte* panel, float* t) {
    // The fp32 sums live in t (L1) between groups: 16 ymm cannot hold them and the
    // integer accumulators at once.
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2m1Lut)));
    auto decode = [&](__m256i q) { return E2m1 ? _mm256_shuffle_epi8(lut, q) : q; };
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) _mm256_store_ps(t + 8 * b, _mm256_setzero_ps());
    for (int gi = 0; gi < in.groups; ++gi) {
      const std::byte* gb = int4_group(w, panel, gi);
      const __m256i* wp = reinterpret_cast<const __m256i*>(gb);
      prefetch_group_tail(w, gb);
      const int8_t* a = in.row(r0) + gi * w.group;
      const int start = Symmetric ? -w.fixed_zero() * in.sums[static_cast<size_t>(r0) * in.groups + gi] : 0;
      acc_t acc[8];
#pragma GCC unroll 8
      for (int b = 0; b < 8; ++b) acc[b] = acc_t{} + start;
      const int steps = w.group / 8;
      int o = 0;
      if constexpr (Dot::kPairs16) {
        for (; o + 2 <= steps; o += 2) {
          prefetch_ahead(wp + 8 * o);
          prefetch_ahead(wp + 8 * o + 8);
          const __m256i x0 = bcast(a + 8 * o), x1 = bcast(a + 8 * o + 4), x2 = bcast(a + 8 * o + 8),
                        x3 = bcast(a + 8 * o + 12);
#pragma GCC unroll 8
          for (int b = 0; b < 8; ++b) {
            const __m256i v = _mm256_load_si256(wp + 8 * o + b), u = _mm256_load_si256(wp + 8 * o + 8 + b);
            const __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(decode(_mm256_and_si256(v, low4)), x0),
                                                _mm256_maddubs_epi16(decode(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4)), x1));
            const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(decode(_mm256_and_si256(u, low4)), x2),
                                                _mm256_maddubs_epi16(decode(_mm256_and_si256(_mm256_srli_epi16(u, 4), low4)), x3));
            acc[b] = Dot::widen(acc[b], _mm256_add_epi16(s0, s1));
          }
        }
      }
      for (; o < steps; ++o) {
        prefetch_ahead(wp + 8 * o);
        const __m256i x0 = bcast(a + 8 * o), x1 = bcast(a + 8 * o + 4);
#pragma GCC unroll 8
        for (int b = 0; b < 8; ++b) {
          const __m256i v = _mm256_load_si256(wp + 8 * o + b);
          acc[b] = Dot::apply(acc[b], decode(_mm256_and_si256(v, low4)), x0);
          acc[b] = Dot::apply(acc[b], decode(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4)), x1);
        }
      }
      const uint16_t* sc = int4_scales(w, gb);
      const uint8_t* zp = int4_zeros(w, gb);
#pragma GCC unroll 8
      for (int b = 0; b < 8; ++b) {
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 8 * b)));
        __m256i d = as_m256i(acc[b]);
        if constexpr (!Symmetric)
          d = _mm256_sub_epi32(d, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(zp + 8 * b))),
                                                     _mm256_set1_epi32(in.sums[static_cast<size_t>(r0) * in.groups + gi])));
        _mm256_store_ps(t + 8 * b, _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, _mm256_load_ps(t + 8 * b)));
      }
    }
  }
};

}  // namespace
}  // namespace tandem
