// Engine: a model's MoE layers built from a placement config, loaded from a safetensors
// checkpoint (Qwen3 naming, BF16 or F32) or from in-memory sources, run on the host
// stream (gpu.device: none; the "device" is the stream's thread, holding the hot experts
// as bf16) and checked against an fp64 reference that applies the same placement (hot /
// cold) and deferral, written out here independently of routing.h's split().
//
// Reference and tolerance (as in test_hybrid.cpp): per routed (token, expert) pair,
// y = Wd (silu(Wg x) * (Wu x)) in fp64 on the weights as held (bf16-exact sources, x
// rounded to bf16 as the kernels see it). The engine rounds h to bf16, so per output
// element |out - ref| <= sum |w| sum_j |Wd_ij| 2^-8 |h_j| plus fp32 accumulation,
// bounded by 64 (hidden + inter) 2^-24 (magnitude + |ref|).
#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>
#include <fstream>
#include <cstdio>
#include <filesystem>
#include <malloc.h>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "tandem/engine.h"
#include "tandem/error.h"
#include "tandem/routing.h"
#include "tandem/safetensors.h"
#include <limits>

#include "tandem/lora.h"
#include "test_util.h"

namespace tandem {
namespace {

using test::test_seed;

// The model under test: 8 experts of hidden 128 / inter 128 (two subpools of 64 rows)
// in model layers 1 and 3 (MoE indices 0 and 1); layers 0 and 2 are dense.
constexpr int kE = 8, kH = 128, kI = 128, kK = 4, kTokens = 9;
const std::vector<int> kLayers = {1, 3};

EngineSpec spec() { return {{kE, kH, kI}, kLayers}; }

// The config every test starts from; `gpu` and `rest` add keys to gpu: and the top level.
Config config(const std::string& gpu = "", const std::string& rest = "") {
  return parse_config("version: 1\ncpu: {format: bf16, virtual_subpools: 2, threads: 1}\ngpu: {device: none" + gpu +
                          "}\n" + rest,
                      "engine.yaml");
}

// Passes when f throws a tandem::Error of category `code` whose message contains `needle`.
template <typename F>
::testing::AssertionResult throws_error(F&& f, const std::string& needle, Errc code) {
  try {
    f();
  } catch (const Error& e) {
    if (e.code() != code)
      return ::testing::AssertionFailure() << "category " << errc_name(e.code()) << ", want " << errc_name(code)
                                           << "; message: " << e.message();
    if (e.message().find(needle) == std::string::npos)
      return ::testing::AssertionFailure() << "message '" << e.message() << "' does not contain '" << needle << "'";
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-tandem exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "nothing thrown; expected a tandem::Error containing '" << needle << "'";
}

// ---- weights, checkpoints, batches ------------------------------------------------------

// Random experts per MoE layer; bf16-exact, so a BF16 checkpoint, an F32 one and the
// in-memory f32 sources all hold exactly these values.
struct Weights {
  std::vector<std::vector<std::vector<float>>> g, u, d;  // [moe index][expert], nn.Linear layout
  explicit Weights(std::mt19937_64& rng) {
    std::normal_distribution<float> nd(0.f, 1.f);
    const float sg = 2.0f / std::sqrt(float(kH)), sd = 1.0f / std::sqrt(float(kI));
    auto mk = [&](size_t n, float sc) {
      std::vector<float> v(n);
      for (auto& x : v) x = bf16_to_fp32(fp32_to_bf16(nd(rng) * sc));
      return v;
    };
    const size_t L = kLayers.size();
    g.resize(L);
    u.resize(L);
    d.resize(L);
    for (size_t i = 0; i < L; ++i)
      for (int e = 0; e < kE; ++e) {
        g[i].push_back(mk(size_t(kI) * kH, sg));
        u[i].push_back(mk(size_t(kI) * kH, sg));
        d[i].push_back(mk(size_t(kH) * kI, sd));
      }
  }
  // MoE layer i's experts as in-memory f32 tensors.
  std::function<ExpertSource(int)> source(int i) const {
    return [this, i](int e) {
      return ExpertSource{{g[i][e].data(), SourceType::f32, kI, kH},
                          {u[i][e].data(), SourceType::f32, kI, kH},
                          {d[i][e].data(), SourceType::f32, kH, kI}};
    };
  }
};

std::string expert_key(int model_layer, int expert, const std::string& proj) {
  return "model.layers." + std::to_string(model_layer) + ".mlp.experts." + std::to_string(expert) + "." + proj +
         "_proj.weight";
}

std::string tensor_bytes(const std::vector<float>& v, const std::string& dtype) {
  if (dtype == "F32") return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
  std::vector<bf16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = fp32_to_bf16(v[i]);
  return std::string(reinterpret_cast<const char*>(b.data()), b.size() * 2);
}

// The checkpoint's entries as Qwen3 saves them, plus tensors the engine must ignore (a
// dense layer's MLP, the embedding). Tests edit the list to break it.
std::vector<test::Entry> checkpoint_entries(const Weights& w, const std::string& dtype) {
  std::vector<test::Entry> out;
  const std::vector<float> dense(size_t(kH) * 4, 0.25f);
  out.push_back({"model.embed_tokens.weight", dtype, {4, kH}, tensor_bytes(dense, dtype)});
  out.push_back({"model.layers.2.mlp.gate_proj.weight", dtype, {4, kH}, tensor_bytes(dense, dtype)});
  for (size_t i = 0; i < kLayers.size(); ++i)
    for (int e = 0; e < kE; ++e) {
      out.push_back({expert_key(kLayers[i], e, "gate"), dtype, {kI, kH}, tensor_bytes(w.g[i][e], dtype)});
      out.push_back({expert_key(kLayers[i], e, "up"), dtype, {kI, kH}, tensor_bytes(w.u[i][e], dtype)});
      out.push_back({expert_key(kLayers[i], e, "down"), dtype, {kH, kI}, tensor_bytes(w.d[i][e], dtype)});
    }
  return out;
}

Checkpoint write_checkpoint(const test::ScratchDir& dir, const std::vector<test::Entry>& entries) {
  test::write_file(dir / "model.safetensors", test::good_file(entries));
  return Checkpoint::open(dir / "model.safetensors");
}

// One layer's routing: top_k distinct experts per token, weights in (0.05, 1] / K.
struct Routing {
  std::vector<int32_t> ids;
  std::vector<float> w;
};
Routing random_routing(std::mt19937_64& rng, bool empty_slots) {
  Routing r;
  std::uniform_real_distribution<float> uw(0.05f, 1.0f);
  for (int t = 0; t < kTokens; ++t) {
    std::vector<int> perm(kE);
    for (int e = 0; e < kE; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int k = 0; k < kK; ++k) {
      r.ids.push_back(empty_slots && (t * kK + k) % 11 == 10 ? -1 : perm[k]);
      r.w.push_back(uw(rng) / kK);
    }
  }
  return r;
}

// One layer's inputs and output in host memory (the host stream's "device" memory).
struct Batch {
  std::vector<float> x;      // [tokens x hidden], what the reference sees
  std::vector<bf16_t> x_bf;  // the same values as bf16, when the layer is fed bf16
  XType xt;
  Routing r;
  std::vector<float> out;
  Batch(std::mt19937_64& rng, XType xt_, bool empty_slots) : xt(xt_), r(random_routing(rng, empty_slots)) {
    std::normal_distribution<float> nd(0.f, 1.f);
    x.resize(size_t(kTokens) * kH);
    for (auto& v : x) v = nd(rng);
    if (xt == XType::bf16)
      for (auto& v : x) x_bf.push_back(fp32_to_bf16(v));
    out.assign(x.size(), std::nanf(""));  // every element must be written
  }
  LayerIO io() {
    const void* xp = xt == XType::bf16 ? static_cast<const void*>(x_bf.data()) : x.data();
    return {xp, xt, kTokens, r.ids.data(), false, r.w.data(), kK, out.data()};
  }
};

// ---- reference -----------------------------------------------------------------------

struct RefOut {
  std::vector<double> y, bound, mag;  // [tokens x hidden]
  RefOut() : y(size_t(kTokens) * kH), bound(y.size()), mag(y.size()) {}
};

// Adds w * expert(x_row) for one (token, expert) pair of MoE layer i.
void add_pair(const Weights& wt, int i, int e, const float* xrow, double w, size_t o, RefOut& ref) {
  const float *G = wt.g[i][e].data(), *U = wt.u[i][e].data(), *D = wt.d[i][e].data();
  std::vector<double> x(kH), h(kI);
  for (int k = 0; k < kH; ++k) x[k] = bf16_to_fp32(fp32_to_bf16(xrow[k]));
  for (int j = 0; j < kI; ++j) {
    double gg = 0, uu = 0;
    for (int k = 0; k < kH; ++k) {
      gg += double(G[size_t(j) * kH + k]) * x[k];
      uu += double(U[size_t(j) * kH + k]) * x[k];
    }
    h[j] = gg / (1 + std::exp(-gg)) * uu;
  }
  for (int r = 0; r < kH; ++r) {
    double s = 0, b = 0, mg = 0;
    for (int j = 0; j < kI; ++j) {
      const double dw = D[size_t(r) * kI + j];
      s += dw * h[j];
      b += std::abs(dw) * std::ldexp(std::abs(h[j]), -8);
      mg += std::abs(dw * h[j]);
    }
    ref.y[o + r] += w * s;
    ref.bound[o + r] += std::abs(w) * b;
    ref.mag[o + r] += std::abs(w) * mg;
  }
}

// Where each (token, slot) runs: the engine's contract (routing.h, split_token) written
// out independently. A valid id is hot when its expert is; of a token's cold experts,
// the `deferred` lowest-weighted (ties: the later slot) move to the deferred list.
enum class Where { empty, hot, cold, deferred };
std::vector<Where> place(const Routing& r, const std::vector<int>& hot, int deferred) {
  std::vector<Where> where(r.ids.size());
  for (int t = 0; t < kTokens; ++t) {
    const size_t o = size_t(t) * kK;
    for (int k = 0; k < kK; ++k) {
      const int e = r.ids[o + k];
      where[o + k] = e < 0 ? Where::empty : std::count(hot.begin(), hot.end(), e) ? Where::hot : Where::cold;
    }
    for (int j = 0; j < deferred; ++j) {
      int pick = -1;
      for (int k = 0; k < kK; ++k)
        if (where[o + k] == Where::cold && (pick < 0 || r.w[o + k] <= r.w[o + pick])) pick = k;
      if (pick >= 0) where[o + pick] = Where::deferred;
    }
  }
  return where;
}

// Adds MoE layer i's pairs placed in one of `which` to ref (on the batch's own x).
void add_layer(const Weights& wt, int i, const Batch& b, const std::vector<Where>& where,
               std::initializer_list<Where> which, RefOut& ref) {
  for (int t = 0; t < kTokens; ++t)
    for (int k = 0; k < kK; ++k) {
      const size_t s = size_t(t) * kK + k;
      if (std::find(which.begin(), which.end(), where[s]) == which.end() || b.r.ids[s] < 0) continue;
      add_pair(wt, i, b.r.ids[s], &b.x[size_t(t) * kH], b.r.w[s], size_t(t) * kH, ref);
    }
}

// The layer's full output (every routed expert, nothing deferred).
RefOut reference(const Weights& wt, int i, const Batch& b) {
  RefOut ref;
  add_layer(wt, i, b, place(b.r, {}, 0), {Where::cold}, ref);
  return ref;
}

// The first n outputs (all of them when n is 0).
void expect_close(const std::vector<float>& out, const RefOut& r, const std::string& what, size_t n = 0) {
  for (size_t i = 0; i < (n ? n : out.size()); ++i) {
    const double tol = r.bound[i] + 64.0 * (kH + kI) * std::ldexp(r.mag[i] + std::abs(r.y[i]), -24) + 1e-30;
    ASSERT_LE(std::abs(out[i] - r.y[i]), tol) << what << ": token " << i / kH << " output " << i % kH << " got "
                                              << out[i] << " want " << r.y[i];
  }
}

// ---- building and running ------------------------------------------------------------

TEST(Engine, LoadsACheckpointAndMatchesTheReference) {
  const uint64_t seed = test_seed();
  for (const std::string dtype : {"BF16", "F32"}) {
    SCOPED_TRACE("checkpoint dtype " + dtype);
    std::mt19937_64 rng(seed);
    const Weights w(rng);
    test::ScratchDir dir;
    const Checkpoint ckpt = write_checkpoint(dir, checkpoint_entries(w, dtype));
    const ExpertNaming naming = ExpertNaming::detect(ckpt, kLayers[0]);
    EXPECT_EQ(naming.gate, ExpertNaming::qwen3().gate);

    Engine e(config(), spec());
    EXPECT_EQ(e.moe_layers(), 2);
    EXPECT_EQ(e.index_of(1), 0);
    EXPECT_EQ(e.index_of(3), 1);
    for (int l : {-1, 0, 2, 4}) EXPECT_EQ(e.index_of(l), -1) << "model layer " << l;
    EXPECT_EQ(e.layer(0).layer_index(), 1);  // MoeLayer names the model layer
    EXPECT_EQ(e.layer(1).layer_index(), 3);
    EXPECT_FALSE(e.stream().is_cuda());
    EXPECT_EQ(e.pool().subpools(), 2);
    EXPECT_FALSE(e.loaded());

    e.load(ckpt, naming);
    EXPECT_TRUE(e.loaded());
    EXPECT_GT(e.cpu_bytes(), 0u);
    EXPECT_EQ(e.cpu_bytes(), e.layer(0).packed_bytes() + e.layer(1).packed_bytes());
    EXPECT_EQ(e.device_bytes(), 0u);  // no hot experts configured
    EXPECT_TRUE(e.hot(0).empty());
    EXPECT_TRUE(e.hot(1).empty());

    // Layer 0 fed fp32, layer 1 bf16; each layer's output is its own full MoE.
    Batch b0(rng, XType::f32, true), b1(rng, XType::bf16, true);
    e.forward(0, b0.io());
    e.forward(1, b1.io());
    e.synchronize();
    expect_close(b0.out, reference(w, 0, b0), "MoE layer 0");
    expect_close(b1.out, reference(w, 1, b1), "MoE layer 1");
  }
}

// Engine::run without a device part (host stream, no hot experts, no deferral) runs the
// CPU task from the calling thread instead of the stream: the same output bit for bit as
// forward + synchronize, the same placement counts, errors named the same way; with hot
// experts in the layer it takes the stream's path (and still matches the reference).
TEST(Engine, RunOnTheCallingThreadIsTheStreamPathBitForBit) {
  std::mt19937_64 rng(test_seed());
  const Weights w(rng);
  test::ScratchDir dir;
  const Checkpoint ckpt = write_checkpoint(dir, checkpoint_entries(w, "BF16"));
  Engine direct(config(), spec()), streamed(config(), spec());
  direct.load(ckpt, ExpertNaming::qwen3());
  streamed.load(ckpt, ExpertNaming::qwen3());
  for (const XType xt : {XType::f32, XType::bf16}) {
    for (int i = 0; i < 2; ++i) {
      Batch a(rng, xt, true);
      Batch b = a;
      direct.run(i, a.io());
      streamed.forward(i, b.io());
      streamed.synchronize();
      ASSERT_EQ(std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(float)), 0) << "MoE layer " << i;
      expect_close(a.out, reference(w, i, a), "run, MoE layer " + std::to_string(i));
    }
  }
  for (int i = 0; i < 2; ++i) {
    const PlacementCounts x = direct.hybrid().counts(i), y = streamed.hybrid().counts(i);
    EXPECT_EQ(x.tokens, y.tokens);
    EXPECT_EQ(x.cold, y.cold);
    EXPECT_EQ(x.hot, y.hot);
  }
  Batch bad(rng, XType::f32, false);
  bad.r.ids[5] = kE;  // out of range
  const std::string msg = test::error_of([&] { direct.run(0, bad.io()); });
  EXPECT_NE(msg.find(std::to_string(kE)), std::string::npos) << msg;
  Batch ok(rng, XType::f32, false);
  direct.run(0, ok.io());  // usable after the error
  expect_close(ok.out, reference(w, 0, ok), "after an error");

  Engine hot(config(", hot_experts: {layers: {1: [3, 0]}}"), spec());
  hot.load(ckpt, ExpertNaming::qwen3());
  EXPECT_FALSE(hot.hybrid().run_direct(0, ok.io()));  // layer with hot experts: the stream's path
  Batch c(rng, XType::f32, false);
  hot.run(0, c.io());
  expect_close(c.out, reference(w, 0, c), "run with hot experts");
}

// One rule picks the kernels of every CPU part (cpu.isa, lowered by TANDEM_ISA, capped
// by the hardware): the engine and each of its layers report the level and run it, the
// host stream's hot experts included (the output at each level matches the fp64 reference).
TEST(Engine, KernelLevelFollowsConfigLoweredByTandemIsa) {
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed);
  const Weights w(rng);
  const Batch b(rng, XType::f32, true);
  const IsaLevel hw = hardware_isa();
  for (IsaLevel level : all_isa_levels()) {
    if (level > hw) continue;
    SCOPED_TRACE(std::string("cpu.isa ") + std::string(isa_name(level)));
    test::ScopedEnv env("TANDEM_ISA", nullptr);
    const Config c = parse_config(str_cat("version: 1\ncpu: {format: bf16, virtual_subpools: 2, threads: 1, isa: ",
                                          isa_name(level), "}\ngpu: {device: none, hot_experts: 2}\n"),
                                  "engine.yaml");
    Engine e(c, spec());
    EXPECT_EQ(e.isa(), level);
    for (int i = 0; i < e.moe_layers(); ++i) EXPECT_EQ(e.layer(i).isa(), level);
    for (int i = 0; i < e.moe_layers(); ++i) e.load_layer(i, w.source(i));
    Batch got = b;
    e.forward(0, got.io());
    e.synchronize();
    expect_close(got.out, reference(w, 0, b), "MoE layer 0");

    // TANDEM_ISA lowers an auto config, and a config above the hardware is refused.
    test::ScopedEnv env2("TANDEM_ISA", std::string(isa_name(level)).c_str());
    Engine lowered(config(), spec());
    EXPECT_EQ(lowered.isa(), level);
    EXPECT_EQ(lowered.layer(1).isa(), level);
  }
  if (hw != IsaLevel::amx) {
    const std::string above(isa_name(static_cast<IsaLevel>(static_cast<int>(hw) + 1)));
    const Config c = parse_config("version: 1\ncpu: {isa: " + above + "}\ngpu: {device: none}\n", "engine.yaml");
    EXPECT_TRUE(throws_error([&] { Engine e(c, spec()); }, "engine.yaml: cpu.isa=" + above + " asks for more",
                             Errc::unsupported));
  }
}

TEST(Engine, HotExpertsFromTheConfig) {
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed);
  const Weights w(rng);
  test::ScratchDir dir;
  const Checkpoint ckpt = write_checkpoint(dir, checkpoint_entries(w, "BF16"));

  // Explicit lists, keyed by the model layer.
  Engine e(config(", hot_experts: {layers: {1: [3, 0], 3: [5]}}"), spec());
  e.load(ckpt, ExpertNaming::qwen3());
  const std::vector<std::vector<int>> hot = {{0, 3}, {5}};
  EXPECT_EQ(e.hot(0), hot[0]);
  EXPECT_EQ(e.hot(1), hot[1]);
  for (int i = 0; i < 2; ++i)
    for (int x = 0; x < kE; ++x)
      EXPECT_EQ(e.layer(i).excluded(x), std::count(hot[i].begin(), hot[i].end(), x) > 0) << "layer " << i << " expert " << x;
  EXPECT_GT(e.device_bytes(), 0u);
  // The hot experts are not packed on the CPU as well: 13 of 16 experts' bytes there.
  Engine all_cold(config(), spec());
  all_cold.load(ckpt, ExpertNaming::qwen3());
  EXPECT_EQ(e.cpu_bytes() * 16, all_cold.cpu_bytes() * 13);

  // No empty slots, so every slot is counted somewhere; token 0 routes to every hot expert.
  Batch b0(rng, XType::f32, false), b1(rng, XType::f32, false);
  for (Batch* b : {&b0, &b1}) {
    const int32_t t0[kK] = {5, 0, 3, 6};
    std::copy(t0, t0 + kK, b->r.ids.begin());
  }
  e.forward(0, b0.io());
  e.forward(1, b1.io());
  e.synchronize();
  expect_close(b0.out, reference(w, 0, b0), "explicit, MoE layer 0");
  expect_close(b1.out, reference(w, 1, b1), "explicit, MoE layer 1");
  for (int i = 0; i < 2; ++i) {
    SCOPED_TRACE("MoE layer " + std::to_string(i));
    const Routing& r = (i == 0 ? b0 : b1).r;
    const PlacementCounts pc = e.hybrid().counts(i);
    EXPECT_EQ(pc.tokens, uint64_t(kTokens));
    uint64_t total = 0, on_hot = 0;
    for (int x = 0; x < kE; ++x) {
      const bool is_hot = std::count(hot[i].begin(), hot[i].end(), x) > 0;
      const uint64_t routed = std::count(r.ids.begin(), r.ids.end(), x);
      EXPECT_EQ(pc.hot[x], is_hot ? routed : 0u) << "expert " << x;
      EXPECT_EQ(pc.cold[x], is_hot ? 0u : routed) << "expert " << x;
      EXPECT_EQ(pc.deferred[x], 0u) << "expert " << x;
      total += pc.hot[x] + pc.cold[x] + pc.deferred[x];
      on_hot += pc.hot[x];
    }
    EXPECT_EQ(total, uint64_t(kTokens) * kK);
    EXPECT_GE(on_hot, hot[i].size());  // token 0 at least
  }

  // A uniform count: that many experts per layer, spread evenly over the ids.
  Engine u(config(", hot_experts: {count: 2}"), spec());
  u.load(ckpt, ExpertNaming::qwen3());
  for (int i = 0; i < 2; ++i) EXPECT_EQ(u.hot(i), (std::vector<int>{0, 4})) << "MoE layer " << i;
  for (Batch* b : {&b0, &b1}) std::fill(b->out.begin(), b->out.end(), std::nanf(""));
  u.forward(0, b0.io());
  u.forward(1, b1.io());
  u.synchronize();
  expect_close(b0.out, reference(w, 0, b0), "count 2, MoE layer 0");
  expect_close(b1.out, reference(w, 1, b1), "count 2, MoE layer 1");
  for (int i = 0; i < 2; ++i) {
    const PlacementCounts pc = u.hybrid().counts(i);
    for (int x = 0; x < kE; ++x)
      if (x != 0 && x != 4) EXPECT_EQ(pc.hot[x], 0u) << "count 2, MoE layer " << i << " expert " << x;
  }
}

// Layer 0 defers each token's lowest-weighted CPU expert; its output lands in layer 1's.
TEST(Engine, DeferredExpertsLandInTheNextLayer) {
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed);
  const Weights w(rng);
  test::ScratchDir dir;
  const Checkpoint ckpt = write_checkpoint(dir, checkpoint_entries(w, "BF16"));
  Engine e(config(", hot_experts: {layers: {1: [0, 3], 3: [5]}}, deferred_experts: 1", "buffers: {pinned_slots: 2}\n"),
           spec());
  EXPECT_EQ(e.hybrid().options().deferred, 1);
  e.load(ckpt, ExpertNaming::qwen3());

  Batch b0(rng, XType::f32, true), b1(rng, XType::f32, true);
  // Token 0: equal weights, slot 3 hot, so the tie rule picks slot 2 (the later CPU
  // expert); token 1: only hot experts and empty slots, so it defers nothing.
  const int32_t t0[kK] = {1, 2, 6, 0}, t1[kK] = {0, -1, 3, -1};
  std::copy(t0, t0 + kK, b0.r.ids.begin());
  std::copy(t1, t1 + kK, b0.r.ids.begin() + kK);
  for (int k = 0; k < kK; ++k) b0.r.w[k] = 0.25f;
  e.forward(0, b0.io());
  e.forward(1, b1.io());
  e.synchronize();

  const std::vector<Where> p0 = place(b0.r, e.hot(0), 1), p1 = place(b1.r, e.hot(1), 0);  // the last layer defers nothing
  RefOut r0, r1;
  add_layer(w, 0, b0, p0, {Where::hot, Where::cold}, r0);
  add_layer(w, 1, b1, p1, {Where::hot, Where::cold}, r1);
  add_layer(w, 0, b0, p0, {Where::deferred}, r1);  // layer 0's deferred experts, on layer 0's x
  expect_close(b0.out, r0, "MoE layer 0 (its deferred experts left out)");
  expect_close(b1.out, r1, "MoE layer 1 (plus layer 0's deferred experts)");

  // The counts agree with the placement: one deferred expert per token with a cold one.
  const PlacementCounts c0 = e.hybrid().counts(0), c1 = e.hybrid().counts(1);
  uint64_t deferred0 = 0, deferred1 = 0;
  for (int x = 0; x < kE; ++x) {
    uint64_t want = 0;
    for (size_t s = 0; s < p0.size(); ++s) want += p0[s] == Where::deferred && b0.r.ids[s] == x;
    EXPECT_EQ(c0.deferred[x], want) << "expert " << x;
    deferred0 += c0.deferred[x];
    deferred1 += c1.deferred[x];
  }
  EXPECT_EQ(deferred0, uint64_t(kTokens - 1)) << "every token but token 1 has a cold expert to defer";
  // The reference itself resolved token 0's tie as intended (so the outputs above check it).
  EXPECT_EQ(p0[2], Where::deferred) << "token 0's tie goes to its last CPU expert (slot 2)";
  EXPECT_EQ(deferred1, 0u) << "the last layer defers nothing";
}

// Both MoE layers of engines `a` and `b` (the same weights, loaded two ways) on the same two
// random batches: each output against the reference, and the two engines' bits equal.
void expect_same_outputs(const Weights& w, std::mt19937_64& rng, Engine& a, Engine& b) {
  Batch b0(rng, XType::f32, true), b1(rng, XType::f32, true);
  std::vector<std::vector<float>> outs;
  for (Engine* e : {&a, &b}) {
    for (Batch* x : {&b0, &b1}) std::fill(x->out.begin(), x->out.end(), std::nanf(""));
    e->forward(0, b0.io());
    e->forward(1, b1.io());
    e->synchronize();
    expect_close(b0.out, reference(w, 0, b0), "MoE layer 0");
    expect_close(b1.out, reference(w, 1, b1), "MoE layer 1");
    outs.push_back(b0.out);
    outs.push_back(b1.out);
  }
  EXPECT_EQ(outs[0], outs[2]);
  EXPECT_EQ(outs[1], outs[3]);
}

// transformers v5's fused layout: experts.gate_up_proj [E, 2I, H] (gate the first I rows of
// each expert) and experts.down_proj [E, H, I]. The same weights as the per-expert
// checkpoint: the same packs and the same outputs; a transposed or mixed naming is refused.
TEST(Engine, FusedExpertTensorsLoadAsThePerExpertOnes) {
  std::mt19937_64 rng(test_seed());
  const Weights w(rng);
  std::vector<test::Entry> fused;
  for (size_t i = 0; i < kLayers.size(); ++i) {
    std::vector<float> gu, dn;
    for (int e = 0; e < kE; ++e) {
      gu.insert(gu.end(), w.g[i][e].begin(), w.g[i][e].end());
      gu.insert(gu.end(), w.u[i][e].begin(), w.u[i][e].end());
      dn.insert(dn.end(), w.d[i][e].begin(), w.d[i][e].end());
    }
    const std::string base = "model.layers." + std::to_string(kLayers[i]) + ".mlp.experts.";
    fused.push_back({base + "gate_up_proj", "BF16", {kE, 2 * kI, kH}, tensor_bytes(gu, "BF16")});
    fused.push_back({base + "down_proj", "BF16", {kE, kH, kI}, tensor_bytes(dn, "BF16")});
  }
  test::ScratchDir dir;  // one per test: three files in it
  auto open = [&](const std::string& file, const std::vector<test::Entry>& entries) {
    test::write_file(dir / file, test::good_file(entries));
    return Checkpoint::open(dir / file);
  };
  const Checkpoint per_expert = open("a.safetensors", checkpoint_entries(w, "BF16")),
                   fused_ckpt = open("b.safetensors", fused);
  const ExpertNaming naming{"model.layers.{L}.mlp.experts.gate_up_proj", "model.layers.{L}.mlp.experts.gate_up_proj",
                            "model.layers.{L}.mlp.experts.down_proj"};
  EXPECT_TRUE(naming.fused());
  EXPECT_FALSE(ExpertNaming::qwen3().fused());
  const Config cfg = config(", hot_experts: {layers: {1: [2]}}");
  Engine x(cfg, spec()), y(cfg, spec());
  x.load(per_expert, ExpertNaming::qwen3());
  y.load(fused_ckpt, naming);
  for (int i = 0; i < 2; ++i)
    for (int s = 0; s < 2; ++s)
      for (int e = 0; e < kE; ++e) {
        if (x.layer(i).excluded(e)) continue;
        ASSERT_EQ(unpack(x.layer(i).gate_up_pack(s, e)), unpack(y.layer(i).gate_up_pack(s, e))) << i << " " << e;
        ASSERT_EQ(unpack(x.layer(i).down_pack(s, e)), unpack(y.layer(i).down_pack(s, e))) << i << " " << e;
      }
  expect_same_outputs(w, rng, x, y);
  // A mix of per-expert and fused patterns, or gate and up naming different tensors.
  const std::string mixed = test::error_of([&] {
    checkpoint_expert(fused_ckpt, kLayers[0], 0, {naming.gate, naming.up, ExpertNaming::qwen3().down}, {kE, kH, kI});
  });
  EXPECT_NE(mixed.find("either every pattern names one expert"), std::string::npos) << mixed;
  // The transposed layout ([E, H, 2I], as Llama 4 stores it) is refused naming the shapes.
  std::vector<test::Entry> transposed = fused;
  transposed[0].shape = {kE, kH, 2 * kI};
  const Checkpoint t = open("c.safetensors", transposed);
  const std::string msg = test::error_of([&] { checkpoint_expert(t, kLayers[0], 0, naming, {kE, kH, kI}); });
  EXPECT_NE(msg.find("a transposed layout is not supported"), std::string::npos) << msg;
  EXPECT_NE(msg.find("gate_up_proj"), std::string::npos) << msg;
}

// The same weights from memory (f32) and from a checkpoint (bf16) pack and run alike.
TEST(Engine, LoadLayerFromMemoryMatchesTheCheckpoint) {
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed);
  const Weights w(rng);
  test::ScratchDir dir;
  const Checkpoint ckpt = write_checkpoint(dir, checkpoint_entries(w, "BF16"));
  const Config cfg = config(", hot_experts: {layers: {1: [2], 3: [1, 7]}}");
  Engine from_ckpt(cfg, spec()), from_mem(cfg, spec());
  from_ckpt.load(ckpt, ExpertNaming::qwen3());
  from_mem.load_layer(1, w.source(1));  // any order
  EXPECT_FALSE(from_mem.loaded());
  EXPECT_TRUE(from_mem.layer(1).loaded());
  from_mem.load_layer(0, w.source(0));
  EXPECT_TRUE(from_mem.loaded());

  EXPECT_EQ(from_mem.cpu_bytes(), from_ckpt.cpu_bytes());
  EXPECT_EQ(from_mem.device_bytes(), from_ckpt.device_bytes());
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(from_mem.hot(i), from_ckpt.hot(i));
    for (int s = 0; s < 2; ++s)
      for (int x = 0; x < kE; ++x) {
        if (from_mem.layer(i).excluded(x)) continue;
        ASSERT_EQ(unpack(from_mem.layer(i).gate_up_pack(s, x)), unpack(from_ckpt.layer(i).gate_up_pack(s, x)))
            << "layer " << i << " subpool " << s << " expert " << x;
        ASSERT_EQ(unpack(from_mem.layer(i).down_pack(s, x)), unpack(from_ckpt.layer(i).down_pack(s, x)))
            << "layer " << i << " subpool " << s << " expert " << x;
      }
  }

  // Same packs, same placement, same kernels: the same bits.
  expect_same_outputs(w, rng, from_ckpt, from_mem);
}

// Engine::load with `only` packs those layers from the checkpoint and leaves the rest to
// load_layer; unload_layer gives a layer back (hot experts too) so it can load again (what
// merging an adapter into the packs does), and the result is the full load's, bit for bit.
TEST(Engine, LoadsALayerSubsetAndReloadsALayer) {
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed);
  const Weights w(rng);
  test::ScratchDir dir;
  const Checkpoint ckpt = write_checkpoint(dir, checkpoint_entries(w, "BF16"));
  const Config cfg = config(", hot_experts: {layers: {1: [2], 3: [1, 7]}}");
  Engine full(cfg, spec()), part(cfg, spec());
  full.load(ckpt, ExpertNaming::qwen3());
  part.load(ckpt, ExpertNaming::qwen3(), {}, {1});
  EXPECT_TRUE(part.loaded(1));
  EXPECT_FALSE(part.loaded(0));
  EXPECT_FALSE(part.loaded());
  part.load_layer(0, w.source(0));
  EXPECT_TRUE(part.loaded());
  part.unload_layer(1);
  EXPECT_FALSE(part.loaded(1));
  EXPECT_TRUE(part.hot(1).empty());
  part.load_layer(1, w.source(1));
  EXPECT_EQ(part.hot(1), (std::vector<int>{1, 7}));
  EXPECT_EQ(part.cpu_bytes(), full.cpu_bytes());
  EXPECT_EQ(part.device_bytes(), full.device_bytes());

  expect_same_outputs(w, rng, full, part);

  const Errc inv = Errc::invalid_argument;
  Engine bad(cfg, spec());
  EXPECT_TRUE(throws_error([&] { bad.load(ckpt, ExpertNaming::qwen3(), {}, {1, 1}); }, "engine: MoE layer 1 is listed twice", inv));
  EXPECT_TRUE(throws_error([&] { bad.load(ckpt, ExpertNaming::qwen3(), {}, {2}); }, "engine: MoE layer 2 is outside [0, 2)", inv));
  EXPECT_TRUE(throws_error([&] { bad.unload_layer(-1); }, "engine: MoE layer -1 is outside [0, 2)", inv));
  EXPECT_FALSE(bad.loaded(0) || bad.loaded(1));
}

// progress(done, total) counts experts over all layers: never past total, never back.
// DISABLED: fails against runtime/engine.cpp as of this test's writing. Engine::load
// adds MoeLayer::load's `done` (which counts (subpool, expert) items, up to
// experts x subpools) to i * experts, so with 2 subpools it reports 16 of 16 after
// layer 0, then 8.. and 24 of 16 for layer 1. Enable once that is fixed.
TEST(Engine, ProgressCountsExpertsOverAllLayers) {
  std::mt19937_64 rng(test_seed());
  const Weights w(rng);
  test::ScratchDir dir;
  const Checkpoint ckpt = write_checkpoint(dir, checkpoint_entries(w, "BF16"));
  Engine e(config(", hot_experts: {count: 1}"), spec());
  std::vector<std::pair<int, int>> calls;
  e.load(ckpt, ExpertNaming::qwen3(), [&](int done, int total) { calls.emplace_back(done, total); });
  ASSERT_FALSE(calls.empty());
  const int total = kE * int(kLayers.size());
  for (size_t c = 0; c < calls.size(); ++c) {
    EXPECT_EQ(calls[c].second, total) << "call " << c;
    EXPECT_GE(calls[c].first, 0) << "call " << c;
    EXPECT_LE(calls[c].first, total) << "call " << c;
    if (c) EXPECT_GE(calls[c].first, calls[c - 1].first) << "call " << c << ": progress went back";
  }
  EXPECT_EQ(calls.back(), std::make_pair(total, total));
}

// ---- errors ---------------------------------------------------------------------------

// A broken checkpoint is refused naming the tensor, before any layer is loaded.
TEST(Engine, CheckpointErrorsNameTheTensor) {
  std::mt19937_64 rng(test_seed());
  const Weights w(rng);
  const auto cases =
      test::checkpoint_defects(expert_key(3, 5, "down"), expert_key(1, 2, "up"), 64, kI, kH, expert_key(3, 0, "gate"));
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    test::ScratchDir dir;
    std::vector<test::Entry> es = checkpoint_entries(w, "BF16");
    c.edit(es);
    const Checkpoint ckpt = write_checkpoint(dir, es);
    Engine e(config(", hot_experts: {count: 2}"), spec());
    EXPECT_TRUE(throws_error([&] { e.load(ckpt, ExpertNaming::qwen3()); }, c.needle, c.code));
    EXPECT_FALSE(e.layer(0).loaded()) << "a layer was loaded before the bad tensor was found";
    EXPECT_FALSE(e.layer(1).loaded());
    EXPECT_EQ(e.cpu_bytes(), 0u);
  }
}

// A non-finite weight is found while packing (reading every weight twice to find it up
// front would double a model's load time), so late in the load: it is refused naming the
// layer, expert, projection, tensor, file and element, in every format, and the layers
// loaded before it are given back, hot experts included.
TEST(Engine, NonFiniteWeightsAreRefusedAndNothingStaysLoaded) {
  std::mt19937_64 rng(test_seed());
  const Weights w(rng);
  const std::string bad = expert_key(kLayers[1], 2, "up");
  for (const std::string fmt : {"bf16", "int8", "int4"})
    for (const float v : {std::nanf(""), -INFINITY}) {
      SCOPED_TRACE(fmt + " " + std::to_string(v));
      test::ScratchDir dir;
      std::vector<test::Entry> es = checkpoint_entries(w, "F32");
      for (auto& x : es)
        if (x.name == bad) std::memcpy(x.bytes.data() + (size_t(1) * kH + 2) * 4, &v, 4);
      const Checkpoint ckpt = write_checkpoint(dir, es);
      Engine e(parse_config("version: 1\ncpu: {format: " + fmt +
                                ", virtual_subpools: 2, threads: 1}\ngpu: {device: none, hot_experts: {count: 1}}\n",
                            "engine.yaml"),
               spec());
      Errc code{};
      const std::string msg = test::error_of([&] { e.load(ckpt, ExpertNaming::qwen3()); }, &code);
      EXPECT_EQ(code, Errc::bad_format) << msg;
      EXPECT_NE(msg.find(str_cat("expert 2 up: tensor ", bad, " of ")), std::string::npos) << msg;
      EXPECT_NE(msg.find("model.safetensors: element [1, 2] is "), std::string::npos) << msg;
      EXPECT_NE(msg.find("non-finite weights are refused"), std::string::npos) << msg;
      EXPECT_FALSE(e.layer(0).loaded());
      EXPECT_FALSE(e.layer(1).loaded());
      EXPECT_EQ(e.cpu_bytes(), 0u);
      EXPECT_EQ(e.device_bytes(), 0u);
      // The fixed checkpoint then loads into the same engine.
      test::ScratchDir dir2;
      const Checkpoint good = write_checkpoint(dir2, checkpoint_entries(w, "F32"));
      e.load(good, ExpertNaming::qwen3());
      EXPECT_TRUE(e.loaded());
    }
}

// Making, loading, running and freeing an engine in a loop (tests, notebooks, a server that
// reloads) leaves nothing behind: after a warm-up, the open files, mappings, threads and
// resident memory stay flat. Bound on RSS: every engine starts pool and stream threads,
// and a leak of anything per thread or per load (a 160 KB trace chunk per thread was
// one) grows by >= 100 KB a cycle; allocator noise after malloc_trim measured < 10 KB a
// cycle. 20 cycles may grow by 1 MiB (50 KB a cycle) at most.
TEST(Engine, ReloadLoopLeavesNothingBehind) {
  // Every cycle starts and joins the pool's threads. glibc gives a thread that meets a
  // locked arena a new one (up to 8 per core), each keeping its heap: on a loaded CI machine
  // (the test 10x slower than alone) 20 cycles grew 1656 KB that way, none of it tandem's.
  // One arena for this process, so the bound below sees only what tandem keeps.
  mallopt(M_ARENA_MAX, 1);
  std::mt19937_64 rng(test_seed());
  const Weights w(rng);
  test::ScratchDir dir;
  write_checkpoint(dir, checkpoint_entries(w, "BF16"));
  auto count = [](const char* path) {
    size_t n = 0;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(path)) ++n;
    return n;
  };
  auto lines = [](const char* path) {
    std::ifstream f(path);
    return static_cast<size_t>(std::count(std::istreambuf_iterator<char>(f), {}, '\n'));
  };
  auto rss_kb = [] {
    std::ifstream f("/proc/self/status");
    for (std::string l; std::getline(f, l);)
      if (l.rfind("VmRSS:", 0) == 0) return std::stol(l.substr(6));
    return 0L;
  };
  auto cycle = [&] {
    const Checkpoint ckpt = Checkpoint::open(dir / "model.safetensors");
    Engine e(config(", hot_experts: {count: 2}"), spec());
    e.load(ckpt, ExpertNaming::qwen3());
    Batch b(rng, XType::f32, true);
    e.forward(0, b.io());
    e.forward(1, b.io());
    e.synchronize();
    malloc_trim(0);
  };
  for (int i = 0; i < 5; ++i) cycle();
  const size_t fds = count("/proc/self/fd"), tasks = count("/proc/self/task"), maps = lines("/proc/self/maps");
  const long rss = rss_kb();
  for (int i = 0; i < 20; ++i) cycle();
  EXPECT_EQ(count("/proc/self/fd"), fds) << "open files";
  EXPECT_EQ(count("/proc/self/task"), tasks) << "threads";
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
  // The sanitizers' allocators map their size-class regions as they grow, one more line
  // each time a class is first touched or a region extends (an ASan run on the AMX Xeon:
  // +4 to +6 lines over 20 cycles, all but two in ASan's heap range 0x6000_0000_0000 -
  // 0x6400_0000_0000, at any kernel level), so the mapping count is checked elsewhere.
  std::printf("[ note     ] mappings not checked under a sanitizer (%zu -> %zu lines)\n", maps, lines("/proc/self/maps"));
  // ThreadSanitizer keeps every finished thread's shadow state and allocator cache (each
  // cycle starts and joins the pool's threads): about 380 KB a cycle with any kernel level.
  // AddressSanitizer holds freed blocks in its quarantine (up to 256 MB) before reuse: one
  // CI run grew 350 KB a cycle, another not at all. So under either, resident memory says
  // nothing about tandem's; LeakSanitizer checks leaks at exit there, this bound elsewhere.
  std::printf("[ note     ] resident memory not checked under a sanitizer (grew %ld KB)\n", rss_kb() - rss);
#else
  EXPECT_LE(lines("/proc/self/maps"), maps + 2) << "mappings";  // the allocator may map an arena
  EXPECT_LE(rss_kb() - rss, 1024) << "resident memory grew by " << rss_kb() - rss << " KB over 20 cycles";
#endif
}

TEST(Engine, MisuseGetsAClearError) {
  std::mt19937_64 rng(test_seed());
  const Weights w(rng);
  test::ScratchDir dir;
  const Checkpoint ckpt = write_checkpoint(dir, checkpoint_entries(w, "BF16"));
  Engine e(config(), spec());
  Batch b(rng, XType::f32, true);
  const Errc inv = Errc::invalid_argument;
  EXPECT_TRUE(throws_error([&] { e.forward(0, b.io()); }, "engine: MoE layer 0 (model layer 1) has no weights: load every layer before the first forward", inv));
  EXPECT_TRUE(throws_error([&] { e.load_layer(2, w.source(0)); }, "engine: MoE layer 2 is outside [0, 2)", inv));
  EXPECT_TRUE(throws_error([&] { e.load_layer(-1, w.source(0)); }, "engine: MoE layer -1 is outside [0, 2)", inv));

  e.load(ckpt, ExpertNaming::qwen3());
  EXPECT_TRUE(throws_error([&] { e.load(ckpt, ExpertNaming::qwen3()); }, "engine: MoE layer 0 (model layer 1) is already loaded", inv));
  EXPECT_TRUE(throws_error([&] { e.load_layer(1, w.source(1)); }, "engine: MoE layer 1 (model layer 3) is already loaded", inv));
  EXPECT_TRUE(throws_error([&] { e.forward(2, b.io()); }, "engine: MoE layer 2 is outside [0, 2)", inv));
  EXPECT_TRUE(throws_error([&] { e.forward(-1, b.io()); }, "engine: MoE layer -1 is outside [0, 2)", inv));
  // Still usable after the refusals.
  e.forward(0, b.io());
  e.synchronize();
  expect_close(b.out, reference(w, 0, b), "MoE layer 0 after the refusals");
}

TEST(Engine, BadSpecOrPlacementIsRefused) {
  const Errc inv = Errc::invalid_argument;
  const MoeShape shape{kE, kH, kI};
  EXPECT_TRUE(throws_error([&] { Engine(config(), {shape, {}}); }, "engine: the model has no MoE layers", inv));
  const std::string order = "MoE layer indices must be distinct, ascending and non-negative";
  EXPECT_TRUE(throws_error([&] { Engine(config(), {shape, {3, 1}}); }, order + " (entry 1 is 1)", inv));
  EXPECT_TRUE(throws_error([&] { Engine(config(), {shape, {1, 1}}); }, order + " (entry 1 is 1)", inv));
  EXPECT_TRUE(throws_error([&] { Engine(config(), {shape, {-1, 2}}); }, order + " (entry 0 is -1)", inv));
  // Hot experts listed for a model layer without routed experts (2 is dense here).
  EXPECT_TRUE(throws_error([&] { Engine(config(", hot_experts: {layers: {1: [0], 2: [1]}}"), spec()); },
                           "engine.yaml: gpu.hot_experts.layers: layer 2 is not a MoE layer of this model", inv));
  // A hot expert id the model does not have is named with its config key, when the
  // engine is built (not halfway through loading), for any layer.
  EXPECT_TRUE(throws_error([&] { Engine(config(", hot_experts: {layers: {1: [0], 3: [8]}}"), spec()); },
                           "gpu.hot_experts.layers.3: expert 8 is outside [0, 8)", inv));
}

// Generation sees a new prompt length per request: buffers per batch shape must not pile
// up. 18 shapes (9 token counts x 2 input dtypes) pass through; at most kMaxBatchShapes
// stay, and every result is still right (freed buffers are never reused; ASan checks).
TEST(Engine, BatchShapesAreBoundedAndStayCorrect) {
  std::mt19937_64 rng(test_seed());
  const Weights w(rng);
  for (const std::string extra : {std::string(), std::string(", hot_experts: {layers: {1: [2]}}, deferred_experts: 1")}) {
    Engine e(config(extra), spec());
    e.load_layer(0, w.source(0));
    e.load_layer(1, w.source(1));
    const bool deferral = !extra.empty();
    for (int round = 0; round < 2; ++round)
      for (XType xt : {XType::f32, XType::bf16})
        for (int t = 1; t <= kTokens; ++t) {
          Batch b0(rng, xt, true), b1(rng, xt, true);
          LayerIO io0 = b0.io(), io1 = b1.io();
          io0.tokens = io1.tokens = t;
          e.forward(0, io0);
          e.forward(1, io1);
          e.synchronize();
          ASSERT_LE(e.hybrid().batch_shapes(), HybridMoe::kMaxBatchShapes);
          if (deferral) continue;  // the deferral arithmetic is DeferredExpertsLandInTheNextLayer's
          const std::string what = "tokens " + std::to_string(t);
          expect_close(b0.out, reference(w, 0, b0), what + ", MoE layer 0", size_t(t) * kH);
          expect_close(b1.out, reference(w, 1, b1), what + ", MoE layer 1", size_t(t) * kH);
        }
  }
}

// gpt-oss's experts (clamped SwiGLU, biases) run on the CPU only: hot experts are refused
// naming the activation, auto finds no room for them, a packed store refuses them (LoRA
// training takes them), and a source without the biases is refused naming the missing one.
TEST(Engine, GptOssExpertsStayOnTheCpuAndTheRestIsRefused) {
  EngineSpec oai = spec();
  oai.shape.act = {GateAct::Kind::clamped, 1.702f, 7.0f, 1.0f};
  oai.shape.bias = true;
  EXPECT_TRUE(throws_error([&] { Engine e(config(", hot_experts: {count: 2}"), oai); },
                           "gpu.hot_experts: hot experts run silu(gate) * up experts without biases only; this model's "
                           "experts are a clamped SwiGLU (alpha 1.702, limit 7, up + 1) with biases",
                           Errc::unsupported));
  {
    Engine e(config(", hot_experts: {count: auto}"), oai, nullptr, uint64_t{1} << 30);
    for (int i = 0; i < e.moe_layers(); ++i) EXPECT_TRUE(e.hot(i).empty());
  }
  Config::Cpu cpu;
  cpu.threads = 1;
  Pool pool(pool_options(cpu));
  EXPECT_NO_THROW(LoraMoe(pool, oai.shape, SftOptions{}, 5));  // training computes them (test_lora.cpp)
  MoeShape bad{kE, kH, kI};
  bad.act = {GateAct::Kind::clamped, 1.0f, std::numeric_limits<float>::quiet_NaN(), 0.0f};
  EXPECT_TRUE(throws_error([&] { LoraMoe l(pool, bad, SftOptions{}, 6); },
                           "lora: layer 6: a clamped SwiGLU needs a finite alpha, up_offset and positive limit",
                           Errc::invalid_argument));
  EXPECT_TRUE(throws_error([&] { MoeLayer l(pool, bad, PackOptions{WeightFormat::bf16}, 6); },
                           "moe: layer 6: a clamped SwiGLU needs a finite alpha, up_offset and positive limit",
                           Errc::invalid_argument));
  MoeLayer layer(pool, oai.shape, PackOptions{WeightFormat::bf16}, 4);
  std::vector<float> g(size_t(kI) * kH, 0.01f), d(size_t(kH) * kI, 0.01f), b(kI, 0.5f);
  EXPECT_TRUE(throws_error(
      [&] {
        layer.load([&](int) {
          ExpertSource src{{g.data(), SourceType::f32, kI, kH}, {g.data(), SourceType::f32, kI, kH}, {d.data(), SourceType::f32, kH, kI}};
          src.gate_bias = {b.data(), SourceType::f32, 1, kI};
          src.up_bias = {b.data(), SourceType::f32, 1, kI};
          return src;  // no down bias
        });
      },
      "moe: expert 0: the layer's experts have biases, its down bias is missing", Errc::invalid_argument));
}

}  // namespace
}  // namespace tandem
