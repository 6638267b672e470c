// The AMX peaks behind bench/ceilings.h: register-resident tile products in the kernels'
// own 2 x 2 blocking (cpu_kernels/amx_tiles.h), four independent products per iteration.
// Compiled with -mamx-tile -mamx-bf16 -mamx-int8; callers check cpu_features() (which also
// requested the tile permission) first.
#include <cstdint>
#include <cstdlib>
#include <cstring>

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
// The register-resident step on random bf16 operands (normal values of either sign, as
// weights and activations are) instead of the zeros above: the tile unit draws more power
// on real data, and the core may run slower for it.
void tile_loop_data(long iters) {
  alignas(64) uint16_t operands[4 * 512];
  uint32_t x = 12345;
  for (auto& v : operands) {
    x = x * 1664525u + 1013904223u;  // a fixed LCG: the same operands every run
    v = static_cast<uint16_t>(0x3c00 + ((x >> 8) & 0x7ff)) | static_cast<uint16_t>((x >> 31) << 15);
  }
  amx::configure_2x2(64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const char* p = reinterpret_cast<const char*>(operands);
  _tile_loadd(4, p, 64);
  _tile_loadd(5, p + 1024, 64);
  _tile_loadd(6, p + 2048, 64);
  _tile_loadd(7, p + 3072, 64);
  for (long i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_release();
}
// The same step with its four tiles loaded first (A0, A1, B0, B1: 4 KB in a row), cycling
// through a per-thread buffer of `bytes`: what the tile loads cost when one step's operands
// come from L1 (16 KB) or from L2 (256 KB) rather than from the registers.
void tile_load_loop(long iters, size_t bytes) {
  thread_local char* buf = nullptr;
  thread_local size_t have = 0;
  if (have < bytes) {
    std::free(buf);
    buf = static_cast<char*>(std::aligned_alloc(4096, bytes));
    std::memset(buf, 0, bytes);  // bf16 zeros: no denormal or NaN can slow the products
    have = bytes;
  }
  amx::configure_2x2(64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const size_t steps = bytes / 4096;
  size_t s = 0;
  for (long i = 0; i < iters; ++i) {
    const char* p = buf + s * 4096;
    _tile_loadd(4, p, 64);
    _tile_loadd(5, p + 1024, 64);
    _tile_loadd(6, p + 2048, 64);
    _tile_loadd(7, p + 3072, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    if (++s == steps) s = 0;
  }
  _tile_release();
}
// The step above while the thread also streams `lines` cache lines per step from its own
// slice [stream, stream + stream_bytes) of a DRAM-sized buffer into L2 (prefetcht1, as the
// kernels stream the next block of weights): what a prefill kernel can reach when every
// weight byte comes from memory once. `b_from_l2` false: all four tiles from 16 KB (L1), an
// idealization no kernel with 8 tile registers reaches at prefill sizes; true: A from L1
// and B from 256 KB (L2) at the packed weights' 256-byte row stride, the AMX kernels' own
// case (a block of weights in L2, reused by every row pair).
void tile_stream_loop(long iters, bool b_from_l2, const char* stream, size_t stream_bytes, int lines) {
  thread_local char* buf = nullptr;
  constexpr size_t kL1 = 16 << 10, kL2 = 256 << 10;
  if (!buf) {
    buf = static_cast<char*>(std::aligned_alloc(4096, kL1 + kL2));
    std::memset(buf, 0, kL1 + kL2);
  }
  const char* b_l2 = buf + kL1;
  amx::configure_2x2(64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  size_t s = 0, sb = 0;
  // Each call goes on where this thread's last call on the same buffer stopped: a short
  // call that began at the start every time would find its lines in the last-level cache.
  thread_local const char* last_stream = nullptr;
  thread_local size_t pos = 0;
  if (last_stream != stream || pos >= stream_bytes) pos = 0;
  last_stream = stream;
  const char* q = stream + pos;
  const char* end = stream + stream_bytes - static_cast<size_t>(lines) * 64;
  for (long i = 0; i < iters; ++i) {
    if (b_from_l2) {
      const char* a = buf + (s & 3) * 2048;
      const char* b = b_l2 + sb * 4096;
      _tile_loadd(4, a, 64);
      _tile_loadd(5, a + 1024, 64);
      _tile_loadd(6, b, 256);
      _tile_loadd(7, b + 64, 256);
      if (++sb == kL2 / 4096) sb = 0;
    } else {
      const char* p = buf + (s & 3) * 4096;
      _tile_loadd(4, p, 64);
      _tile_loadd(5, p + 1024, 64);
      _tile_loadd(6, p + 2048, 64);
      _tile_loadd(7, p + 3072, 64);
    }
    ++s;
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    for (int j = 0; j < lines; ++j, q += 64) _mm_prefetch(q, _MM_HINT_T1);
    if (q > end) q = stream;
  }
  pos = static_cast<size_t>(q - stream);
  _tile_release();
}
}  // namespace

void tdpbf16ps_stream_loop(long iters, bool b_from_l2, const char* stream, size_t stream_bytes, int lines) {
  tile_stream_loop(iters, b_from_l2, stream, stream_bytes, lines);
}

// The 2 x 2 bf16 step with its tiles loaded from a footprint of `bytes` (a multiple of 4 KB).
void tdpbf16ps_loaded_loop(long iters, size_t bytes) { tile_load_loop(iters, bytes); }

// 4 x 16x16x32 bf16 products per iteration: 65536 FLOP.
void tdpbf16ps_loop(long iters) { tile_loop<false>(iters); }
void tdpbf16ps_data_loop(long iters) { tile_loop_data(iters); }
// 4 x 16x16x64 int8 products per iteration: 131072 OP.
void tdpbsud_loop(long iters) { tile_loop<true>(iters); }

}  // namespace tandem::bench
