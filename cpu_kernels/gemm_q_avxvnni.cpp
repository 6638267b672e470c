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
#include "gemm_q_ymm.h"

namespace tandem {
namespace {

// int32 lanes += the four u8 x s8 products of each lane.
inline acc_t dpbusd(acc_t acc, __m256i u, __m256i s) {
  return reinterpret_cast<acc_t>(_mm256_dpbusd_avx_epi32(as_m256i(acc), u, s));
}
struct AvxVnniDot {
  static constexpr bool kPairs16 = false;  // gemm_q_ymm.h's int16 pair sums: vpdpbusd needs none
  static acc_t apply(acc_t acc, __m256i u, __m256i s) { return dpbusd(acc, u, s); }
};

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
      prefetch_ahead(wp + 8 * i);
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

using MicroInt8 = RowDispatch<Int8AvxVnni, 1>;
template <int MR>
using Int4AvxVnni = Int4Ymm<AvxVnniDot, MR>;
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
