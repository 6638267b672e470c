// Integer kernels for AVX2 CPUs with AVX-VNNI (Alder Lake and later desktops, Sapphire
// Rapids, Zen 5): the VEX-encoded vpdpbusd on 256-bit vectors does in one instruction
// what gemm_q_avx2.cpp needs vpmaddubsw + vpmaddwd + vpaddd (and, for INT8, the sign
// trick) for. The arithmetic is that of gemm_q_avx512vnni.cpp on half the width: INT8
// weights are the unsigned operand as stored (q + 128) and the dot product is corrected
// by 128 * sum(q_a); INT4 nibbles are unsigned already and corrected by zero * sum(q_a)
// per group. The integer sums are exact, and the fp32 steps after them are those of
// gemm_q_avx2.cpp in the same order, so both give the same bits.
//
// One token row at a time, as in gemm_q_avx2.cpp: a row's 64 outputs are eight ymm
// accumulators, and the panel streams through once per row (decode-sized m is bound by
// that stream; a second row would need eight more of the sixteen ymm registers).
// Compiled with -mavx2 -mfma -mf16c -mavxvnni, without AVX-512, so the compiler emits
// the VEX form (_mm256_dpbusd_avx_epi32), which CPUs without AVX512_VNNI decode.
#include <immintrin.h>

#include "gemm_q_driver.h"

namespace tandem {
namespace {

inline __m256i bcast(const int8_t* p) { return _mm256_set1_epi32(load_i32(p)); }

// Accumulator type without __m256i's may_alias attribute, so GCC keeps arrays of
// them in registers (see gemm_q_avx512vnni.cpp).
using acc_t = int __attribute__((vector_size(32)));
inline __m256i as_m256i(acc_t v) { return reinterpret_cast<__m256i>(v); }

// int32 lanes += the four u8 x s8 products of each lane.
inline acc_t dpbusd(acc_t acc, __m256i u, __m256i s) {
  return reinterpret_cast<acc_t>(_mm256_dpbusd_avx_epi32(as_m256i(acc), u, s));
}

template <int MR>
struct Int8AvxVnni {
  static_assert(MR == 1);
  static void run(const QuantInput& in, int r0, const PackedWeight& w, const std::byte* panel, float* t) {
    acc_t acc[8];
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) acc[b] = acc_t{};
    const __m256i* wp = reinterpret_cast<const __m256i*>(panel);
    const int8_t* a = in.row(r0);
    for (int i = 0; i < w.k_pad / 4; ++i) {
      const __m256i x = bcast(a + 4 * i);
#pragma GCC unroll 8
      for (int b = 0; b < 8; ++b) acc[b] = dpbusd(acc[b], _mm256_load_si256(wp + 8 * i + b), x);
    }
    const float* scale = int8_scales(w, panel);
    const __m256i corr = _mm256_set1_epi32(128 * in.sums[r0]);
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) {
      const __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(as_m256i(acc[b]), corr));
      _mm256_store_ps(t + 8 * b, _mm256_mul_ps(v, _mm256_loadu_ps(scale + 8 * b)));
    }
  }
};

template <int MR>
struct Int4AvxVnni {
  static_assert(MR == 1);
  static void run(const QuantInput& in, int r0, const PackedWeight& w, const std::byte* panel, float* t) {
    // As in gemm_q_avx2.cpp, the fp32 sums live in t (L1) between groups.
    const __m256i low4 = _mm256_set1_epi8(0x0f);
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) _mm256_store_ps(t + 8 * b, _mm256_setzero_ps());
    for (int gi = 0; gi < in.groups; ++gi) {
      const std::byte* gb = int4_group(w, panel, gi);
      const __m256i* wp = reinterpret_cast<const __m256i*>(gb);
      const int8_t* a = in.row(r0) + gi * w.group;
      acc_t acc[8];
#pragma GCC unroll 8
      for (int b = 0; b < 8; ++b) acc[b] = acc_t{};
      for (int o = 0; o < w.group / 8; ++o) {
        const __m256i x0 = bcast(a + 8 * o), x1 = bcast(a + 8 * o + 4);
#pragma GCC unroll 8
        for (int b = 0; b < 8; ++b) {
          const __m256i v = _mm256_load_si256(wp + 8 * o + b);
          acc[b] = dpbusd(acc[b], _mm256_and_si256(v, low4), x0);
          acc[b] = dpbusd(acc[b], _mm256_and_si256(_mm256_srli_epi16(v, 4), low4), x1);
        }
      }
      const uint16_t* sc = int4_scales(w, gb);
      const uint8_t* zp = int4_zeros(w, gb);
      const __m256i sum = _mm256_set1_epi32(in.sums[static_cast<size_t>(r0) * in.groups + gi]);
#pragma GCC unroll 8
      for (int b = 0; b < 8; ++b) {
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 8 * b)));
        const __m256i z = w.symmetric ? _mm256_set1_epi32(8)
                                      : _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(zp + 8 * b)));
        const __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(as_m256i(acc[b]), _mm256_mullo_epi32(z, sum)));
        _mm256_store_ps(t + 8 * b, _mm256_fmadd_ps(v, s, _mm256_load_ps(t + 8 * b)));
      }
    }
  }
};

using MicroInt8 = RowDispatch<Int8AvxVnni, 1>;
using MicroInt4 = RowDispatch<Int4AvxVnni, 1>;

}  // namespace

void gemm_int8_avxvnni(const PackedWeight& w, const GemmArgs& g) { gemm_q_driver<MicroInt8>(w, g); }
void gate_up_int8_avxvnni(const PackedWeight& w, const GateUpArgs& g) { gate_up_q_driver<MicroInt8>(w, g); }
void gemm_int4_avxvnni(const PackedWeight& w, const GemmArgs& g) { gemm_q_driver<MicroInt4>(w, g); }
void gate_up_int4_avxvnni(const PackedWeight& w, const GateUpArgs& g) { gate_up_q_driver<MicroInt4>(w, g); }

void quantize_avxvnni(const bf16_t* a, const float* a_f32, int m, int k, int lda, int k_pad, int group, int8_t* q,
                      float* scale, int32_t* sums) {
  quantize_any(a, a_f32, m, k, lda, k_pad, group, q, scale, sums);
}

}  // namespace tandem
