// decode_attention (tandem/attention.h): flash-decoding on the pool. Phase 0: per
// (sequence, kv head, chunk of keys), the chunk's scores for the kv head's query heads,
// their max, the exponentials' sum and the weighted sum of the values; phase 1: per
// (sequence, query head), the chunks combined and rounded to bf16.
#include "tandem/attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "bf16_round.h"
#include "tandem/dense.h"
#include "tandem/error.h"
#include "tandem/trace.h"

namespace tandem {

namespace {

struct Loops {
  void (*scores)(const float*, int, int, const bf16_t*, int64_t, const bf16_t*, int64_t, int, int, const uint8_t*, float,
                 float*, float*);
  void (*accumulate)(const float*, int, int, const bf16_t*, int64_t, int, float*);
  float (*exp_shifted)(const float*, float, int, float*);
  void (*widen)(const bf16_t*, int, float*);
  float (*row_max)(const float*, int);
};

namespace scalar {
#include "attention_loops.inc"
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#include "attention_loops.inc"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")
namespace avx512 {
#define TANDEM_ATTENTION_ZMM 1
#include "attention_loops.inc"
#undef TANDEM_ATTENTION_ZMM
}  // namespace avx512
#pragma GCC pop_options

const Loops& loops_for(IsaLevel level) {
  static const Loops s{scalar::scores, scalar::accumulate, scalar::exp_shifted, scalar::widen, scalar::row_max},
      a2{avx2::scores, avx2::accumulate, avx2::exp_shifted, avx2::widen, avx2::row_max},
      a5{avx512::scores, avx512::accumulate, avx512::exp_shifted, avx512::widen, avx512::row_max};
  if (level >= IsaLevel::avx512) return a5;
  if (level >= IsaLevel::avx2) return a2;
  return s;
}

class AttentionTask final : public Task {
 public:
  AttentionTask(const DecodeAttention& a, const Loops& f, int threads, int subpools)
      : a_(a), f_(f), subpools_(subpools) {
    G_ = a.q_heads / a.kv_heads;
    dv_ = a.value_dim;
    // Enough chunks that every thread has about two items, none shorter than 32 keys,
    // none longer than 512 (a chunk's scores stay in L1 / L2).
    const int rows = a.batch * a.kv_heads;
    int chunks = std::max((2 * threads + rows - 1) / rows, (a.keys + 511) / 512);
    chunks = std::max(1, std::min(chunks, (a.keys + 31) / 32));
    chunk_ = (a.keys + chunks - 1) / chunks;
    chunks_ = (a.keys + chunk_ - 1) / chunk_;
    stride_ = dv_ + 2;
    part_.resize(static_cast<size_t>(a.batch) * a.q_heads * chunks_ * stride_);
  }
  int phases() const override { return 2; }
  // Each subpool takes an equal share of the phase's items (a range of them).
  int items(int phase, int s) override { return first(phase, s + 1) - first(phase, s); }
  void run(int phase, int s, int item, int) override {
    if (phase == 0)
      chunk(first(phase, s) + item);
    else
      combine(first(phase, s) + item);
  }
  void finished() override { trace::record("attention", begin_ns_, trace::now_ns(), {-1, -1, a_.keys}); }

 private:
  int first(int phase, int s) const {
    const int64_t n = phase == 0 ? a_.batch * a_.kv_heads * chunks_ : a_.batch * a_.q_heads;
    return static_cast<int>(n * s / subpools_);
  }
  void chunk(int item) {
    const int c = item % chunks_, g = (item / chunks_) % a_.kv_heads, b = item / (chunks_ * a_.kv_heads);
    const int l0 = c * chunk_, n = std::min(a_.keys, l0 + chunk_) - l0;
    const int dk = a_.head_dim;
    thread_local std::vector<float> qf, kf, s, acc;
    qf.resize(static_cast<size_t>(G_) * dk);
    kf.resize(dk);
    s.resize(static_cast<size_t>(G_) * n);
    acc.assign(static_cast<size_t>(G_) * dv_, 0.f);
    for (int j = 0; j < G_; ++j) f_.widen(a_.q + b * a_.q_b + (g * G_ + j) * a_.q_h, dk, qf.data() + j * dk);
    const uint8_t* mask = a_.mask ? a_.mask + b * a_.mask_b + l0 : nullptr;
    const bf16_t* k2 = a_.k2 ? a_.k2 + b * a_.k2_b + g * a_.k2_h + l0 * a_.k2_l : nullptr;
    f_.scores(qf.data(), G_, dk, a_.k + b * a_.k_b + g * a_.k_h + l0 * a_.k_l, a_.k_l, k2, a_.k2_l, a_.k2 ? a_.k2_dim : 0,
              n, mask, a_.scale, kf.data(), s.data());
    float* part = part_.data();
    for (int j = 0; j < G_; ++j) {
      float* sj = s.data() + static_cast<size_t>(j) * n;
      const float m = f_.row_max(sj, n);
      float* pr = part + ((static_cast<size_t>(b) * a_.q_heads + g * G_ + j) * chunks_ + c) * stride_;
      pr[0] = m;
      if (m == -std::numeric_limits<float>::infinity()) {  // every key of the chunk masked
        pr[1] = 0.f;
        std::fill(sj, sj + n, 0.f);
        continue;
      }
      pr[1] = f_.exp_shifted(sj, m, n, sj);
    }
    f_.accumulate(s.data(), G_, dv_, a_.v + b * a_.v_b + g * a_.v_h + l0 * a_.v_l, a_.v_l, n, acc.data());
    for (int j = 0; j < G_; ++j) {
      float* pr = part + ((static_cast<size_t>(b) * a_.q_heads + g * G_ + j) * chunks_ + c) * stride_;
      std::memcpy(pr + 2, acc.data() + static_cast<size_t>(j) * dv_, sizeof(float) * dv_);
    }
  }
  void combine(int item) {
    const int h = item % a_.q_heads, b = item / a_.q_heads;
    const float* pr = part_.data() + (static_cast<size_t>(b) * a_.q_heads + h) * chunks_ * stride_;
    float m = -std::numeric_limits<float>::infinity();
    for (int c = 0; c < chunks_; ++c) m = std::max(m, pr[c * stride_]);
    thread_local std::vector<float> o;
    o.assign(dv_, 0.f);
    float sum = 0.f;
    if (m != -std::numeric_limits<float>::infinity())
      for (int c = 0; c < chunks_; ++c) {
        const float* p = pr + c * stride_;
        if (p[1] == 0.f) continue;
        const float w = std::exp(p[0] - m);
        sum += w * p[1];
        for (int d = 0; d < dv_; ++d) o[d] += w * p[2 + d];
      }
    bf16_t* out = a_.out + b * a_.out_b + h * a_.out_h;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int d = 0; d < dv_; ++d) out[d] = round_to_bf16(o[d] * inv);
  }

  DecodeAttention a_;
  const Loops& f_;
  int subpools_;
  int G_ = 1, dv_ = 0, chunk_ = 1, chunks_ = 1, stride_ = 2;
  std::vector<float> part_;  // [batch, q_heads, chunks] x (max, sum, weighted values [dv])
  int64_t begin_ns_ = trace::now_ns();
};

}  // namespace

void decode_attention(Pool& pool, IsaLevel level, const DecodeAttention& in) {
  DecodeAttention a = in;
  if (a.value_dim == 0) a.value_dim = a.head_dim;
  TANDEM_CHECK(a.batch >= 1 && a.q_heads >= 1 && a.kv_heads >= 1 && a.head_dim >= 1 && a.value_dim >= 1 && a.keys >= 1,
               Errc::invalid_argument, "decode attention: batch ", a.batch, ", q_heads ", a.q_heads, ", kv_heads ",
               a.kv_heads, ", head_dim ", a.head_dim, ", value_dim ", a.value_dim, ", keys ", a.keys,
               ": each must be positive");
  TANDEM_CHECK(a.q_heads % a.kv_heads == 0, Errc::invalid_argument, "decode attention: q_heads ", a.q_heads,
               " is not a multiple of kv_heads ", a.kv_heads);
  TANDEM_CHECK(a.q && a.k && a.v && a.out, Errc::invalid_argument, "decode attention: ",
               !a.q ? "q" : !a.k ? "k" : !a.v ? "v" : "out", " is null");
  TANDEM_CHECK(std::isfinite(a.scale), Errc::invalid_argument, "decode attention: scale ", a.scale, " is not finite");
  TANDEM_CHECK(!a.k2 || (a.k2_dim >= 1 && a.k2_dim < a.head_dim), Errc::invalid_argument,
               "decode attention: k2_dim ", a.k2_dim, " must be in 1..head_dim - 1 = ", a.head_dim - 1,
               " with a second key part");
  pool.run(std::make_shared<AttentionTask>(a, loops_for(level), pool.total_threads(), pool.subpools()));
}

void mla_decode(Pool& pool, IsaLevel level, DenseLinear& w_uk, DenseLinear& w_uv, const MlaDecode& a) {
  const int B = a.batch, H = a.heads, r = a.rank;
  TANDEM_CHECK(B >= 1 && H >= 1 && a.nope >= 1 && a.rope >= 1 && r >= 1 && a.v_dim >= 1 && a.keys >= 1,
               Errc::invalid_argument, "MLA decode: batch ", B, ", heads ", H, ", nope ", a.nope, ", rope ", a.rope,
               ", rank ", r, ", v_dim ", a.v_dim, ", keys ", a.keys, ": each must be positive");
  TANDEM_CHECK(w_uk.groups() == H && w_uk.n() == H * r && w_uk.k() == a.nope, Errc::invalid_argument,
               "MLA decode: ", w_uk.name(), " is ", w_uk.groups(), " groups of [", w_uk.n() / w_uk.groups(), " x ",
               w_uk.k(), "], not ", H, " of [", r, " x ", a.nope, "]");
  TANDEM_CHECK(w_uv.groups() == H && w_uv.n() == H * a.v_dim && w_uv.k() == r, Errc::invalid_argument,
               "MLA decode: ", w_uv.name(), " is ", w_uv.groups(), " groups of [", w_uv.n() / w_uv.groups(), " x ",
               w_uv.k(), "], not ", H, " of [", a.v_dim, " x ", r, "]");
  TANDEM_CHECK(a.q && a.latent && a.k_rope && a.out, Errc::invalid_argument, "MLA decode: ",
               !a.q ? "q" : !a.latent ? "latent" : !a.k_rope ? "k_rope" : "out", " is null");
  const size_t BH = static_cast<size_t>(B) * H;
  std::vector<bf16_t> qn(BH * a.nope), q(BH * (r + a.rope)), o_lat(BH * r);
  std::vector<float> f(BH * std::max(r, a.v_dim));
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      std::memcpy(qn.data() + (static_cast<size_t>(b) * H + h) * a.nope, a.q + b * a.q_b + h * a.q_h,
                  sizeof(bf16_t) * a.nope);
  w_uk.forward(qn.data(), true, B, H * a.nope, f.data(), H * r);  // q_lat, fp32
  for (size_t i = 0; i < BH; ++i) {
    bf16_t* qi = q.data() + i * (r + a.rope);
    fp32_to_bf16(f.data() + i * r, qi, r);
    const int b = static_cast<int>(i / H), h = static_cast<int>(i % H);
    std::memcpy(qi + r, a.q + b * a.q_b + h * a.q_h + a.nope, sizeof(bf16_t) * a.rope);
  }
  DecodeAttention d;
  d.batch = B, d.q_heads = H, d.kv_heads = 1, d.head_dim = r + a.rope, d.value_dim = r, d.keys = a.keys;
  d.scale = a.scale;
  d.q = q.data(), d.q_b = static_cast<int64_t>(H) * (r + a.rope), d.q_h = r + a.rope;
  d.k = a.latent, d.k_b = a.latent_b, d.k_l = a.latent_l;
  d.k2 = a.k_rope, d.k2_b = a.k_rope_b, d.k2_l = a.k_rope_l, d.k2_dim = a.rope;
  d.v = a.latent, d.v_b = a.latent_b, d.v_l = a.latent_l;
  d.mask = a.mask, d.mask_b = a.mask_b;
  d.out = o_lat.data(), d.out_b = static_cast<int64_t>(H) * r, d.out_h = r;
  decode_attention(pool, level, d);
  w_uv.forward(o_lat.data(), true, B, H * r, f.data(), H * a.v_dim);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      fp32_to_bf16(f.data() + (static_cast<size_t>(b) * H + h) * a.v_dim, a.out + b * a.out_b + h * a.out_h, a.v_dim);
}

}  // namespace tandem
