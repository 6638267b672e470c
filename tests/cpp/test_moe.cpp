// The CPU MoE engine against an fp64 reference MoE on the same (dequantized) weights.
//
// Reference: for each token, sum_k w_k * Wd_e (silu(Wg_e x) * (Wu_e x)) in fp64, with
// the engine's weights as packed (unpack of every subpool's slices) and, for int8 /
// int4, x quantized exactly as the kernels do (quantize_activations is deterministic).
// What the reference does not mimic is the intermediate h: the engine rounds it to bf16
// (and, for integer weights, quantizes each row of each subpool's slice to int8 with
// step s = max|h| / 127). Per output element the error is therefore bounded by
//   sum_k |w_k| sum_j |Wd_ij| (2^-8 |h_j| + s_j / 2) + 64 (hidden + inter) 2^-24 * magnitude,
// and, the rounding errors being independent, its RMS over all outputs should follow the
// uniform model (variance ulp_bf16(h)^2 / 12 + s^2 / 12 per term): the test asserts the
// measured relative L2 error is below twice that prediction.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <random>

#include "expert_core.h"
#include "tandem/error.h"
#include "tandem/moe.h"
#include "tandem/pool_config.h"
#include "tandem/safetensors.h"
#include "test_util.h"

namespace tandem {
namespace {

struct Case {
  int experts, hidden, inter, top_k, tokens;
  PackOptions fmt;
  int subpools;
  bool fp32_in = false, i64 = false, accumulate = false, mask = false, one_expert = false;
  bool oai = false;  // gpt-oss's experts: clamped SwiGLU (limit 1.5, so that the clamps bite) and biases
};

std::unique_ptr<Pool> make_pool(int subpools) {
  Config::Cpu cpu;
  cpu.virtual_subpools = subpools;
  cpu.threads = 1;
  return std::make_unique<Pool>(pool_options(cpu));
}

struct Weights {
  std::vector<std::vector<float>> g, u, d;  // per expert, fp32 nn.Linear layout
  std::vector<std::vector<float>> bg, bu, bd;  // per expert, biases (Case::oai)
};

Weights random_weights(const Case& c, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  Weights w;
  const float sg = 1.0f / std::sqrt(float(c.hidden)), sd = 1.0f / std::sqrt(float(c.inter));
  for (int e = 0; e < c.experts; ++e) {
    std::vector<float> g(size_t(c.inter) * c.hidden), u(g.size()), d(size_t(c.hidden) * c.inter);
    for (auto& x : g) x = nd(rng) * sg * 2;
    for (auto& x : u) x = nd(rng) * sg * 2;
    for (auto& x : d) x = nd(rng) * sd;
    w.g.push_back(std::move(g));
    w.u.push_back(std::move(u));
    w.d.push_back(std::move(d));
    std::vector<float> bg(c.inter), bu(c.inter), bd(c.hidden);
    if (c.oai)  // (only then: the other cases keep their random streams)
      for (auto* b : {&bg, &bu, &bd})
        for (auto& x : *b) x = nd(rng);
    w.bg.push_back(std::move(bg));
    w.bu.push_back(std::move(bu));
    w.bd.push_back(std::move(bd));
  }
  return w;
}

void check_case(const Case& c, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "experts " << c.experts << " hidden " << c.hidden << " inter " << c.inter << " top_k "
                                  << c.top_k << " tokens " << c.tokens << " format " << format_name(c.fmt)
                                  << " subpools " << c.subpools << " seed " << seed);
  std::mt19937_64 rng(seed);
  auto pool = make_pool(c.subpools);
  MoeShape shape{c.experts, c.hidden, c.inter};
  if (c.oai) {
    shape.act = {GateAct::Kind::clamped, 1.702f, 1.5f, 1.0f};
    shape.bias = true;
  }
  MoeLayer layer(*pool, shape, c.fmt, 7);
  Weights w = random_weights(c, rng);
  int progress_calls = 0, last_done = -1;
  layer.load(
      [&](int e) {
        if (!c.oai) return test::f32_expert(w.g[e].data(), w.u[e].data(), w.d[e].data(), c.hidden, c.inter);
        return test::f32_expert(w.g[e].data(), w.u[e].data(), w.d[e].data(), c.hidden, c.inter, w.bg[e].data(),
                                w.bu[e].data(), w.bd[e].data());
      },
      [&](int done, int total) {
        ++progress_calls;
        last_done = done;
        EXPECT_EQ(total, c.experts * c.subpools);
      });
  EXPECT_GE(progress_calls, 1);
  EXPECT_EQ(last_done, c.experts * c.subpools);

  // Inputs.
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> pick(0, c.experts - 1);
  std::vector<float> xf(size_t(c.tokens) * c.hidden);
  for (auto& v : xf) v = nd(rng);
  std::vector<bf16_t> xb(xf.size());
  fp32_to_bf16(xf.data(), xb.data(), xf.size());
  if (!c.fp32_in)
    for (size_t i = 0; i < xf.size(); ++i) xf[i] = bf16_to_fp32(xb[i]);
  std::vector<int32_t> ids(size_t(c.tokens) * c.top_k);
  std::vector<int64_t> ids64(ids.size());
  std::vector<float> wts(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = c.one_expert ? 0 : (i % 11 == 10 ? -1 : pick(rng));
    ids64[i] = ids[i];
    wts[i] = std::abs(nd(rng)) / c.top_k;
  }
  std::vector<uint8_t> mask(c.experts, 1);
  if (c.mask)
    for (int e = 0; e < c.experts; e += 2) mask[e] = 0;
  std::vector<float> out(size_t(c.tokens) * c.hidden), out0(out.size());
  for (auto& v : out0) v = c.accumulate ? nd(rng) : 12345.f;  // =: must be overwritten
  out = out0;

  MoeInput in;
  if (c.fp32_in) in.x_f32 = xf.data();
  else in.x = xb.data();
  in.tokens = c.tokens;
  if (c.i64) in.ids_i64 = ids64.data();
  else in.ids = ids.data();
  in.top_k = c.top_k;
  in.weights = wts.data();
  in.expert_mask = c.mask ? mask.data() : nullptr;
  in.out = out.data();
  in.accumulate = c.accumulate;
  layer.forward(in);

  // Dequantized weights as the engine holds them, assembled from the slices.
  const bool quant = c.fmt.format != WeightFormat::bf16;
  std::vector<std::vector<float>> G(c.experts), U(c.experts), D(c.experts);
  std::vector<int> slice_of(c.inter);
  for (int e = 0; e < c.experts; ++e) {
    G[e].assign(size_t(c.inter) * c.hidden, 0);
    U[e] = G[e];
    D[e].assign(size_t(c.hidden) * c.inter, 0);
    for (int s = 0; s < c.subpools; ++s) {
      const auto [i0, i1] = layer.slice(s);
      if (i0 == i1) continue;
      const int len = i1 - i0;
      const auto gu = unpack(layer.gate_up_pack(s, e)), dn = unpack(layer.down_pack(s, e));
      for (int r = 0; r < len; ++r)
        for (int k = 0; k < c.hidden; ++k) {
          G[e][size_t(i0 + r) * c.hidden + k] = gu[size_t(r) * c.hidden + k];
          U[e][size_t(i0 + r) * c.hidden + k] = gu[size_t(len + r) * c.hidden + k];
        }
      for (int r = 0; r < c.hidden; ++r)
        for (int j = 0; j < len; ++j) D[e][size_t(r) * c.inter + i0 + j] = dn[size_t(r) * len + j];
      for (int j = i0; j < i1; ++j) slice_of[j] = s;
    }
  }
  // x as the kernels see it.
  std::vector<double> xq(xf.size());
  if (quant) {
    const PackedWeight& l0 = layer.gate_up_pack(0, 0).panels ? layer.gate_up_pack(0, 0) : layer.gate_up_pack(c.subpools - 1, 0);
    std::vector<int8_t> q(size_t(c.tokens) * l0.k_pad);
    std::vector<float> sc(c.tokens);
    std::vector<int32_t> sums(size_t(c.tokens) * (l0.k_pad / l0.group));
    quantize_activations(xf.data(), c.tokens, c.hidden, c.hidden, l0.k_pad, l0.group, q.data(), sc.data(), sums.data());
    for (int t = 0; t < c.tokens; ++t)
      for (int k = 0; k < c.hidden; ++k) xq[size_t(t) * c.hidden + k] = double(sc[t]) * q[size_t(t) * l0.k_pad + k];
  } else {  // the BF16 kernels round fp32 input to bf16
    for (size_t i = 0; i < xf.size(); ++i) xq[i] = bf16_to_fp32(fp32_to_bf16(xf[i]));
  }

  double err2 = 0, ref2 = 0, pred2 = 0;
  std::vector<double> h(c.inter), step(c.inter);
  for (int t = 0; t < c.tokens; ++t) {
    std::vector<double> ref(c.hidden, 0), bound(c.hidden, 0), var(c.hidden, 0), mag(c.hidden, 0);
    for (int k = 0; k < c.top_k; ++k) {
      const int e = ids[size_t(t) * c.top_k + k];
      if (e < 0 || !mask[e]) continue;
      const double wk = wts[size_t(t) * c.top_k + k];
      for (int j = 0; j < c.inter; ++j) {
        double g = 0, u = 0;
        for (int q = 0; q < c.hidden; ++q) {
          g += G[e][size_t(j) * c.hidden + q] * xq[size_t(t) * c.hidden + q];
          u += U[e][size_t(j) * c.hidden + q] * xq[size_t(t) * c.hidden + q];
        }
        if (c.oai) {
          const double gc = std::min(g + w.bg[e][j], 1.5), uc = std::clamp(u + w.bu[e][j], -1.5, 1.5);
          h[j] = gc / (1 + std::exp(-1.702 * gc)) * (uc + 1);
        } else {
          h[j] = g / (1 + std::exp(-g)) * u;
        }
      }
      // The int8 step of h per subpool slice.
      std::vector<double> hmax(c.subpools, 0);
      for (int j = 0; j < c.inter; ++j) hmax[slice_of[j]] = std::max(hmax[slice_of[j]], std::abs(h[j]) * (1 + 1.0 / 128));
      for (int j = 0; j < c.inter; ++j) step[j] = quant ? hmax[slice_of[j]] / 127 : 0;
      for (int r = 0; r < c.hidden; ++r) {
        double s = 0, b = 0, v = 0, m = 0;
        for (int j = 0; j < c.inter; ++j) {
          const double dw = D[e][size_t(r) * c.inter + j];
          s += dw * h[j];
          b += std::abs(dw) * (std::ldexp(std::abs(h[j]), -8) + step[j] / 2);
          const double ulp = h[j] == 0 ? 0 : std::ldexp(1.0, std::ilogb(h[j]) - 7);  // of bf16 at h
          v += dw * dw * (ulp * ulp + step[j] * step[j]) / 12;
          m += std::abs(dw * h[j]);
        }
        if (c.oai) {
          s += w.bd[e][r];
          m += std::abs(w.bd[e][r]);
        }
        ref[r] += wk * s;
        bound[r] += wk * b;
        var[r] += wk * wk * v;
        mag[r] += wk * m;
      }
    }
    for (int r = 0; r < c.hidden; ++r) {
      const size_t i = size_t(t) * c.hidden + r;
      const double want = (c.accumulate ? out0[i] : 0.0) + ref[r];
      const double tol = bound[r] + 64.0 * (c.hidden + c.inter) * std::ldexp(mag[r] + std::abs(want), -24) + 1e-30;
      ASSERT_LE(std::abs(out[i] - want), tol) << "token " << t << " output " << r;
      err2 += (out[i] - want) * (out[i] - want);
      ref2 += ref[r] * ref[r];
      pred2 += var[r];
    }
  }
  if (ref2 > 0) {
    const double rel = std::sqrt(err2 / ref2), pred = std::sqrt(pred2 / ref2);
    EXPECT_LE(rel, 2 * pred + 1e-6) << "relative L2 " << rel << ", rounding model " << pred;
  }
}

class MoeEngine : public ::testing::TestWithParam<int> {};  // param: subpools

TEST_P(MoeEngine, MatchesTheFp64ReferenceOverRandomConfigs) {
  const int subpools = GetParam();
  const uint64_t seed = test::test_seed();
  std::mt19937_64 rng(seed + subpools);
  const PackOptions formats[] = {{WeightFormat::bf16}, {WeightFormat::int8}, {WeightFormat::int4, 32, false}};
  for (int i = 0; i < 9; ++i) {
    Case c{};
    c.fmt = formats[i % 3];
    const int expert_choices[] = {1, 3, 16, 128};
    c.experts = expert_choices[std::uniform_int_distribution<int>(0, 3)(rng)];
    c.hidden = 64 * std::uniform_int_distribution<int>(1, 3)(rng);
    c.inter = 32 * std::uniform_int_distribution<int>(1, 6)(rng) + (c.fmt.format == WeightFormat::int4 ? 0 : 32);
    c.top_k = std::uniform_int_distribution<int>(1, std::min(8, c.experts + 1))(rng);
    const int token_choices[] = {1, 2, 5, 37, 600};
    c.tokens = token_choices[std::uniform_int_distribution<int>(0, 4)(rng)];
    if (c.tokens == 600) c.hidden = 64, c.inter = 64;  // keep the fp64 reference cheap
    c.subpools = subpools;
    c.fp32_in = i % 2;
    c.i64 = i % 4 == 1;
    c.accumulate = i % 3 == 1;
    c.mask = i % 5 == 2;
    check_case(c, seed + i);
  }
}

// gpt-oss's experts (clamped SwiGLU, biases on gate, up and down) in every format.
TEST_P(MoeEngine, GptOssExpertsMatchTheFp64Reference) {
  const uint64_t seed = test::test_seed();
  const PackOptions formats[] = {{WeightFormat::bf16}, {WeightFormat::int8}, {WeightFormat::int4, 32, false},
                                 pack_options("mxfp4", 32, false)};
  const std::array<int, 5> shapes[] = {{16, 128, 96, 4, 37}, {3, 64, 64, 2, 600}, {128, 64, 64, 8, 5}};
  int i = 0;
  for (const auto& f : formats)
    for (const auto& [E, H, I, K, T] : shapes) {
      Case c{E, H, I, K, T, f, GetParam()};
      c.oai = true;
      c.accumulate = i % 2 == 1;
      c.fp32_in = i % 3 == 1;
      check_case(c, seed + i++);
    }
}

TEST_P(MoeEngine, AllTokensOnOneExpertAndTheRestIdle) {
  Case c{128, 128, 96, 2, 300, {WeightFormat::int8}, GetParam()};
  c.one_expert = true;
  check_case(c, test::test_seed());
}

INSTANTIATE_TEST_SUITE_P(Subpools, MoeEngine, ::testing::Values(1, 2, 3));

TEST(MoeEngineApi, BadInputIsRefusedAndOutputUntouched) {
  auto pool = make_pool(2);
  MoeLayer layer(*pool, {4, 64, 64}, {WeightFormat::bf16});
  std::vector<float> g(64 * 64, 0.01f);
  MoeInput in;
  std::vector<bf16_t> x(2 * 64, fp32_to_bf16(1.0f));
  std::vector<int32_t> ids = {0, 1, 2, 4};
  std::vector<float> wts = {0.5f, 0.5f, 0.5f, 0.5f}, out(2 * 64, 7.0f);
  in.x = x.data();
  in.tokens = 2;
  in.ids = ids.data();
  in.top_k = 2;
  in.weights = wts.data();
  in.out = out.data();
  EXPECT_EQ(test::error_of([&] { layer.forward(in); }), "moe: layer 0 has no weights (call load first)");
  layer.load([&](int) {
    WeightView v{g.data(), SourceType::f32, 64, 64};
    return ExpertSource{v, v, v};
  });
  EXPECT_EQ(test::error_of([&] { layer.forward(in); }), "moe: topk_ids[1, 1] = 4 is outside [-1, 4)");
  ids[3] = -2;
  EXPECT_EQ(test::error_of([&] { layer.forward(in); }), "moe: topk_ids[1, 1] = -2 is outside [-1, 4)");
  ids[3] = 3;
  wts[2] = NAN;
  EXPECT_EQ(test::error_of([&] { layer.forward(in); }), "moe: topk_weights[1, 0] = nan is not finite");
  wts[2] = 0.5f;
  in.out = nullptr;
  EXPECT_EQ(test::error_of([&] { layer.forward(in); }), "moe: output is null");
  in.out = out.data();
  in.x_f32 = reinterpret_cast<const float*>(x.data());
  EXPECT_EQ(test::error_of([&] { layer.forward(in); }), "moe: give exactly one input (bf16 x or fp32 x_f32)");
  for (float v : out) ASSERT_EQ(v, 7.0f);
  in.x_f32 = nullptr;
  layer.forward(in);  // and valid input still works
  EXPECT_NE(out[0], 7.0f);
  EXPECT_EQ(test::error_of([&] {
              layer.load([&](int) {
                WeightView v{g.data(), SourceType::f32, 64, 64}, bad{g.data(), SourceType::f32, 32, 64};
                return ExpertSource{v, bad, v};
              });
            }),
            "moe: expert 0 up is [32 x 64], the layer needs [64 x 64]");
  EXPECT_EQ(test::error_of([&] { MoeLayer l(*pool, {4, 64, 48}, {WeightFormat::int4, 32}); }),
            "moe: int4 group 32 must divide hidden (64) and intermediate (48); no int4 group does: use int8 or bf16");
  EXPECT_EQ(test::error_of([&] { MoeLayer l(*pool, {4, 2880, 2880}, {WeightFormat::int4, 128}); }),
            "moe: int4 group 128 must divide hidden (2880) and intermediate (2880); set cpu.group_size to 32 or 64");
  // Non-finite weights from memory (offload's torch tensors) are refused in every format,
  // naming the layer, expert, projection and element of the full matrix (subpool slices
  // are views into it).
  for (const WeightFormat f : {WeightFormat::bf16, WeightFormat::int8}) {
    MoeLayer l(*pool, {4, 64, 64}, {f}, 7);
    std::vector<float> gate(g), down(g);
    down[size_t(40) * 64 + 50] = -INFINITY;
    EXPECT_EQ(test::error_of([&] {
                l.load([&](int e) {
                  WeightView v{g.data(), SourceType::f32, 64, 64}, d{(e == 3 ? down : g).data(), SourceType::f32, 64, 64};
                  return ExpertSource{v, v, d};
                });
              }),
              "layer 7, expert 3 down: element [40, 50] is -inf; non-finite weights are refused")
        << format_name(f);
    EXPECT_FALSE(l.loaded());
  }
}

std::string bytes_of(const void* p, size_t n) { return std::string(static_cast<const char*>(p), n); }

// A checkpoint loads to exactly the packs its raw weights give, under each naming and
// source dtype (BF16 per-expert keys as Qwen3 / Mixtral save them, FP8 E4M3 with block
// scales as DeepSeek-V3 ships them); a missing expert is named.
TEST(MoeEngineApi, LoadsCheckpointsByKeyPattern) {
  test::ScratchDir dir;
  auto pool = make_pool(2);
  const int E = 3, H = 128, I = 192, L = 4;
  std::mt19937_64 rng(test::test_seed());
  std::normal_distribution<float> nd(0.f, 0.1f);
  auto rand_bf16 = [&](size_t n) {
    std::vector<bf16_t> v(n);
    for (auto& x : v) x = fp32_to_bf16(nd(rng));
    return v;
  };
  std::vector<std::vector<bf16_t>> g, u, d;
  std::vector<std::vector<uint8_t>> g8;
  std::vector<test::Entry> qwen, mixtral, deepseek;
  const std::vector<float> scale_gu = {0.5f, 2.0f};  // [2 x 1] blocks of 128 x 128
  for (int e = 0; e < E; ++e) {
    g.push_back(rand_bf16(size_t(I) * H));
    u.push_back(rand_bf16(size_t(I) * H));
    d.push_back(rand_bf16(size_t(H) * I));
    g8.emplace_back(size_t(I) * H);
    for (auto& b : g8.back()) b = static_cast<uint8_t>(std::uniform_int_distribution<int>(0, 0x7e)(rng) | (rng() & 0x80));
    const std::string p = "model.layers." + std::to_string(L) + ".mlp.experts." + std::to_string(e) + ".";
    const std::string m = "model.layers." + std::to_string(L) + ".block_sparse_moe.experts." + std::to_string(e) + ".";
    qwen.push_back({p + "gate_proj.weight", "BF16", {I, H}, bytes_of(g[e].data(), g[e].size() * 2)});
    qwen.push_back({p + "up_proj.weight", "BF16", {I, H}, bytes_of(u[e].data(), u[e].size() * 2)});
    qwen.push_back({p + "down_proj.weight", "BF16", {H, I}, bytes_of(d[e].data(), d[e].size() * 2)});
    mixtral.push_back({m + "w1.weight", "BF16", {I, H}, bytes_of(g[e].data(), g[e].size() * 2)});
    mixtral.push_back({m + "w3.weight", "BF16", {I, H}, bytes_of(u[e].data(), u[e].size() * 2)});
    mixtral.push_back({m + "w2.weight", "BF16", {H, I}, bytes_of(d[e].data(), d[e].size() * 2)});
    deepseek.push_back({p + "gate_proj.weight", "F8_E4M3", {I, H}, bytes_of(g8[e].data(), g8[e].size())});
    deepseek.push_back({p + "gate_proj.weight_scale_inv", "F32", {2, 1}, bytes_of(scale_gu.data(), 8)});
    deepseek.push_back({p + "up_proj.weight", "BF16", {I, H}, bytes_of(u[e].data(), u[e].size() * 2)});
    deepseek.push_back({p + "down_proj.weight", "BF16", {H, I}, bytes_of(d[e].data(), d[e].size() * 2)});
  }
  for (const PackOptions fmt : {PackOptions{WeightFormat::bf16}, PackOptions{WeightFormat::int4, 64, true}}) {
    MoeLayer want(*pool, {E, H, I}, fmt, L);
    want.load([&](int e) {
      return ExpertSource{{g[e].data(), SourceType::bf16, I, H}, {u[e].data(), SourceType::bf16, I, H},
                          {d[e].data(), SourceType::bf16, H, I}};
    });
    for (auto* entries : {&qwen, &mixtral}) {
      test::write_file(dir / "model.safetensors", test::good_file(*entries));
      const Checkpoint ckpt = Checkpoint::open(dir / "model.safetensors");
      MoeLayer got(*pool, {E, H, I}, fmt, L);
      got.load(ckpt, L, ExpertNaming::detect(ckpt, L));
      for (int s = 0; s < 2; ++s)
        for (int e = 0; e < E; ++e) {
          ASSERT_EQ(unpack(got.gate_up_pack(s, e)), unpack(want.gate_up_pack(s, e)));
          ASSERT_EQ(unpack(got.down_pack(s, e)), unpack(want.down_pack(s, e)));
        }
    }
  }
  // FP8 gate with 128 x 128 block scales; the subpool slices ([0, 64), [64, 192)) cut a block.
  test::write_file(dir / "model.safetensors", test::good_file(deepseek));
  const Checkpoint ckpt = Checkpoint::open(dir / "model.safetensors");
  MoeLayer got(*pool, {E, H, I}, {WeightFormat::bf16}, L);
  got.load(ckpt, L, ExpertNaming::detect(ckpt, L));
  for (int e = 0; e < E; ++e) {
    std::vector<float> gate(size_t(I) * H);
    for (int r = 0; r < I; ++r)
      for (int c = 0; c < H; ++c)
        gate[size_t(r) * H + c] = bf16_to_fp32(fp32_to_bf16(fp8_e4m3_to_fp32(g8[e][size_t(r) * H + c]) * scale_gu[r / 128]));
    for (int s = 0; s < 2; ++s) {
      const auto [i0, i1] = got.slice(s);
      const auto gu = unpack(got.gate_up_pack(s, e));
      for (int r = i0; r < i1; ++r)
        for (int c = 0; c < H; ++c) ASSERT_EQ(gu[size_t(r - i0) * H + c], gate[size_t(r) * H + c]) << e << " " << r << " " << c;
    }
  }
  EXPECT_EQ(test::error_of([&] { got.load(ckpt, L + 1, ExpertNaming::qwen3()); }),
            "checkpoint " + dir.path().string() + " has no tensor model.layers.5.mlp.experts.0.gate_proj.weight");
}

TEST(MoeEngineApi, LayersQueueInOrder) {
  // Layer 2 accumulates into layer 1's output: correct only if they run in FIFO order.
  auto pool = make_pool(2);
  std::vector<float> g(64 * 64, 0.02f);
  auto make = [&](int idx) {
    auto l = std::make_unique<MoeLayer>(*pool, MoeShape{2, 64, 64}, PackOptions{WeightFormat::bf16}, idx);
    l->load([&](int) {
      WeightView v{g.data(), SourceType::f32, 64, 64};
      return ExpertSource{v, v, v};
    });
    return l;
  };
  auto l1 = make(1), l2 = make(2);
  std::vector<bf16_t> x(64, fp32_to_bf16(1.0f));
  std::vector<int32_t> ids = {1};
  std::vector<float> w = {1.0f}, out(64, -1.0f), once(64);
  MoeInput in;
  in.x = x.data();
  in.tokens = 1;
  in.ids = ids.data();
  in.top_k = 1;
  in.weights = w.data();
  in.out = once.data();
  l1->forward(in);
  in.out = out.data();
  l1->submit(in);
  in.accumulate = true;
  l2->submit(in);
  pool->sync();
  for (int j = 0; j < 64; ++j) EXPECT_FLOAT_EQ(out[j], 2 * once[j]);
}

TEST(MoeEngineApi, LayersOfOnePoolShareTheirScratchAndStayExact) {
  // The layers of a pool share one forward scratch (moe.cpp): tasks queued back to back,
  // of different shapes, formats and batch sizes, must each give the bits the same layer
  // gives on a pool of its own.
  const uint64_t seed = test::test_seed();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  struct Spec {
    MoeShape shape;
    PackOptions fmt;
  };
  const Spec specs[2] = {{{8, 128, 96}, {WeightFormat::bf16}}, {{4, 64, 128}, {WeightFormat::int8}}};
  std::vector<std::vector<float>> weights[2];
  for (int l = 0; l < 2; ++l) {
    const MoeShape& sh = specs[l].shape;
    for (int e = 0; e < sh.experts; ++e)
      for (int t = 0; t < 3; ++t) {
        std::vector<float> w(static_cast<size_t>(sh.hidden) * sh.inter);
        for (auto& v : w) v = 0.1f * nd(rng);
        weights[l].push_back(std::move(w));
      }
  }
  auto make = [&](Pool& pool, int l) {
    const MoeShape& sh = specs[l].shape;
    auto layer = std::make_unique<MoeLayer>(pool, sh, specs[l].fmt, l);
    layer->load([&, l](int e) {
      return test::f32_expert(weights[l][3 * e].data(), weights[l][3 * e + 1].data(), weights[l][3 * e + 2].data(), sh.hidden,
                              sh.inter);
    });
    return layer;
  };
  struct Call {
    int layer, tokens;
    std::vector<bf16_t> x;
    std::vector<int32_t> ids;
    std::vector<float> w, out;
  };
  std::vector<Call> calls;
  for (auto [l, tokens] : {std::pair{0, 150}, {1, 3}, {0, 5}, {1, 120}}) {
    const MoeShape& sh = specs[l].shape;
    Call c{l, tokens, {}, {}, {}, {}};
    for (int i = 0; i < tokens * sh.hidden; ++i) c.x.push_back(fp32_to_bf16(nd(rng)));
    for (int i = 0; i < tokens * 2; ++i) {
      c.ids.push_back(static_cast<int32_t>(rng() % sh.experts));
      c.w.push_back(0.5f);
    }
    c.out.assign(static_cast<size_t>(tokens) * sh.hidden, 0.f);
    calls.push_back(std::move(c));
  }
  auto input = [](Call& c, float* out) {
    MoeInput in;
    in.x = c.x.data();
    in.tokens = c.tokens;
    in.ids = c.ids.data();
    in.top_k = 2;
    in.weights = c.w.data();
    in.out = out;
    return in;
  };
  // Alone: each call on a pool of its own layer.
  std::vector<std::vector<float>> alone;
  for (Call& c : calls) {
    auto pool = make_pool(1);
    auto layer = make(*pool, c.layer);
    std::vector<float> out(c.out.size());
    layer->forward(input(c, out.data()));
    alone.push_back(std::move(out));
  }
  // Shared: both layers on one pool, all four calls queued before any finishes.
  auto pool = make_pool(1);
  std::unique_ptr<MoeLayer> layers[2] = {make(*pool, 0), make(*pool, 1)};
  for (Call& c : calls) layers[c.layer]->submit(input(c, c.out.data()));
  pool->sync();
  for (size_t i = 0; i < calls.size(); ++i)
    EXPECT_EQ(calls[i].out, alone[i]) << "call " << i << " (layer " << calls[i].layer << ", " << calls[i].tokens
                                      << " tokens), seed=" << seed;
}

// use_kernels: a layer runs the table it is given (benchmarks force one variant with
// with_kernel). Every line of the list this CPU runs, forced for its format at every row
// count, reports itself and gives the default layer's output, at 1 and 40 tokens: to the
// bit for the integer formats (exact int32 sums, the same fp32 scaling), and for bf16
// within one bf16 step of h (2^-8 relative): the variants sum in other orders, and an
// fp32 difference can flip h's rounding to bf16 between the two products.
TEST(MoeEngineApi, ForcedKernelVariantRunsAtEveryRowCount) {
  const uint64_t seed = test::test_seed();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const MoeShape sh{4, 128, 64};
  std::vector<std::vector<float>> w;
  for (int i = 0; i < 3 * sh.experts; ++i) {
    std::vector<float> v(static_cast<size_t>(sh.hidden) * sh.inter);
    for (auto& x : v) x = 0.1f * nd(rng);
    w.push_back(std::move(v));
  }
  auto pool = make_pool(1);
  for (const PackOptions fmt : {PackOptions{WeightFormat::bf16}, PackOptions{WeightFormat::int8}, PackOptions{WeightFormat::int4, 64}}) {
    MoeLayer layer(*pool, sh, fmt);
    layer.load([&](int e) { return test::f32_expert(w[3 * e].data(), w[3 * e + 1].data(), w[3 * e + 2].data(), sh.hidden, sh.inter); });
    for (const int tokens : {1, 40}) {
      std::vector<bf16_t> x;
      std::vector<int32_t> ids;
      for (int i = 0; i < tokens * sh.hidden; ++i) x.push_back(fp32_to_bf16(nd(rng)));
      for (int i = 0; i < tokens * 2; ++i) ids.push_back(static_cast<int32_t>((i + i / 2) % sh.experts));
      const std::vector<float> wts(static_cast<size_t>(tokens) * 2, 0.5f);
      auto run = [&] {
        std::vector<float> out(static_cast<size_t>(tokens) * sh.hidden);
        MoeInput in;
        in.x = x.data();
        in.tokens = tokens;
        in.ids = ids.data();
        in.top_k = 2;
        in.weights = wts.data();
        in.out = out.data();
        layer.forward(in);
        return out;
      };
      layer.use_isa(effective_isa());
      const std::vector<float> ref = run();
      double ref2 = 0;
      for (float v : ref) ref2 += double(v) * v;
      int ran = 0;
      for (const KernelListEntry& e : kernel_list()) {
        if (e.family != family_of(fmt.format) || !feature_set(cpu_features()).contains(e.needs)) continue;
        const KernelTable table = with_kernel(kernels(), e);
        layer.use_kernels(table);
        const FormatKernels& fk = layer.kernel_set().of(fmt.format);
        EXPECT_STREQ(fk.pick(1).name, e.name());
        EXPECT_STREQ(fk.pick(1 << 20).name, e.name());
        const std::vector<float> out = run();
        double d2 = 0;
        for (size_t i = 0; i < out.size(); ++i) d2 += double(out[i] - ref[i]) * (out[i] - ref[i]);
        EXPECT_LE(std::sqrt(d2 / ref2), fmt.format == WeightFormat::bf16 ? std::ldexp(1.0, -8) : 0.0)
            << format_name(fmt) << " variant " << e.name() << ", " << tokens << " tokens, seed=" << seed;
        ++ran;
      }
      EXPECT_GE(ran, 1) << format_name(fmt);
      layer.use_isa(effective_isa());  // the forced tables die with the loop
    }
  }
}

}  // namespace
}  // namespace tandem

// The work-item planner: runs of about 512 KB of one expert's panels, more when a call
// reads many input rows (the AMX kernels pack them per call), never fewer than 4 items
// per thread.
TEST(WorkRuns, ItemsGrowWithTheInputRowsAndKeepFourPerThread) {
  using tandem::core::WorkRuns;
  const size_t pair = 1 << 20;  // a bf16 gate/up panel pair at k = 4096: 2 x 64 x 4096 x 2 bytes
  // Decode-sized input: items of one pair (512 KB rounds up to one panel run).
  WorkRuns r = WorkRuns::plan(128, 1, 24, pair, 2, 8 << 10);
  EXPECT_EQ(r.chunk, 1);
  EXPECT_EQ(r.items(128), 128 * 24);
  // 128 rows of 4096 bf16 (1 MB) per call: at least 4 MB of weights per item.
  r = WorkRuns::plan(128, 1, 24, pair, 2, 1 << 20);
  EXPECT_EQ(r.chunk, 4);
  EXPECT_EQ(r.per, 6);
  // One expert on 2 threads: 24 panels / (4 x 2) = 3 panels per item, 8 items.
  r = WorkRuns::plan(1, 1, 24, pair, 2, 1 << 20);
  EXPECT_EQ(r.chunk, 3);
  EXPECT_EQ(r.items(1), 8);
  // Every panel still in exactly one item.
  for (const auto& [n, input] : {std::pair{5, size_t(0)}, {5, size_t(3) << 20}, {1, size_t(64) << 20}}) {
    r = WorkRuns::plan(n, 2, 24, pair, 3, input);
    std::vector<int> seen(static_cast<size_t>(n) * 2 * 24, 0);
    for (int k = 0; k < r.items(n); ++k) {
      const auto it = r.item(k);
      for (int p = it.begin; p < it.end; ++p) ++seen[(static_cast<size_t>(it.i) * 2 + it.w) * 24 + p];
    }
    for (int c : seen) EXPECT_EQ(c, 1);
  }
}

TEST(WorkRuns, InputBytesAreTheMeanRowsOfTheFormat) {
  using tandem::core::WorkRuns;
  tandem::PackedWeight w;
  w.k = 4096;
  w.format = tandem::WeightFormat::bf16;
  EXPECT_EQ(WorkRuns::input_bytes(w, 256, 2), size_t(128) * 4096 * 2);
  w.format = tandem::WeightFormat::int8;
  EXPECT_EQ(WorkRuns::input_bytes(w, 256, 2), size_t(128) * 4096);
  w.format = tandem::WeightFormat::int4;
  EXPECT_EQ(WorkRuns::input_bytes(w, 3, 2), size_t(3) * 4096 / 2);
  EXPECT_EQ(WorkRuns::input_bytes(w, 0, 0), 0u);
}
