// GPTQ-quantized expert weights (SourceType::q4_gptq): read in place from a checkpoint, packed
// into int4 of the same group size without quantizing again (the nibbles, fp16 scales and
// zero points copied: the pack holds exactly the checkpoint's values), and into every other
// format from their exact values. The reference here is the GPTQ formula written out
// independently: w = scale[g][r] * (q - ((stored zero + 1) & 15)).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tandem/engine.h"
#include "tandem/error.h"
#include "tandem/experts.h"
#include "tandem/kernels.h"
#include "test_util.h"

namespace tandem {
namespace {

using test::test_seed;

// One GPTQ weight [n x k]: its tensors as a checkpoint stores them, and its values.
struct Gptq {
  int n, k, group;
  std::vector<int32_t> qweight, qzeros;  // [k/8, n], [k/group, n/8]
  std::vector<uint16_t> scales;          // [k/group, n] fp16
  std::vector<int> q, zero;              // [n][k] nibbles; [k/group][n] effective zero points
  std::vector<float> w;                  // [n x k]
  Gptq(std::mt19937_64& rng, int n_, int k_, int group_, bool symmetric)
      : n(n_), k(k_), group(group_), qweight(size_t(k) / 8 * n), qzeros(size_t(k) / group * n / 8),
        scales(size_t(k) / group * n), q(size_t(n) * k), zero(size_t(k) / group * n), w(size_t(n) * k) {
    std::uniform_int_distribution<int> nib(0, 15);
    std::uniform_real_distribution<float> sc(1e-3f, 4e-2f);
    for (int g = 0; g < k / group; ++g)
      for (int r = 0; r < n; ++r) {
        const int stored = symmetric ? 7 : nib(rng);  // the original format stores zero - 1
        qzeros[size_t(g) * (n / 8) + r / 8] |= int32_t(uint32_t(stored) << (4 * (r % 8)));
        zero[size_t(g) * n + r] = (stored + 1) & 15;
        scales[size_t(g) * n + r] = fp32_to_fp16(sc(rng));
      }
    for (int r = 0; r < n; ++r)
      for (int c = 0; c < k; ++c) {
        const int v = nib(rng);
        q[size_t(r) * k + c] = v;
        qweight[size_t(c / 8) * n + r] |= int32_t(uint32_t(v) << (4 * (c % 8)));
        const int g = c / group;
        w[size_t(r) * k + c] = fp16_to_fp32(scales[size_t(g) * n + r]) * float(v - zero[size_t(g) * n + r]);
      }
  }
  Q4Source source() const {
    Q4Source s;
    s.qweight = reinterpret_cast<const std::byte*>(qweight.data());
    s.scales = reinterpret_cast<const std::byte*>(scales.data());
    s.qzeros = reinterpret_cast<const std::byte*>(qzeros.data());
    s.n = n;
    s.k = k;
    s.group = group;
    return s;
  }
  static WeightView view(const Q4Source& s) {
    WeightView v;
    v.type = SourceType::q4_gptq;
    v.data = s.qweight;
    v.n = s.n;
    v.k = s.k;
    v.q4 = &s;
    return v;
  }
  WeightView f32() const { return {w.data(), SourceType::f32, n, k}; }
};

bool same_bytes(const PackedWeight& a, const PackedWeight& b) {
  return a.bytes() == b.bytes() && (a.bytes() == 0 || std::memcmp(a.data.data(), b.data.data(), a.bytes()) == 0);
}

TEST(Gptq, DecodesToTheFormulasValues) {
  std::mt19937_64 rng(test_seed());
  for (bool sym : {true, false}) {
    const Gptq g(rng, 72, 256, 64, sym);
    const Q4Source s = g.source();
    std::vector<float> rows(size_t(g.n) * g.k);
    decode_rows(Gptq::view(s), 0, g.n, rows.data());
    ASSERT_EQ(std::memcmp(rows.data(), g.w.data(), rows.size() * 4), 0) << (sym ? "symmetric" : "zero points");
    // A sub-view decodes the same elements.
    const WeightView sub = sub_view(Gptq::view(s), 8, 16, 64, 128);
    std::vector<float> part(size_t(16) * 128);
    decode_rows(sub, 0, 16, part.data());
    for (int r = 0; r < 16; ++r)
      for (int c = 0; c < 128; ++c) ASSERT_EQ(part[size_t(r) * 128 + c], g.w[size_t(8 + r) * g.k + 64 + c]);
  }
}

// The same nibbles, zero points and scales in AWQ's and compressed-tensors' layouts decode to
// the same weight, and pack into int4 by copying.
TEST(Gptq, AwqAndCompressedTensorsLayoutsReadTheSame) {
  std::mt19937_64 rng(test_seed());
  const Gptq g(rng, 64, 128, 32, false);
  const int n = g.n, k = g.k, G = k / g.group;
  std::vector<int32_t> awq_w(size_t(k) * n / 8), awq_z(size_t(G) * n / 8), ct_w(size_t(n) * k / 8), ct_z(size_t(n) / 8 * G);
  std::vector<uint16_t> ct_s(size_t(n) * G);  // bf16 scales, [n, groups]
  const int slot[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < k; ++c) {
      const uint32_t v = uint32_t(g.q[size_t(r) * k + c]);
      awq_w[size_t(c) * (n / 8) + r / 8] |= int32_t(v << (4 * slot[r % 8]));
      ct_w[size_t(r) * (k / 8) + c / 8] |= int32_t(v << (4 * (c % 8)));
    }
  for (int gi = 0; gi < G; ++gi)
    for (int r = 0; r < n; ++r) {
      const uint32_t z = uint32_t(g.zero[size_t(gi) * n + r]);
      awq_z[size_t(gi) * (n / 8) + r / 8] |= int32_t(z << (4 * slot[r % 8]));
      ct_z[size_t(r / 8) * G + gi] |= int32_t(z << (4 * (r % 8)));
      ct_s[size_t(r) * G + gi] = fp32_to_bf16(fp16_to_fp32(g.scales[size_t(gi) * n + r]));
    }
  Q4Source awq = g.source(), ct = g.source();
  awq.layout = Q4Source::Layout::awq;
  awq.qweight = reinterpret_cast<const std::byte*>(awq_w.data());
  awq.qzeros = reinterpret_cast<const std::byte*>(awq_z.data());
  ct.layout = Q4Source::Layout::packed_rows;
  ct.qweight = reinterpret_cast<const std::byte*>(ct_w.data());
  ct.qzeros = reinterpret_cast<const std::byte*>(ct_z.data());
  ct.scales = reinterpret_cast<const std::byte*>(ct_s.data());
  ct.scale_type = Q4Source::Scale::bf16;
  std::vector<float> want(size_t(n) * k);  // the bf16-rounded scales for compressed-tensors
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < k; ++c)
      want[size_t(r) * k + c] = bf16_to_fp32(ct_s[size_t(r) * G + c / g.group]) *
                                float(g.q[size_t(r) * k + c] - g.zero[size_t(c / g.group) * n + r]);
  for (const auto& [src, expect, what] : {std::tuple{&awq, &g.w, "AWQ"}, std::tuple{&ct, static_cast<const std::vector<float>*>(&want), "compressed-tensors"}}) {
    SCOPED_TRACE(what);
    std::vector<float> rows(size_t(n) * k);
    decode_rows(Gptq::view(*src), 0, n, rows.data());
    ASSERT_EQ(rows, *expect);
    ASSERT_EQ(unpack(pack(Gptq::view(*src), {WeightFormat::int4, 32, false})), *expect);
  }
  // compressed-tensors without zero points is symmetric: zero 8.
  ct.qzeros = nullptr;
  std::vector<float> rows(size_t(n) * k);
  decode_rows(Gptq::view(ct), 0, 1, rows.data());
  for (int c = 0; c < k; ++c)
    ASSERT_EQ(rows[c], bf16_to_fp32(ct_s[c / g.group]) * float(g.q[c] - 8));
}

// int4 at the checkpoint's group size keeps its values exactly; every other format and group
// gets what packing the exact values gives (the same bytes as from an fp32 source).
TEST(Gptq, PacksKeepTheCheckpointsNumbers) {
  std::mt19937_64 rng(test_seed());
  for (bool sym : {true, false}) {
    SCOPED_TRACE(sym ? "symmetric" : "zero points");
    const Gptq g(rng, 104, 256, 64, sym);  // 104 rows: a partial last panel
    const Q4Source s = g.source();
    const WeightView v = Gptq::view(s);
    const PackOptions same{WeightFormat::int4, 64, sym};
    const std::vector<float> back = unpack(pack(v, same));
    for (size_t i = 0; i < back.size(); ++i)
      ASSERT_EQ(back[i], g.w[i]) << "row " << i / g.k << " column " << i % g.k;
    // Cut along k at the group, or by rows: the same numbers as the whole.
    EXPECT_TRUE(same_bytes(pack_cols(v, 64, 128, same), slice_cols(pack(v, same), 64, 128)));
    const std::vector<float> rows = unpack(pack(sub_view(v, 64, 40, 0, g.k), same));
    ASSERT_EQ(std::memcmp(rows.data(), g.w.data() + size_t(64) * g.k, rows.size() * 4), 0);
    if (sym)  // the symmetric checkpoint also fits tandem's zero-point layout
      EXPECT_EQ(unpack(pack(v, {WeightFormat::int4, 64, false})), g.w);
    for (const PackOptions& o : std::vector<PackOptions>{{WeightFormat::bf16}, {WeightFormat::int8},
                                                         {WeightFormat::int4, 32, true}, {WeightFormat::int4, 128, false}}) {
      SCOPED_TRACE(std::string(format_name(o.format)) + " group " + std::to_string(o.group));
      EXPECT_TRUE(same_bytes(pack(v, o), pack(g.f32(), o)));
      EXPECT_TRUE(same_bytes(pack_cols(v, 128, 128, o), pack_cols(g.f32(), 128, 128, o)));
    }
    if (!sym) {  // zero points other than 8 do not fit symmetric int4: refused, naming one
      const std::string msg = test::error_of([&] { pack(v, {WeightFormat::int4, 64, true}); });
      EXPECT_NE(msg.find("zero point"), std::string::npos) << msg;
      EXPECT_NE(msg.find("cpu.zero_point: true"), std::string::npos) << msg;
    }
  }
}

// ---- from a checkpoint ------------------------------------------------------------------------

constexpr int kE = 4, kH = 128, kI = 64, kG = 32;

std::string bytes_of(const void* p, size_t n) { return std::string(static_cast<const char*>(p), n); }

void add_gptq(std::vector<test::Entry>& es, const std::string& base, const Gptq& g, bool with_g_idx = true) {
  es.push_back({base + ".qweight", "I32", {g.k / 8, g.n}, bytes_of(g.qweight.data(), g.qweight.size() * 4)});
  es.push_back({base + ".qzeros", "I32", {g.k / g.group, g.n / 8}, bytes_of(g.qzeros.data(), g.qzeros.size() * 4)});
  es.push_back({base + ".scales", "F16", {g.k / g.group, g.n}, bytes_of(g.scales.data(), g.scales.size() * 2)});
  if (with_g_idx) {
    std::vector<int32_t> idx(g.k);
    for (int c = 0; c < g.k; ++c) idx[c] = c / g.group;
    es.push_back({base + ".g_idx", "I32", {g.k}, bytes_of(idx.data(), idx.size() * 4)});
  }
}

std::string expert_base(int e, const char* proj) {
  return "model.layers.0.mlp.experts." + std::to_string(e) + "." + proj + "_proj";
}

TEST(Gptq, AnEngineLoadsGptqExpertsExactly) {
  std::mt19937_64 rng(test_seed());
  std::vector<Gptq> ws;
  std::vector<test::Entry> es;
  for (int e = 0; e < kE; ++e) {
    ws.emplace_back(rng, kI, kH, kG, false);  // gate
    add_gptq(es, expert_base(e, "gate"), ws.back());
    ws.emplace_back(rng, kI, kH, kG, false);  // up
    add_gptq(es, expert_base(e, "up"), ws.back());
    ws.emplace_back(rng, kH, kI, kG, false);  // down
    add_gptq(es, expert_base(e, "down"), ws.back(), e != 0);  // g_idx is optional
  }
  test::ScratchDir dir;
  test::write_file(dir / "model.safetensors", test::good_file(es));
  const Checkpoint ckpt = Checkpoint::open(dir / "model.safetensors");
  for (int subpools : {1, 2}) {
    const Config cfg = parse_config("version: 1\ncpu: {format: int4, group_size: 32, zero_point: true, virtual_subpools: " +
                                        std::to_string(subpools) + ", threads: 1}\ngpu: {device: none}\n",
                                    "gptq.yaml");
    Engine eng(cfg, {{kE, kH, kI}, {0}});
    eng.load(ckpt, ExpertNaming::qwen3());
    for (int e = 0; e < kE; ++e) {
      for (int s = 0; s < subpools; ++s) {
        const auto [i0, i1] = eng.layer(0).slice(s);
        const std::vector<float> gu = unpack(eng.layer(0).gate_up_pack(s, e)), dn = unpack(eng.layer(0).down_pack(s, e));
        const int l = i1 - i0;
        for (int r = 0; r < l; ++r)
          for (int c = 0; c < kH; ++c) {
            ASSERT_EQ(gu[size_t(r) * kH + c], ws[3 * e].w[size_t(i0 + r) * kH + c]) << "gate " << e;
            ASSERT_EQ(gu[size_t(l + r) * kH + c], ws[3 * e + 1].w[size_t(i0 + r) * kH + c]) << "up " << e;
          }
        for (int r = 0; r < kH; ++r)
          for (int c = 0; c < l; ++c) ASSERT_EQ(dn[size_t(r) * l + c], ws[3 * e + 2].w[size_t(r) * kI + i0 + c]) << "down " << e;
      }
    }
  }
  // Symmetric int4 cannot hold these zero points: refused at load, naming the tensor.
  Engine sym(parse_config("version: 1\ncpu: {format: int4, group_size: 32, threads: 1}\ngpu: {device: none}\n", "s.yaml"),
             {{kE, kH, kI}, {0}});
  const std::string msg = test::error_of([&] { sym.load(ckpt, ExpertNaming::qwen3()); });
  EXPECT_NE(msg.find("_proj.qweight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cpu.zero_point: true"), std::string::npos) << msg;
}

TEST(Gptq, RefusesActOrderAndBrokenTensors) {
  std::mt19937_64 rng(test_seed());
  const MoeShape shape{1, kH, kI};
  auto checkpoint_with = [&](auto&& edit) {
    std::vector<test::Entry> es;
    const Gptq g(rng, kI, kH, kG, true), u(rng, kI, kH, kG, true), d(rng, kH, kI, kG, true);
    add_gptq(es, expert_base(0, "gate"), g);
    add_gptq(es, expert_base(0, "up"), u);
    add_gptq(es, expert_base(0, "down"), d);
    edit(es);
    return test::good_file(es);
  };
  struct Case {
    std::string what, needle;
    std::function<void(std::vector<test::Entry>&)> edit;
  };
  const std::vector<Case> cases = {
      {"act-order", "act-order (desc_act)",
       [](std::vector<test::Entry>& es) {
         for (auto& e : es)
           if (e.name == expert_base(0, "up") + ".g_idx") std::memset(e.bytes.data(), 0, 8 * 4), e.bytes[8 * 4] = 1;
       }},
      {"missing scales", "its scales tensor is missing",
       [](std::vector<test::Entry>& es) { std::erase_if(es, [](auto& e) { return e.name == expert_base(0, "up") + ".scales"; }); }},
      {"8-bit", "other bit widths",
       [](std::vector<test::Entry>& es) {
         for (auto& e : es)
           if (e.name == expert_base(0, "down") + ".qweight") e.shape = {kI / 4, kH / 2}, e.bytes.resize(size_t(kI / 4) * kH / 2 * 4);
       }},
      {"integer scales", "scales must be F16, BF16 or F32",
       [](std::vector<test::Entry>& es) {
         for (auto& e : es)
           if (e.name == expert_base(0, "gate") + ".scales") e.dtype = "I16";
       }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    test::ScratchDir dir;
    test::write_file(dir / "m.safetensors", checkpoint_with(c.edit));
    const Checkpoint ckpt = Checkpoint::open(dir / "m.safetensors");
    const std::string msg = test::error_of([&] { checkpoint_expert(ckpt, 0, 0, ExpertNaming::qwen3(), shape); });
    EXPECT_NE(msg.find(c.needle), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace tandem
