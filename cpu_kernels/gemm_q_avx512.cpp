// Integer kernels for AVX-512 without VNNI (Skylake-SP): the pre-VNNI sequence
// vpmaddubsw (u8 x s8 -> pairs summed in int16) + vpmaddwd by ones (-> int32).
// vpmaddubsw saturates, so the INT8 operands are arranged to stay in range: the
// activation's magnitude |q_a| <= 127 is the unsigned operand and the weight, made
// signed (q_w in [-127, 127]) and given the activation's sign, the signed one; a pair
// sums to at most 2 * 127 * 127 < 2^15. INT4 nibbles (<= 15) times q_a cannot saturate.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq.
#include "gemm_q_zmm.h"

namespace tandem {
namespace {

// int32 lanes += the four u8 x s8 products of each lane (no saturation given the ranges above).
inline acc_t dot4(acc_t acc, __m512i u, __m512i s) {
  return reinterpret_cast<acc_t>(
      _mm512_add_epi32(as_m512i(acc), _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1))));
}
struct MaddDot {
  static acc_t apply(acc_t acc, __m512i u, __m512i s) { return dot4(acc, u, s); }
};
template <int MR>
using Int4Avx512 = Int4Zmm<MaddDot, MR>;

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
      prefetch_ahead(wp + 4 * i);
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
