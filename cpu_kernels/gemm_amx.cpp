// AMX kernels (Sapphire Rapids and later): BF16 (tdpbf16ps), INT8 (tdpbsud: signed
// activations x unsigned weights) and INT4 (tdpbssd: signed x signed).
//
// The packed layouts are AMX's B operand already: 16 k-pair (bf16) or k-quad (int8) rows
// of a panel, 64 bytes each at a stride of 256 bytes, are one B tile of 16 outputs. INT4
// groups are unpacked, once per block of k and call, into that same int8 layout as
// q - zero (-15..15), so each group's int32 sum needs no zero-point correction; a row
// pair's group sums are then scaled into its fp32 results in passes of up to 4 groups.
//
// Register blocking (8 tiles): two A tiles (32 token rows) times two B tiles (32 of the
// panel's 64 outputs) into four accumulators, so every tile loaded serves two products;
// each step loads its four tiles first and then runs the four products (interleaving
// them measured three times slower). Work order per call (one work item: a run of panels
// of one expert, all its rows), in amx_run:
//   rows in chunks of up to kChunkRows; panels in groups whose accumulators (fp32, or
//   for INT8 int32 until the end of the k) fit about kAccBytes;
//   blocks of k (BF16 128 k up to 64 rows, else 256 to 1024 k; INT8 256 k up to 64 rows,
//   else 512 to 1024 k; INT4 256 k: block_steps_for):
//   the chunk's A rows of the block are packed tile by tile
//   (pack_a: 1 KB tiles, no cache-set conflicts from power-of-two row strides, rows past
//   m zero), unless the caller passed its rows in that order already (a_tiles, from
//   pack_row_tiles: the engine packs each expert's rows once for all its calls), then
//   for each panel of the group, each half of the panel (its B tiles of
//   the block stay in L1, or in L2 for the longer blocks), each row pair: the
//   accumulators are loaded, the block's steps run, the accumulators are stored (INT4:
//   per group, zeroed, stored, then scaled as above);
//   meanwhile the next block of k of the group's panels is prefetched into L2, a few
//   lines per step, so the weights stream from DRAM once per call and chunk while the
//   tile unit works.
// The tile configuration (every tile 16 rows) is loaded once per call with an ldtilecfg
// whose 64-byte operand the compiler sees whole, and released at the call's end. The
// kernel runs on the calling thread, whose AMX permission cpu_features.cpp requested
// (ARCH_REQ_XCOMP_PERM).
//
// Integer results are bit-identical to the VNNI kernels': the dot products are exact in
// int32, and the scaling (per panel for INT8, per group for INT4, in group order) is the
// same fp32 arithmetic. BF16 accumulates in fp32 in the tile unit's own order (and it
// flushes denormals). Not executed on machines without AMX (the tests skip there); BF16
// needs k % 32 == 0 and otherwise hands the call to the AVX512_BF16 kernel.
// Compiled with the AVX512_BF16 flags plus -mamx-tile -mamx-bf16 -mamx-int8.
#include <immintrin.h>

#include <type_traits>

#include "amx_tiles.h"
#include "gemm_q_driver.h"

namespace tandem {

void gemm_bf16_avx512bf16(const PackedWeight&, const GemmArgs&);
void gate_up_bf16_avx512bf16(const PackedWeight&, const GateUpArgs&);

namespace {

constexpr int kTileRows = 16;
constexpr int kChunkRows = 512;  // rows of one chunk at most (their k-block of A stays in L2)
constexpr size_t kRowBytes = 256;  // one packed k-pair / k-quad row of a panel
// Row stride of the accumulator buffers, in 4-byte elements: a panel's 64 plus one cache
// line, so that a row pair's accumulators do not sit a multiple of 4 KB after the previous
// pair's (at 64, a tile load waited on the stores of the pair before it: 4K aliasing; the
// 2 x 2 step with an accumulator round trip every 8 steps measured 12% faster at 80).
constexpr int kAccLd = kPanel + 16;

// Spreads prefetches of [p, end) into L2 over the products of the current block.
struct Prefetch {
  const char* p = nullptr;
  const char* end = nullptr;
  int per_step = 0;  // cache lines per product step
  void set(const char* begin, size_t bytes, int steps) {
    p = begin;
    end = begin + bytes;
    const size_t lines = (bytes + 63) / 64;
    per_step = steps > 0 ? static_cast<int>((lines + steps - 1) / steps) : 0;
  }
  void step() {
    for (int i = 0; i < per_step && p < end; ++i, p += 64) _mm_prefetch(p, _MM_HINT_T1);
  }
};

struct Dpbf16 {
  static constexpr bool integer = false, signed_b = false;
};
struct Dpbsud {  // signed A x unsigned B (INT8: weights stored q + 128)
  static constexpr bool integer = true, signed_b = false;
};
struct Dpbssd {  // signed A x signed B (INT4: nibbles unpacked to q - zero)
  static constexpr bool integer = true, signed_b = true;
};
#define TANDEM_TDP(Dot, c, a, b)          \
  do {                                    \
    if constexpr (Dot::signed_b)          \
      _tile_dpbssd(c, a, b);              \
    else                                  \
      TANDEM_AMX_DOT(Dot::integer, c, a, b); \
  } while (0)

// One row pair (a1 null: one block) times 32 outputs (b: the first B tile's bytes of the
// block, 64 more for the second), `steps` steps: A tiles at a0 / a1 + s * a_step (rows
// a_bytes apart: packed by pack_a), B tiles at b + s * b_step (rows 256 bytes apart);
// c (4-byte elements, rows ldc bytes apart) += the products, or = when `first`.
template <class Dot>
inline void pair_half(const char* a0, const char* a1, int a_bytes, size_t a_step, const char* b, size_t b_step,
                      int steps, char* c, bool first, Prefetch& pf, size_t ldc = kAccLd * 4) {
  char* c1 = c + kTileRows * ldc;
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
  } else {
    _tile_loadd(0, c, ldc);
    _tile_loadd(1, c + 64, ldc);
  }
  if (a1) {
    if (first) {
      _tile_zero(2);
      _tile_zero(3);
    } else {
      _tile_loadd(2, c1, ldc);
      _tile_loadd(3, c1 + 64, ldc);
    }
    // All four loads, then the four products: interleaving them (load, product, load,
    // ...) measured three times slower on Sapphire Rapids.
    for (int s = 0; s < steps; ++s) {
      const char* bs = b + s * b_step;
      _tile_loadd(4, a0 + s * a_step, a_bytes);
      _tile_loadd(5, a1 + s * a_step, a_bytes);
      _tile_loadd(6, bs, kRowBytes);
      _tile_loadd(7, bs + 64, kRowBytes);
      TANDEM_TDP(Dot, 0, 4, 6);
      TANDEM_TDP(Dot, 1, 4, 7);
      TANDEM_TDP(Dot, 2, 5, 6);
      TANDEM_TDP(Dot, 3, 5, 7);
      pf.step();
    }
    _tile_stored(2, c1, ldc);
    _tile_stored(3, c1 + 64, ldc);
  } else {
    for (int s = 0; s < steps; ++s) {
      const char* bs = b + s * b_step;
      _tile_loadd(4, a0 + s * a_step, a_bytes);
      _tile_loadd(6, bs, kRowBytes);
      _tile_loadd(7, bs + 64, kRowBytes);
      TANDEM_TDP(Dot, 0, 4, 6);
      TANDEM_TDP(Dot, 1, 4, 7);
      pf.step();
    }
  }
  _tile_stored(0, c, ldc);
  _tile_stored(1, c + 64, ldc);
}

// A grow-only, 64-byte aligned per-thread buffer of n T.
template <typename T>
T* grow(AlignedBuffer& b, size_t n) {
  if (b.size < n * sizeof(T)) b = AlignedBuffer::allocate(n * sizeof(T));
  return reinterpret_cast<T*>(b.data());
}

// A call's input: m rows of bytes at a stride of ld bytes (bf16 values, or the
// quantized int8 ones).
struct Rows {
  const char* a = nullptr;
  size_t ld = 0;
  int m = 0;
  const char* tiles = nullptr;  // the same rows in the order of pack_row_tiles, or null
  int blocks() const { return (m + kTileRows - 1) / kTileRows; }
};

// The chunk's row blocks [b0, b1) of one block of k (bytes [off, off + steps * a_bytes)
// of each row), tile by tile: [row block][step][16 rows][a_bytes], rows past m zero.
// A tile is then 1 KB of consecutive bytes: rows of A a power of two apart (8 KB for a
// hidden size of 4096) would otherwise fall into a few cache sets and evict each other.
void pack_a(const Rows& in, int b0, int b1, size_t off, int steps, int a_bytes, char* out) {
  const size_t tile = static_cast<size_t>(kTileRows) * a_bytes;
  for (int bi = b0; bi < b1; ++bi)
    for (int r = 0; r < kTileRows; ++r) {
      const int row = bi * kTileRows + r;
      char* dst = out + static_cast<size_t>(bi - b0) * steps * tile + static_cast<size_t>(r) * a_bytes;
      if (row >= in.m) {
        for (int s = 0; s < steps; ++s) std::memset(dst + s * tile, 0, a_bytes);
        continue;
      }
      const char* src = in.a + static_cast<size_t>(row) * in.ld + off;
      if (a_bytes == 64) {
        for (int s = 0; s < steps; ++s) _mm512_store_si512(dst + s * tile, _mm512_loadu_si512(src + s * 64));
      } else {
        for (int s = 0; s < steps; ++s) std::memcpy(dst + s * tile, src + s * a_bytes, a_bytes);
      }
    }
}

// Every pair and both halves of a chunk's `nb` packed row blocks (`rbs` bytes apart, the
// block's `steps` steps from a) against B at b.
template <class Dot>
void run_rows(const char* a, size_t rbs, int nb, int steps, int a_bytes, const char* b, size_t b_step, char* c,
              bool first, Prefetch& pf) {
  const size_t tile = static_cast<size_t>(kTileRows) * a_bytes;
  // Halves outside, pairs inside: a half's B tiles of the block stay in L1 (in L2 for the
  // longer blocks) while every pair's A tiles stream from L2.
  for (int h = 0; h < 2; ++h)
    for (int bi = 0; bi < nb; bi += 2) {
      const char* a0 = a + static_cast<size_t>(bi) * rbs;
      const char* a1 = bi + 1 < nb ? a0 + rbs : nullptr;
      char* cb = c + static_cast<size_t>(bi) * kTileRows * kAccLd * 4 + 128 * h;
      pair_half<Dot>(a0, a1, a_bytes, tile, b + 128 * h, b_step, steps, cb, first, pf);
    }
}

// The formats' parts of a call, each with
//   a_bytes                  bytes of an A tile row (the k of one step)
//   blocks()                 blocks of k
//   a_steps(kb), a_off(kb)   the block's steps, and where its k starts in an A row (bytes)
//   block_data(panel, kb), block_bytes(kb)   the panel bytes the block reads (prefetch)
//   begin(acc, rows)         before a panel's first block
//   run_block(a, rbs, nb, r0, rows, panel, kb, acc, pf)   the block's products for nb
//                            row blocks of A in tile order (the block's first step at a,
//                            row blocks rbs bytes apart), the chunk's rows [r0, r0 + rows)
//                            of them real
//   finish(panel, acc, r0, rows)             after its last: acc becomes fp32 results
// acc: one panel's accumulators for the chunk's rows, row stride kAccLd.

// BF16 and INT8: the panel's packed rows are B tiles as they are. A step is 64 bytes of
// an A row (32 bf16 or 64 int8) against 16 packed rows (4 KB) of the panel; a block of
// k is block_steps steps (block_steps_for: 4, or 8 to 32). The accumulators stay in the panel's
// own buffer across blocks (fp32 for BF16, int32 for INT8 until finish).
template <class Dot>
struct DirectFmt {
  static constexpr int a_bytes = 64;
  static constexpr size_t step_bytes = 16 * kRowBytes;
  int steps = 0;          // steps over the whole k
  int block_steps = 0;
  size_t tail_bytes = 0;  // what follows the last block in the panel (INT8: its scales)
  int blocks() const { return (steps + block_steps - 1) / block_steps; }
  int a_steps(int kb) const { return std::min(block_steps, steps - kb * block_steps); }
  size_t a_off(int kb) const { return static_cast<size_t>(kb) * block_steps * a_bytes; }
  const char* block_data(const std::byte* panel, int kb) const {
    return reinterpret_cast<const char*>(panel) + static_cast<size_t>(kb) * block_steps * step_bytes;
  }
  size_t block_bytes(int kb) const { return a_steps(kb) * step_bytes + (kb + 1 == blocks() ? tail_bytes : 0); }
  void begin(float*, int) {}
  void run_block(const char* a, size_t rbs, int nb, int, int, const std::byte* panel, int kb, float* acc, Prefetch& pf) {
    run_rows<Dot>(a, rbs, nb, a_steps(kb), a_bytes, block_data(panel, kb), step_bytes, reinterpret_cast<char*>(acc),
                  kb == 0, pf);
  }
};

// Steps per block of k for a call of m rows: the chunk's A rows of a block take about
// kABlockBytes (they stream from L2 for every half panel of the group), at least 8 steps
// and at most max_steps. Longer blocks store and reload the accumulators less often (each
// round trip drains the tile unit: 8-step blocks ran the 2 x 2 step at half the rate of
// no round trips, 32-step blocks at 70%), but their B tiles no longer stay in L1 and their
// A rows fill L2. Measured (one thread, qwen3-235b's expert, weights from DRAM, best of
// alternated runs, AMX Xeon): BF16 at 128 rows 32 steps +9% over 8, at 256 rows 16
// steps level; INT8 at 128 rows 16 steps +5% over 4.
// Up to kShortBlockRows rows, blocks of 4 steps: there the weight stream sets the pace,
// and a call's first block is read without the prefetch that covers the others (the
// engine's items are ~512 KB, so that block is a large share of each call), while the
// accumulators of so few rows cost little to store and reload. Measured on the same
// machine (2 threads, calls of one panel pair as the engine cuts them, qwen3-30b's
// expert, variants alternated per step, medians of the paired ratios): BF16 at 1 / 4 / 8
// / 32 / 64 rows 1.09-1.14x / 1.00-1.18x / 1.11-1.17x / 1.23-1.29x / 1.15-1.20x the
// speed of the blocks above, 128 rows 1.03x; qwen3-235b's 1 / 32 / 128 rows 1.07x / 1.12x
// / 0.96x; INT8 at 8 and 32 rows 1.08x.
constexpr size_t kABlockBytes = 256 << 10;
constexpr int kShortBlockRows = 64;
inline int block_steps_for(int m, int max_steps) {
  if (m <= kShortBlockRows) return 4;
  const int rows = std::min(kChunkRows, (m + 31) / 32 * 32);
  return std::clamp(static_cast<int>(kABlockBytes / (static_cast<size_t>(rows) * 64)), 8, max_steps);
}

struct Bf16Fmt : DirectFmt<Dpbf16> {
  Bf16Fmt(int k, int m) : DirectFmt{k / 32, block_steps_for(m, 32)} {}  // 4, or 8 to 32 steps: 128, or 256 to 1024 k
  void finish(const std::byte*, float*, int, int) {}
};

struct Int8Fmt : DirectFmt<Dpbsud> {
  const PackedWeight* w;
  const QuantInput* in;
  Int8Fmt(const PackedWeight& pw, const QuantInput& qi, int m)  // 4, or 8 to 16 steps: 256, or 512 to 1024 k
      : DirectFmt{pw.k_pad / 64, block_steps_for(m, 16), kPanel * sizeof(float)}, w(&pw), in(&qi) {}
  // acc = scale[j] * (sum - 128 * sum(q_a)), in place: the VNNI kernel's arithmetic.
  void finish(const std::byte* panel, float* acc, int r0, int rows) {
    const float* scale = int8_scales(*w, panel);
    for (int r = 0; r < rows; ++r) {
      const __m512i corr = _mm512_set1_epi32(128 * in->sums[r0 + r]);
      for (int b = 0; b < 4; ++b) {
        float* p = acc + r * kAccLd + 16 * b;
        const __m512i v = _mm512_sub_epi32(_mm512_load_si512(p), corr);
        _mm512_store_ps(p, _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_loadu_ps(scale + 16 * b)));
      }
    }
  }
};

struct Int4Fmt {
  const PackedWeight* w = nullptr;
  int32_t* acc32 = nullptr;    // a row pair's int32 sums, one 4 KB [32 rows][32] slice per group of the pass
  int8_t* unpacked = nullptr;  // one block of k in the INT8 layout, q - zero: [k/4][64][4]
  int a_bytes = 64;            // 32 for groups of 32
  int groups_per_block = 1;    // 256 k per block
  static constexpr int kMaxBlockGroups = 256 / 32;
  static constexpr int kPassGroups = 4;  // groups scaled in one pass over a row pair's sums
  __m512 scales[kMaxBlockGroups * 4];    // the block's group scales: [group][4] x 16 outputs
  int blocks() const { return (w->groups() + groups_per_block - 1) / groups_per_block; }
  int groups(int kb) const { return std::min(groups_per_block, w->groups() - kb * groups_per_block); }
  int a_steps(int kb) const { return groups(kb) * w->group / a_bytes; }
  size_t a_off(int kb) const { return static_cast<size_t>(kb) * groups_per_block * w->group; }
  const char* block_data(const std::byte* panel, int kb) const {
    return reinterpret_cast<const char*>(int4_group(*w, panel, kb * groups_per_block));
  }
  size_t block_bytes(int kb) const { return static_cast<size_t>(groups(kb)) * w->group_stride; }
  void begin(float* acc, int n) { std::memset(acc, 0, sizeof(float) * n * kAccLd); }
  // Low nibbles of packed row o are k-quad 2o (k = 8o + e), high nibbles k-quad 2o + 1;
  // each becomes q - zero (-15..15, signed: tdpbssd), so the products need no zero-point
  // correction through the activation sums. Also the group's scales, as fp32.
  void unpack(const std::byte* group, int8_t* out, __m512* scale) const {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const uint16_t* sc = int4_scales(*w, group);
    const uint8_t* zp = int4_zeros(*w, group);
    __m512i zero[4];
    for (int b = 0; b < 4; ++b) {
      scale[b] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 16 * b)));
      // each output's zero point in all 4 bytes of its k-quad (zero <= 15: no carries)
      zero[b] = w->symmetric ? _mm512_set1_epi8(static_cast<char>(w->fixed_zero()))
                             : _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(zp + 16 * b))),
                                                  _mm512_set1_epi32(0x01010101));
    }
    // MXFP4: the code table first (its entries minus 12 are the codes' doubled values).
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2m1Lut)));
    auto decode = [&](__m512i q) { return w->e2m1 ? _mm512_shuffle_epi8(lut, q) : q; };
    for (int o = 0; o < w->group / 8; ++o)
      for (int b = 0; b < 4; ++b) {
        const __m512i v = _mm512_loadu_si512(group + o * kRowBytes + 64 * b);
        _mm512_store_si512(out + (2 * o) * kRowBytes + 64 * b, _mm512_sub_epi8(decode(_mm512_and_si512(v, low4)), zero[b]));
        _mm512_store_si512(out + (2 * o + 1) * kRowBytes + 64 * b,
                           _mm512_sub_epi8(decode(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4)), zero[b]));
      }
  }
  // acc += scale[j] * sum over the group of q_a * (q_w - zero): the VNNI kernel's
  // arithmetic (its sum - zero * sum(q_a) is the same int32), in group order. Per row pair
  // and half: up to kPassGroups groups' tile products into their own sums, then one pass
  // adds them into the fp32 results (each result loaded and stored once per pass, not per
  // group), while they are in L1.
  void run_block(const char* a, size_t rbs, int nb, int, int rows, const std::byte* panel, int kb, float* acc,
                 Prefetch& pf) {
    const int g0 = kb * groups_per_block, ng = groups(kb), steps = w->group / a_bytes;
    const size_t group_unpacked = static_cast<size_t>(w->group) * kPanel;
    const size_t tile = static_cast<size_t>(kTileRows) * a_bytes;
    const size_t b_step = static_cast<size_t>(a_bytes / 4) * kRowBytes;
    constexpr size_t ld32 = 32 * 4;                           // a pass slice's row stride, bytes
    constexpr size_t slice = static_cast<size_t>(32) * 32;   // int32 per group slice
    for (int i = 0; i < ng; ++i) unpack(int4_group(*w, panel, g0 + i), unpacked + i * group_unpacked, scales + 4 * i);
    for (int h = 0; h < 2; ++h)
      for (int bi = 0; bi < nb; bi += 2) {
        const char* a0 = a + static_cast<size_t>(bi) * rbs;
        const char* a1 = bi + 1 < nb ? a0 + rbs : nullptr;
        const int r_end = std::min(rows, (bi + 2) * kTileRows);  // rows past m: padding, dropped
        for (int p0 = 0; p0 < ng; p0 += kPassGroups) {
          const int pn = std::min(kPassGroups, ng - p0);
          for (int i = p0; i < p0 + pn; ++i)
            pair_half<Dpbssd>(a0 + static_cast<size_t>(i) * steps * tile, a1 ? a1 + static_cast<size_t>(i) * steps * tile : nullptr,
                              a_bytes, tile, reinterpret_cast<const char*>(unpacked + i * group_unpacked) + 128 * h, b_step,
                              steps, reinterpret_cast<char*>(acc32 + (i - p0) * slice), true, pf, ld32);
          for (int r = bi * kTileRows; r < r_end; ++r) {
            const int32_t* sr = acc32 + (r - bi * kTileRows) * 32;
            for (int c = 0; c < 2; ++c) {
              float* tr = acc + r * kAccLd + 32 * h + 16 * c;
              __m512 t = _mm512_load_ps(tr);
              for (int i = 0; i < pn; ++i)
                t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sr + i * slice + 16 * c)), scales[4 * (p0 + i) + 2 * h + c], t);
              _mm512_store_ps(tr, t);
            }
          }
        }
      }
  }
  void finish(const std::byte*, float*, int, int) {}
};

// The driver (the order is described at the top of the file): `slots` panels
// (panel(i)); out(i, acc(i), acc(i-1), r0, rows) takes each panel's results for a chunk
// (a group holds whole gate/up pairs: its size is even).
constexpr size_t kAccBytes = 512 << 10;

template <class Fmt, class PanelAt, class Out>
void amx_run(Fmt& f, const Rows& in, int slots, PanelAt panel, Out out) {
  const int nblocks = in.blocks();
  if (slots <= 0 || nblocks == 0) return;
  const int kblocks = f.blocks();
  const int chunk_blocks = std::min(nblocks + (nblocks & 1), kChunkRows / kTileRows);  // even: whole pairs
  const size_t stride = static_cast<size_t>(chunk_blocks) * kTileRows * kAccLd;       // floats per slot
  const int group = std::min(slots, std::max(2, static_cast<int>(kAccBytes / (stride * sizeof(float))) & ~1));
  thread_local AlignedBuffer acc_buf, a_buf;
  float* acc = grow<float>(acc_buf, stride * group);
  const size_t tile = static_cast<size_t>(kTileRows) * f.a_bytes;
  int max_steps = 0, all_steps = 0;
  for (int kb = 0; kb < kblocks; ++kb) max_steps = std::max(max_steps, f.a_steps(kb)), all_steps += f.a_steps(kb);
  char* a = in.tiles ? nullptr : grow<char>(a_buf, static_cast<size_t>(chunk_blocks) * max_steps * tile);
  amx::configure_2x2(f.a_bytes);
  for (int s0 = 0; s0 < slots; s0 += group) {
    const int ns = std::min(group, slots - s0);
    for (int c0 = 0; c0 < nblocks; c0 += chunk_blocks) {
      const int c1 = std::min(nblocks, c0 + chunk_blocks), nb = c1 - c0;
      const int r0 = c0 * kTileRows, rows = std::min(in.m, c1 * kTileRows) - r0;
      for (int i = 0; i < ns; ++i) f.begin(acc + i * stride, nb * kTileRows);
      for (int kb = 0; kb < kblocks; ++kb) {
        // The block's A: from the caller's tiles (every step of a row block in a row), or
        // packed here for this chunk and block.
        const char* ab = a;
        size_t rbs = static_cast<size_t>(f.a_steps(kb)) * tile;
        if (in.tiles) {
          rbs = static_cast<size_t>(all_steps) * tile;
          ab = in.tiles + c0 * rbs + f.a_off(kb) / f.a_bytes * tile;
        } else {
          pack_a(in, c0, c1, f.a_off(kb), f.a_steps(kb), f.a_bytes, a);
        }
        for (int i = 0; i < ns; ++i) {
          Prefetch pf;  // the next block in this order, spread over this one's products
          const int work = 2 * ((nb + 1) / 2) * f.a_steps(kb);
          if (i + 1 < ns) pf.set(f.block_data(panel(s0 + i + 1), kb), f.block_bytes(kb), work);
          else if (kb + 1 < kblocks) pf.set(f.block_data(panel(s0), kb + 1), f.block_bytes(kb + 1), work);
          else if (s0 + ns < slots && c1 == nblocks) pf.set(f.block_data(panel(s0 + ns), 0), f.block_bytes(0), work);
          f.run_block(ab, rbs, nb, r0, rows, panel(s0 + i), kb, acc + i * stride, pf);
        }
      }
      for (int i = 0; i < ns; ++i) {
        f.finish(panel(s0 + i), acc + i * stride, r0, rows);
        out(s0 + i, acc + i * stride, i > 0 ? acc + (i - 1) * stride : nullptr, r0, rows);
      }
    }
  }
  _tile_release();
}

template <class Fmt, class Args>
void amx_call(Fmt& f, const Rows& in, const PackedWeight& w, const Args& g, const float* act_scale) {
  const int pb = g.panel_begin, pe = g.panel_end < 0 ? w.panels : g.panel_end;
  if constexpr (std::is_same_v<Args, GateUpArgs>) {
    amx_run(f, in, 2 * (pe - pb), [&](int i) { return w.panel_data(2 * pb + i); },
            [&](int i, float* acc, float* gate, int r0, int rows) {
              if (i % 2 == 0) return;  // gate: taken with its up panel
              const int n0 = (pb + i / 2) * kPanel;
              store_silu_rows(g, gate, acc, rows, r0, n0, std::min(kPanel, w.n - n0), act_scale, kAccLd);
            });
  } else {
    amx_run(f, in, pe - pb, [&](int i) { return w.panel_data(pb + i); },
            [&](int i, float* acc, float*, int r0, int rows) {
              const int n0 = (pb + i) * kPanel;
              store_rows(g, acc, rows, r0, n0, std::min(kPanel, w.n - n0), act_scale, kAccLd);
            });
  }
}

// The caller's input in tile order (pack_row_tiles), when it gave one.
template <class Args>
const char* tiles_of(const Args& g) {
  return reinterpret_cast<const char*>(g.a_tiles);
}

template <class Args>
void bf16_call(const PackedWeight& w, const Args& g) {
  int lda;
  const bf16_t* a = bf16_input(g, w.k, lda);  // a_f32 rounded to bf16 first
  Bf16Fmt f(w.k, g.m);
  amx_call(f, {reinterpret_cast<const char*>(a), static_cast<size_t>(lda) * 2, g.m, tiles_of(g)}, w, g, nullptr);
}

template <class Args>
void int8_call(const PackedWeight& w, const Args& g) {
  const QuantInput in = quantize_input(w, g);
  Int8Fmt f(w, in, g.m);
  amx_call(f, {reinterpret_cast<const char*>(in.q), static_cast<size_t>(in.ldq), g.m, tiles_of(g)}, w, g, in.scale);
}

template <class Args>
void int4_call(const PackedWeight& w, const Args& g) {
  const QuantInput in = quantize_input(w, g);
  thread_local AlignedBuffer acc32, unpacked;
  Int4Fmt f;
  f.w = &w;
  f.a_bytes = std::min(w.group, 64);
  f.groups_per_block = std::max(1, 256 / w.group);  // 256 k per block: 8 KB of the panel
  f.acc32 = grow<int32_t>(acc32, static_cast<size_t>(Int4Fmt::kPassGroups) * 32 * 32);
  f.unpacked = grow<int8_t>(unpacked, static_cast<size_t>(f.groups_per_block) * w.group * kPanel);
  amx_call(f, {reinterpret_cast<const char*>(in.q), static_cast<size_t>(in.ldq), g.m, f.a_bytes == 64 ? tiles_of(g) : nullptr},
           w, g, in.scale);
}

}  // namespace

void gemm_bf16_amx(const PackedWeight& w, const GemmArgs& g) {
  if (w.k % 32 != 0) return gemm_bf16_avx512bf16(w, g);
  bf16_call(w, g);
}
void gate_up_bf16_amx(const PackedWeight& w, const GateUpArgs& g) {
  if (w.k % 32 != 0) return gate_up_bf16_avx512bf16(w, g);
  bf16_call(w, g);
}
void gemm_int8_amx(const PackedWeight& w, const GemmArgs& g) { int8_call(w, g); }
void gate_up_int8_amx(const PackedWeight& w, const GateUpArgs& g) { int8_call(w, g); }
void gemm_int4_amx(const PackedWeight& w, const GemmArgs& g) { int4_call(w, g); }
void gate_up_int4_amx(const PackedWeight& w, const GateUpArgs& g) { int4_call(w, g); }

}  // namespace tandem
