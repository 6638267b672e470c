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
    if (w.e2m1)
      body<true>(in, r0, w, panel, t);
    else
      body<false>(in, r0, w, panel, t);
  }
  // E2m1: each nibble goes through the MXFP4 code table (one vpshufb) before its product.
  template <bool E2m1>
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
      acc_t acc[8];
#pragma GCC unroll 8
      for (int b = 0; b < 8; ++b) acc[b] = acc_t{};
      for (int o = 0; o < w.group / 8; ++o) {
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
      const __m256i sum = _mm256_set1_epi32(in.sums[static_cast<size_t>(r0) * in.groups + gi]);
#pragma GCC unroll 8
      for (int b = 0; b < 8; ++b) {
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 8 * b)));
        const __m256i z = w.symmetric ? _mm256_set1_epi32(w.fixed_zero())
                                      : _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(zp + 8 * b)));
        const __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(as_m256i(acc[b]), _mm256_mullo_epi32(z, sum)));
        _mm256_store_ps(t + 8 * b, _mm256_fmadd_ps(v, s, _mm256_load_ps(t + 8 * b)));
      }
    }
  }
};

}  // namespace
}  // namespace tandem
