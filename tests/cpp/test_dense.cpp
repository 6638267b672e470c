// DenseLinear (tandem/dense.h): a dense layer on the expert kernels and the pool. Its
// output must be exactly the kernel's on the whole, unsliced pack (a subpool's slice of
// output panels changes no scale: int8 scales are per output row, int4 groups run along
// k, activations are quantized per row over the whole k), for every subpool count; the
// whole-pack kernels are checked against fp64 references in test_kernels_*.cpp, and the
// BF16 case once more here.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <tuple>

#include "tandem/config.h"
#include "tandem/dense.h"
#include "tandem/error.h"
#include "tandem/pool_config.h"
#include "test_util.h"

namespace tandem {
namespace {

std::unique_ptr<Pool> dense_pool(int subpools, int threads = 1) {
  Config::Cpu cpu;
  cpu.virtual_subpools = subpools;
  cpu.threads = threads;
  return std::make_unique<Pool>(pool_options(cpu));
}

PackOptions fmt(WeightFormat f, int group = 128, bool symmetric = true) {
  PackOptions o;
  o.format = f;
  o.group = group;
  o.symmetric = symmetric;
  return o;
}

TEST(Dense, EqualsTheKernelOnTheWholePackForEverySplit) {
  std::mt19937_64 rng(test::test_seed());
  std::normal_distribution<float> nd(0.f, 1.f);
  const KernelTable& kt = kernels();
  for (const PackOptions& o : {fmt(WeightFormat::bf16), fmt(WeightFormat::int8), fmt(WeightFormat::int4, 32),
                               fmt(WeightFormat::int4, 128, false)}) {
    for (const auto [n, k] : {std::pair{200, 256}, {64, 512}, {7, 128}}) {
      std::vector<bf16_t> w(static_cast<size_t>(n) * k);
      for (auto& v : w) v = fp32_to_bf16(nd(rng) / std::sqrt(float(k)));
      const WeightView view{w.data(), SourceType::bf16, n, k};
      const PackedWeight whole = pack(view, o);
      for (const int m : {1, 5, 40}) {
        std::vector<float> x(static_cast<size_t>(m) * k);
        for (auto& v : x) v = nd(rng);
        std::vector<bf16_t> xb(x.size());
        fp32_to_bf16(x.data(), xb.data(), x.size());
        // The reference: one kernel call on the whole pack, bf16 input (fp32 input is
        // rounded to bf16 first in every format).
        std::vector<float> ref(static_cast<size_t>(m) * n);
        GemmArgs g = test::gemm_args(xb.data(), m, k, ref.data(), n);
        QuantizedActs qa;
        if (o.format != WeightFormat::bf16) {
          qa.prepare(whole, m);
          quantize_activations(qa, xb.data(), k, 0, m, &kt);
          g.a = nullptr;
          g.qa = &qa;
        }
        kt.of(o.format).pick(m).gemm(whole, g);
        // 1 x 2 threads: two pieces per subpool, packed and run in parallel.
        for (const auto [subpools, threads] : {std::pair{1, 1}, {1, 2}, {2, 1}, {3, 1}}) {
          auto pool = dense_pool(subpools, threads);
          DenseLinear d(*pool, kt, view, o, "model.layers.0.self_attn.q_proj");
          EXPECT_EQ(d.n(), n);
          EXPECT_EQ(d.bytes(), whole.bytes());  // slices end on panel boundaries: no padding added
          for (const bool in_bf16 : {true, false}) {
            std::vector<float> y(static_cast<size_t>(m) * (n + 3), -1.0f);  // ldy > n: the gap stays
            d.forward(in_bf16 ? static_cast<const void*>(xb.data()) : x.data(), in_bf16, m, k, y.data(), n + 3);
            for (int r = 0; r < m; ++r) {
              for (int j = 0; j < n; ++j)
                ASSERT_EQ(y[static_cast<size_t>(r) * (n + 3) + j], ref[static_cast<size_t>(r) * n + j])
                    << format_name(o.format) << " g" << o.group << " n=" << n << " k=" << k << " m=" << m
                    << " subpools=" << subpools << " x " << threads << " bf16 in=" << in_bf16 << " at (" << r << ", " << j << ")";
              for (int j = n; j < n + 3; ++j) ASSERT_EQ(y[static_cast<size_t>(r) * (n + 3) + j], -1.0f);
            }
            // bf16 output: the same sums rounded to nearest even, each column by the thread that made it.
            std::vector<bf16_t> yb(static_cast<size_t>(m) * (n + 2), 0xFFFF);
            d.forward_bf16(in_bf16 ? static_cast<const void*>(xb.data()) : x.data(), in_bf16, m, k, yb.data(), n + 2);
            for (int r = 0; r < m; ++r) {
              for (int j = 0; j < n; ++j)
                ASSERT_EQ(yb[static_cast<size_t>(r) * (n + 2) + j], fp32_to_bf16(ref[static_cast<size_t>(r) * n + j]))
                    << format_name(o.format) << " n=" << n << " m=" << m << " subpools=" << subpools << " at (" << r
                    << ", " << j << ")";
              for (int j = n; j < n + 2; ++j) ASSERT_EQ(yb[static_cast<size_t>(r) * (n + 2) + j], 0xFFFF);
            }
          }
        }
      }
    }
  }
}

// BF16 against fp64: products of bf16 values are exact in fp32, so the only error is the
// fp32 accumulation of k terms, |err| <= k * 2^-24 * sum |x_c w_c| (a loose bound on the
// order-dependent rounding of k - 1 additions).
TEST(Dense, Bf16MatchesFp64) {
  std::mt19937_64 rng(test::test_seed());
  std::normal_distribution<float> nd(0.f, 1.f);
  const int n = 130, k = 320, m = 9;
  std::vector<bf16_t> w(static_cast<size_t>(n) * k), x(static_cast<size_t>(m) * k);
  for (auto& v : w) v = fp32_to_bf16(nd(rng));
  for (auto& v : x) v = fp32_to_bf16(nd(rng));
  auto pool = dense_pool(2);
  DenseLinear d(*pool, kernels(), {w.data(), SourceType::bf16, n, k}, fmt(WeightFormat::bf16), "lm_head");
  std::vector<float> y(static_cast<size_t>(m) * n);
  d.forward(x.data(), true, m, k, y.data(), n);
  const std::vector<float> dq = d.dequantized();
  for (int r = 0; r < m; ++r)
    for (int j = 0; j < n; ++j) {
      double exact = 0, mag = 0;
      for (int c = 0; c < k; ++c) {
        const double p = double(bf16_to_fp32(x[static_cast<size_t>(r) * k + c])) * bf16_to_fp32(w[static_cast<size_t>(j) * k + c]);
        exact += p;
        mag += std::fabs(p);
        ASSERT_EQ(dq[static_cast<size_t>(j) * k + c], bf16_to_fp32(w[static_cast<size_t>(j) * k + c]));
      }
      ASSERT_NEAR(y[static_cast<size_t>(r) * n + j], exact, k * std::ldexp(1.0, -24) * mag) << r << ", " << j;
    }
}

TEST(RmsNorm, MatchesFp64WithinTwoBf16Roundings) {
  // y = bf16(w * bf16(x / rms(x))): two bf16 roundings (unit roundoff 2^-8 each) after an
  // fp32 product whose own error is ~2^-23; rows of several lengths and magnitudes, some
  // tiny (eps matters) and some zero.
  std::mt19937_64 rng(test::test_seed());
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int n : {1, 7, 64, 128, 2048, 2051}) {
    for (float scale : {1e-4f, 1.0f, 300.0f}) {
      const int rows = 5;
      std::vector<uint16_t> x(size_t(rows) * n), w(n), y(x.size());
      for (auto& v : x) v = fp32_to_bf16(nd(rng) * scale);
      for (int i = 0; i < n; ++i) x[size_t(3) * n + i] = 0;  // an all-zero row: eps keeps it finite (zero out)
      for (auto& v : w) v = fp32_to_bf16(1.0f + 0.5f * nd(rng));
      const float eps = 1e-6f;
      rms_norm_bf16(x.data(), w.data(), eps, rows, n, y.data());
      for (int r = 0; r < rows; ++r) {
        double ss = 0;
        for (int i = 0; i < n; ++i) ss += double(bf16_to_fp32(x[size_t(r) * n + i])) * bf16_to_fp32(x[size_t(r) * n + i]);
        const double inv = 1.0 / std::sqrt(ss / n + double(eps));
        for (int i = 0; i < n; ++i) {
          const double want = double(bf16_to_fp32(w[i])) * bf16_to_fp32(x[size_t(r) * n + i]) * inv;
          const double got = bf16_to_fp32(y[size_t(r) * n + i]);
          ASSERT_LE(std::abs(got - want), std::ldexp(std::abs(want), -7) * (1 + 1e-5) + 1e-30)
              << "n " << n << " scale " << scale << " row " << r << " i " << i;
        }
      }
    }
  }
  // in place, and no rows
  std::vector<uint16_t> x = {fp32_to_bf16(3.0f), fp32_to_bf16(4.0f)}, w = {fp32_to_bf16(1.0f), fp32_to_bf16(2.0f)};
  rms_norm_bf16(x.data(), w.data(), 0.0f, 1, 2, x.data());  // rms = sqrt(12.5)
  EXPECT_EQ(bf16_to_fp32(x[0]), bf16_to_fp32(fp32_to_bf16(3.0f / std::sqrt(12.5f))));
  rms_norm_bf16(nullptr, w.data(), 0.0f, 0, 2, nullptr);
  EXPECT_NE(test::error_of([&] { rms_norm_bf16(x.data(), w.data(), 0.0f, 1, 0, x.data()); }).find("rms_norm"),
            std::string::npos);
}

// A softmax-then-top-k router (DenseLinear::route): the logits are forward()'s output rounded
// once to bf16; the chosen experts are the k most probable (none left out is more probable;
// which of equal ones is torch.topk's rule, tested against torch in test_router.py); scores
// against fp64 from the same bf16 logits: fp32 exp and sum (a few ulps) plus, for bf16
// scores, one rounding (2^-8 relative).
TEST(Dense, RouteIsSoftmaxTopKOfTheRoundedLogits) {
  std::mt19937_64 rng(test::test_seed());
  std::normal_distribution<float> nd(0.f, 1.f);
  const int n = 40, k = 96, m = 23;
  std::vector<bf16_t> w(static_cast<size_t>(n) * k), x(static_cast<size_t>(m) * k);
  for (auto& v : w) v = fp32_to_bf16(nd(rng) / std::sqrt(float(k)) * 3.0f);
  for (auto& v : x) v = fp32_to_bf16(nd(rng));
  auto pool = dense_pool(2);
  DenseLinear d(*pool, kernels(), {w.data(), SourceType::bf16, n, k}, fmt(WeightFormat::bf16), "mlp.gate");
  std::vector<float> y(static_cast<size_t>(m) * n);
  d.forward(x.data(), true, m, k, y.data(), n);
  for (const int top : {1, 6, n}) {
    for (const bool renorm : {true, false}) {
      for (const bool f32 : {true, false}) {
        std::vector<uint16_t> logits(static_cast<size_t>(m) * n);
        std::vector<float> sf(static_cast<size_t>(m) * top);
        std::vector<uint16_t> sb(static_cast<size_t>(m) * top);
        std::vector<int64_t> idx(static_cast<size_t>(m) * top);
        d.route(x.data(), true, m, k, top, renorm, logits.data(), f32 ? static_cast<void*>(sf.data()) : sb.data(), f32,
                idx.data());
        for (int r = 0; r < m; ++r) {
          std::vector<double> p(n);
          double mx = -INFINITY, sum = 0, top_sum = 0;
          for (int e = 0; e < n; ++e) {
            ASSERT_EQ(logits[static_cast<size_t>(r) * n + e], fp32_to_bf16(y[static_cast<size_t>(r) * n + e]));
            mx = std::max(mx, double(bf16_to_fp32(logits[static_cast<size_t>(r) * n + e])));
          }
          for (int e = 0; e < n; ++e) sum += p[e] = std::exp(double(bf16_to_fp32(logits[static_cast<size_t>(r) * n + e])) - mx);
          std::vector<char> chosen(n);
          for (int j = 0; j < top; ++j) {
            const int64_t e = idx[static_cast<size_t>(r) * top + j];
            ASSERT_TRUE(e >= 0 && e < n && !chosen[e]) << "row " << r << " slot " << j;
            chosen[e] = 1;
            top_sum += p[e] / sum;
            if (j) ASSERT_LE(p[e], p[idx[static_cast<size_t>(r) * top + j - 1]]) << "largest first, row " << r;
          }
          double least = INFINITY, most_left = -INFINITY;
          for (int e = 0; e < n; ++e) {
            if (chosen[e])
              least = std::min(least, p[e]);
            else
              most_left = std::max(most_left, p[e]);
          }
          ASSERT_GE(least, most_left) << "row " << r;
          for (int j = 0; j < top; ++j) {
            const double want = p[idx[static_cast<size_t>(r) * top + j]] / sum / (renorm ? top_sum : 1.0);
            const double got = f32 ? sf[static_cast<size_t>(r) * top + j] : bf16_to_fp32(sb[static_cast<size_t>(r) * top + j]);
            ASSERT_NEAR(got, want, want * ((f32 ? 0 : std::ldexp(1.0, -8)) + (n + 8) * std::ldexp(1.0, -23)))
                << "top " << top << " renorm " << renorm << " row " << r << " slot " << j;
          }
        }
      }
    }
  }
  // Refused: top_k outside 1..n, and a weight not in bf16.
  std::vector<uint16_t> l(n), s(n);
  std::vector<int64_t> i(n);
  EXPECT_NE(test::error_of([&] { d.route(x.data(), true, 1, k, 0, true, l.data(), s.data(), false, i.data()); })
                .find("mlp.gate: top_k = 0 is outside 1..40"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { d.route(x.data(), true, 1, k, n + 1, true, l.data(), s.data(), false, i.data()); })
                .find("top_k = 41"),
            std::string::npos);
  DenseLinear q(*pool, kernels(), {w.data(), SourceType::bf16, n, k}, fmt(WeightFormat::int8), "gate8");
  EXPECT_NE(test::error_of([&] { q.route(x.data(), true, 1, k, 2, true, l.data(), s.data(), false, i.data()); })
                .find("gate8: a router runs on a bf16 weight"),
            std::string::npos);
}

// Grouped (MLA's per-head absorbed products): each group's outputs are exactly that
// group's weight alone on that group's inputs (the same kernel on the same panels), for
// every pool split, bf16 or fp32 input, and the row strides of a batch.
TEST(Dense, GroupedEqualsEachGroupAlone) {
  std::mt19937_64 rng(test::test_seed());
  std::normal_distribution<float> nd(0.f, 1.f);
  const KernelTable& kt = kernels();
  for (const auto [G, ng, k] : {std::tuple{3, 128, 96}, {16, 64, 128}, {2, 192, 512}}) {
    const int n = G * ng;
    std::vector<bf16_t> w(static_cast<size_t>(n) * k);
    for (auto& v : w) v = fp32_to_bf16(nd(rng) / std::sqrt(float(k)));
    for (const int m : {1, 3}) {
      const int ldx = G * k + 5;  // a row: G inputs of k, then a gap
      std::vector<float> x(static_cast<size_t>(m) * ldx);
      for (auto& v : x) v = nd(rng);
      std::vector<bf16_t> xb(x.size());
      fp32_to_bf16(x.data(), xb.data(), x.size());
      // The reference: group g alone as an ordinary layer on its own k inputs.
      std::vector<float> ref(static_cast<size_t>(m) * n);
      {
        auto pool = dense_pool(1);
        for (int g = 0; g < G; ++g) {
          DenseLinear one(*pool, kt, {w.data() + static_cast<size_t>(g) * ng * k, SourceType::bf16, ng, k},
                          fmt(WeightFormat::bf16), "alone");
          std::vector<float> y(static_cast<size_t>(m) * ng);
          one.forward(xb.data() + static_cast<size_t>(g) * k, true, m, ldx, y.data(), ng);
          for (int r = 0; r < m; ++r)
            std::copy_n(y.data() + static_cast<size_t>(r) * ng, ng, ref.data() + static_cast<size_t>(r) * n + g * ng);
        }
      }
      for (const auto [subpools, threads] : {std::pair{1, 1}, {1, 2}, {3, 1}}) {
        auto pool = dense_pool(subpools, threads);
        DenseLinear d(*pool, kt, {w.data(), SourceType::bf16, n, k}, fmt(WeightFormat::bf16), "kv_b_proj.absorbed", G);
        EXPECT_EQ(d.groups(), G);
        for (const bool in_bf16 : {true, false}) {
          std::vector<float> y(static_cast<size_t>(m) * n, -1.0f);
          d.forward(in_bf16 ? static_cast<const void*>(xb.data()) : x.data(), in_bf16, m, ldx, y.data(), n);
          for (size_t i = 0; i < y.size(); ++i)
            ASSERT_EQ(y[i], ref[i]) << "G=" << G << " n/G=" << ng << " k=" << k << " m=" << m << " subpools="
                                    << subpools << " x " << threads << " bf16 in=" << in_bf16 << " at " << i;
        }
      }
    }
  }
  // Refused: groups that do not cut n into whole panels, integer formats, short rows.
  auto pool = dense_pool(1);
  std::vector<bf16_t> w(static_cast<size_t>(4 * kPanel) * 32, fp32_to_bf16(1.0f));
  const WeightView v{w.data(), SourceType::bf16, 4 * kPanel, 32};
  EXPECT_NE(test::error_of([&] { DenseLinear d(*pool, kernels(), v, fmt(WeightFormat::bf16), "wk", 3); })
                .find("wk: 3 groups of a weight with n = 256 rows"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { DenseLinear d(*pool, kernels(), v, fmt(WeightFormat::bf16), "wk", 8); })
                .find("multiple of 64 rows"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { DenseLinear d(*pool, kernels(), v, fmt(WeightFormat::int8), "wv", 2); })
                .find("wv: a grouped dense layer runs on bf16 weights, not int8"),
            std::string::npos);
  DenseLinear d(*pool, kernels(), v, fmt(WeightFormat::bf16), "wv", 2);
  std::vector<bf16_t> x(64);
  std::vector<float> y(4 * kPanel);
  EXPECT_NE(test::error_of([&] { d.forward(x.data(), true, 1, 32, y.data(), 4 * kPanel); })
                .find("below the input's 64 values (k = 32 x 2 groups)"),
            std::string::npos);
  std::vector<uint16_t> logits(4 * kPanel);
  std::vector<float> sc(1);
  std::vector<int64_t> ix(1);
  EXPECT_NE(test::error_of([&] { d.route(x.data(), true, 1, 64, 1, false, logits.data(), sc.data(), true, ix.data()); })
                .find("not a grouped one"),
            std::string::npos);
}

TEST(Dense, BadInputIsRefused) {
  auto pool = dense_pool(1);
  std::vector<bf16_t> w(64 * 100, fp32_to_bf16(1.0f));
  // int4 needs k to be a multiple of the group.
  EXPECT_NE(test::error_of([&] {
              DenseLinear d(*pool, kernels(), {w.data(), SourceType::bf16, 64, 100}, fmt(WeightFormat::int4, 32),
                            "model.layers.3.mlp.down_proj");
            }).find("model.layers.3.mlp.down_proj"),
            std::string::npos);
  DenseLinear d(*pool, kernels(), {w.data(), SourceType::bf16, 64, 100}, fmt(WeightFormat::bf16), "o_proj");
  std::vector<float> y(64);
  std::vector<bf16_t> x(100);
  EXPECT_NE(test::error_of([&] { d.forward(x.data(), true, 1, 99, y.data(), 64); }).find("o_proj: row strides 99"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { d.forward(x.data(), true, -1, 100, y.data(), 64); }).find("is negative"),
            std::string::npos);
  d.forward(nullptr, true, 0, 100, nullptr, 64);  // no rows: nothing to do
  // A NaN or Inf weight is refused in every format, naming the layer (and, in bf16, the
  // element: row 0, column 5; row 1, column 7 in the second slice of 2 subpools).
  w[5] = fp32_to_bf16(std::nanf(""));
  EXPECT_NE(test::error_of([&] {
              DenseLinear q(*pool, kernels(), {w.data(), SourceType::bf16, 64, 100}, fmt(WeightFormat::bf16), "v_proj");
            }).find("v_proj: weight element (0, 5) is nan: not finite"),
            std::string::npos);
  {
    auto pool2 = dense_pool(2);
    std::vector<bf16_t> w2(200 * 64, fp32_to_bf16(0.5f));
    w2[130 * 64 + 7] = fp32_to_bf16(-INFINITY);
    EXPECT_NE(test::error_of([&] {
                DenseLinear q(*pool2, kernels(), {w2.data(), SourceType::bf16, 200, 64}, fmt(WeightFormat::bf16), "lm_head");
              }).find("lm_head: weight element (130, 7) is -inf: not finite"),
              std::string::npos);
  }
  EXPECT_NE(test::error_of([&] {
              DenseLinear q(*pool, kernels(), {w.data(), SourceType::bf16, 64, 100}, fmt(WeightFormat::int8), "k_proj");
            }).find("k_proj"),
            std::string::npos);
}

}  // namespace
}  // namespace tandem
