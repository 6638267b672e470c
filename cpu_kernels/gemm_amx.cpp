// AMX kernels (Sapphire Rapids and later) for prefill-sized m: BF16 (tdpbf16ps) and
// INT8 (tdpbsud: signed activations x unsigned weights). The packed layouts are AMX's
// B operand already: 16 k-pair (bf16) or k-quad (int8) rows of a panel, 64 bytes each
// at a stride of 256 bytes, are one B tile of 16 outputs. A tile is up to 16 token rows
// of 32 bf16 or 64 int8 values, loaded straight from the activations.
//
// Tiles: 0-3 accumulate the panel's 64 outputs (16 each), 4 holds A, 5 and 6 take B
// in turn. The configuration (rows = the block's token count) is loaded per call and
// released at its end; the kernel runs on the calling thread, whose AMX permission
// cpu_features.cpp requested (arch_prctl ARCH_REQ_XCOMP_PERM).
//
// Not executed on machines without AMX (the tests skip there); the BF16 kernel needs
// k % 32 == 0 and otherwise hands the call to the AVX512_BF16 kernel.
// Compiled with the AVX512_BF16 flags plus -mamx-tile -mamx-bf16 -mamx-int8.
#include <immintrin.h>

#include "gemm_q_driver.h"

namespace tandem {

void gemm_bf16_avx512bf16(const PackedWeight&, const GemmArgs&);
void gate_up_bf16_avx512bf16(const PackedWeight&, const GateUpArgs&);

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// C tiles 0-3 and A tile 4: `rows` x 64 bytes; B tiles 5, 6: 16 x 64 bytes.
inline void configure(int rows) {
  TileConfig cfg;
  for (int i = 0; i < 5; ++i) {
    cfg.rows[i] = static_cast<uint8_t>(rows);
    cfg.colsb[i] = 64;
  }
  for (int i = 5; i < 7; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
}

struct AmxBf16 {
  static constexpr int kMaxRows = 16;
  static void run(int mr, const bf16_t* a, int lda, const bf16_t* wp, int k, float* t) {
    configure(mr);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const auto* w = reinterpret_cast<const char*>(wp);
    for (int c = 0; c < k; c += 32) {
      _tile_loadd(4, a + c, lda * static_cast<int>(sizeof(bf16_t)));
      const char* b = w + static_cast<size_t>(c / 2) * 256;
      _tile_loadd(5, b, 256);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, b + 64, 256);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, b + 128, 256);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, b + 192, 256);
      _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, t, kPanel * 4);
    _tile_stored(1, t + 16, kPanel * 4);
    _tile_stored(2, t + 32, kPanel * 4);
    _tile_stored(3, t + 48, kPanel * 4);
    _tile_release();
  }
};

struct AmxInt8 {
  static constexpr int kMaxRows = 16;
  static void run(int mr, const QuantInput& in, int r0, const PackedWeight& w, const std::byte* panel, float* t) {
    alignas(64) int32_t acc[16 * kPanel];
    configure(mr);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const auto* wp = reinterpret_cast<const char*>(panel);
    const int8_t* a = in.row(r0);
    for (int c = 0; c < w.k_pad; c += 64) {
      _tile_loadd(4, a + c, in.ldq);
      const char* b = wp + static_cast<size_t>(c / 4) * 256;
      _tile_loadd(5, b, 256);
      _tile_dpbsud(0, 4, 5);
      _tile_loadd(6, b + 64, 256);
      _tile_dpbsud(1, 4, 6);
      _tile_loadd(5, b + 128, 256);
      _tile_dpbsud(2, 4, 5);
      _tile_loadd(6, b + 192, 256);
      _tile_dpbsud(3, 4, 6);
    }
    _tile_stored(0, acc, kPanel * 4);
    _tile_stored(1, acc + 16, kPanel * 4);
    _tile_stored(2, acc + 32, kPanel * 4);
    _tile_stored(3, acc + 48, kPanel * 4);
    _tile_release();
    const float* scale = int8_scales(w, panel);
    for (int r = 0; r < mr; ++r) {
      const __m512i corr = _mm512_set1_epi32(128 * in.sums[r0 + r]);
      for (int b = 0; b < 4; ++b) {
        const __m512i v = _mm512_sub_epi32(_mm512_load_si512(acc + r * kPanel + 16 * b), corr);
        _mm512_store_ps(t + r * kPanel + 16 * b, _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_loadu_ps(scale + 16 * b)));
      }
    }
  }
};

}  // namespace

void gemm_bf16_amx(const PackedWeight& w, const GemmArgs& g) {
  if (w.k % 32 != 0) return gemm_bf16_avx512bf16(w, g);
  gemm_driver<AmxBf16>(w, g);
}
void gate_up_bf16_amx(const PackedWeight& w, const GateUpArgs& g) {
  if (w.k % 32 != 0) return gate_up_bf16_avx512bf16(w, g);
  gate_up_driver<AmxBf16>(w, g);
}
void gemm_int8_amx(const PackedWeight& w, const GemmArgs& g) { gemm_q_driver<AmxInt8>(w, g); }
void gate_up_int8_amx(const PackedWeight& w, const GateUpArgs& g) { gate_up_q_driver<AmxInt8>(w, g); }

}  // namespace tandem
