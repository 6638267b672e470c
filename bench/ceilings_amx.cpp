// The AMX peaks behind bench/ceilings.h: register-resident tile products in the kernels'
// own 2 x 2 blocking (cpu_kernels/amx_tiles.h), four independent products per iteration.
// Compiled with -mamx-tile -mamx-bf16 -mamx-int8; callers check cpu_features() (which also
// requested the tile permission) first.
#include "amx_tiles.h"

namespace tandem::bench {

namespace {
template <bool Integer>
void tile_loop(long iters) {
  amx::configure_2x2(64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (long i = 0; i < iters; ++i) {
    TANDEM_AMX_DOT(Integer, 0, 4, 6);
    TANDEM_AMX_DOT(Integer, 1, 4, 7);
    TANDEM_AMX_DOT(Integer, 2, 5, 6);
    TANDEM_AMX_DOT(Integer, 3, 5, 7);
  }
  _tile_release();
}
}  // namespace

// 4 x 16x16x32 bf16 products per iteration: 65536 FLOP.
void tdpbf16ps_loop(long iters) { tile_loop<false>(iters); }
// 4 x 16x16x64 int8 products per iteration: 131072 OP.
void tdpbsud_loop(long iters) { tile_loop<true>(iters); }

}  // namespace tandem::bench
