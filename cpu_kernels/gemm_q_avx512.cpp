// Integer kernels for AVX-512 without VNNI (Skylake-SP): the pre-VNNI sequence
// vpmaddubsw (u8 x s8 -> pairs summed in int16) + vpmaddwd by ones (-> int32).
// vpmaddubsw saturates, so the INT8 operands are arranged to stay in range: the
// activation's magnitude |q_a| <= 127 is the unsigned operand and the weight, made
// signed (q_w in [-127, 127]) and given the activation's sign, the signed one; a pair
// sums to at most 2 * 127 * 127 < 2^15. INT4 nibbles (<= 15) times q_a cannot saturate.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq.
#include <immintrin.h>

#include "gemm_q_driver.h"

namespace tandem {
namespace {

inline __m512i bcast(const int8_t* p) { return _mm512_set1_epi32(load_i32(p)); }

// Accumulator type without __m512i's may_alias attribute, so GCC keeps arrays of
// them in registers (see gemm_q_avx512vnni.cpp).
using acc_t = int __attribute__((vector_size(64)));
inline __m512i as_m512i(acc_t v) { return reinterpret_cast<__m512i>(v); }

// int32 lanes += the four u8 x s8 products of each lane (no saturation given the ranges above).
inline acc_t dot4(acc_t acc, __m512i u, __m512i s) {
  return reinterpret_cast<acc_t>(
      _mm512_add_epi32(as_m512i(acc), _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1))));
}

template <int MR>
struct Int8Avx512 {
  static void run(const QuantInput& in, int r0, const PackedWeight& w, const std::byte* panel, float* t) {
    acc_t acc[MR][4];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) acc[r][b] = acc_t{};
    const __m512i* wp = reinterpret_cast<const __m512i*>(panel);
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int i = 0; i < w.k_pad / 4; ++i) {
      __m512i ws[4];
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) ws[b] = _mm512_xor_si512(_mm512_load_si512(wp + 4 * i + b), flip);  // q + 128 -> q
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512i x = bcast(in.row(r0 + r) + 4 * i);
        const __m512i ax = _mm512_abs_epi8(x);
        const __mmask64 neg = _mm512_movepi8_mask(x);
#pragma GCC unroll 4
        for (int b = 0; b < 4; ++b)
          acc[r][b] = dot4(acc[r][b], ax, _mm512_mask_sub_epi8(ws[b], neg, _mm512_setzero_si512(), ws[b]));
      }
    }
    const float* scale = int8_scales(w, panel);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b)
        _mm512_store_ps(t + r * kPanel + 16 * b,
                        _mm512_mul_ps(_mm512_cvtepi32_ps(as_m512i(acc[r][b])), _mm512_loadu_ps(scale + 16 * b)));
  }
};

template <int MR>
struct Int4Avx512 {
  static void run(const QuantInput& in, int r0, const PackedWeight& w, const std::byte* panel, float* t) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) _mm512_store_ps(t + r * kPanel + 16 * b, _mm512_setzero_ps());
    for (int gi = 0; gi < in.groups; ++gi) {
      const std::byte* gb = int4_group(w, panel, gi);
      const __m512i* wp = reinterpret_cast<const __m512i*>(gb);
      acc_t acc[MR][4];
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int b = 0; b < 4; ++b) acc[r][b] = acc_t{};
      const int c0 = gi * w.group;
      for (int o = 0; o < w.group / 8; ++o) {
        __m512i lo[4], hi[4];
#pragma GCC unroll 4
        for (int b = 0; b < 4; ++b) {
          const __m512i v = _mm512_load_si512(wp + 4 * o + b);
          lo[b] = _mm512_and_si512(v, low4);
          hi[b] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const int8_t* a = in.row(r0 + r) + c0 + 8 * o;
          const __m512i x0 = bcast(a), x1 = bcast(a + 4);
#pragma GCC unroll 4
          for (int b = 0; b < 4; ++b) acc[r][b] = dot4(dot4(acc[r][b], lo[b], x0), hi[b], x1);
        }
      }
      const uint16_t* sc = int4_scales(w, gb);
      const uint8_t* zp = int4_zeros(w, gb);
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) {
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 16 * b)));
        const __m512i z = w.symmetric ? _mm512_set1_epi32(8)
                                      : _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(zp + 16 * b)));
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const __m512i corr = _mm512_mullo_epi32(z, _mm512_set1_epi32(in.sums[static_cast<size_t>(r0 + r) * in.groups + gi]));
          const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(as_m512i(acc[r][b]), corr));
          float* tr = t + r * kPanel + 16 * b;
          _mm512_store_ps(tr, _mm512_fmadd_ps(v, s, _mm512_load_ps(tr)));
        }
      }
    }
  }
};

using MicroInt8 = RowDispatch<Int8Avx512, 4>;
using MicroInt4 = RowDispatch<Int4Avx512, 3>;  // 4 rows spill: 16 accumulators + 8 unpacked

}  // namespace

void gemm_int8_avx512(const PackedWeight& w, const GemmArgs& g) { gemm_q_driver<MicroInt8>(w, g); }
void gate_up_int8_avx512(const PackedWeight& w, const GateUpArgs& g) { gate_up_q_driver<MicroInt8>(w, g); }
void gemm_int4_avx512(const PackedWeight& w, const GemmArgs& g) { gemm_q_driver<MicroInt4>(w, g); }
void gate_up_int4_avx512(const PackedWeight& w, const GateUpArgs& g) { gate_up_q_driver<MicroInt4>(w, g); }

void quantize_avx512(const bf16_t* a, const float* a_f32, int m, int k, int lda, int k_pad, int group, int8_t* q,
                  float* scale, int32_t* sums) {
  quantize_any(a, a_f32, m, k, lda, k_pad, group, q, scale, sums);
}

}  // namespace tandem
