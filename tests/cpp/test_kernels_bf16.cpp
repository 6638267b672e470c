// Every BF16 kernel variant of cpu_kernels/kernel_list.inc that the machine can run
// (the rest skip with the missing feature named), against an fp64 reference on the
// same bf16 values.
//
// Tolerance, from the arithmetic: each output sums k exact bf16 x bf16 products in
// fp32 (a product of two 8-bit significands fits fp32 exactly), so its error is that
// of k + 2 fp32 roundings (k adds, the split-accumulator merge, the final scale):
//   |c - ref| <= (k + 4) * 2^-24 * sum_c |a_c w_c|
// Indexing or packing mistakes give errors of the order of the values themselves,
// hundreds of times above this bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>

#include <cmath>
#include <random>

#include "tandem/error.h"
#include "kernel_variants.h"
#include "tandem/kernels.h"
#include "test_util.h"

namespace tandem {
namespace {

using test::gemm_args;

constexpr double kU = 1.0 / (1 << 24);  // fp32 unit roundoff

struct Problem {
  int m, n, k;
  std::vector<bf16_t> a, w;  // a [m x lda], w [n x k]
  int lda;
};

Problem make(int m, int n, int k, std::mt19937_64& rng, int lda_pad = 0) {
  std::normal_distribution<float> d(0.f, 1.f);
  Problem p{m, n, k, {}, {}, k + lda_pad};
  p.a.resize(static_cast<size_t>(m) * p.lda + 1);
  p.w.resize(static_cast<size_t>(n) * k);
  for (auto& x : p.a) x = fp32_to_bf16(d(rng));
  for (auto& x : p.w) {  // never exactly zero: a wrong index must not hit a zero and vanish
    float v = d(rng);
    x = fp32_to_bf16(std::abs(v) < 1e-3f ? 0.5f : v);
  }
  return p;
}

// ref[r][j] = sum_c a[r][c] w[j][c] in fp64, and the error scale sum |a w|.
void reference(const Problem& p, const bf16_t* a, std::vector<double>& ref, std::vector<double>& mag) {
  ref.assign(static_cast<size_t>(p.m) * p.n, 0);
  mag.assign(ref.size(), 0);
  for (int r = 0; r < p.m; ++r)
    for (int j = 0; j < p.n; ++j) {
      double s = 0, m = 0;
      for (int c = 0; c < p.k; ++c) {
        const double t = double(bf16_to_fp32(a[static_cast<size_t>(r) * p.lda + c])) * bf16_to_fp32(p.w[static_cast<size_t>(j) * p.k + c]);
        s += t;
        m += std::abs(t);
      }
      ref[static_cast<size_t>(r) * p.n + j] = s;
      mag[static_cast<size_t>(r) * p.n + j] = m;
    }
}

class KernelsBf16 : public ::testing::TestWithParam<const KernelListEntry*> {
 protected:
  void SetUp() override {
    TANDEM_SKIP_UNLESS_CPU_RUNS(*GetParam());
    kernel = &GetParam()->kernel;
    seed = test::test_seed();
    rng.seed(seed);
  }
  const KernelVariant* kernel = nullptr;
  uint64_t seed = 0;
  std::mt19937_64 rng;
};

TEST_P(KernelsBf16, GemmMatchesReferenceOverShapes) {
  const int ms[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17, 64};
  const int ns[] = {1, 17, 64, 65, 130};
  const int ks[] = {1, 2, 3, 31, 64, 65, 258};
  std::vector<std::array<int, 3>> shapes;
  for (int m : ms)
    for (int n : ns)
      for (int k : ks)
        if (!((m * n * k) % 3 == 1 && m > 9)) shapes.push_back({m, n, k});  // thin the largest cases; edges all stay
  // Large batches: the AMX kernels' chunks of 512 rows (600 = 512 + 88) and groups of
  // panels (5 panels of accumulators for 512 rows exceed one group).
  shapes.push_back({600, 320, 96});
  shapes.push_back({600, 320, 100});
  // Several blocks of k with a short last one: at 100 rows the AMX BF16 kernel takes 32
  // steps (1024 k) per block, at 300 rows 16; 1312 k = 41 steps.
  shapes.push_back({100, 130, 1312});
  shapes.push_back({300, 64, 1312});
  int cases = 0;
  for (const auto& [m, n, k] : shapes) {
        Problem p = make(m, n, k, rng, (m + k) % 3);  // odd row strides too
        PackedWeight w = pack_bf16(p.w.data(), n, k, k);
        std::vector<float> c(static_cast<size_t>(m) * (n + 1), -7.f);
        // A misaligned on purpose (2-byte offset); C rows padded by one.
        GemmArgs g = gemm_args(p.a.data() + 1, m, p.lda, c.data(), n + 1);
        kernel->gemm(w, g);
        std::vector<double> ref, mag;
        reference(p, p.a.data() + 1, ref, mag);
        for (int r = 0; r < m; ++r) {
          for (int j = 0; j < n; ++j) {
            const double got = c[static_cast<size_t>(r) * (n + 1) + j], want = ref[static_cast<size_t>(r) * n + j];
            ASSERT_LE(std::abs(got - want), (k + 4) * kU * mag[static_cast<size_t>(r) * n + j] + 1e-30)
                << "m=" << m << " n=" << n << " k=" << k << " at [" << r << "," << j << "] seed=" << seed;
          }
          ASSERT_EQ(c[static_cast<size_t>(r) * (n + 1) + n], -7.f) << "wrote past n (ldc padding)";
        }
        ++cases;
      }
  EXPECT_GT(cases, 300);
}

TEST_P(KernelsBf16, AccumulateWithRowScaleAndPanelRange) {
  const int m = 11, n = 200, k = 96;  // 4 panels, the last one partial
  Problem p = make(m, n, k, rng);
  PackedWeight w = pack_bf16(p.w.data(), n, k, k);
  std::vector<float> c0(static_cast<size_t>(m) * n), scale(m);
  std::normal_distribution<float> d;
  for (auto& x : c0) x = d(rng);
  for (auto& x : scale) x = d(rng);
  std::vector<float> c = c0;
  GemmArgs g = gemm_args(p.a.data(), m, k, c.data(), n);
  g.accumulate = true;
  g.row_scale = scale.data();
  g.panel_begin = 1;
  g.panel_end = 3;  // outputs 64..191 only
  kernel->gemm(w, g);
  std::vector<double> ref, mag;
  reference(p, p.a.data(), ref, mag);
  for (int r = 0; r < m; ++r)
    for (int j = 0; j < n; ++j) {
      const size_t i = static_cast<size_t>(r) * n + j;
      if (j < 64 || j >= 192) {
        ASSERT_EQ(c[i], c0[i]) << "touched an output outside the panel range at [" << r << "," << j << "]";
        continue;
      }
      const double want = c0[i] + double(scale[r]) * ref[i];
      const double tol = (k + 4) * kU * std::abs(scale[r]) * mag[i] + 2 * kU * std::abs(want) + 1e-30;
      ASSERT_LE(std::abs(c[i] - want), tol) << "[" << r << "," << j << "] seed=" << seed;
    }
}

TEST_P(KernelsBf16, GateUpMatchesReference) {
  // k = 128: the AMX kernel's path (k % 32 == 0); 130: its hand-over to AVX512_BF16.
  std::vector<std::array<int, 3>> shapes;
  for (int m : {1, 3, 6, 7, 20, 40})
    for (int n : {5, 64, 100})
      for (int k : {130, 128}) shapes.push_back({m, n, k});
  shapes.push_back({600, 160, 64});  // two chunks of rows, two groups of panels
  shapes.push_back({100, 70, 1312});  // blocks of 32 steps (1024 k) and a short last one
  for (const auto& [m, n, k] : shapes) {
    {
      Problem pg = make(m, n, k, rng), pu = make(m, n, k, rng);
      pu.a = pg.a;  // same activations for both projections
      PackedWeight w = pack_gate_up_bf16(pg.w.data(), pu.w.data(), n, k, k);
      std::vector<float> h;
      std::vector<bf16_t> hb;
      test::gate_up_both(*kernel, w, pg.a.data(), m, k, h, hb, n);
      std::vector<double> rg, mg, ru, mu;
      reference(pg, pg.a.data(), rg, mg);
      reference(pu, pu.a.data(), ru, mu);
      for (size_t i = 0; i < h.size(); ++i) {
        const double gv = rg[i], uv = ru[i];
        const double silu = gv / (1 + std::exp(-gv)), want = silu * uv;
        const double eg = (k + 4) * kU * mg[i], eu = (k + 4) * kU * mu[i];
        // silu' is within [-0.1, 1.1]; the exp polynomial and the divide add a few ulp.
        const double tol = 1.1 * eg * std::abs(uv) + std::abs(silu) * eu + 8 * kU * std::abs(want) + 1e-30;
        ASSERT_LE(std::abs(h[i] - want), tol) << "m=" << m << " n=" << n << " i=" << i << " seed=" << seed;
        // bf16 output: the same value rounded to 8 significant bits.
        ASSERT_LE(std::abs(bf16_to_fp32(hb[i]) - want), tol + std::abs(want) / 256) << "bf16 out, i=" << i;
      }
    }
  }
}

// The clamped SwiGLU (GateAct::Kind::clamped) with biases on g and u: the
// pre-activations of N(0, 1) data at k = 128 have a spread of ~11, so both clamps (limit
// 7) and the unclamped range are hit. The bound is the silu one's: d/dg [g sigmoid(a g)]
// lies within [-0.1, 1.1] as silu's does, the clamps are 1-Lipschitz, and the bias add
// is one more fp32 rounding of each pre-activation.
TEST_P(KernelsBf16, GateUpClampedSwigluWithBiases) {
  // gpt-oss's (alpha 1.702, up + 1) and DeepSeek-V4's (silu of the clamped gate, up + 0).
  for (const GateAct act : {GateAct{GateAct::Kind::clamped, 1.702f, 7.0f, 1.0f}, GateAct{GateAct::Kind::clamped, 1.0f, 7.0f, 0.0f}})
  for (const auto& [m, n, k] : std::vector<std::array<int, 3>>{{1, 70, 128}, {7, 64, 130}, {40, 100, 128}, {600, 160, 64}}) {
    Problem pg = make(m, n, k, rng), pu = make(m, n, k, rng);
    pu.a = pg.a;
    const auto [bg, bu] = test::random_biases(n, rng);
    PackedWeight w = pack_gate_up_bf16(pg.w.data(), pu.w.data(), n, k, k);
    std::vector<float> h;
    std::vector<bf16_t> hb;
    test::gate_up_both(*kernel, w, pg.a.data(), m, k, h, hb, n, act, bg.data(), bu.data());
    std::vector<double> rg, mg, ru, mu;
    reference(pg, pg.a.data(), rg, mg);
    reference(pu, pu.a.data(), ru, mu);
    int clamped = 0;
    for (size_t i = 0; i < h.size(); ++i) {
      const int j = static_cast<int>(i % n);
      const double gv = rg[i] + bg[j], uv = ru[i] + bu[j];
      const double gc = std::min(gv, 7.0), uc = std::clamp(uv, -7.0, 7.0);
      const double glu = gc / (1 + std::exp(-double(act.alpha) * gc)), want = glu * (uc + act.up_offset);
      clamped += gv > 7 || std::abs(uv) > 7;
      const double eg = (k + 4) * kU * mg[i] + 2 * kU * (std::abs(rg[i]) + std::abs(bg[j]));
      const double eu = (k + 4) * kU * mu[i] + 2 * kU * (std::abs(ru[i]) + std::abs(bu[j]));
      const double tol = 1.1 * eg * std::abs(uc + act.up_offset) + std::abs(glu) * eu + 8 * kU * std::abs(want) + 1e-30;
      ASSERT_LE(std::abs(h[i] - want), tol) << "m=" << m << " n=" << n << " i=" << i << " seed=" << seed;
      ASSERT_LE(std::abs(bf16_to_fp32(hb[i]) - want), tol + std::abs(want) / 256) << "bf16 out, i=" << i;
    }
    EXPECT_GT(clamped, 0) << "the test input never reached the clamps";
  }
}

TEST_P(KernelsBf16, NanAndInfPropagate) {
  const int m = 4, n = 70, k = 33;
  Problem p = make(m, n, k, rng);
  p.a[static_cast<size_t>(1) * k + 5] = 0x7fc0;   // NaN in row 1
  p.a[static_cast<size_t>(2) * k + 32] = 0x7f80;  // +Inf in row 2 (the odd-k tail column)
  PackedWeight w = pack_bf16(p.w.data(), n, k, k);
  std::vector<float> c(static_cast<size_t>(m) * n);
  kernel->gemm(w, gemm_args(p.a.data(), m, k, c.data(), n));
  for (int j = 0; j < n; ++j) {
    EXPECT_TRUE(std::isfinite(c[j])) << j;
    EXPECT_TRUE(std::isnan(c[n + j])) << j;
    EXPECT_TRUE(std::isinf(c[2 * n + j])) << j;
    EXPECT_TRUE(std::isfinite(c[3 * n + j])) << j;
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, KernelsBf16, ::testing::ValuesIn(test::list_entries({KernelFamily::bf16})),
                         [](const auto& info) { return test::variant_name(*info.param, false); });

TEST(PackBf16, RoundTripsExactly) {
  std::mt19937_64 rng(test::test_seed());
  for (auto [n, k] : {std::pair{1, 1}, {63, 7}, {64, 64}, {65, 129}}) {
    Problem p = make(1, n, k, rng);
    EXPECT_EQ(unpack(pack_bf16(p.w.data(), n, k, k)), [&] {
      std::vector<float> v(p.w.size());
      for (size_t i = 0; i < v.size(); ++i) v[i] = bf16_to_fp32(p.w[i]);
      return v;
    }()) << n << "x" << k;
  }
}

TEST(PackBf16, FromFp32RoundsToNearestEven) {
  EXPECT_EQ(fp32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(fp32_to_bf16(1.00390625f), 0x3f80);   // halfway, even stays
  EXPECT_EQ(fp32_to_bf16(1.01171875f), 0x3f82);   // halfway, odd rounds up
  EXPECT_EQ(fp32_to_bf16(INFINITY), 0x7f80);
  EXPECT_TRUE(std::isnan(bf16_to_fp32(fp32_to_bf16(NAN))));
  EXPECT_EQ(fp32_to_bf16(3.4e38f), 0x7f80);        // rounds to Inf, as RNE must
  const float w[] = {1.5f, -2.25f, 3.0f};
  EXPECT_EQ(unpack(pack_bf16_from_fp32(w, 1, 3, 3)), (std::vector<float>{1.5f, -2.25f, 3.0f}));
}

TEST(KernelsApi, RejectsBadArguments) {
  bf16_t wv[4 * 8] = {};
  PackedWeight w = pack_bf16(wv, 4, 8, 8);
  bf16_t a[16] = {};
  float c[16];
  GemmArgs g = gemm_args(a, 2, 7, c, 4);
  EXPECT_EQ(test::error_of([&] { gemm(w, g); }), "gemm: lda = 7 is smaller than k = 8");
  g.lda = 8;
  g.panel_end = 2;
  EXPECT_EQ(test::error_of([&] { gemm(w, g); }), "gemm: panel range [0, 2) is outside the weight's 1 panels");
  g.panel_end = -1;
  g.c = nullptr;
  EXPECT_EQ(test::error_of([&] { gemm(w, g); }), "gemm: null output pointer");
  GateUpArgs u;
  u.a = a;
  u.m = 1;
  u.lda = 8;
  u.ldh = 4;
  EXPECT_EQ(test::error_of([&] { gate_up(w, u); }), "gate_up: the weight is not a gate_up pack (pack_gate_up)");
  PackedWeight gu = pack_gate_up_bf16(wv, wv, 4, 8, 8);
  EXPECT_EQ(test::error_of([&] { gate_up(gu, u); }), "gate_up: give exactly one output (fp32 h or bf16 h_bf16)");
  EXPECT_EQ(test::error_of([&] { pack_bf16(wv, 4, 8, 6); }), "pack: weight leading dimension 6 is smaller than k = 8");
  EXPECT_EQ(test::error_of([&] { pack_bf16(nullptr, 4, 8, 8); }), "pack: weight pointer is null");
}

TEST(KernelsApi, LevelAboveHardwareIsRefused) {
  if (hardware_isa() == IsaLevel::amx) GTEST_SKIP() << "every level is available here";
  Errc code{};
  const std::string msg = test::error_of([] { kernel_table(IsaLevel::amx); }, &code);
  EXPECT_EQ(code, Errc::unsupported);
  EXPECT_EQ(msg.rfind("kernels for amx need ", 0), 0u) << msg;
}

}  // namespace
}  // namespace tandem
