// decode_attention (tandem/attention.h) against an fp64 reference on random bf16 inputs:
// GQA and MHA, key and value dims that differ (MLA), a batch with strided (non-packed)
// rows and a per-sequence mask, caches from 1 key to several chunks, every vector level
// this CPU runs, and 1 or 2 subpools. The bound comes from the arithmetic: the output is
// rounded to bf16 once (at most 2^-8 of it: 8 significant bits); an fp32 score is off by
// at most dk x 2^-24 x scale x sum |q_i k_i| (the sum's rounding), which moves each
// softmax weight by twice that relatively, so the output by 2 x that x max |v|; the
// exponentials (the polynomial's 3e-8) and the fp32 sums over `keys` terms add at most a
// few keys x 2^-24 of max |v| (generous: 4 keys x 2^-24).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "tandem/attention.h"
#include "tandem/config.h"
#include "tandem/error.h"
#include "tandem/pool_config.h"
#include "test_util.h"

namespace tandem {
namespace {

std::unique_ptr<Pool> attention_pool(int subpools, int threads) {
  Config::Cpu cpu;
  cpu.virtual_subpools = subpools;
  cpu.threads = threads;
  return std::make_unique<Pool>(pool_options(cpu));
}

float f32(bf16_t b) { return bf16_to_fp32(b); }

// fp64 attention of one query row (q: dk bf16 values) over `keys` keys (key l: dk values at
// k + l * k_l, value l: dv at v + l * v_l) of which `admit(l)` says which count: the output
// (zeros when none counts), max |v| over all the keys, and the fp32 score error bound
// dk x 2^-24 x scale x sum |q_i k_i| of the worst counted key.
struct ReferenceRow {
  std::vector<double> out;
  double vmax = 0, score_err = 0;
};
template <class Admit>
ReferenceRow reference_row(const bf16_t* q, const bf16_t* k, int64_t k_l, const bf16_t* v, int64_t v_l, int keys,
                           int dk, int dv, double scale, Admit admit) {
  ReferenceRow r;
  std::vector<double> s(keys, -INFINITY);
  double m = -INFINITY;
  for (int l = 0; l < keys; ++l) {
    if (!admit(l)) continue;
    double d = 0, mag = 0;
    for (int e = 0; e < dk; ++e) {
      const double x = double(f32(q[e])) * f32(k[l * k_l + e]);
      d += x;
      mag += std::abs(x);
    }
    s[l] = d * scale;
    r.score_err = std::max(r.score_err, dk * std::ldexp(1.0, -24) * scale * mag);
    m = std::max(m, s[l]);
  }
  double sum = 0;
  for (int l = 0; l < keys; ++l) sum += s[l] == -INFINITY ? 0 : std::exp(s[l] - m);
  r.out.assign(dv, 0.0);
  for (int e = 0; e < dv; ++e)
    for (int l = 0; l < keys; ++l) {
      const double x = f32(v[l * v_l + e]);
      r.vmax = std::max(r.vmax, std::abs(x));
      if (s[l] != -INFINITY) r.out[e] += std::exp(s[l] - m) / sum * x;
    }
  return r;
}

struct Case {
  int batch, q_heads, kv_heads, dk, dv, keys;
  bool mask;
  int split = 0;  // > 0: the keys' last `split` values held apart (k2), as MLA's rope part
};

TEST(DecodeAttention, MatchesAnFp64ReferenceAtEveryLevel) {
  std::mt19937_64 rng(test::test_seed());
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<IsaLevel> levels;
  for (IsaLevel l : {IsaLevel::scalar, IsaLevel::avx2, IsaLevel::avx512})
    if (l <= hardware_isa()) levels.push_back(l);
  const Case cases[] = {{1, 32, 4, 128, 128, 150, false}, {2, 8, 8, 64, 64, 37, true}, {1, 16, 2, 192, 128, 1100, false},
                        {3, 6, 3, 40, 24, 1, true},       {2, 4, 1, 16, 16, 700, true}, {1, 9, 1, 8, 5, 33, false},
                        {1, 16, 1, 576, 512, 150, true, 64}, {2, 9, 1, 40, 32, 70, false, 8},
                        {2, 8, 2, 48, 16, 600, false, 16},
                        // eight query heads per kv head with partial vectors (AVX-512's two-key
                        // scores: their tails, a masked pair, a split key's tail-only part)
                        {1, 16, 2, 40, 40, 33, false}, {2, 8, 1, 72, 40, 45, true, 8}};
  for (const int subpools : {1, 2}) {
    auto pool = attention_pool(subpools, 1);
    for (const Case& c : cases) {
      // Rows padded (strides larger than the dims) so the strides are exercised.
      const int64_t q_h = c.dk + 3, q_b = q_h * c.q_heads + 5;
      const int64_t k_l = c.dk + 2, k_h = k_l * c.keys + 7, k_b = k_h * c.kv_heads;
      const int64_t v_l = c.dv + 1, v_h = v_l * c.keys, v_b = v_h * c.kv_heads + 11;
      const int64_t out_h = c.dv, out_b = out_h * c.q_heads;
      std::vector<bf16_t> q(q_b * c.batch), k(k_b * c.batch), v(v_b * c.batch), out(out_b * c.batch);
      for (auto* buf : {&q, &k, &v})
        for (auto& x : *buf) x = fp32_to_bf16(nd(rng));
      std::vector<uint8_t> mask(static_cast<size_t>(c.batch) * c.keys, 1);
      if (c.mask)
        for (int b = 0; b < c.batch; ++b)
          for (int l = 0; l < c.keys; ++l) mask[b * c.keys + l] = (b == 2) ? 0 : (l + b) % 3 != 0;
      // The second key part: a copy of each key row's last `split` values, in rows of its own.
      const int64_t k2_l = c.split + 1, k2_h = k2_l * c.keys, k2_b = k2_h * c.kv_heads + 3;
      std::vector<bf16_t> k2(c.split ? k2_b * c.batch : 0, fp32_to_bf16(NAN));
      for (int b = 0; b < c.batch && c.split; ++b)
        for (int g = 0; g < c.kv_heads; ++g)
          for (int l = 0; l < c.keys; ++l) {
            bf16_t* row = k.data() + b * k_b + g * k_h + l * k_l;
            std::copy_n(row + c.dk - c.split, c.split, k2.data() + b * k2_b + g * k2_h + l * k2_l);
          }
      const float scale = 1.f / std::sqrt(static_cast<float>(c.dk));
      for (IsaLevel level : levels) {
        // Split: k's own copy of the moved values poisoned, so reading them there would show.
        std::vector<bf16_t> kk = k;
        for (int b = 0; b < c.batch && c.split; ++b)
          for (int g = 0; g < c.kv_heads; ++g)
            for (int l = 0; l < c.keys; ++l)
              std::fill_n(kk.data() + b * k_b + g * k_h + l * k_l + c.dk - c.split, c.split, fp32_to_bf16(NAN));
        DecodeAttention a;
        a.batch = c.batch, a.q_heads = c.q_heads, a.kv_heads = c.kv_heads, a.head_dim = c.dk, a.value_dim = c.dv;
        a.keys = c.keys, a.scale = scale;
        a.q = q.data(), a.q_b = q_b, a.q_h = q_h;
        a.k = kk.data(), a.k_b = k_b, a.k_h = k_h, a.k_l = k_l;
        if (c.split) a.k2 = k2.data(), a.k2_b = k2_b, a.k2_h = k2_h, a.k2_l = k2_l, a.k2_dim = c.split;
        a.v = v.data(), a.v_b = v_b, a.v_h = v_h, a.v_l = v_l;
        a.mask = c.mask ? mask.data() : nullptr, a.mask_b = c.keys;
        a.out = out.data(), a.out_b = out_b, a.out_h = out_h;
        decode_attention(*pool, level, a);
        const int G = c.q_heads / c.kv_heads;
        for (int b = 0; b < c.batch; ++b)
          for (int h = 0; h < c.q_heads; ++h) {
            const int g = h / G;
            const ReferenceRow r =
                reference_row(q.data() + b * q_b + h * q_h, k.data() + b * k_b + g * k_h, k_l,
                              v.data() + b * v_b + g * v_h, v_l, c.keys, c.dk, c.dv, scale,
                              [&](int l) { return !c.mask || mask[b * c.keys + l]; });
            const double score_err = r.score_err, vmax = r.vmax;
            for (int e = 0; e < c.dv; ++e) {
              const double ref = r.out[e];
              const double got = f32(out[b * out_b + h * out_h + e]);
              const double bound =
                  std::ldexp(std::abs(ref), -8) + (2 * score_err + 4.0 * c.keys * std::ldexp(1.0, -24)) * vmax + 1e-30;
              ASSERT_LE(std::abs(got - ref), bound)
                  << "level " << isa_name(level) << ", subpools " << subpools << ", case b" << c.batch << " hq"
                  << c.q_heads << " hkv" << c.kv_heads << " dk" << c.dk << " dv" << c.dv << " L" << c.keys << " split"
                  << c.split << ": seq "
                  << b << " head " << h << " col " << e << " (seed " << test::test_seed() << ")";
            }
          }
      }
    }
  }
}

TEST(DecodeAttention, RefusesBadShapesNamingThem) {
  auto pool = attention_pool(1, 1);
  std::vector<bf16_t> buf(64);
  DecodeAttention a;
  a.batch = 1, a.q_heads = 6, a.kv_heads = 4, a.head_dim = 4, a.keys = 2, a.scale = 1.f;
  a.q = a.k = a.v = buf.data();
  a.out = buf.data();
  auto error = [&] { return test::error_of([&] { decode_attention(*pool, IsaLevel::scalar, a); }); };
  EXPECT_NE(error().find("q_heads 6 is not a multiple of kv_heads 4"), std::string::npos) << error();
  a.q_heads = 4, a.keys = 0;
  EXPECT_NE(error().find("keys 0"), std::string::npos) << error();
  a.keys = 2, a.v = nullptr;
  EXPECT_NE(error().find("v is null"), std::string::npos) << error();
  a.v = buf.data(), a.k2 = buf.data(), a.k2_dim = 4;  // the whole key in the second part: no first
  EXPECT_NE(error().find("k2_dim 4 must be in 1..head_dim - 1 = 3"), std::string::npos) << error();
}

// prefill_attention against an fp64 reference: causal prompts and chunks after cached keys,
// GQA / MHA / MQA, key and value dims that differ or are odd, boolean masks with rows that
// admit no key, strided (non-packed) rows, every kernel level this CPU runs (its BF16 GEMM
// variant: reference, AVX2, AVX-512, AVX512_BF16, AMX), 1 or 2 subpools and 1 or 2 threads
// (pools of 1 subpool x 1 thread, 2 x 1, 1 x 2).
// The bound, from the arithmetic: the probabilities are rounded to bf16 before the value
// product (each off by at most 2^-8 of itself, so the output by 2^-8 of max |v|), the output
// once more (2^-8 of it); the fp32 scores as for decode (2 x score_err x max |v|); the fp32
// sums over the keys (the values' and the softmax denominator's) 2 x keys x 2^-24 of max |v|;
// the exponentials' polynomial (2.4e-7 relative, in the probabilities and their sum) 2^-21.
struct PrefillCase {
  int batch, q_heads, kv_heads, queries, keys, dk, dv;
  bool causal;
  int mask;  // 0: none; 1: random bytes with whole rows masked; 2: left padding per sequence
};

TEST(PrefillAttention, MatchesAnFp64ReferenceAtEveryLevel) {
  std::mt19937_64 rng(test::test_seed());
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<IsaLevel> levels;
  for (IsaLevel l : {IsaLevel::scalar, IsaLevel::avx2, IsaLevel::avx512, IsaLevel::avx512_bf16, IsaLevel::amx})
    if (l <= hardware_isa()) levels.push_back(l);
  std::vector<std::unique_ptr<Pool>> pools;  // 1 subpool of 1 thread, 2 subpools, 1 subpool of 2 threads
  for (const auto& [subpools, threads] : {std::pair{1, 1}, std::pair{2, 1}, std::pair{1, 2}})
    pools.push_back(attention_pool(subpools, threads));
  const PrefillCase cases[] = {
      {1, 16, 2, 200, 200, 128, 128, true, 0},  // a prompt, 8 heads per kv head
      {1, 4, 2, 600, 600, 64, 64, true, 0},     // three key blocks, the last partial
      {2, 4, 4, 37, 300, 64, 64, true, 0},      // a chunk after 263 cached keys
      {1, 6, 2, 130, 130, 40, 24, false, 1},    // a mask alone, rows with no key
      {3, 8, 1, 65, 65, 72, 40, true, 2},       // causal and left padding (MQA)
      {1, 3, 3, 5, 9, 17, 9, true, 0},          // odd dims, a few keys
      {2, 2, 1, 1, 257, 32, 32, true, 1},       // one query (a decode step through this path)
      {1, 4, 2, 140, 140, 192, 128, true, 1},   // DeepSeek-V2's expanded MLA heads: dk 192, dv 128
  };
  for (const PrefillCase& c : cases) {
    // q as transformers hands it ([B, Lq, Hq, D] memory seen as [B, Hq, Lq, D]), k / v with
    // padded rows, out [B, Lq, Hq, Dv] with padded heads.
    const int64_t q_h = c.dk, q_l = q_h * c.q_heads + 3, q_b = q_l * c.queries;
    const int64_t k_l = c.dk + 2, k_h = k_l * c.keys + 7, k_b = k_h * c.kv_heads;
    const int64_t v_l = c.dv + 1, v_h = v_l * c.keys, v_b = v_h * c.kv_heads + 11;
    const int64_t out_h = c.dv + 2, out_l = out_h * c.q_heads, out_b = out_l * c.queries + 5;
    std::vector<bf16_t> q(q_b * c.batch), k(k_b * c.batch), v(v_b * c.batch);
    for (auto* buf : {&q, &k, &v})
      for (auto& x : *buf) x = fp32_to_bf16(nd(rng));
    const int64_t mask_l = c.keys + 1, mask_b = mask_l * c.queries;
    std::vector<uint8_t> mask(static_cast<size_t>(mask_b) * c.batch, 1);
    for (int b = 0; b < c.batch; ++b)
      for (int i = 0; i < c.queries; ++i)
        for (int l = 0; l < c.keys; ++l) {
          uint8_t& x = mask[b * mask_b + i * mask_l + l];
          if (c.mask == 1) x = (i % 7 == 3) ? 0 : (rng() % 4 != 0);
          if (c.mask == 2) x = l >= 9 * b;  // sequence b's first 9 b keys are padding
        }
    const float scale = 1.f / std::sqrt(static_cast<float>(c.dk));
    // The reference and its bound per output element, [b][i][h][e].
    const int G = c.q_heads / c.kv_heads;
    const size_t n_out = static_cast<size_t>(c.batch) * c.queries * c.q_heads * c.dv;
    std::vector<double> ref(n_out), bound(n_out);
    for (int b = 0; b < c.batch; ++b)
      for (int h = 0; h < c.q_heads; ++h)
        for (int i = 0; i < c.queries; ++i) {
          const int g = h / G, pos = c.keys - c.queries + i;
          const ReferenceRow r =
              reference_row(q.data() + b * q_b + h * q_h + i * q_l, k.data() + b * k_b + g * k_h, k_l,
                            v.data() + b * v_b + g * v_h, v_l, c.keys, c.dk, c.dv, scale, [&](int l) {
                              return !(c.causal && l > pos) && !(c.mask && !mask[b * mask_b + i * mask_l + l]);
                            });
          for (int e = 0; e < c.dv; ++e) {
            const size_t at = ((static_cast<size_t>(b) * c.queries + i) * c.q_heads + h) * c.dv + e;
            ref[at] = r.out[e];
            const double terms =
                std::ldexp(1.0, -8) + 2 * r.score_err + 2.0 * c.keys * std::ldexp(1.0, -24) + std::ldexp(1.0, -21);
            bound[at] = std::ldexp(std::abs(r.out[e]), -8) + terms * r.vmax;
          }
        }
    for (size_t pi = 0; pi < pools.size(); ++pi)
      for (IsaLevel level : levels) {
        std::vector<bf16_t> out(out_b * c.batch, fp32_to_bf16(NAN));
        PrefillAttention a;
        a.batch = c.batch, a.q_heads = c.q_heads, a.kv_heads = c.kv_heads, a.queries = c.queries, a.keys = c.keys;
        a.head_dim = c.dk, a.value_dim = c.dv, a.scale = scale, a.causal = c.causal;
        a.q = q.data(), a.q_b = q_b, a.q_h = q_h, a.q_l = q_l;
        a.k = k.data(), a.k_b = k_b, a.k_h = k_h, a.k_l = k_l;
        a.v = v.data(), a.v_b = v_b, a.v_h = v_h, a.v_l = v_l;
        if (c.mask) a.mask = mask.data(), a.mask_b = mask_b, a.mask_l = mask_l;
        a.out = out.data(), a.out_b = out_b, a.out_l = out_l, a.out_h = out_h;
        prefill_attention(*pools[pi], level, a);
        for (int b = 0; b < c.batch; ++b)
          for (int i = 0; i < c.queries; ++i)
            for (int h = 0; h < c.q_heads; ++h)
              for (int e = 0; e < c.dv; ++e) {
                const size_t at = ((static_cast<size_t>(b) * c.queries + i) * c.q_heads + h) * c.dv + e;
                const double got = f32(out[b * out_b + i * out_l + h * out_h + e]);
                ASSERT_LE(std::abs(got - ref[at]), bound[at])
                    << "level " << isa_name(level) << ", pool " << pi << ", case b" << c.batch << " hq" << c.q_heads
                    << " hkv" << c.kv_heads << " Lq" << c.queries << " L" << c.keys << " dk" << c.dk << " dv" << c.dv
                    << ": seq " << b << " head " << h << " query " << i << " col " << e << " (seed "
                    << test::test_seed() << ")";
              }
      }
  }
}

TEST(PrefillAttention, RefusesBadShapesNamingThem) {
  auto pool = attention_pool(1, 1);
  std::vector<bf16_t> buf(256);
  PrefillAttention a;
  a.batch = 1, a.q_heads = 6, a.kv_heads = 4, a.head_dim = 4, a.queries = 2, a.keys = 2, a.scale = 1.f;
  a.q = a.k = a.v = buf.data();
  a.out = buf.data();
  auto error = [&] { return test::error_of([&] { prefill_attention(*pool, IsaLevel::scalar, a); }); };
  EXPECT_NE(error().find("q_heads 6 is not a multiple of kv_heads 4"), std::string::npos) << error();
  a.q_heads = 4, a.queries = 0;
  EXPECT_NE(error().find("queries 0"), std::string::npos) << error();
  a.queries = 3, a.causal = true;
  EXPECT_NE(error().find("causal with 3 queries and only 2 keys"), std::string::npos) << error();
  a.queries = 2, a.out = nullptr;
  EXPECT_NE(error().find("out is null"), std::string::npos) << error();
  a.out = buf.data(), a.scale = NAN;
  EXPECT_NE(error().find("scale nan is not positive and finite"), std::string::npos) << error();
  a.scale = -0.5f;
  EXPECT_NE(error().find("scale -0.5 is not positive and finite"), std::string::npos) << error();
}

}  // namespace
}  // namespace tandem
