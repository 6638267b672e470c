// LoraEngine: the training side of a model built from a placement config (pool + one
// LoraMoe per MoE layer, kernels at cpu.isa), loaded from a safetensors checkpoint the way
// the inference engine loads one. Its layers must compute exactly (bit for bit) what a
// LoraMoe built by hand with the same options and loaded from the same checkpoint computes;
// LoraMoe itself is checked against fp64 references in test_lora.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "tandem/error.h"
#include "tandem/lora_engine.h"
#include "tandem/pool_config.h"
#include "tandem/safetensors.h"
#include "test_util.h"

namespace tandem {
namespace {

// 6 experts of hidden 64 / inter 128 (two subpools of 64 rows) in model layers 1 and 3.
constexpr int kE = 6, kH = 64, kI = 128, kK = 2, kTokens = 7, kRank = 4;
const std::vector<int> kLayers = {1, 3};

EngineSpec spec() { return {{kE, kH, kI}, kLayers}; }

// cpu_extra: more cpu keys (the format bf16 unless they give one).
Config config(const std::string& cpu_extra = "") {
  const std::string format = cpu_extra.find("format:") == std::string::npos ? ", format: bf16" : "";
  return parse_config("version: 1\ncpu: {virtual_subpools: 2, threads: 1" + format + cpu_extra +
                          "}\ngpu: {device: none}\n",
                      "train.yaml");
}

std::string expert_key(int model_layer, int expert, const std::string& proj) {
  return "model.layers." + std::to_string(model_layer) + ".mlp.experts." + std::to_string(expert) + "." + proj +
         "_proj.weight";
}

// A BF16 checkpoint (Qwen3 naming) of random experts for every MoE layer, plus a dense tensor.
std::vector<test::Entry> checkpoint_entries(std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  auto bytes = [&](size_t n, float scale) {
    std::vector<bf16_t> b(n);
    for (auto& v : b) v = fp32_to_bf16(nd(rng) * scale);
    return std::string(reinterpret_cast<const char*>(b.data()), b.size() * 2);
  };
  std::vector<test::Entry> out;
  out.push_back({"model.embed_tokens.weight", "BF16", {4, kH}, bytes(size_t(4) * kH, 1.f)});
  for (int l : kLayers)
    for (int e = 0; e < kE; ++e) {
      out.push_back({expert_key(l, e, "gate"), "BF16", {kI, kH}, bytes(size_t(kI) * kH, 2.f / std::sqrt(float(kH)))});
      out.push_back({expert_key(l, e, "up"), "BF16", {kI, kH}, bytes(size_t(kI) * kH, 2.f / std::sqrt(float(kH)))});
      out.push_back({expert_key(l, e, "down"), "BF16", {kH, kI}, bytes(size_t(kH) * kI, 1.f / std::sqrt(float(kI)))});
    }
  return out;
}

Checkpoint write_checkpoint(const test::ScratchDir& dir, const std::vector<test::Entry>& entries) {
  test::write_file(dir / "model.safetensors", test::good_file(entries));
  return Checkpoint::open(dir / "model.safetensors");
}

// One training step's inputs for a layer: x, routing, LoRA weights (dense layouts), dOut.
struct Step {
  std::vector<float> x, w, d_out;
  std::vector<int32_t> ids;
  std::array<std::vector<float>, 6> lora;
  Step(std::mt19937_64& rng, const LoraMoe& layer) {
    std::normal_distribution<float> nd(0.f, 1.f);
    std::uniform_real_distribution<float> uw(0.1f, 1.0f);
    x.resize(size_t(kTokens) * kH);
    for (auto& v : x) v = nd(rng);
    d_out.resize(x.size());
    for (auto& v : d_out) v = nd(rng);
    for (int t = 0; t < kTokens; ++t)
      for (int k = 0; k < kK; ++k) {
        ids.push_back((t * 5 + k * 3) % kE);
        w.push_back(uw(rng) / kK);
      }
    const auto shapes = layer.lora_shapes();
    for (int m = 0; m < 6; ++m) {
      lora[m].resize(size_t(kE) * shapes[m].first * shapes[m].second);
      for (auto& v : lora[m]) v = 0.1f * nd(rng);
    }
  }
  LoraWeights weights() {
    LoraWeights lw;
    LoraMatrix* m[6] = {&lw.a_gate, &lw.b_gate, &lw.a_up, &lw.b_up, &lw.a_down, &lw.b_down};
    for (int i = 0; i < 6; ++i) *m[i] = LoraMatrix{lora[i].data(), lora[i].size()};
    return lw;
  }
};

struct Result {
  std::vector<float> out, d_x, d_w;
  std::array<std::vector<float>, 6> grads;
};

Result run(LoraMoe& layer, Step& s) {
  Result r;
  r.out.assign(s.x.size(), std::nanf(""));
  MoeInput in;
  in.x_f32 = s.x.data();
  in.tokens = kTokens;
  in.ids = s.ids.data();
  in.top_k = kK;
  in.weights = s.w.data();
  in.out = r.out.data();
  const LoraWeights lw = s.weights();
  LoraContext ctx = layer.forward(in, lw, true);
  r.d_x.assign(s.x.size(), 0.f);
  r.d_w.assign(s.w.size(), 0.f);
  SftGrad g;
  g.d_out = s.d_out.data();
  g.d_x = r.d_x.data();
  g.d_weights = r.d_w.data();
  LoraMatrix* m[6] = {&g.grads.a_gate, &g.grads.b_gate, &g.grads.a_up, &g.grads.b_up, &g.grads.a_down, &g.grads.b_down};
  for (int i = 0; i < 6; ++i) {
    r.grads[i].assign(s.lora[i].size(), 0.f);
    *m[i] = LoraMatrix{r.grads[i].data(), r.grads[i].size()};
  }
  layer.backward(ctx, lw, g);
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---- tests -------------------------------------------------------------------------------

TEST(LoraEngine, BuiltFromTheConfig) {
  const IsaLevel hw = hardware_isa();
  for (IsaLevel level : all_isa_levels()) {
    if (level > hw) continue;
    SCOPED_TRACE(std::string("cpu.isa ") + std::string(isa_name(level)));
    test::ScopedEnv env("TANDEM_ISA", nullptr);
    LoraEngineOptions o;
    o.backward_format = WeightFormat::int8;
    o.lora = {16, 8.0f, true};
    LoraEngine t(config(str_cat(", format: int4, group_size: 32, zero_point: true, isa: ", isa_name(level))), spec(), o);
    EXPECT_EQ(t.isa(), level);
    EXPECT_EQ(t.pool().subpools(), 2);
    EXPECT_EQ(t.pool().total_threads(), 2);
    EXPECT_EQ(t.moe_layers(), 2);
    EXPECT_EQ(t.index_of(1), 0);
    EXPECT_EQ(t.index_of(3), 1);
    for (int l : {-1, 0, 2, 4}) EXPECT_EQ(t.index_of(l), -1) << "model layer " << l;
    for (int i = 0; i < t.moe_layers(); ++i) {
      const LoraMoe& l = t.layer(i);
      EXPECT_EQ(l.isa(), level);
      EXPECT_EQ(l.layer_index(), kLayers[i]);  // the model layer
      EXPECT_EQ(&const_cast<LoraMoe&>(l).pool(), &t.pool());  // one pool for every layer
      EXPECT_EQ(l.options().format.format, WeightFormat::int4);
      EXPECT_EQ(l.options().format.group, 32);
      EXPECT_FALSE(l.options().format.symmetric);
      EXPECT_EQ(l.options().backward_format, WeightFormat::int8);
      EXPECT_EQ(l.options().lora.rank, 16);
      EXPECT_FLOAT_EQ(l.options().lora.scaling(), 8.0f / 4.0f);  // rsLoRA: alpha / sqrt(rank)
    }
    EXPECT_FALSE(t.loaded());
    EXPECT_EQ(t.packed_bytes(), 0u);
    EXPECT_EQ(t.backward_bytes(), 0u);

    // TANDEM_ISA lowers an auto config, as for the inference engine.
    test::ScopedEnv env2("TANDEM_ISA", std::string(isa_name(level)).c_str());
    LoraEngine lowered(config(), spec());
    EXPECT_EQ(lowered.isa(), level);
    EXPECT_EQ(lowered.layer(1).isa(), level);
  }
  if (hw != IsaLevel::amx) {
    const std::string above(isa_name(static_cast<IsaLevel>(static_cast<int>(hw) + 1)));
    Errc code{};
    const std::string msg = test::error_of([&] { LoraEngine t(config(", isa: " + above), spec()); }, &code);
    EXPECT_EQ(code, Errc::unsupported);
    EXPECT_NE(msg.find("train.yaml: cpu.isa=" + above + " asks for more"), std::string::npos) << msg;
  }
}

TEST(LoraEngine, BadSpecOrIndexIsRefused) {
  Errc code{};
  std::string msg = test::error_of([&] { LoraEngine t(config(), {{kE, kH, kI}, {}}); }, &code);
  EXPECT_NE(msg.find("no MoE layers"), std::string::npos) << msg;
  msg = test::error_of([&] { LoraEngine t(config(), {{kE, kH, kI}, {3, 1}}); }, &code);
  EXPECT_NE(msg.find("distinct, ascending and non-negative (entry 1 is 1)"), std::string::npos) << msg;
  LoraEngine t(config(), spec());
  msg = test::error_of([&] { t.layer(2); }, &code);
  EXPECT_EQ(code, Errc::invalid_argument);
  EXPECT_NE(msg.find("MoE layer 2 is outside [0, 2)"), std::string::npos) << msg;
  msg = test::error_of([&] { LoraEngine b(config(), spec(), {WeightFormat::int4, {}}); }, &code);
  EXPECT_NE(msg.find("backward_format int4"), std::string::npos) << msg;
}

// The engine's layers and LoraMoe layers built and loaded by hand compute the same bits,
// forward and backward, in the bf16 and an integer format.
TEST(LoraEngine, LoadsACheckpointLikeALoraMoeLoadedDirectly) {
  const uint64_t seed = test::test_seed();
  for (const std::string cpu : {"", ", format: int8", ", format: int4, group_size: 32"}) {
    SCOPED_TRACE("cpu" + cpu);
    std::mt19937_64 rng(seed);
    test::ScratchDir dir;
    const Checkpoint ckpt = write_checkpoint(dir, checkpoint_entries(rng));
    const ExpertNaming naming = ExpertNaming::detect(ckpt, kLayers[0]);
    const Config c = config(cpu);
    LoraEngine t(c, spec(), {WeightFormat::bf16, {kRank, 8.0f, false}});
    int last_done = -1, last_total = -1, calls = 0;
    bool monotone = true;
    t.load(ckpt, naming, [&](int done, int total) {
      monotone = monotone && done >= last_done;
      last_done = done, last_total = total, ++calls;
    });
    EXPECT_TRUE(t.loaded());
    EXPECT_TRUE(monotone);
    EXPECT_GT(calls, 0);
    EXPECT_EQ(last_total, kE * 2);
    EXPECT_EQ(last_done, kE * 2);

    Pool pool(pool_options(c.cpu));
    SftOptions o;
    o.format = pack_options(c.cpu);
    o.lora = {kRank, 8.0f, false};
    size_t packed = 0, backward = 0;
    for (int i = 0; i < 2; ++i) {
      SCOPED_TRACE("MoE layer " + std::to_string(i));
      LoraMoe direct(pool, spec().shape, o, kLayers[i]);
      direct.use_isa(c.isa());
      direct.load(ckpt, kLayers[i], naming);
      EXPECT_EQ(t.layer(i).packed_bytes(), direct.packed_bytes());
      for (int e = 0; e < kE; ++e) {
        const auto a = t.layer(i).dequantized(e), b = direct.dequantized(e);
        for (int p = 0; p < 3; ++p) EXPECT_TRUE(same_bits(a[p], b[p])) << "expert " << e << " projection " << p;
      }
      Step s(rng, direct);
      const Result got = run(t.layer(i), s), want = run(direct, s);
      EXPECT_TRUE(same_bits(got.out, want.out)) << "forward output";
      EXPECT_TRUE(same_bits(got.d_x, want.d_x)) << "dL/dx";
      EXPECT_TRUE(same_bits(got.d_w, want.d_w)) << "dL/dw";
      for (int m = 0; m < 6; ++m) EXPECT_TRUE(same_bits(got.grads[m], want.grads[m])) << "gradient " << m;
      for (float v : got.out) ASSERT_TRUE(std::isfinite(v));
      packed += direct.packed_bytes();
      backward += direct.backward_bytes();
    }
    EXPECT_EQ(t.packed_bytes(), packed);
    EXPECT_EQ(t.backward_bytes(), backward);
    EXPECT_GT(t.backward_bytes(), 0u);
  }
}

TEST(LoraEngine, LoadLayerFromMemoryAndPrepareBackward) {
  std::mt19937_64 rng(test::test_seed());
  std::vector<test::Entry> es = checkpoint_entries(rng);
  test::ScratchDir dir;
  const Checkpoint ckpt = write_checkpoint(dir, es);
  LoraEngine from_ckpt(config(), spec()), from_memory(config(), spec());
  from_ckpt.load(ckpt, ExpertNaming::qwen3());
  // The same bf16 tensors, handed over as in-memory sources (what offload() does).
  for (int i = 0; i < 2; ++i)
    from_memory.load_layer(
        i, [&, i](int e) { return checkpoint_expert(ckpt, kLayers[i], e, ExpertNaming::qwen3(), spec().shape); });
  EXPECT_TRUE(from_memory.loaded());
  EXPECT_EQ(from_memory.packed_bytes(), from_ckpt.packed_bytes());
  from_memory.prepare_backward();
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(from_memory.layer(i).backward_ready());
  EXPECT_GT(from_memory.backward_bytes(), 0u);
  for (int i = 0; i < 2; ++i) {
    Step s(rng, from_ckpt.layer(i));
    const Result a = run(from_ckpt.layer(i), s), b = run(from_memory.layer(i), s);
    EXPECT_TRUE(same_bits(a.out, b.out)) << "MoE layer " << i;
    EXPECT_TRUE(same_bits(a.d_x, b.d_x)) << "MoE layer " << i;
  }
  EXPECT_EQ(from_memory.backward_bytes(), from_ckpt.backward_bytes());
}

// A bad tensor anywhere (here in the last layer) is named before any layer is packed.
TEST(LoraEngine, CheckpointErrorsNameTheTensorBeforeAnythingLoads) {
  std::mt19937_64 rng(test::test_seed());
  const std::vector<test::Entry> good = checkpoint_entries(rng);
  const auto cases =
      test::checkpoint_defects(expert_key(3, 5, "up"), expert_key(3, 2, "down"), 32, kH, kI, expert_key(3, 4, "gate"));
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    test::ScratchDir dir;
    std::vector<test::Entry> es = good;
    c.edit(es);
    const Checkpoint ckpt = write_checkpoint(dir, es);
    LoraEngine t(config(), spec());
    int progress_calls = 0;
    Errc code{};
    const std::string msg =
        test::error_of([&] { t.load(ckpt, ExpertNaming::qwen3(), [&](int, int) { ++progress_calls; }); }, &code);
    EXPECT_EQ(code, c.code);
    EXPECT_NE(msg.find(c.needle), std::string::npos) << msg;
    EXPECT_FALSE(t.layer(0).loaded()) << "a layer was loaded before the bad tensor was found";
    EXPECT_FALSE(t.layer(1).loaded());
    EXPECT_EQ(t.packed_bytes(), 0u);
    EXPECT_EQ(progress_calls, 0);
  }
}

}  // namespace
}  // namespace tandem
