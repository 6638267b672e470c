// Integer kernels for AVX2 (Haswell .. Zen 3): vpmaddubsw + vpmaddwd on 256-bit
// vectors, with the INT8 sign trick of the AVX-512 fallback (vpsignb gives the weight
// the activation's sign; |q_a| is the unsigned operand; no pair can saturate). One
// token row at a time: a row's 64 outputs are eight ymm accumulators.
// Compiled with -mavx2 -mfma -mf16c.
#include "gemm_q_ymm.h"

namespace tandem {
namespace {

inline acc_t dot4(acc_t acc, __m256i u, __m256i s) {
  return reinterpret_cast<acc_t>(
      _mm256_add_epi32(as_m256i(acc), _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))));
}
struct Avx2Dot {
  static constexpr bool kPairs16 = true;
  static acc_t apply(acc_t acc, __m256i u, __m256i s) { return dot4(acc, u, s); }
  // acc += the int16 pair sums in p, added in twos into the int32 lanes.
  static acc_t widen(acc_t acc, __m256i p) {
    return reinterpret_cast<acc_t>(_mm256_add_epi32(as_m256i(acc), _mm256_madd_epi16(p, _mm256_set1_epi16(1))));
  }
};

template <int MR>
struct Int8Avx2 {
  static_assert(MR == 1);
  static void run(const QuantInput& in, int r0, const PackedWeight& w, const std::byte* panel, float* t) {
    acc_t acc[8];
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b) acc[b] = acc_t{};
    const __m256i* wp = reinterpret_cast<const __m256i*>(panel);
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    const int8_t* a = in.row(r0);
    for (int i = 0; i < w.k_pad / 4; ++i) {
      prefetch_ahead(wp + 8 * i);
      const __m256i x = bcast(a + 4 * i);
      const __m256i ax = _mm256_abs_epi8(x);
#pragma GCC unroll 8
      for (int b = 0; b < 8; ++b) {
        const __m256i ws = _mm256_xor_si256(_mm256_load_si256(wp + 8 * i + b), flip);
        acc[b] = dot4(acc[b], ax, _mm256_sign_epi8(ws, x));
      }
    }
    const float* scale = int8_scales(w, panel);
#pragma GCC unroll 8
    for (int b = 0; b < 8; ++b)
      _mm256_store_ps(t + 8 * b, _mm256_mul_ps(_mm256_cvtepi32_ps(as_m256i(acc[b])), _mm256_loadu_ps(scale + 8 * b)));
  }
};

using MicroInt8 = RowDispatch<Int8Avx2, 1>;
template <int MR>
using Int4Avx2 = Int4Ymm<Avx2Dot, MR>;
using MicroInt4 = RowDispatch<Int4Avx2, 1>;

}  // namespace

void gemm_int8_avx2(const PackedWeight& w, const GemmArgs& g) { gemm_q_driver<MicroInt8>(w, g); }
void gate_up_int8_avx2(const PackedWeight& w, const GateUpArgs& g) { gate_up_q_driver<MicroInt8>(w, g); }
void gemm_int4_avx2(const PackedWeight& w, const GemmArgs& g) { gemm_q_driver<MicroInt4>(w, g); }
void gate_up_int4_avx2(const PackedWeight& w, const GateUpArgs& g) { gate_up_q_driver<MicroInt4>(w, g); }

void quantize_avx2(const bf16_t* a, const float* a_f32, int m, int k, int lda, int k_pad, int group, int8_t* q,
                  float* scale, int32_t* sums) {
  quantize_any(a, a_f32, m, k, lda, k_pad, group, q, scale, sums);
}

}  // namespace tandem
