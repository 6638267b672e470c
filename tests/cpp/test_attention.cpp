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
            std::vector<double> s(c.keys);
            double m = -INFINITY, vmax = 0, score_err = 0;
            for (int l = 0; l < c.keys; ++l) {
              if (c.mask && !mask[b * c.keys + l]) {
                s[l] = -INFINITY;
                continue;
              }
              double d = 0, mag = 0;
              for (int e = 0; e < c.dk; ++e) {
                const double p = double(f32(q[b * q_b + h * q_h + e])) * f32(k[b * k_b + g * k_h + l * k_l + e]);
                d += p;
                mag += std::abs(p);
              }
              s[l] = d * scale;
              score_err = std::max(score_err, c.dk * std::ldexp(1.0, -24) * scale * mag);
              m = std::max(m, s[l]);
            }
            double sum = 0;
            for (int l = 0; l < c.keys; ++l) sum += s[l] == -INFINITY ? 0 : std::exp(s[l] - m);
            for (int e = 0; e < c.dv; ++e) {
              double ref = 0;
              for (int l = 0; l < c.keys; ++l) {
                const double x = f32(v[b * v_b + g * v_h + l * v_l + e]);
                vmax = std::max(vmax, std::abs(x));
                if (s[l] != -INFINITY) ref += std::exp(s[l] - m) / sum * x;
              }
              if (m == -INFINITY) ref = 0;  // every key masked: zeros
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

}  // namespace
}  // namespace tandem
