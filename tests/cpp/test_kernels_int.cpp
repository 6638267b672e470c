// INT8 / INT4 packing, activation quantization and every integer kernel variant of
// cpu_kernels/kernel_list.inc that the machine can run (the rest skip, naming the
// missing feature).
//
// Kernel tolerance, from the arithmetic: the reference is the fp64 product of the same
// dequantized weights (unpack) and the same quantized activations
// (quantize_activations). The kernel's integer dot products are exact; what rounds is
// fp32: per group one conversion and one multiply-add (G groups), then the weight scale,
// the activation scale, the row scale and the accumulate, so
//   |c - ref| <= (2G + 6) * 2^-24 * sum_c |w_c a_c|.
// Packing or indexing mistakes give errors of the order of the values themselves.
//
// Quantization error (weights and activations vs fp32) is measured against the
// uniform-rounding model: a value rounded to a grid of step s is off by a uniform
// error of variance s^2 / 12, so the output error's variance is predicted from the
// actual scales; the measured relative L2 error must sit within [0.8, 1.2] x that
// (measured: int8 0.0113, int4 g32 sym 0.100, g64 asym 0.094, g128 sym 0.118, g128
// asym 0.104, each within 3% of the prediction, for N(0, 1) weights and activations).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <tuple>

#include "tandem/error.h"
#include "kernel_variants.h"
#include "tandem/kernels.h"
#include "test_util.h"

namespace tandem {
namespace {

using test::gemm_args;

constexpr double kU = 1.0 / (1 << 24);

struct FormatCase {
  const char* name;
  PackOptions opt;
};
const FormatCase kFormats[] = {
    {"int8", {WeightFormat::int8, 0, true}},
    {"int4_g32_sym", {WeightFormat::int4, 32, true}},
    {"int4_g64_asym", {WeightFormat::int4, 64, false}},
    {"int4_g128_sym", {WeightFormat::int4, 128, true}},
    {"int4_g128_asym", {WeightFormat::int4, 128, false}},
    {"mxfp4", pack_options("mxfp4", 32, false)},
};

// The rounding step around v in a group whose values span [lo, hi] (lo <= 0 <= hi): int8
// and int4 grids are uniform; MXFP4's step is 2^(e-1), 2^e or 2^(e+1) as |v| / 2^e is
// below 2, below 4, or up to 6, e the smallest exponent with max|w| <= 6 * 2^e.
double grid_step(const PackOptions& o, double lo, double hi, double v) {
  const double amax = std::max(-lo, hi);
  if (o.format == WeightFormat::int8) return amax / 127.0;
  if (!o.e2m1) return o.symmetric ? amax / 7.0 : (hi - lo) / 15.0;
  int e = -23;
  while (amax > std::ldexp(6.0, e)) ++e;
  const double x = std::abs(v) / std::ldexp(1.0, e);
  return std::ldexp(x < 2 ? 0.5 : x < 4 ? 1.0 : 2.0, e);
}

void PrintTo(const FormatCase& f, std::ostream* os) { *os << f.name; }

std::vector<float> random_weights(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> w(n);
  for (auto& x : w) {
    const float v = d(rng);
    x = std::abs(v) < 1e-3f ? 0.5f : v;  // never zero
  }
  return w;
}

std::vector<bf16_t> random_acts(size_t n, std::mt19937_64& rng) {
  std::vector<bf16_t> a(n);
  std::normal_distribution<float> d(0.f, 1.f);
  for (auto& x : a) {
    const float v = d(rng);
    x = fp32_to_bf16(std::abs(v) < 1e-3f ? -0.25f : v);
  }
  return a;
}

// Quantized activations as the kernels see them, dequantized to fp64.
std::vector<double> dequantized_acts(const PackedWeight& w, const bf16_t* a, int m, int lda) {
  const int groups = w.k_pad / w.group;
  std::vector<int8_t> q(static_cast<size_t>(m) * w.k_pad);
  std::vector<float> s(m);
  std::vector<int32_t> sums(static_cast<size_t>(m) * groups);
  quantize_activations(a, m, w.k, lda, w.k_pad, w.group, q.data(), s.data(), sums.data());
  std::vector<double> out(static_cast<size_t>(m) * w.k);
  for (int r = 0; r < m; ++r)
    for (int c = 0; c < w.k; ++c) out[static_cast<size_t>(r) * w.k + c] = double(s[r]) * q[static_cast<size_t>(r) * w.k_pad + c];
  return out;
}

// ref[r][j] = sum_c W[j][c] a[r][c] in fp64 and mag = sum |.|; W rows from offset row0.
void reference(const std::vector<float>& wdq, int row0, int n, int k, const std::vector<double>& a, int m,
               std::vector<double>& ref, std::vector<double>& mag) {
  ref.assign(static_cast<size_t>(m) * n, 0);
  mag.assign(ref.size(), 0);
  for (int r = 0; r < m; ++r)
    for (int j = 0; j < n; ++j) {
      double s = 0, g = 0;
      for (int c = 0; c < k; ++c) {
        const double t = double(wdq[static_cast<size_t>(row0 + j) * k + c]) * a[static_cast<size_t>(r) * k + c];
        s += t;
        g += std::abs(t);
      }
      ref[static_cast<size_t>(r) * n + j] = s;
      mag[static_cast<size_t>(r) * n + j] = g;
    }
}

using Param = std::tuple<const KernelListEntry*, FormatCase>;

// Each int8 line with the int8 case, each int4 line with every int4 case.
std::vector<Param> variant_cases() {
  std::vector<Param> out;
  for (const KernelListEntry* e : test::list_entries({KernelFamily::int8, KernelFamily::int4}))
    for (const FormatCase& f : kFormats)
      if (family_of(f.opt.format) == e->family) out.emplace_back(e, f);
  return out;
}

class KernelsInt : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    const KernelListEntry& e = *std::get<0>(GetParam());
    TANDEM_SKIP_UNLESS_CPU_RUNS(e);
    opt = std::get<1>(GetParam()).opt;
    variants.push_back(&e.kernel);
    seed = test::test_seed();
    rng.seed(seed);
  }
  std::vector<int> ks() const {
    if (opt.format == WeightFormat::int8) return {1, 3, 31, 64, 65, 200};
    return {opt.group, 2 * opt.group, 5 * opt.group};
  }
  double bound(const PackedWeight& w, double mag) const { return (2.0 * w.groups() + 6) * kU * mag + 1e-30; }
  PackOptions opt;
  std::vector<const KernelVariant*> variants;
  uint64_t seed = 0;
  std::mt19937_64 rng;
};

TEST_P(KernelsInt, GemmMatchesReferenceOverShapes) {
  const int ms[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 40};
  const int ns[] = {1, 17, 64, 65, 130};
  std::vector<std::array<int, 3>> shapes;
  for (int m : ms)
    for (int n : ns)
      for (int k : ks())
        if (!((m * n + k) % 3 != 0 && m > 7)) shapes.push_back({m, n, k});  // thin the larger cases; every m keeps some
  // Large batches: the AMX kernels' chunks of 512 rows (600 = 512 + 88) and groups of
  // panels (5 panels of accumulators for 512 rows exceed one group).
  shapes.push_back({600, 320, ks()[1]});
  // INT8 on AMX: 16-step blocks (1024 k) at 100 rows and a short last one (1216 k).
  if (opt.format == WeightFormat::int8) shapes.push_back({100, 70, 1216});
  int cases = 0;
  for (const KernelVariant* v : variants)
    for (const auto& [m, n, k] : shapes) {
          const int lda = k + (m + k) % 3;
          auto w = random_weights(static_cast<size_t>(n) * k, rng);
          auto a = random_acts(static_cast<size_t>(m) * lda + 1, rng);
          PackedWeight pw = pack({w.data(), SourceType::f32, n, k}, opt);
          std::vector<float> c(static_cast<size_t>(m) * (n + 1), -7.f);
          v->gemm(pw, gemm_args(a.data() + 1, m, lda, c.data(), n + 1));  // A misaligned on purpose
          std::vector<double> ref, mag;
          reference(unpack(pw), 0, n, k, dequantized_acts(pw, a.data() + 1, m, lda), m, ref, mag);
          for (int r = 0; r < m; ++r) {
            for (int j = 0; j < n; ++j) {
              const size_t i = static_cast<size_t>(r) * n + j;
              ASSERT_LE(std::abs(c[static_cast<size_t>(r) * (n + 1) + j] - ref[i]), bound(pw, mag[i]))
                  << v->name << " m=" << m << " n=" << n << " k=" << k << " at [" << r << "," << j << "] seed=" << seed;
            }
            ASSERT_EQ(c[static_cast<size_t>(r) * (n + 1) + n], -7.f) << "wrote past n (ldc padding)";
          }
          ++cases;
        }
  EXPECT_GT(cases, 100);
}

TEST_P(KernelsInt, Fp32InputAccumulateRowScaleAndPanelRange) {
  const int m = 11, n = 200, k = ks()[3 % ks().size()];  // 4 panels, the last one partial
  auto w = random_weights(static_cast<size_t>(n) * k, rng);
  auto af = random_weights(static_cast<size_t>(m) * k, rng);
  PackedWeight pw = pack({w.data(), SourceType::f32, n, k}, opt);
  std::vector<float> c0(static_cast<size_t>(m) * n), scale(m);
  std::normal_distribution<float> d;
  for (auto& x : c0) x = d(rng);
  for (auto& x : scale) x = d(rng);
  // Reference activations: the fp32 rows quantized the way the kernel does.
  std::vector<int8_t> q(static_cast<size_t>(m) * pw.k_pad);
  std::vector<float> s(m);
  std::vector<int32_t> sums(static_cast<size_t>(m) * (pw.k_pad / pw.group));
  quantize_activations(af.data(), m, k, k, pw.k_pad, pw.group, q.data(), s.data(), sums.data());
  std::vector<double> aq(static_cast<size_t>(m) * k);
  for (int r = 0; r < m; ++r)
    for (int c = 0; c < k; ++c) aq[static_cast<size_t>(r) * k + c] = double(s[r]) * q[static_cast<size_t>(r) * pw.k_pad + c];
  std::vector<double> ref, mag;
  reference(unpack(pw), 0, n, k, aq, m, ref, mag);
  for (const KernelVariant* v : variants) {
    std::vector<float> c = c0;
    GemmArgs g = gemm_args(af.data(), m, k, c.data(), n);
    g.accumulate = true;
    g.row_scale = scale.data();
    g.panel_begin = 1;
    g.panel_end = 3;
    v->gemm(pw, g);
    for (int r = 0; r < m; ++r)
      for (int j = 0; j < n; ++j) {
        const size_t i = static_cast<size_t>(r) * n + j;
        if (j < 64 || j >= 192) {
          ASSERT_EQ(c[i], c0[i]) << "touched an output outside the panel range at [" << r << "," << j << "]";
          continue;
        }
        const double want = c0[i] + double(scale[r]) * ref[i];
        ASSERT_LE(std::abs(c[i] - want), bound(pw, std::abs(scale[r]) * mag[i]) + 2 * kU * std::abs(want))
            << v->name << " [" << r << "," << j << "] seed=" << seed;
      }
  }
}

TEST_P(KernelsInt, PrequantizedInputGivesTheSameBits) {
  const int m = 13, n = 130, k = ks().back();
  auto w = random_weights(static_cast<size_t>(n) * k, rng);
  auto a = random_acts(static_cast<size_t>(m) * k, rng);
  PackedWeight pw = pack({w.data(), SourceType::f32, n, k}, opt);
  QuantizedActs qa;
  qa.prepare(pw, m);
  quantize_activations(qa, a.data(), k, 0, 5);  // in two row ranges, as two threads would
  quantize_activations(qa, a.data(), k, 5, m);
  for (const KernelVariant* v : variants) {
    std::vector<float> c1(static_cast<size_t>(m) * n), c2(c1.size());
    GemmArgs g = gemm_args(a.data(), m, k, c1.data(), n);
    v->gemm(pw, g);
    g.a = nullptr;
    g.qa = &qa;
    g.c = c2.data();
    v->gemm(pw, g);
    EXPECT_EQ(c1, c2) << v->name;
  }
  std::vector<float> c(static_cast<size_t>(m + 1) * n);
  GemmArgs g = gemm_args(static_cast<const bf16_t*>(nullptr), m + 1, 0, c.data(), n);
  g.qa = &qa;
  EXPECT_EQ(test::error_of([&] { gemm(pw, g); }), "gemm: quantized activations hold 13 rows, m = 14");
  PackedWeight other = pack({w.data(), SourceType::f32, n / 2, 2 * k}, opt);
  g.m = m;
  EXPECT_EQ(test::error_of([&] { gemm(other, g); }).rfind("gemm: quantized activations (k ", 0), 0u);
}

TEST_P(KernelsInt, GateUpMatchesReference) {
  for (const KernelVariant* v : variants)
    for (const auto& [m, n] : std::vector<std::pair<int, int>>{{1, 5}, {1, 64}, {1, 100}, {3, 5}, {3, 64}, {3, 100},
                                                                {6, 5}, {6, 100}, {17, 64}, {17, 100}, {40, 100},
                                                                {600, 160}}) {  // 600: two chunks, two panel groups
      {
        const int k = ks()[1];
        auto wg = random_weights(static_cast<size_t>(n) * k, rng), wu = random_weights(static_cast<size_t>(n) * k, rng);
        auto a = random_acts(static_cast<size_t>(m) * k, rng);
        PackedWeight pw = pack_gate_up({wg.data(), SourceType::f32, n, k}, {wu.data(), SourceType::f32, n, k}, opt);
        std::vector<float> h;
        std::vector<bf16_t> hb;
        test::gate_up_both(*v, pw, a.data(), m, k, h, hb, n);
        const auto wdq = unpack(pw);  // gate rows, then up rows
        const auto aq = dequantized_acts(pw, a.data(), m, k);
        std::vector<double> rg, mg, ru, mu;
        reference(wdq, 0, n, k, aq, m, rg, mg);
        reference(wdq, n, n, k, aq, m, ru, mu);
        for (size_t i = 0; i < h.size(); ++i) {
          const double gv = rg[i], uv = ru[i];
          const double silu = gv / (1 + std::exp(-gv)), want = silu * uv;
          // silu' is within [-0.1, 1.1]; the exp polynomial and the divide add a few ulp.
          const double tol = 1.1 * bound(pw, mg[i]) * std::abs(uv) + std::abs(silu) * bound(pw, mu[i]) + 8 * kU * std::abs(want);
          ASSERT_LE(std::abs(h[i] - want), tol) << v->name << " m=" << m << " n=" << n << " i=" << i << " seed=" << seed;
          ASSERT_LE(std::abs(bf16_to_fp32(hb[i]) - want), tol + std::abs(want) / 256) << "bf16 out, i=" << i;
        }
      }
    }
}

// The clamped SwiGLU with biases (see the BF16 test of the same name for the
// bound): the silu bound of the test above, plus one fp32 rounding for each bias add.
TEST_P(KernelsInt, GateUpClampedSwigluWithBiases) {
  for (const GateAct act : {GateAct{GateAct::Kind::clamped, 1.702f, 7.0f, 1.0f}, GateAct{GateAct::Kind::clamped, 1.0f, 7.0f, 0.0f}})
  for (const KernelVariant* v : variants)
    for (const auto& [m, n] : std::vector<std::pair<int, int>>{{1, 70}, {6, 100}, {40, 100}, {600, 160}}) {
      const int k = ks()[1];
      auto wg = random_weights(static_cast<size_t>(n) * k, rng), wu = random_weights(static_cast<size_t>(n) * k, rng);
      auto a = random_acts(static_cast<size_t>(m) * k, rng);
      const auto [bg, bu] = test::random_biases(n, rng);
      PackedWeight pw = pack_gate_up({wg.data(), SourceType::f32, n, k}, {wu.data(), SourceType::f32, n, k}, opt);
      std::vector<float> h;
      std::vector<bf16_t> hb;
      test::gate_up_both(*v, pw, a.data(), m, k, h, hb, n, act, bg.data(), bu.data());
      const auto wdq = unpack(pw);
      const auto aq = dequantized_acts(pw, a.data(), m, k);
      std::vector<double> rg, mg, ru, mu;
      reference(wdq, 0, n, k, aq, m, rg, mg);
      reference(wdq, n, n, k, aq, m, ru, mu);
      for (size_t i = 0; i < h.size(); ++i) {
        const int j = static_cast<int>(i % n);
        const double gv = rg[i] + bg[j], uv = ru[i] + bu[j];
        const double gc = std::min(gv, 7.0), uc = std::clamp(uv, -7.0, 7.0);
        const double glu = gc / (1 + std::exp(-double(act.alpha) * gc)), want = glu * (uc + act.up_offset);
        const double eg = bound(pw, mg[i]) + 2 * kU * (std::abs(rg[i]) + std::abs(bg[j]));
        const double eu = bound(pw, mu[i]) + 2 * kU * (std::abs(ru[i]) + std::abs(bu[j]));
        const double tol = 1.1 * eg * std::abs(uc + act.up_offset) + std::abs(glu) * eu + 8 * kU * std::abs(want);
        ASSERT_LE(std::abs(h[i] - want), tol) << v->name << " m=" << m << " n=" << n << " i=" << i << " seed=" << seed;
        ASSERT_LE(std::abs(bf16_to_fp32(hb[i]) - want), tol + std::abs(want) / 256) << "bf16 out, i=" << i;
      }
    }
}

TEST_P(KernelsInt, NanAndInfRowsBecomeNan) {
  const int m = 4, n = 70, k = ks().back();
  auto w = random_weights(static_cast<size_t>(n) * k, rng);
  auto a = random_acts(static_cast<size_t>(m) * k, rng);
  a[static_cast<size_t>(1) * k + 5] = 0x7fc0;      // NaN in row 1
  a[static_cast<size_t>(2) * k + k - 1] = 0xff80;  // -Inf in row 2, last column
  PackedWeight pw = pack({w.data(), SourceType::f32, n, k}, opt);
  for (const KernelVariant* v : variants) {
    std::vector<float> c(static_cast<size_t>(m) * n);
    v->gemm(pw, gemm_args(a.data(), m, k, c.data(), n));
    for (int j = 0; j < n; ++j) {
      EXPECT_TRUE(std::isfinite(c[j])) << v->name << " " << j;
      EXPECT_TRUE(std::isnan(c[n + j])) << v->name << " " << j;
      EXPECT_TRUE(std::isnan(c[2 * n + j])) << v->name << " " << j;
      EXPECT_TRUE(std::isfinite(c[3 * n + j])) << v->name << " " << j;
    }
  }
}

TEST_P(KernelsInt, QuantizationErrorMatchesTheRoundingModel) {
  const int m = 8, n = 256, k = 1024;
  auto w = random_weights(static_cast<size_t>(n) * k, rng);
  auto af = random_weights(static_cast<size_t>(m) * k, rng);
  PackedWeight pw = pack({w.data(), SourceType::f32, n, k}, opt);
  std::vector<float> c(static_cast<size_t>(m) * n);
  variants[0]->gemm(pw, gemm_args(af.data(), m, k, c.data(), n));
  // Exact product of the unquantized fp32 values, and the predicted error variance.
  std::vector<float> amax(m, 0.f);
  for (int r = 0; r < m; ++r)
    for (int c2 = 0; c2 < k; ++c2) amax[r] = std::max(amax[r], std::abs(af[static_cast<size_t>(r) * k + c2]));
  // The weights' grid steps: one scale per row (int8) or per row and group (int4).
  std::vector<double> step(static_cast<size_t>(n) * k);
  const int group = opt.format == WeightFormat::int8 ? k : opt.group;
  for (int j = 0; j < n; ++j)
    for (int g0 = 0; g0 < k; g0 += group) {
      double lo = 0, hi = 0;
      for (int c2 = g0; c2 < g0 + group; ++c2) {
        lo = std::min(lo, double(w[static_cast<size_t>(j) * k + c2]));
        hi = std::max(hi, double(w[static_cast<size_t>(j) * k + c2]));
      }
      for (int c2 = g0; c2 < g0 + group; ++c2)
        step[static_cast<size_t>(j) * k + c2] = grid_step(opt, lo, hi, w[static_cast<size_t>(j) * k + c2]);
    }
  double err2 = 0, ref2 = 0, pred2 = 0;
  for (int r = 0; r < m; ++r) {
    const double sa = amax[r] / 127.0;
    for (int j = 0; j < n; ++j) {
      double y = 0, var = 0;
      for (int c2 = 0; c2 < k; ++c2) {
        const size_t i = static_cast<size_t>(j) * k + c2;
        const double wv = w[i], av = af[static_cast<size_t>(r) * k + c2];
        y += wv * av;
        var += (av * av * step[i] * step[i] + wv * wv * sa * sa) / 12.0;
      }
      const double e = c[static_cast<size_t>(r) * n + j] - y;
      err2 += e * e;
      ref2 += y * y;
      pred2 += var;
    }
  }
  const double measured = std::sqrt(err2 / ref2), predicted = std::sqrt(pred2 / ref2);
  std::printf("[ quant    ] %s: relative L2 error vs fp32 %.4f (rounding model predicts %.4f)\n",
              std::get<1>(GetParam()).name, measured, predicted);
  RecordProperty("relative_l2_error", std::to_string(measured));
  EXPECT_GE(measured, 0.8 * predicted) << "less error than rounding allows: is the input really quantized?";
  EXPECT_LE(measured, 1.2 * predicted) << "seed=" << seed;
}

INSTANTIATE_TEST_SUITE_P(Variants, KernelsInt, ::testing::ValuesIn(variant_cases()), [](const auto& info) {
  return test::variant_name(*std::get<0>(info.param), false) + "_" + std::get<1>(info.param).name;
});

// The AMX integer kernels give the AVX512-VNNI kernels' bits: both compute each group's
// int32 dot product exactly (VNNI as sum(q_a (q_w + 128)) or sum(q_a q_w) - zero sum(q_a),
// AMX INT4 as sum(q_a (q_w - zero)): the same integer) and scale it in the same fp32
// operations, in group order. Rows from the AMX kernels' smallest m, several row pairs,
// several blocks of k, both products; every format case.
TEST(KernelsIntAmx, SameBitsAsAvx512Vnni) {
  const KernelListEntry *amx[2] = {}, *vnni[2] = {};
  for (const KernelListEntry& e : kernel_list()) {
    const int f = e.family == KernelFamily::int8 ? 0 : e.family == KernelFamily::int4 ? 1 : -1;
    if (f < 0) continue;
    if (std::string(e.isa) == "amx") amx[f] = &e;
    if (std::string(e.isa) == "avx512vnni") vnni[f] = &e;
  }
  ASSERT_TRUE(amx[0] && amx[1] && vnni[0] && vnni[1]) << "kernel_list.inc lacks an amx or avx512_vnni line";
  TANDEM_SKIP_UNLESS_CPU_RUNS(*amx[0]);
  TANDEM_SKIP_UNLESS_CPU_RUNS(*vnni[0]);
  const uint64_t seed = test::test_seed();
  std::mt19937_64 rng(seed);
  for (const FormatCase& fc : kFormats) {
    const int f = fc.opt.format == WeightFormat::int8 ? 0 : 1;
    const int k = fc.opt.format == WeightFormat::int8 ? 1216 : 12 * fc.opt.group;
    for (int m : {8, 40, 100}) {
      const int n = 130;
      auto wg = random_weights(static_cast<size_t>(n) * k, rng), wu = random_weights(static_cast<size_t>(n) * k, rng);
      auto a = random_acts(static_cast<size_t>(m) * k, rng);
      const PackedWeight pw = pack({wg.data(), SourceType::f32, n, k}, fc.opt);
      const PackedWeight gu = pack_gate_up({wg.data(), SourceType::f32, n, k}, {wu.data(), SourceType::f32, n, k}, fc.opt);
      std::vector<float> c[2], h[2];
      for (int v = 0; v < 2; ++v) {
        const KernelVariant& kv = (v ? vnni : amx)[f]->kernel;
        c[v].assign(static_cast<size_t>(m) * n, 0.0f);
        kv.gemm(pw, gemm_args(a.data(), m, k, c[v].data(), n));
        h[v].assign(static_cast<size_t>(m) * n, 0.0f);
        GateUpArgs g;
        g.a = a.data();
        g.m = m;
        g.lda = k;
        g.h = h[v].data();
        g.ldh = n;
        kv.gate_up(gu, g);
      }
      EXPECT_EQ(c[0], c[1]) << fc.name << " gemm, m = " << m << ", seed=" << seed;
      EXPECT_EQ(h[0], h[1]) << fc.name << " gate_up, m = " << m << ", seed=" << seed;
    }
  }
}

TEST(QuantizeActivations, RoundsPerRowAndFlagsNonFinite) {
  const float a[] = {1.0f, -2.0f, 0.5f, 0.0f,  //
                     0.0f, 0.0f, 0.0f, 0.0f,   //
                     1.0f, NAN, 2.0f, 3.0f};
  int8_t q[3 * 64];
  float s[3];
  int32_t sums[3];
  quantize_activations(a, 3, 4, 4, 64, 64, q, s, sums);
  EXPECT_EQ(s[0], 2.0f / 127.0f);
  EXPECT_EQ(q[0], 64);  // 63.5 rounds to even
  EXPECT_EQ(q[1], -127);
  EXPECT_EQ(q[2], 32);  // 31.75
  EXPECT_EQ(q[3], 0);
  for (int c = 4; c < 64; ++c) ASSERT_EQ(q[c], 0) << "padding column " << c;
  EXPECT_EQ(sums[0], 64 - 127 + 32);
  EXPECT_EQ(s[1], 0.0f);
  EXPECT_EQ(sums[1], 0);
  EXPECT_TRUE(std::isnan(s[2]));
}

TEST(PackInt, DequantizationErrorIsWithinHalfAStep) {
  std::mt19937_64 rng(test::test_seed());
  const int n = 70, k = 256;
  auto w = random_weights(static_cast<size_t>(n) * k, rng);
  for (const FormatCase& f : kFormats) {
    PackedWeight p = pack({w.data(), SourceType::f32, n, k}, f.opt);
    const auto d = unpack(p);
    const int group = f.opt.format == WeightFormat::int8 ? k : f.opt.group;
    for (int j = 0; j < n; ++j)
      for (int g0 = 0; g0 < k; g0 += group) {
        float lo = 0, hi = 0;
        for (int c = g0; c < g0 + group; ++c) {
          lo = std::min(lo, w[static_cast<size_t>(j) * k + c]);
          hi = std::max(hi, w[static_cast<size_t>(j) * k + c]);
        }
        for (int c = g0; c < g0 + group; ++c) {
          const size_t i = static_cast<size_t>(j) * k + c;
          const double step = grid_step(f.opt, lo, hi, w[i]);
          // Half a step, plus the scale's own rounding (fp16: 2^-11 relative) times |q| <= 15.
          ASSERT_LE(std::abs(d[i] - w[i]), 0.5 * step * (1 + 1e-6) + 16 * std::ldexp(step, -11))
              << f.name << " [" << j << "," << c << "]";
        }
      }
  }
}

TEST(PackInt, DeterministicAcrossThreadCounts) {
  std::mt19937_64 rng(test::test_seed());
  const int n = 300, k = 256;
  auto w = random_weights(static_cast<size_t>(n) * k, rng);
  for (const FormatCase& f : kFormats) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    PackedWeight one = pack({w.data(), SourceType::f32, n, k}, f.opt);
    omp_set_num_threads(3);
    PackedWeight three = pack({w.data(), SourceType::f32, n, k}, f.opt);
    omp_set_num_threads(saved);
    ASSERT_EQ(one.bytes(), three.bytes());
    EXPECT_EQ(std::memcmp(one.data.data(), three.data.data(), one.bytes()), 0) << f.name;
  }
}

TEST(PackInt, SourcesDecodeTheSameValues) {
  // bf16, fp16 and fp8 sources holding values all three represent exactly pack to the
  // same bytes as their fp32 twin.
  const int n = 65, k = 128;
  std::mt19937_64 rng(test::test_seed());
  std::uniform_int_distribution<int> d(-14, 14);
  std::vector<float> f(static_cast<size_t>(n) * k);
  std::vector<bf16_t> b(f.size());
  std::vector<uint16_t> h(f.size());
  std::vector<uint8_t> e(f.size());
  for (size_t i = 0; i < f.size(); ++i) {
    int v = d(rng);
    if (v == 0) v = 1;
    f[i] = v * 0.25f;  // multiples of 1/4 up to 3.5: exact in e4m3
    b[i] = fp32_to_bf16(f[i]);
    h[i] = fp32_to_fp16(f[i]);
    int code = 0;
    while (fp8_e4m3_to_fp32(static_cast<uint8_t>(code)) != std::abs(f[i])) ++code;
    e[i] = static_cast<uint8_t>(code | (f[i] < 0 ? 0x80 : 0));
  }
  for (const FormatCase& fc : kFormats) {
    const auto want = unpack(pack({f.data(), SourceType::f32, n, k}, fc.opt));
    EXPECT_EQ(unpack(pack({b.data(), SourceType::bf16, n, k}, fc.opt)), want) << fc.name;
    EXPECT_EQ(unpack(pack({h.data(), SourceType::f16, n, k}, fc.opt)), want) << fc.name;
    EXPECT_EQ(unpack(pack({e.data(), SourceType::f8_e4m3, n, k}, fc.opt)), want) << fc.name;
  }
}

TEST(PackInt, Fp8BlockScalesApplyPerBlock) {
  // DeepSeek-V3 layout: weight_scale_inv [ceil(n / 128) x ceil(k / 128)].
  const int n = 130, k = 200;  // partial blocks in both directions
  std::vector<uint8_t> e(static_cast<size_t>(n) * k, 0x38);  // 1.0
  const float scales[] = {0.5f, 2.0f, 4.0f, 8.0f};           // [2 x 2]
  WeightView v{e.data(), SourceType::f8_e4m3, n, k};
  v.block_scale = scales;
  PackedWeight p = pack(v, {WeightFormat::bf16});
  const auto d = unpack(p);
  EXPECT_EQ(d[0], 0.5f);
  EXPECT_EQ(d[127], 0.5f);
  EXPECT_EQ(d[128], 2.0f);
  EXPECT_EQ(d[static_cast<size_t>(128) * k], 4.0f);
  EXPECT_EQ(d[static_cast<size_t>(129) * k + 199], 8.0f);
  EXPECT_EQ(source_value(v, 129, 199), 8.0f);
}

TEST(PackInt, Fp8E4m3Decodes) {
  EXPECT_EQ(fp8_e4m3_to_fp32(0x38), 1.0f);
  EXPECT_EQ(fp8_e4m3_to_fp32(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_fp32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(fp8_e4m3_to_fp32(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(fp8_e4m3_to_fp32(0xc0), -2.0f);
  EXPECT_TRUE(std::signbit(fp8_e4m3_to_fp32(0x80)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_fp32(0x7f)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_fp32(0xff)));
}

TEST(PackInt, RejectsWhatTheFormatCannotHold) {
  std::vector<float> w(64 * 100, 1.0f);
  EXPECT_EQ(test::error_of([&] { pack({w.data(), SourceType::f32, 64, 100}, {WeightFormat::int4, 32, true}); }),
            "pack: k = 100 is not a multiple of the int4 group size 32; int4 cannot represent a partial group "
            "(choose a group that divides k, or int8 / bf16)");
  EXPECT_EQ(test::error_of([&] { pack({w.data(), SourceType::f32, 64, 96}, {WeightFormat::int4, 48, true}); }),
            "pack: int4 group size 48 is not one of 32, 64, 128");
  w[3 * 100 + 7] = NAN;
  EXPECT_EQ(test::error_of([&] { pack({w.data(), SourceType::f32, 64, 100}, {WeightFormat::int8}); }),
            "pack: weight [3, 7] is nan; integer formats cannot hold NaN or Inf (pack it as bf16, or fix the checkpoint)");
  w[3 * 100 + 7] = 1.0f;
  w[5 * 100 + 40] = 1e6f;
  Errc code{};
  const std::string msg =
      test::error_of([&] { pack({w.data(), SourceType::f32, 64, 96, 100}, {WeightFormat::int4, 32, true}); }, &code);
  EXPECT_EQ(code, Errc::bad_format);
  EXPECT_EQ(msg.rfind("pack: weight row 5, group 1: scale ", 0), 0u) << msg;
  EXPECT_EQ(test::error_of([&] {
              std::vector<float> g(64 * 32), u(64 * 64);
              pack_gate_up({g.data(), SourceType::f32, 64, 32}, {u.data(), SourceType::f32, 64, 64}, {});
            }),
            "pack_gate_up: gate [64 x 32] and up [64 x 64] differ in shape");
  EXPECT_EQ(test::error_of([] { parse_format("q4_0"); }), "unknown weight format 'q4_0' (expected bf16, int8 or int4)");
}

// MXFP4 packs keep MXFP4 numbers: a block of E2M1 values times 2^s comes back exactly,
// every code and sign (-0 included), at the exponents a checkpoint holds; the shared
// exponent is the smallest that holds the block's max without saturating; blocks below
// 2^-21 round on the step 2^-23; a block beyond 6 * 2^16 is refused.
TEST(PackInt, Mxfp4KeepsMxfp4Values) {
  static constexpr float kE2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  std::mt19937_64 rng(test::test_seed());
  const int n = 70, k = 128;
  std::vector<float> w(static_cast<size_t>(n) * k);
  std::uniform_int_distribution<int> code(0, 15), expo(-20, 12);
  for (int j = 0; j < n; ++j)
    for (int g = 0; g < k / 32; ++g) {
      const int s = expo(rng);
      for (int c = 0; c < 32; ++c) {
        const int q = code(rng);
        const float v = std::ldexp(kE2m1[q & 7], s);
        w[static_cast<size_t>(j) * k + g * 32 + c] = (q & 8) ? -v : v;
      }
    }
  const PackOptions mx = pack_options("mxfp4", 128, true);  // group and zero_point: not mxfp4's
  EXPECT_TRUE(mx.e2m1 && mx.format == WeightFormat::int4 && mx.group == 32 && mx.symmetric);
  EXPECT_EQ(format_name(mx), "mxfp4");
  const PackedWeight p = pack({w.data(), SourceType::f32, n, k}, mx);
  EXPECT_TRUE(p.e2m1);
  EXPECT_EQ(p.bytes(), packed_bytes(pack_options("int4", 32, false), n, k));  // no zero bytes
  const auto d = unpack(p);
  for (size_t i = 0; i < w.size(); ++i) ASSERT_EQ(d[i], w[i]) << "element " << i;
  // The shared exponent: max 5 * 2^-3 needs 2^-3 * 6 (5 is not a code: 5 / 6 of the top).
  std::vector<float> one(64 * 32, 0.0f);
  one[0] = 5.0f / 8;
  one[1] = 1.0f / 8;  // 1 * 2^-3: a code
  one[2] = 0.3f / 8;  // 0.3 -> 0.5 (nearest)
  one[3] = 2.5f / 8;  // 2.5: a tie between 2 and 3, to the even code (2)
  const auto od = unpack(pack({one.data(), SourceType::f32, 64, 32}, mx));
  EXPECT_EQ(od[0], 4.0f / 8);  // 5 is a tie between 4 and 6: to the even code (4)
  EXPECT_EQ(od[1], 1.0f / 8);
  EXPECT_EQ(od[2], 0.5f / 8);
  EXPECT_EQ(od[3], 2.0f / 8);
  // Tiny blocks: the step is 2^-23 at most fine.
  std::vector<float> tiny(64 * 32, 0.0f);
  tiny[5] = std::ldexp(3.0f, -30);
  tiny[6] = std::ldexp(1.0f, -23);
  const auto td = unpack(pack({tiny.data(), SourceType::f32, 64, 32}, mx));
  EXPECT_EQ(td[5], 0.0f);
  EXPECT_EQ(td[6], std::ldexp(1.0f, -23));
  std::vector<float> big(64 * 32, 1.0f);
  big[7] = 1e6f;
  Errc c{};
  const std::string msg = test::error_of([&] { pack({big.data(), SourceType::f32, 64, 32}, mx); }, &c);
  EXPECT_EQ(c, Errc::bad_format);
  EXPECT_EQ(msg.rfind("pack: weight row 0, group 0: max |w| 1e+06 is beyond mxfp4", 0), 0u) << msg;
  EXPECT_EQ(test::error_of([] { parse_format("mxfp4"); }),
            "unknown weight format 'mxfp4' (expected bf16, int8 or int4; mxfp4 is int4 with MXFP4 codes: pack_options)");
}

TEST(KernelsBf16Input, Fp32InputIsRoundedToBf16) {
  std::mt19937_64 rng(test::test_seed());
  const int m = 5, n = 70, k = 33;
  auto w = random_weights(static_cast<size_t>(n) * k, rng), af = random_weights(static_cast<size_t>(m) * k, rng);
  std::vector<bf16_t> ab(af.size());
  fp32_to_bf16(af.data(), ab.data(), af.size());
  PackedWeight p = pack({w.data(), SourceType::f32, n, k});
  std::vector<float> c1(static_cast<size_t>(m) * n), c2(c1.size());
  GemmArgs g = gemm_args(ab.data(), m, k, c1.data(), n);
  gemm(p, g);
  g.a = nullptr;
  g.a_f32 = af.data();
  g.c = c2.data();
  gemm(p, g);
  EXPECT_EQ(c1, c2);
  g.a = ab.data();
  EXPECT_EQ(test::error_of([&] { gemm(p, g); }), "gemm: give exactly one input (bf16 a, fp32 a_f32 or quantized qa)");
}

}  // namespace
}  // namespace tandem
