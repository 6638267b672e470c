// Internal: the AMX tile setup shared by the AMX kernels (gemm_amx.cpp) and the AMX
// ceilings (bench/ceilings_amx.cpp), so the benchmark's peak runs the kernels' own
// blocking. Include only from files compiled with -mamx-tile -mamx-bf16 -mamx-int8.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tandem::amx {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

// The 2 x 2 blocking: tiles 0, 1 = A0 x B0, B1; 2, 3 = A1 x B0, B1; 4, 5 hold A0, A1;
// 6, 7 hold B0, B1. Every tile has 16 rows; an A row is a_bytes (the k of one step times
// the element size: 64, or 32 for INT4 groups of 32), a B tile a_bytes / 4 rows of 64
// bytes. The whole 64-byte operand is an input of the asm, so no compiler may drop the
// stores that fill it (GCC 12's _tile_loadconfig declares an 8-byte one).
inline void configure_2x2(int a_bytes) {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  cfg.colsb[4] = cfg.colsb[5] = static_cast<uint16_t>(a_bytes);
  cfg.rows[6] = cfg.rows[7] = static_cast<uint8_t>(a_bytes / 4);
  asm volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
}

}  // namespace tandem::amx

// One tile product: tdpbsud (signed A x unsigned B, int32) when `integer`, else
// tdpbf16ps. GCC's tile intrinsics paste their operands into the assembly text, so the
// tile numbers must be literals, not template arguments: hence a macro.
#define TANDEM_AMX_DOT(integer, c, a, b) \
  do {                                   \
    if constexpr (integer)               \
      _tile_dpbsud(c, a, b);             \
    else                                 \
      _tile_dpbf16ps(c, a, b);           \
  } while (0)
