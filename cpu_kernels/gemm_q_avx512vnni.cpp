// Integer kernels with AVX512_VNNI: vpdpbusd multiplies four unsigned weight bytes by
// four signed activation bytes per int32 lane and adds the sum into the lane, so one
// packed k-quad row of a panel (64 outputs x 4 bytes) is four instructions per token.
// INT8 weights are stored as q + 128 (unsigned), so the dot product is corrected by
// 128 * sum(q_a); INT4 nibbles are unsigned already and corrected by zero * sum(q_a)
// per group. Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni.
#include <immintrin.h>

#include "gemm_q_driver.h"

namespace tandem {
namespace {

inline __m512i bcast(const int8_t* p) { return _mm512_set1_epi32(load_i32(p)); }

// Accumulators are kept in a vector type without __m512i's may_alias attribute: with
// it, GCC 12 keeps arrays of them in memory and stores every accumulator on every
// iteration (a third of the peak); without it they stay in registers.
using acc_t = int __attribute__((vector_size(64)));
inline acc_t dpbusd(acc_t acc, __m512i u, __m512i s) {
  return reinterpret_cast<acc_t>(_mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc), u, s));
}
inline __m512i as_m512i(acc_t v) { return reinterpret_cast<__m512i>(v); }

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

template <int MR>
struct Int4Vnni {
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
          for (int b = 0; b < 4; ++b)
            acc[r][b] = dpbusd(dpbusd(acc[r][b], lo[b], x0), hi[b], x1);
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
