// Integer kernels with AVX512_VNNI: vpdpbusd multiplies four unsigned weight bytes by
// four signed activation bytes per int32 lane and adds the sum into the lane, so one
// packed k-quad row of a panel (64 outputs x 4 bytes) is four instructions per token.
// INT8 weights are stored as q + 128 (unsigned), so the dot product is corrected by
// 128 * sum(q_a); INT4 nibbles are unsigned already and corrected by zero * sum(q_a)
// per group. Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni.
#include "gemm_q_zmm.h"

namespace tandem {
namespace {

inline acc_t dpbusd(acc_t acc, __m512i u, __m512i s) {
  return reinterpret_cast<acc_t>(_mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc), u, s));
}
struct VnniDot {
  static acc_t apply(acc_t acc, __m512i u, __m512i s) { return dpbusd(acc, u, s); }
};
template <int MR>
using Int4Vnni = Int4Zmm<VnniDot, MR>;

template <int MR>
struct Int8Vnni {
  static void run(const QuantInput& in, int r0, const PackedWeight& w, const std::byte* panel, float* t) {
    acc_t acc[MR][4];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) acc[r][b] = acc_t{};
    const __m512i* wp = reinterpret_cast<const __m512i*>(panel);
    const int8_t* a[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) a[r] = in.row(r0 + r);
    for (int i = 0; i < w.k_pad / 4; ++i) {
      prefetch_ahead(wp + 4 * i);
      const __m512i w0 = _mm512_load_si512(wp + 4 * i), w1 = _mm512_load_si512(wp + 4 * i + 1),
                    w2 = _mm512_load_si512(wp + 4 * i + 2), w3 = _mm512_load_si512(wp + 4 * i + 3);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512i x = bcast(a[r] + 4 * i);
        acc[r][0] = dpbusd(acc[r][0], w0, x);
        acc[r][1] = dpbusd(acc[r][1], w1, x);
        acc[r][2] = dpbusd(acc[r][2], w2, x);
        acc[r][3] = dpbusd(acc[r][3], w3, x);
      }
    }
    const float* scale = int8_scales(w, panel);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512i corr = _mm512_set1_epi32(128 * in.sums[r0 + r]);
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) {
        const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(as_m512i(acc[r][b]), corr));
        _mm512_store_ps(t + r * kPanel + 16 * b, _mm512_mul_ps(v, _mm512_loadu_ps(scale + 16 * b)));
      }
    }
  }
};

using MicroInt8 = RowDispatch<Int8Vnni, 6>;
using MicroInt4 = RowDispatch<Int4Vnni, 4>;

}  // namespace

void gemm_int8_avx512vnni(const PackedWeight& w, const GemmArgs& g) { gemm_q_driver<MicroInt8>(w, g); }
void gate_up_int8_avx512vnni(const PackedWeight& w, const GateUpArgs& g) { gate_up_q_driver<MicroInt8>(w, g); }
void gemm_int4_avx512vnni(const PackedWeight& w, const GemmArgs& g) { gemm_q_driver<MicroInt4>(w, g); }
void gate_up_int4_avx512vnni(const PackedWeight& w, const GateUpArgs& g) { gate_up_q_driver<MicroInt4>(w, g); }

void quantize_avx512vnni(const bf16_t* a, const float* a_f32, int m, int k, int lda, int k_pad, int group, int8_t* q,
                  float* scale, int32_t* sums) {
  quantize_any(a, a_f32, m, k, lda, k_pad, group, q, scale, sums);
}

}  // namespace tandem
