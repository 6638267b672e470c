// Inputs in the AMX kernels' tile order (kernels.h: pack_row_tiles, GemmArgs::a_tiles):
// the layout itself on every CPU, and on AMX CPUs the AMX kernels giving the same bits
// from packed tiles as from plain rows, for every format, across row chunks and panel
// ranges.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernel_variants.h"
#include "tandem/error.h"
#include "tandem/kernels.h"
#include "test_util.h"

namespace tandem {
namespace {

TEST(PackRowTiles, LayoutRowBlocksThenStepsThenRows) {
  const int m = 37;
  const size_t row_bytes = 192, lda = 200;  // 3 steps per row; rows not 64-byte apart
  std::vector<unsigned char> a(m * lda);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<unsigned char>(i * 7 + 3);
  ASSERT_EQ(row_tiles_bytes(m, row_bytes), 48 * row_bytes);  // 3 blocks of 16 rows
  AlignedBuffer out = AlignedBuffer::allocate(row_tiles_bytes(m, row_bytes));
  std::memset(out.data(), 0xAB, out.size);
  pack_row_tiles(a.data(), lda, m, row_bytes, out.data());
  const auto* o = reinterpret_cast<const unsigned char*>(out.data());
  for (int r = 0; r < 48; ++r)
    for (size_t s = 0; s < 3; ++s)
      for (size_t b = 0; b < 64; ++b) {
        const unsigned char got = o[(r / 16) * 3 * 1024 + s * 1024 + (r % 16) * 64 + b];
        const unsigned char want = r < m ? a[r * lda + s * 64 + b] : 0;
        ASSERT_EQ(got, want) << "row " << r << " step " << s << " byte " << b;
      }
}

TEST(PackRowTiles, RefusesRowsThatAreNotWholeSteps) {
  std::vector<unsigned char> a(100);
  AlignedBuffer out = AlignedBuffer::allocate(4096);
  EXPECT_THROW(pack_row_tiles(a.data(), 100, 1, 100, out.data()), Error);
}

const KernelListEntry* amx_line(KernelFamily f) {
  for (const KernelListEntry& e : kernel_list())
    if (e.family == f && std::string(e.isa) == "amx") return &e;
  return nullptr;
}

TEST(PackRowTiles, TakenByTheAmxKernelsWhereTheirStepsAreRowBytes) {
  for (KernelFamily f : {KernelFamily::bf16, KernelFamily::int8, KernelFamily::int4}) {
    const KernelListEntry* e = amx_line(f);
    ASSERT_TRUE(e) << "kernel_list.inc lacks the " << family_name(f) << " amx line";
    EXPECT_TRUE(e->kernel.row_tiles) << e->name();
  }
  for (const KernelListEntry& e : kernel_list())
    if (std::string(e.isa) != "amx") EXPECT_FALSE(e.kernel.row_tiles) << e.name();
  const KernelVariant& bf16 = amx_line(KernelFamily::bf16)->kernel;
  const KernelVariant& int4 = amx_line(KernelFamily::int4)->kernel;
  EXPECT_TRUE(takes_row_tiles(bf16, pack_layout({WeightFormat::bf16}, 64, 96)));
  EXPECT_FALSE(takes_row_tiles(bf16, pack_layout({WeightFormat::bf16}, 64, 80)));  // k % 32: the AVX512_BF16 kernel runs
  EXPECT_TRUE(takes_row_tiles(int4, pack_layout({WeightFormat::int4, 128, true}, 64, 256)));
  EXPECT_TRUE(takes_row_tiles(int4, pack_layout({WeightFormat::int4, 64, false}, 64, 256)));
  EXPECT_FALSE(takes_row_tiles(int4, pack_layout({WeightFormat::int4, 32, true}, 64, 256)));  // 32-byte steps
  EXPECT_EQ(row_tile_row_bytes(pack_layout({WeightFormat::bf16}, 64, 96)), 192u);
  EXPECT_EQ(row_tile_row_bytes(pack_layout({WeightFormat::int8}, 64, 100)), 128u);  // k_pad
}

struct Case {
  const char* name;
  PackOptions opt;
  int k;
};

// The AMX kernels from tiles against the same kernels from plain rows: the same bits
// (the tiles are the bytes pack_a would copy). m past 512 crosses a row chunk; the panel
// ranges start past 0 (a call of a work item).
TEST(PackRowTiles, AmxKernelsGiveTheSameBitsFromTiles) {
  const KernelListEntry* bf16_line = amx_line(KernelFamily::bf16);
  ASSERT_TRUE(bf16_line);
  TANDEM_SKIP_UNLESS_CPU_RUNS(*bf16_line);
  const uint64_t seed = test::test_seed();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const Case cases[] = {{"bf16", {WeightFormat::bf16}, 320},
                        {"int8", {WeightFormat::int8}, 300},
                        {"int4_g64_asym", {WeightFormat::int4, 64, false}, 384},
                        {"int4_g128_sym", {WeightFormat::int4, 128, true}, 512},
                        {"int4_g32_sym (tiles ignored)", {WeightFormat::int4, 32, true}, 256}};
  for (const Case& c : cases) {
    const KernelFamily fam = family_of(c.opt.format);
    const KernelVariant& kv = amx_line(fam)->kernel;
    const int n = 200, k = c.k;  // 4 panels, the last partial
    std::vector<float> wg(static_cast<size_t>(n) * k), wu(wg.size());
    for (auto& x : wg) x = nd(rng);
    for (auto& x : wu) x = nd(rng);
    const PackedWeight pw = pack({wg.data(), SourceType::f32, n, k}, c.opt);
    const PackedWeight gu = pack_gate_up({wg.data(), SourceType::f32, n, k}, {wu.data(), SourceType::f32, n, k}, c.opt);
    for (int m : {3, 16, 45, 100, 530}) {
      const int lda = k + 8;  // rows not a power of two apart either way
      std::vector<bf16_t> a(static_cast<size_t>(m) * lda);
      for (auto& x : a) x = fp32_to_bf16(nd(rng));
      QuantizedActs qa;
      const bool quant = c.opt.format != WeightFormat::bf16;
      if (quant) {
        qa.prepare(pw, m);
        quantize_activations(qa, a.data(), lda, 0, m);
      }
      const size_t rb = row_tile_row_bytes(pw);
      AlignedBuffer tiles = AlignedBuffer::allocate(row_tiles_bytes(m, rb));
      if (quant)
        pack_row_tiles(qa.q.data(), static_cast<size_t>(qa.k_pad), m, rb, tiles.data());
      else
        pack_row_tiles(a.data(), static_cast<size_t>(lda) * sizeof(bf16_t), m, rb, tiles.data());
      for (int begin : {0, 1}) {
        std::vector<float> c_rows(static_cast<size_t>(m) * n, -1.f), c_tiles(c_rows), h_rows(c_rows), h_tiles(c_rows);
        for (int v = 0; v < 2; ++v) {
          GemmArgs g;
          g.a = quant ? nullptr : a.data();
          g.qa = quant ? &qa : nullptr;
          g.m = m;
          g.lda = lda;
          g.c = (v ? c_tiles : c_rows).data();
          g.ldc = n;
          g.panel_begin = begin;
          g.a_tiles = v ? tiles.data() : nullptr;
          kv.gemm(pw, g);
          GateUpArgs u;
          u.a = g.a;
          u.qa = g.qa;
          u.m = m;
          u.lda = lda;
          u.h = (v ? h_tiles : h_rows).data();
          u.ldh = n;
          u.panel_begin = begin;
          u.a_tiles = g.a_tiles;
          kv.gate_up(gu, u);
        }
        EXPECT_EQ(c_rows, c_tiles) << c.name << " gemm, m = " << m << ", panels from " << begin << ", seed=" << seed;
        EXPECT_EQ(h_rows, h_tiles) << c.name << " gate_up, m = " << m << ", panels from " << begin << ", seed=" << seed;
      }
    }
  }
}

}  // namespace
}  // namespace tandem
