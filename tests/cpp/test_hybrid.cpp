// The hybrid scheduler on the host stream: hot experts on the "device" (the stream's
// thread, bf16 weights), cold ones on the CPU pools, deferred ones a layer late, all
// checked against an fp64 reference that applies the same placement and deferral.
//
// Reference and tolerance (as in test_moe.cpp): per routed (token, expert) pair,
// y = Wd (silu(Wg x) * (Wu x)) in fp64 on the weights as held (bf16-exact sources; for
// int4 cold experts the engine's dequantized slices and x quantized as the kernels do).
// The engine rounds h to bf16 (and, for int formats, quantizes each slice's row with
// step s), so per output element |out - ref| <= sum |w| sum_j |Wd_ij| (2^-8 |h_j| + s_j/2)
// plus fp32 accumulation, bounded by 64 (hidden + inter) 2^-24 (magnitude + |ref|).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>

#include <nlohmann/json.hpp>

#include "tandem/engine.h"
#include "tandem/error.h"
#include "tandem/gpu_info.h"
#include "tandem/hybrid.h"
#include "tandem/pool_config.h"
#include "tandem/streams.h"
#include "tandem/trace.h"
#include "test_util.h"

namespace tandem {
namespace {

using test::error_of;
using test::test_seed;

// The stream a test runs on: "host" everywhere, "cuda" where a GPU is present (the
// test skips otherwise).
bool cuda_available() {
  static const bool ok = [] {
    const gpu::GpuReport r = gpu::query_gpus(false);
    return r.cuda_built && !r.gpus.empty();
  }();
  return ok;
}

std::unique_ptr<Stream> make_stream(const std::string& kind) {
  return kind == "cuda" ? make_cuda_stream(0) : make_host_stream();
}

class Hybrid : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "cuda" && !cuda_available()) GTEST_SKIP() << "no CUDA device (or tandem built without CUDA)";
  }
  std::unique_ptr<Stream> stream() const { return make_stream(GetParam()); }
};

std::unique_ptr<Pool> make_pool(int subpools) {
  Config::Cpu cpu;
  cpu.virtual_subpools = subpools;
  cpu.threads = 1;
  return std::make_unique<Pool>(pool_options(cpu));
}

// Random experts for several layers; weights are bf16-exact so every holder of them
// (packed bf16 on the CPU, the host stream's hot experts) has exactly these values.
struct Model {
  int layers, E, H, I;
  std::vector<std::vector<std::vector<float>>> g, u, d;  // [layer][expert] nn.Linear layout
  Model(int layers_, int E_, int H_, int I_, std::mt19937_64& rng) : layers(layers_), E(E_), H(H_), I(I_) {
    std::normal_distribution<float> nd(0.f, 1.f);
    const float sg = 2.0f / std::sqrt(float(H)), sd = 1.0f / std::sqrt(float(I));
    auto mk = [&](size_t n, float sc) {
      std::vector<float> v(n);
      for (auto& x : v) x = bf16_to_fp32(fp32_to_bf16(nd(rng) * sc));
      return v;
    };
    g.resize(layers);
    u.resize(layers);
    d.resize(layers);
    for (int l = 0; l < layers; ++l)
      for (int e = 0; e < E; ++e) {
        g[l].push_back(mk(size_t(I) * H, sg));
        u[l].push_back(mk(size_t(I) * H, sg));
        d[l].push_back(mk(size_t(H) * I, sd));
      }
  }
  std::function<ExpertSource(int)> source(int l) {
    return [this, l](int e) {
      return ExpertSource{{g[l][e].data(), SourceType::f32, I, H},
                          {u[l][e].data(), SourceType::f32, I, H},
                          {d[l][e].data(), SourceType::f32, H, I}};
    };
  }
};

// One expert's weights as held and how it sees x.
struct HeldExpert {
  const float *G, *U, *D;
  bool quant = false;            // int8 / int4: x quantized, h quantized per slice
  std::vector<int> slice_of;     // [inter] -> slice (quant only)
  int slices = 1;
  const PackedWeight* layout = nullptr;  // quant: gives k_pad / group for x's quantization
};

struct RefOut {
  std::vector<double> y, bound, mag;  // [tokens x hidden]
  explicit RefOut(size_t n) : y(n), bound(n), mag(n) {}
};

// Adds w * expert(x_row) for one (token, expert) pair.
void add_pair(const HeldExpert& he, const Model& m, const float* xrow, double w, size_t o, RefOut& ref) {
  const int H = m.H, I = m.I;
  std::vector<double> x(H), h(I), step(I, 0.0);
  if (he.quant) {
    const int kp = he.layout->k_pad, grp = he.layout->group;
    std::vector<int8_t> q(kp);
    float sc;
    std::vector<int32_t> sums(kp / grp);
    quantize_activations(xrow, 1, H, H, kp, grp, q.data(), &sc, sums.data());
    for (int k = 0; k < H; ++k) x[k] = double(sc) * q[k];
  } else {
    for (int k = 0; k < H; ++k) x[k] = bf16_to_fp32(fp32_to_bf16(xrow[k]));
  }
  for (int j = 0; j < I; ++j) {
    double gg = 0, uu = 0;
    for (int k = 0; k < H; ++k) {
      gg += double(he.G[size_t(j) * H + k]) * x[k];
      uu += double(he.U[size_t(j) * H + k]) * x[k];
    }
    h[j] = gg / (1 + std::exp(-gg)) * uu;
  }
  if (he.quant) {
    std::vector<double> hmax(he.slices, 0);
    for (int j = 0; j < I; ++j) hmax[he.slice_of[j]] = std::max(hmax[he.slice_of[j]], std::abs(h[j]) * (1 + 1.0 / 128));
    for (int j = 0; j < I; ++j) step[j] = hmax[he.slice_of[j]] / 127;
  }
  for (int r = 0; r < H; ++r) {
    double s = 0, b = 0, mg = 0;
    for (int j = 0; j < I; ++j) {
      const double dw = he.D[size_t(r) * I + j];
      s += dw * h[j];
      b += std::abs(dw) * (std::ldexp(std::abs(h[j]), -8) + step[j] / 2);
      mg += std::abs(dw * h[j]);
    }
    ref.y[o + r] += w * s;
    ref.bound[o + r] += std::abs(w) * b;
    ref.mag[o + r] += std::abs(w) * mg;
  }
}

void expect_close(const std::vector<float>& out, const RefOut& r, const Model& m, const std::string& what) {
  for (size_t i = 0; i < out.size(); ++i) {
    const double tol = r.bound[i] + 64.0 * (m.H + m.I) * std::ldexp(r.mag[i] + std::abs(r.y[i]), -24) + 1e-30;
    ASSERT_LE(std::abs(out[i] - r.y[i]), tol) << what << ": token " << i / m.H << " output " << i % m.H << " got "
                                              << out[i] << " want " << r.y[i];
  }
}

// Device buffers of the host stream (host memory, freed with the stream's allocator).
struct DevBuf {
  Stream* s;
  void* p;
  DevBuf(Stream& st, size_t bytes) : s(&st), p(st.alloc_device(bytes)) {}
  ~DevBuf() { s->free_device(p); }
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
};

struct Routing {
  std::vector<int32_t> ids;
  std::vector<float> w;
};
Routing random_routing(int tokens, int K, int E, std::mt19937_64& rng, bool allow_empty = true) {
  Routing r;
  std::uniform_int_distribution<int> pick(0, E - 1);
  std::uniform_real_distribution<float> uw(0.05f, 1.0f);
  for (int t = 0; t < tokens; ++t) {
    std::vector<int> chosen;
    for (int k = 0; k < K; ++k) {
      int e;
      do e = pick(rng);
      while (std::count(chosen.begin(), chosen.end(), e) && int(chosen.size()) < E);
      chosen.push_back(e);
      r.ids.push_back(allow_empty && (t * K + k) % 13 == 12 ? -1 : e);
      r.w.push_back(uw(rng) / K);
    }
  }
  return r;
}

std::vector<int> random_subset(int E, int n, std::mt19937_64& rng) {
  std::vector<int> all(E);
  for (int e = 0; e < E; ++e) all[e] = e;
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(n);
  std::sort(all.begin(), all.end());
  return all;
}

// ---- the split on the stream (CUDA: the kernel) == the host code ----------------------

TEST_P(Hybrid, SplitOnTheStreamMatchesTheHost) {
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed);
  auto st = stream();
  const int T = 37, E = 128, K = 8;
  std::uniform_real_distribution<float> uw(0.01f, 1.f);
  std::vector<int32_t> ids(size_t(T) * K);
  std::vector<float> w(ids.size());
  for (int t = 0; t < T; ++t) {
    std::vector<int> perm(E);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int k = 0; k < K; ++k) {
      ids[size_t(t) * K + k] = k == K - 1 && t % 5 == 0 ? -1 : perm[k];  // some empty slots
      w[size_t(t) * K + k] = uw(rng);
    }
  }
  DevBuf di(*st, ids.size() * 4), dw(*st, w.size() * 4);
  st->upload(di.p, ids.data(), ids.size() * 4);
  st->upload(dw.p, w.data(), w.size() * 4);
  std::vector<uint8_t> mask(E, 0);
  for (int e = 0; e < E; e += 3) mask[e] = 1;
  DevBuf dm(*st, E), d3(*st, 3 * ids.size() * 4);
  st->upload(dm.p, mask.data(), E);
  for (int deferred : {0, 2}) {
    const SplitSpec sp{E, K, deferred};
    std::vector<int32_t> want(3 * ids.size()), got(want.size());
    const size_t n = ids.size();
    split(ids.data(), w.data(), T, mask.data(), sp, want.data(), want.data() + n, want.data() + 2 * n);
    st->split(di.p, false, dw.as<float>(), T, dm.as<uint8_t>(), sp, d3.as<int32_t>());
    st->synchronize();
    st->download(got.data(), d3.p, got.size() * 4);
    EXPECT_EQ(got, want) << "deferred " << deferred;
  }
}

// ---- hybrid layer == CPU engine == fp64 reference ------------------------------------

struct SplitCase {
  int E, H, I, K, tokens, subpools;
  PackOptions fmt;
  int hot;  // -1: random count
  bool exclude, f32_in;
};

void check_split_case(const std::string& kind, const SplitCase& c, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "E " << c.E << " H " << c.H << " I " << c.I << " K " << c.K << " tokens "
                                  << c.tokens << " subpools " << c.subpools << " format " << format_name(c.fmt.format)
                                  << " hot " << c.hot << " seed " << seed);
  std::mt19937_64 rng(seed);
  Model m(1, c.E, c.H, c.I, rng);
  auto pool = make_pool(c.subpools);
  std::uniform_int_distribution<int> nh(0, c.E);
  const std::vector<int> hot = random_subset(c.E, c.hot < 0 ? nh(rng) : c.hot, rng);

  MoeLayer cpu(*pool, {c.E, c.H, c.I}, c.fmt, 3), full(*pool, {c.E, c.H, c.I}, c.fmt, 3);
  if (c.exclude) cpu.exclude(hot);
  cpu.load(m.source(0));
  full.load(m.source(0));
  auto stream = make_stream(kind);
  HybridMoe hy(*stream, {&cpu}, {});
  hy.set_hot(0, hot, m.source(0));
  EXPECT_EQ(hy.hot(0), hot);

  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(size_t(c.tokens) * c.H);
  for (auto& v : x) v = nd(rng);
  std::vector<bf16_t> xb(x.size());
  fp32_to_bf16(x.data(), xb.data(), x.size());
  if (!c.f32_in)
    for (size_t i = 0; i < x.size(); ++i) x[i] = bf16_to_fp32(xb[i]);
  const Routing rt = random_routing(c.tokens, c.K, c.E, rng);

  DevBuf dx(*stream, x.size() * 4), dids(*stream, rt.ids.size() * 4), dw(*stream, rt.w.size() * 4),
      dout(*stream, x.size() * 4);
  if (c.f32_in) stream->upload(dx.p, x.data(), x.size() * 4);
  else stream->upload(dx.p, xb.data(), xb.size() * 2);
  stream->upload(dids.p, rt.ids.data(), rt.ids.size() * 4);
  stream->upload(dw.p, rt.w.data(), rt.w.size() * 4);
  std::vector<float> junk(x.size(), 12345.f);  // out is written, not accumulated
  stream->upload(dout.p, junk.data(), junk.size() * 4);
  LayerIO io{dx.p, c.f32_in ? XType::f32 : XType::bf16, c.tokens, dids.p, false, dw.as<float>(), c.K, dout.as<float>()};
  hy.enqueue(0, io);
  stream->synchronize();
  std::vector<float> out(x.size());
  stream->download(out.data(), dout.p, out.size() * 4);

  // The CPU engine alone, all experts.
  std::vector<float> ref_cpu(x.size());
  MoeInput in;
  if (c.f32_in) in.x_f32 = x.data();
  else in.x = xb.data();
  in.tokens = c.tokens;
  in.ids = rt.ids.data();
  in.top_k = c.K;
  in.weights = rt.w.data();
  in.out = ref_cpu.data();
  full.forward(in);

  // fp64 reference: hot experts bf16, cold ones as the engine holds them.
  const bool quant = c.fmt.format != WeightFormat::bf16;
  std::vector<std::vector<float>> G(c.E), U(c.E), D(c.E);
  std::vector<HeldExpert> held(c.E);
  std::vector<int> slice_of(c.I);
  for (int e = 0; e < c.E; ++e) {
    const bool is_hot = std::binary_search(hot.begin(), hot.end(), e);
    held[e] = {m.g[0][e].data(), m.u[0][e].data(), m.d[0][e].data()};
    if (is_hot || !quant) continue;
    G[e].assign(size_t(c.I) * c.H, 0);
    U[e] = G[e];
    D[e].assign(size_t(c.H) * c.I, 0);
    for (int s = 0; s < c.subpools; ++s) {
      const auto [i0, i1] = cpu.slice(s);
      const int len = i1 - i0;
      if (!len) continue;
      const auto gu = unpack(cpu.gate_up_pack(s, e)), dn = unpack(cpu.down_pack(s, e));
      for (int r = 0; r < len; ++r)
        for (int k = 0; k < c.H; ++k) {
          G[e][size_t(i0 + r) * c.H + k] = gu[size_t(r) * c.H + k];
          U[e][size_t(i0 + r) * c.H + k] = gu[size_t(len + r) * c.H + k];
        }
      for (int r = 0; r < c.H; ++r)
        for (int j = 0; j < len; ++j) D[e][size_t(r) * c.I + i0 + j] = dn[size_t(r) * len + j];
      for (int j = i0; j < i1; ++j) slice_of[j] = s;
      if (!held[e].layout) held[e].layout = &cpu.gate_up_pack(s, e);
    }
    held[e] = {G[e].data(), U[e].data(), D[e].data(), true, slice_of, c.subpools, held[e].layout};
  }
  RefOut ref(x.size());
  for (int t = 0; t < c.tokens; ++t)
    for (int k = 0; k < c.K; ++k) {
      const int e = rt.ids[size_t(t) * c.K + k];
      if (e >= 0) add_pair(held[e], m, &x[size_t(t) * c.H], rt.w[size_t(t) * c.K + k], size_t(t) * c.H, ref);
    }
  expect_close(out, ref, m, "hybrid vs fp64");
  if (!quant) {  // same weights everywhere: hybrid and CPU engine agree within both bounds
    for (size_t i = 0; i < out.size(); ++i) {
      const double tol = 2 * (ref.bound[i] + 64.0 * (m.H + m.I) * std::ldexp(ref.mag[i] + std::abs(ref.y[i]), -24)) + 1e-30;
      ASSERT_LE(std::abs(out[i] - ref_cpu[i]), tol) << "hybrid vs CPU engine at " << i;
    }
  }
  // Counters: every routed pair ran where the split says.
  const PlacementCounts pc = hy.counts(0);
  EXPECT_EQ(pc.tokens, uint64_t(c.tokens));
  for (int e = 0; e < c.E; ++e) {
    const uint64_t routed = std::count(rt.ids.begin(), rt.ids.end(), e);
    const bool is_hot = std::binary_search(hot.begin(), hot.end(), e);
    EXPECT_EQ(pc.hot[e], is_hot ? routed : 0) << "expert " << e;
    EXPECT_EQ(pc.cold[e], is_hot ? 0 : routed) << "expert " << e;
    EXPECT_EQ(pc.deferred[e], 0u);
  }
}

TEST_P(Hybrid, RandomHotColdSplitsMatchCpuEngineAndReference) {
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> ue(1, 16), uk(1, 4), ut(1, 40), us(1, 2);
  const int hs[] = {64, 128, 192}, is[] = {64, 128};
  for (int it = 0; it < 10; ++it) {
    SplitCase c{ue(rng), hs[it % 3], is[it % 2], 0, ut(rng), us(rng), {WeightFormat::bf16}, -1, it % 2 == 0, it % 3 == 1};
    c.K = std::min(c.E, uk(rng));
    if (it == 0) c.hot = 0;        // all on the CPU
    if (it == 1) c.hot = c.E;      // all on the device
    check_split_case(GetParam(), c, seed + it);
  }
}

TEST_P(Hybrid, QuantizedColdExpertsWithBf16HotExperts) {
  const uint64_t seed = test_seed();
  PackOptions int4{WeightFormat::int4, 64, false}, int8{WeightFormat::int8};
  check_split_case(GetParam(), {8, 128, 128, 3, 17, 2, int4, 3, true, false}, seed);
  check_split_case(GetParam(), {6, 128, 64, 2, 9, 1, int8, 2, false, true}, seed + 1);
}

// ---- deferral, slots, graphs ---------------------------------------------------------

// A chain of layers, as a model runs them: x_{l+1} = x_l + out_l, the "attention"
// done on the stream (copy + add) between the layers' MoE.
struct Chain {
  const Model& m;
  int tokens, K;
  std::vector<Routing> rt;              // per layer
  std::vector<std::unique_ptr<DevBuf>> x, ids, w, out;  // per layer
  Chain(Stream& s, const Model& m_, int tokens_, int K_, std::mt19937_64& rng) : m(m_), tokens(tokens_), K(K_) {
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> x0(size_t(tokens) * m.H);
    for (auto& v : x0) v = nd(rng);
    for (int l = 0; l < m.layers; ++l) {
      rt.push_back(random_routing(tokens, K, m.E, rng));
      x.push_back(std::make_unique<DevBuf>(s, x0.size() * 4));
      ids.push_back(std::make_unique<DevBuf>(s, rt[l].ids.size() * 4));
      w.push_back(std::make_unique<DevBuf>(s, rt[l].w.size() * 4));
      out.push_back(std::make_unique<DevBuf>(s, x0.size() * 4));
      s.upload(ids[l]->p, rt[l].ids.data(), rt[l].ids.size() * 4);
      s.upload(w[l]->p, rt[l].w.data(), rt[l].w.size() * 4);
    }
    s.upload(x[0]->p, x0.data(), x0.size() * 4);
  }
  void enqueue(HybridMoe& hy) {
    Stream& s = hy.stream();
    const size_t n = size_t(tokens) * m.H;
    for (int l = 0; l < m.layers; ++l) {
      hy.enqueue(l, {x[l]->p, XType::f32, tokens, ids[l]->p, false, w[l]->as<float>(), K, out[l]->as<float>()});
      if (l + 1 < m.layers) {
        s.copy(x[l + 1]->p, x[l]->p, n * 4);
        s.add(x[l + 1]->as<float>(), out[l]->as<float>(), n);
      }
    }
  }
  // Every layer's output against the reference applying the same placement and deferral,
  // each layer on the x it actually got (so errors do not compound down the chain).
  void check(Stream& s, const HybridMoe& hy, int deferred, const std::string& what, bool counts = true) {
    const size_t n = size_t(tokens) * m.H;
    std::vector<std::vector<float>> xs(m.layers, std::vector<float>(n)), outs = xs;
    for (int l = 0; l < m.layers; ++l) {
      s.download(xs[l].data(), x[l]->p, n * 4);
      s.download(outs[l].data(), out[l]->p, n * 4);
    }
    std::vector<std::vector<int32_t>> def(m.layers);
    for (int l = 0; l < m.layers; ++l) {
      SCOPED_TRACE(what + ", layer " + std::to_string(l));
      const size_t tk = size_t(tokens) * K;
      std::vector<int32_t> hot(tk), cold(tk);
      def[l].resize(tk);
      std::vector<uint8_t> mask(m.E, 0);
      for (int e : hy.hot(l)) mask[e] = 1;
      const SplitSpec sp{m.E, K, l + 1 < m.layers ? deferred : 0};
      split(rt[l].ids.data(), rt[l].w.data(), tokens, mask.data(), sp, hot.data(), cold.data(), def[l].data());
      RefOut ref(n);
      auto add_all = [&](const std::vector<int32_t>& id, int layer) {
        for (int t = 0; t < tokens; ++t)
          for (int k = 0; k < K; ++k) {
            const int e = id[size_t(t) * K + k];
            if (e < 0) continue;
            HeldExpert he{m.g[layer][e].data(), m.u[layer][e].data(), m.d[layer][e].data()};
            add_pair(he, m, &xs[layer][size_t(t) * m.H], rt[layer].w[size_t(t) * K + k], size_t(t) * m.H, ref);
          }
      };
      add_all(hot, l);
      add_all(cold, l);
      if (l > 0) add_all(def[l - 1], l - 1);  // the previous layer's deferred experts land here
      expect_close(outs[l], ref, m, what);
      if (!counts) continue;
      const PlacementCounts pc = hy.counts(l);
      uint64_t nd = 0;
      for (auto v : pc.deferred) nd += v;
      const uint64_t want = std::count_if(def[l].begin(), def[l].end(), [](int32_t e) { return e >= 0; });
      EXPECT_EQ(nd, want * (pc.tokens / tokens)) << "deferred pairs counted";
      if (l + 1 == m.layers) EXPECT_EQ(nd, 0u) << "the last layer defers nothing";
    }
  }
};

struct Stack {
  std::unique_ptr<Pool> pool;
  std::vector<std::unique_ptr<MoeLayer>> layers;
  std::vector<MoeLayer*> ptrs;
  Stack(Model& m, int subpools, const std::vector<std::vector<int>>& hot) : pool(make_pool(subpools)) {
    for (int l = 0; l < m.layers; ++l) {
      layers.push_back(std::make_unique<MoeLayer>(*pool, MoeShape{m.E, m.H, m.I}, PackOptions{WeightFormat::bf16}, 10 + l));
      layers.back()->exclude(hot[l]);
      layers.back()->load(m.source(l));
      ptrs.push_back(layers.back().get());
    }
  }
};

TEST_P(Hybrid, DeferredExpertsLandInTheNextLayer) {
  const uint64_t seed = test_seed();
  for (int deferred : {0, 1, 2, 4}) {
    std::mt19937_64 rng(seed + deferred);
    Model m(4, 8, 128, 64, rng);
    std::vector<std::vector<int>> hot;
    for (int l = 0; l < m.layers; ++l) hot.push_back(random_subset(m.E, l % 3, rng));
    Stack st(m, 2, hot);
    auto stream = this->stream();
    HybridMoe hy(*stream, st.ptrs, {2, 64, deferred});
    for (int l = 0; l < m.layers; ++l) hy.set_hot(l, hot[l], m.source(l));
    Chain ch(*stream, m, 7, 4, rng);
    ch.enqueue(hy);
    stream->synchronize();
    ch.check(*stream, hy, deferred, "deferred " + std::to_string(deferred));
    if (deferred) {
      uint64_t moved = 0;
      for (auto v : hy.counts(0).deferred) moved += v;
      EXPECT_GT(moved, 0u) << "deferral moved nothing";
    }
  }
}

// A batch larger than buffers.max_tokens runs as chunks: every layer's output is the
// reference's (a tail chunk too); chunks defer nothing, and a deferring step of a fitting
// size works right after. A chunked layer after a deferring one (whose deferred output it
// would drop) is refused.
TEST_P(Hybrid, BatchesLargerThanMaxTokensRunInChunks) {
  const uint64_t seed = test_seed();
  for (int deferred : {0, 1}) {
    std::mt19937_64 rng(seed + 50 + deferred);
    Model m(3, 8, 128, 64, rng);
    std::vector<std::vector<int>> hot;
    for (int l = 0; l < m.layers; ++l) hot.push_back(random_subset(m.E, l % 2 ? 2 : 0, rng));
    Stack st(m, 2, hot);
    auto stream = this->stream();
    HybridMoe hy(*stream, st.ptrs, {2, 4, deferred});
    for (int l = 0; l < m.layers; ++l) hy.set_hot(l, hot[l], m.source(l));
    const std::string what = "deferred " + std::to_string(deferred);
    Chain big(*stream, m, 11, 3, rng);  // chunks of 4, 4, 3
    big.enqueue(hy);
    stream->synchronize();
    big.check(*stream, hy, 0, what + ", 11 tokens in chunks of 4");
    EXPECT_EQ(hy.batch_shapes(), 2) << "a full chunk and the tail";
    Chain fits(*stream, m, 3, 3, rng);
    fits.enqueue(hy);
    stream->synchronize();
    fits.check(*stream, hy, deferred, what + ", then 3 tokens", false);
    if (!deferred) continue;
    auto io = [](Chain& c, int l) {
      return LayerIO{c.x[l]->p, XType::f32, c.tokens, c.ids[l]->p, false, c.w[l]->as<float>(), c.K,
                     c.out[l]->as<float>()};
    };
    hy.enqueue(0, io(fits, 0));
    EXPECT_NE(error_of([&] { hy.enqueue(1, io(big, 1)); }).find("would drop"), std::string::npos);
    stream->synchronize();
  }
}

TEST_P(Hybrid, SlotsAreReusedAcrossLayersStepsAndBatchSizes) {
  const uint64_t seed = test_seed();
  for (int slots : {1, 2, 3}) {
    std::mt19937_64 rng(seed + slots);
    Model m(6, 6, 64, 64, rng);
    std::vector<std::vector<int>> hot;
    for (int l = 0; l < m.layers; ++l) hot.push_back(random_subset(m.E, 1 + l % 2, rng));
    Stack st(m, 1 + slots % 2, hot);
    auto stream = this->stream();
    const int deferred = slots >= 2 ? 1 : 0;
    HybridMoe hy(*stream, st.ptrs, {slots, 16, deferred});
    for (int l = 0; l < m.layers; ++l) hy.set_hot(l, hot[l], m.source(l));
    // Steps back to back, nothing synchronized in between: batch sizes 3, 1, 9, 1, 3.
    std::vector<std::unique_ptr<Chain>> steps;
    for (int tokens : {3, 1, 9, 1, 3}) {
      steps.push_back(std::make_unique<Chain>(*stream, m, tokens, 2, rng));
    }
    for (auto& s : steps) s->enqueue(hy);
    stream->synchronize();
    EXPECT_EQ(hy.batch_shapes(), 3);
    for (size_t i = 0; i < steps.size(); ++i)
      steps[i]->check(*stream, hy, deferred, "slots " + std::to_string(slots) + " step " + std::to_string(i), false);
  }
}

TEST_P(Hybrid, StepsFollowTheCallersStream) {
  // From Python the engine enqueues on torch's current stream at each call, which may change
  // between calls (Stream::follow). Steps back to back on three native streams, nothing
  // synchronized in between: slots, the batch buffers and the deferred experts' outputs
  // cross the moves, so each step must still run after the one before.
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed);
  Model m(4, 6, 64, 64, rng);
  std::vector<std::vector<int>> hot{{1}, {}, {0, 5}, {2}};
  Stack st(m, 2, hot);
  auto stream = this->stream();
  std::unique_ptr<Stream> other;  // CUDA: a second stream, only for its native handle
  std::vector<void*> order(5, nullptr);
  if (stream->is_cuda()) {
    other = make_cuda_stream(0);
    void* own = stream->native();
    order = {own, other->native(), nullptr, other->native(), own};  // nullptr: the legacy default stream
  } else {
    EXPECT_EQ(stream->native(), nullptr);
    const std::string msg = error_of([&] { stream->follow(reinterpret_cast<void*>(8)); });
    EXPECT_NE(msg.find("no native streams"), std::string::npos) << msg;
  }
  HybridMoe hy(*stream, st.ptrs, {2, 16, 1});
  for (int l = 0; l < m.layers; ++l) hy.set_hot(l, hot[l], m.source(l));
  std::vector<std::unique_ptr<Chain>> steps;
  for (int tokens : {3, 1, 5, 1, 3}) steps.push_back(std::make_unique<Chain>(*stream, m, tokens, 2, rng));
  for (size_t i = 0; i < steps.size(); ++i) {
    stream->follow(order[i]);
    steps[i]->enqueue(hy);
  }
  EXPECT_EQ(stream->native(), order.back());
  stream->synchronize();
  for (size_t i = 0; i < steps.size(); ++i) steps[i]->check(*stream, hy, 1, "step " + std::to_string(i), false);
}

TEST_P(Hybrid, CapturedStepReplaysWithTheCpuExperts) {
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed);
  Model m(3, 8, 64, 64, rng);
  std::vector<std::vector<int>> hot{{1, 2}, {}, {0, 7}};
  Stack st(m, 2, hot);
  auto stream = this->stream();
  HybridMoe hy(*stream, st.ptrs, {2, 8, 1});
  for (int l = 0; l < m.layers; ++l) hy.set_hot(l, hot[l], m.source(l));
  Chain ch(*stream, m, 2, 3, rng);
  ch.enqueue(hy);  // warm-up: buffers for this batch shape exist before capture
  stream->synchronize();
  stream->begin_capture();
  ch.enqueue(hy);
  auto graph = stream->end_capture();
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int rep = 0; rep < 3; ++rep) {
    // New inputs in the same buffers, then replay.
    std::vector<float> x0(size_t(ch.tokens) * m.H);
    for (auto& v : x0) v = nd(rng);
    stream->upload(ch.x[0]->p, x0.data(), x0.size() * 4);
    for (int l = 0; l < m.layers; ++l) {
      ch.rt[l] = random_routing(ch.tokens, ch.K, m.E, rng);
      stream->upload(ch.ids[l]->p, ch.rt[l].ids.data(), ch.rt[l].ids.size() * 4);
      stream->upload(ch.w[l]->p, ch.rt[l].w.data(), ch.rt[l].w.size() * 4);
    }
    hy.reset_counts();
    graph->launch();
    stream->synchronize();
    ch.check(*stream, hy, 1, "replay " + std::to_string(rep));
  }
}

// ---- trace ----------------------------------------------------------------------------

TEST_P(Hybrid, TraceShowsCpuWorkOverlappingTheStream) {
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed);
  // Each side's work per layer is a few ms: long enough that a woken pool worker gets a
  // core (or preempts) while the stream thread is still busy, which sub-ms work did not
  // always (the worker then started only after the stream thread blocked).
  Model m(2, 8, 512, 1024, rng);
  std::vector<std::vector<int>> hot{{0, 1, 2, 3}, {0, 1, 2, 3}};
  Stack st(m, 1, hot);
  auto stream = this->stream();
  HybridMoe hy(*stream, st.ptrs, {2, 128, 0});
  for (int l = 0; l < m.layers; ++l) hy.set_hot(l, hot[l], m.source(l));
  // Every token on two hot and two cold experts, so both sides have work.
  Chain ch(*stream, m, 128, 4, rng);
  for (int l = 0; l < m.layers; ++l) {
    for (int t = 0; t < ch.tokens; ++t)
      for (int k = 0; k < 4; ++k) ch.rt[l].ids[size_t(t) * 4 + k] = k < 2 ? (t + k) % 4 : 4 + (t + k) % 4;
    stream->upload(ch.ids[l]->p, ch.rt[l].ids.data(), ch.rt[l].ids.size() * 4);
  }
  // Overlap needs both threads on a core at once; on a loaded 2-core machine one
  // attempt can be starved, so try a few steps and require overlap in at least one.
  test::ScratchDir dir;
  double overlap = 0;
  size_t n_hot = 0, n_cpu = 0, n_copies = 0;
  for (int attempt = 0; attempt < 10 && overlap <= 0; ++attempt) {
    trace::enable(true);
    for (int rep = 0; rep < 3; ++rep) ch.enqueue(hy);
    stream->synchronize();
    trace::enable(false);
    trace::write(dir / "t.json");
    std::ifstream f(dir / "t.json");
    const auto j = nlohmann::json::parse(f);
    struct Iv {
      double b, e;
    };
    std::vector<Iv> hot_spans, cpu_spans;
    for (const auto& ev : j["traceEvents"]) {
      if (ev.value("ph", "") != "X") continue;
      const std::string name = ev["name"];
      const Iv iv{ev["ts"].get<double>(), ev["ts"].get<double>() + ev["dur"].get<double>()};
      if (name == "hot_experts") hot_spans.push_back(iv);
      if (name == "gate_up" || name == "down") cpu_spans.push_back(iv);
      if (name == "copy_in" || name == "copy_back") ++n_copies;
    }
    n_hot += hot_spans.size();
    n_cpu += cpu_spans.size();
    for (const Iv& h : hot_spans)
      for (const Iv& c : cpu_spans) overlap += std::max(0.0, std::min(h.e, c.e) - std::max(h.b, c.b));
  }
  ASSERT_GT(n_hot, 0u) << "no stream spans in the trace";
  ASSERT_GT(n_cpu, 0u) << "no CPU worker spans in the trace";
  EXPECT_GT(n_copies, 0u) << "no transfer spans in the trace";
  EXPECT_GT(overlap, 0.0) << "the CPU experts never ran while the stream worked on the hot ones";
}

// ---- errors ---------------------------------------------------------------------------

TEST_P(Hybrid, BadInputGetsAClearError) {
  std::mt19937_64 rng(test_seed());
  Model m(2, 4, 64, 64, rng);
  Stack st(m, 1, {{}, {}});
  auto stream = this->stream();
  EXPECT_NE(error_of([&] { HybridMoe(*stream, st.ptrs, {1, 8, 1}); }).find("pinned slots"), std::string::npos);
  EXPECT_NE(error_of([&] { HybridMoe(*stream, {}, {}); }).find("no layers"), std::string::npos);
  HybridMoe hy(*stream, st.ptrs, {2, 8, 1});
  EXPECT_NE(error_of([&] { hy.set_hot(0, {1, 1}, m.source(0)); }).find("listed twice"), std::string::npos);
  EXPECT_NE(error_of([&] { hy.set_hot(0, {4}, m.source(0)); }).find("outside [0, 4)"), std::string::npos);
  EXPECT_NE(error_of([&] { hy.set_hot(2, {0}, m.source(0)); }).find("layer 2"), std::string::npos);

  DevBuf x(*stream, 16 * 64 * 4), ids(*stream, 16 * 2 * 4), w(*stream, 16 * 2 * 4), out(*stream, 16 * 64 * 4);
  std::vector<int32_t> good_ids(32, 1), bad_ids(32, 1);
  bad_ids[5] = 9;
  std::vector<float> wt(32, 0.5f);
  stream->upload(w.p, wt.data(), wt.size() * 4);
  LayerIO io{x.p, XType::f32, 4, ids.p, false, w.as<float>(), 2, out.as<float>()};
  io.tokens = 4;
  io.out = nullptr;
  EXPECT_NE(error_of([&] { hy.enqueue(0, io); }).find("out is null"), std::string::npos);
  io.out = out.as<float>();
  EXPECT_NE(error_of([&] { hy.enqueue(1, io); }).find("in order"), std::string::npos);

  // An id out of range is found on the stream; synchronize reports it, naming the slot.
  stream->upload(ids.p, bad_ids.data(), bad_ids.size() * 4);
  hy.enqueue(0, io);
  hy.enqueue(1, io);
  const std::string msg = error_of([&] { stream->synchronize(); });
  EXPECT_NE(msg.find("ids[2, 1] = 9"), std::string::npos) << msg;
  // The scheduler is usable again afterwards.
  stream->upload(ids.p, good_ids.data(), good_ids.size() * 4);
  hy.enqueue(0, io);
  hy.enqueue(1, io);
  stream->synchronize();

  // A CPU layer that excluded an expert refuses tokens routed to it there.
  MoeLayer partial(*st.pool, {4, 64, 64}, {WeightFormat::bf16}, 5);
  partial.exclude({1});
  partial.load(m.source(0));
  HybridMoe hy2(*stream, {&partial}, {});
  hy2.enqueue(0, io);  // expert 1 is not hot here, so the CPU gets it
  const std::string msg2 = error_of([&] { stream->synchronize(); });
  EXPECT_NE(msg2.find("does not hold that expert"), std::string::npos) << msg2;
}

// ---- dynamic hot experts ----------------------------------------------------------------

TEST_P(Hybrid, DynamicHotExpertsFollowTheRoutingAndKeepTheOutputs) {
  // gpu.hot_experts.dynamic: 2 hot experts per layer, starting uniform (0 and 4), re-chosen
  // every 3 steps from the routing seen, with hysteresis 0.25 and scores halving per window.
  // Phase A routes every token to {6, 7}; B to {5, 6} or {6, 7}, which leaves 5 and 7 tied
  // (no move); C to {0, 5}. Every step's output matches the fp64 reference of the same
  // weights wherever each expert ran, before and after the moves.
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed);
  Model m(2, 8, 64, 64, rng);
  const Config cfg = parse_config(
      "version: 1\ncpu: {threads: 1}\ngpu:\n  hot_experts: {count: 2, dynamic: true, rebalance_steps: 3, "
      "hysteresis: 0.25}\n");
  Engine e(cfg, EngineSpec{{m.E, m.H, m.I}, {0, 1}}, stream());
  for (int l = 0; l < m.layers; ++l) e.load_layer(l, m.source(l));
  Stream& s = e.stream();
  const int T = 4, K = 2;
  std::vector<std::unique_ptr<DevBuf>> x, ids, w, out;
  for (int l = 0; l < m.layers; ++l) {
    x.push_back(std::make_unique<DevBuf>(s, size_t(T) * m.H * 4));
    ids.push_back(std::make_unique<DevBuf>(s, size_t(T) * K * 4));
    w.push_back(std::make_unique<DevBuf>(s, size_t(T) * K * 4));
    out.push_back(std::make_unique<DevBuf>(s, size_t(T) * m.H * 4));
  }
  auto pairs = [](int step, int t) -> std::vector<int32_t> {
    if (step < 3) return {6, 7};
    if (step < 6) return t < 3 ? std::vector<int32_t>{5, 6} : std::vector<int32_t>{6, 7};
    return {0, 5};
  };
  const std::vector<std::vector<int>> hot_after = {{0, 4}, {0, 4}, {0, 4}, {6, 7}, {6, 7}, {6, 7},
                                                   {6, 7}, {6, 7}, {6, 7}, {0, 5}};
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> uw(0.05f, 0.5f);
  for (int step = 0; step < 10; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    std::vector<std::vector<float>> xs(m.layers), ws(m.layers);
    std::vector<std::vector<int32_t>> is(m.layers);
    for (int l = 0; l < m.layers; ++l) {
      xs[l].resize(size_t(T) * m.H);
      for (auto& v : xs[l]) v = nd(rng);
      for (int t = 0; t < T; ++t)
        for (int32_t id : pairs(step, t)) {
          is[l].push_back(id);
          ws[l].push_back(uw(rng));
        }
      s.upload(x[l]->p, xs[l].data(), xs[l].size() * 4);
      s.upload(ids[l]->p, is[l].data(), is[l].size() * 4);
      s.upload(w[l]->p, ws[l].data(), ws[l].size() * 4);
    }
    for (int l = 0; l < m.layers; ++l)
      e.forward(l, {x[l]->p, XType::f32, T, ids[l]->p, false, w[l]->as<float>(), K, out[l]->as<float>()});
    e.synchronize();
    for (int l = 0; l < m.layers; ++l) {
      EXPECT_EQ(e.hot(l), hot_after[step]) << "layer " << l;
      std::vector<float> got(size_t(T) * m.H);
      s.download(got.data(), out[l]->p, got.size() * 4);
      RefOut ref(got.size());
      for (int t = 0; t < T; ++t)
        for (int k = 0; k < K; ++k) {
          const int ex = is[l][size_t(t) * K + k];
          add_pair({m.g[l][ex].data(), m.u[l][ex].data(), m.d[l][ex].data()}, m, &xs[l][size_t(t) * m.H],
                   ws[l][size_t(t) * K + k], size_t(t) * m.H, ref);
        }
      expect_close(got, ref, m, "layer " + std::to_string(l));
    }
  }
  EXPECT_EQ(e.rebalances(), 2u);  // steps 3 and 9 moved experts; step 6 found 5 and 7 tied
  EXPECT_EQ(e.hot_moves(), 8u);   // 2 per layer, twice
  // A capture would keep pointers into hot sets that later move: refused, and nothing breaks.
  s.begin_capture();
  const std::string msg = error_of(
      [&] { e.forward(0, {x[0]->p, XType::f32, T, ids[0]->p, false, w[0]->as<float>(), K, out[0]->as<float>()}); });
  s.end_capture();
  EXPECT_NE(msg.find("gpu.hot_experts.dynamic"), std::string::npos) << msg;
  e.forward(0, {x[0]->p, XType::f32, T, ids[0]->p, false, w[0]->as<float>(), K, out[0]->as<float>()});
  e.synchronize();
}

TEST_P(Hybrid, HotCountAutoFillsTheBudget) {
  // gpu.hot_experts: auto. Each hot expert takes 6 * 64 * 64 bytes on the device, 2 layers.
  std::mt19937_64 rng(test_seed());
  Model m(2, 8, 64, 64, rng);
  const Config cfg = parse_config("version: 1\ncpu: {threads: 1}\ngpu:\n  hot_experts: auto\n");
  const uint64_t per_count = 2 * 6 * 64 * 64;
  Engine e(cfg, EngineSpec{{m.E, m.H, m.I}, {0, 1}}, stream(), 3 * per_count + 100);
  for (int l = 0; l < m.layers; ++l) e.load_layer(l, m.source(l));
  EXPECT_EQ(e.hot_budget(), 3 * per_count + 100);
  EXPECT_EQ(e.hot(0), (std::vector<int>{0, 2, 5}));  // 3 spread evenly over 8
  EXPECT_EQ(e.device_bytes(), 3 * per_count);
  // No budget given: the device's free memory less the reserve; the host stream has none.
  Engine d(cfg, EngineSpec{{m.E, m.H, m.I}, {0, 1}}, stream());
  const Stream::MemoryInfo mem = d.stream().device_memory();
  if (d.stream().is_cuda()) {
    EXPECT_GT(mem.total, 0u);
    EXPECT_LE(d.hot_budget(), mem.total);
    EXPECT_EQ(static_cast<int>(choose_hot_experts(d.config().gpu.hot_experts, 0, m.E).size()),
              hot_count_for_budget(d.hot_budget(), 2, {m.E, m.H, m.I}));
  } else {
    EXPECT_EQ(mem.total, 0u);
    EXPECT_EQ(d.hot_budget(), 0u);
    EXPECT_EQ(d.config().gpu.hot_experts.policy, HotExpertsConfig::Policy::none);
  }
  for (int l = 0; l < m.layers; ++l) d.load_layer(l, m.source(l));
  EXPECT_EQ(d.hot(0).size(), static_cast<size_t>(d.config().gpu.hot_experts.count));
}

TEST_P(Hybrid, StatisticsRoundTripAndChooseTheHottest) {
  std::mt19937_64 rng(test_seed());
  Model m(2, 6, 64, 64, rng);
  Stack st(m, 1, {{}, {}});
  auto stream = this->stream();
  HybridMoe hy(*stream, st.ptrs, {});
  Chain ch(*stream, m, 20, 2, rng);
  ch.enqueue(hy);
  stream->synchronize();
  test::ScratchDir dir;
  hy.write_statistics(dir / "stats.json");
  const RoutingStatistics rs = load_routing_statistics(dir / "stats.json");
  EXPECT_EQ(rs.experts, m.E);
  ASSERT_EQ(rs.layers.size(), 2u);
  for (int l = 0; l < 2; ++l) {
    const auto& c = rs.layers.at(10 + l);  // keyed by the model layer index
    for (int e = 0; e < m.E; ++e)
      EXPECT_EQ(c[e], uint64_t(std::count(ch.rt[l].ids.begin(), ch.rt[l].ids.end(), e))) << "layer " << l << " expert " << e;
    HotExpertsConfig cfg;
    cfg.policy = HotExpertsConfig::Policy::statistics;
    cfg.count = 2;
    const auto chosen = choose_hot_experts(cfg, 10 + l, m.E, &rs);
    ASSERT_EQ(chosen.size(), 2u);
    for (int e = 0; e < m.E; ++e)
      if (!std::binary_search(chosen.begin(), chosen.end(), e))
        for (int h : chosen) EXPECT_GE(c[h], c[e]);
  }
}

TEST(HybridStreams, TheConfigPicksTheStream) {
  EXPECT_FALSE(make_stream(parse_config("version: 1\ngpu:\n  device: none\n"))->is_cuda());
  EXPECT_EQ(make_stream(parse_config("version: 1\ngpu:\n  device: auto\n"))->is_cuda(), cuda_available());
  // A device that does not exist here (index 7 on a machine with fewer GPUs).
  const std::string msg = error_of([] { make_stream(parse_config("version: 1\ngpu:\n  device: cuda:7\n", "x.yaml")); });
  EXPECT_NE(msg.find("x.yaml: gpu.device: cuda:7"), std::string::npos) << msg;
}

INSTANTIATE_TEST_SUITE_P(Streams, Hybrid, ::testing::Values("host", "cuda"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace tandem
