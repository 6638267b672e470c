// The AMX peaks behind bench/ceilings.h: register-resident tile products, the 2 x 2
// blocking of the kernels (tiles 0-3 accumulate, 4-5 hold A, 6-7 hold B), four
// independent products per iteration. Compiled with -mamx-tile -mamx-bf16 -mamx-int8;
// callers check cpu_features() (which also requested the tile permission) first.
#include <immintrin.h>

#include <cstdint>

namespace tandem::bench {

namespace {
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
void configure() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  asm volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
}
}  // namespace

// 4 x 16x16x32 bf16 products per iteration: 65536 FLOP.
void tdpbf16ps_loop(long iters) {
  configure();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (long i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_release();
}

// 4 x 16x16x64 int8 products per iteration: 131072 OP.
void tdpbsud_loop(long iters) {
  configure();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (long i = 0; i < iters; ++i) {
    _tile_dpbsud(0, 4, 6);
    _tile_dpbsud(1, 4, 7);
    _tile_dpbsud(2, 5, 6);
    _tile_dpbsud(3, 5, 7);
  }
  _tile_release();
}

}  // namespace tandem::bench
