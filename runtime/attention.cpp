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
  float (*prefill_row)(float*, int, int, const uint8_t*, float, float&, float&, bf16_t*);
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

// (the AVX-512 loops again, for CPUs with AVX512_BF16: the prefill rows' probabilities
// rounded by vcvtne2ps2bf16)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")
namespace avx512bf16 {
#define TANDEM_ATTENTION_ZMM 1
#define TANDEM_ATTENTION_BF16 1
#include "attention_loops.inc"
#undef TANDEM_ATTENTION_BF16
#undef TANDEM_ATTENTION_ZMM
}  // namespace avx512bf16
#pragma GCC pop_options

const Loops& loops_for(IsaLevel level) {
  static const Loops s{scalar::scores,      scalar::accumulate, scalar::exp_shifted,
                       scalar::widen,       scalar::row_max,    scalar::prefill_row},
      a2{avx2::scores, avx2::accumulate, avx2::exp_shifted, avx2::widen, avx2::row_max, avx2::prefill_row},
      a5{avx512::scores, avx512::accumulate, avx512::exp_shifted, avx512::widen, avx512::row_max, avx512::prefill_row},
      a5b{avx512bf16::scores, avx512bf16::accumulate, avx512bf16::exp_shifted,
          avx512bf16::widen,  avx512bf16::row_max,    avx512bf16::prefill_row};
  if (level >= IsaLevel::avx512_bf16) return a5b;
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

// Keys per block of the prefill attention: four key panels for the score product, and the
// depth (k) of the value product, whose fp32 output is read, rescaled and written once per
// block. At 2048 keys (Qwen3-30B-A3B's heads, Zen 4) blocks of 256 ran 1.05-1.1x faster than
// blocks of 128 and as fast as blocks of 512.
constexpr int kBlockPanels = 4;
constexpr int kKeyBlock = kBlockPanels * kPanel;
constexpr size_t kPairRow = kPanel * 2 * sizeof(bf16_t);  // one k-pair row of a panel: 256 bytes

// A BF16 pack's layout over memory the task owns: `panels` panels of W [n x k], `stride`
// bytes apart, at `data`.
PackedWeight panel_view(std::byte* data, int n, int k, int panels, size_t stride) {
  PackedWeight w = pack_layout(PackOptions{}, n, k);
  w.panels = panels;
  w.panel_stride = stride;
  w.data = AlignedBuffer::borrow(data, stride * panels);
  return w;
}

class PrefillTask final : public Task {
 public:
  PrefillTask(const PrefillAttention& a, const Loops& f, const KernelTable& kt, int threads, int subpools)
      : a_(a), f_(f), kt_(kt), subpools_(subpools) {
    G_ = a.q_heads / a.kv_heads;
    dv_ = a.value_dim;
    const int seqs = a.batch * a.kv_heads;
    // About 128 query rows per block (every head of the group, qb_ queries each), halved
    // while the blocks would leave threads idle (four items per thread at least).
    qb_ = std::max(1, std::min(a.queries, 128 / G_));
    while (qb_ > 4 && static_cast<int64_t>(seqs) * ((a.queries + qb_ - 1) / qb_) < 4 * threads) qb_ /= 2;
    qblocks_ = (a.queries + qb_ - 1) / qb_;
    kblocks_ = (a.keys + kKeyBlock - 1) / kKeyBlock;
    kpanels_ = (a.keys + kPanel - 1) / kPanel;
    kpanel_bytes_ = static_cast<size_t>((a.head_dim + 1) / 2) * kPairRow;
    vpanels_ = (dv_ + kPanel - 1) / kPanel;
    vblock_bytes_ = static_cast<size_t>(vpanels_) * (kKeyBlock / 2) * kPairRow;
    kseq_bytes_ = static_cast<size_t>(kpanels_) * kpanel_bytes_;
    vseq_bytes_ = static_cast<size_t>(kblocks_) * vblock_bytes_;
    packs_ = AlignedBuffer::allocate(static_cast<size_t>(seqs) * (kseq_bytes_ + vseq_bytes_));
  }
  int phases() const override { return 2; }
  // Subpool s takes every subpools-th item from the s-th on (each a share of the heavy
  // ones).
  int items(int phase, int s) override {
    const int n = a_.batch * a_.kv_heads * (phase == 0 ? kblocks_ : qblocks_);
    return (n - s + subpools_ - 1) / subpools_;
  }
  void run(int phase, int s, int i, int) override {
    const int seqs = a_.batch * a_.kv_heads, item = i * subpools_ + s;
    if (phase == 0)
      pack(item % seqs, item / seqs);
    else  // the last query blocks first: under a causal mask they see the most keys
      block(item % seqs, qblocks_ - 1 - item / seqs);
  }
  void finished() override {
    trace::record("prefill attention", begin_ns_, trace::now_ns(), {-1, a_.queries, a_.keys});
  }

 private:
  std::byte* kpack(int seq) const { return packs_.data() + static_cast<size_t>(seq) * kseq_bytes_; }
  std::byte* vpack(int seq) const {
    return packs_.data() + static_cast<size_t>(a_.batch * a_.kv_heads) * kseq_bytes_ +
           static_cast<size_t>(seq) * vseq_bytes_;
  }

  // Key block j of sequence-and-kv-head `seq`: its key panels ([D/2][64 keys][2]) and its
  // value panels ([kKeyBlock / 2][64 value columns][2]), zero past the keys (to the block's
  // last pair) and dims.
  void pack(int seq, int j) {
    const int b = seq / a_.kv_heads, g = seq % a_.kv_heads, D = a_.head_dim, L = a_.keys;
    const bf16_t* k = a_.k + b * a_.k_b + g * a_.k_h;
    const bf16_t* v = a_.v + b * a_.v_b + g * a_.v_h;
    const int pairs = (D + 1) / 2;
    for (int p = kBlockPanels * j; p < std::min(kBlockPanels * (j + 1), kpanels_); ++p) {
      auto* dst = reinterpret_cast<bf16_t*>(kpack(seq) + static_cast<size_t>(p) * kpanel_bytes_);
      for (int r = 0; r < kPanel; ++r) {
        const int key = p * kPanel + r;
        const bf16_t* row = key < L ? k + key * a_.k_l : nullptr;
        for (int t = 0; t < pairs; ++t) {
          bf16_t* d = dst + (static_cast<size_t>(t) * kPanel + r) * 2;
          d[0] = row ? row[2 * t] : 0;
          d[1] = row && 2 * t + 1 < D ? row[2 * t + 1] : 0;
        }
      }
    }
    auto* dst = reinterpret_cast<bf16_t*>(vpack(seq) + static_cast<size_t>(j) * vblock_bytes_);
    const size_t panel = (kKeyBlock / 2) * kPanel * 2;  // elements per value panel
    // (pairs past the keys are not read: a partial block's view has k = its keys)
    const int pairs_v = (std::min(kKeyBlock, L - j * kKeyBlock) + 1) / 2;
    for (int t = 0; t < pairs_v; ++t) {
      const int key = j * kKeyBlock + 2 * t;
      const bf16_t* r0 = key < L ? v + key * a_.v_l : nullptr;
      const bf16_t* r1 = key + 1 < L ? v + (key + 1) * a_.v_l : nullptr;
      for (int c = 0; c < vpanels_ * kPanel; ++c) {
        bf16_t* d = dst + (c / kPanel) * panel + (static_cast<size_t>(t) * kPanel + c % kPanel) * 2;
        d[0] = r0 && c < dv_ ? r0[c] : 0;
        d[1] = r1 && c < dv_ ? r1[c] : 0;
      }
    }
  }

  // Query block qb of sequence-and-kv-head `seq`: rows h * n + i for the group's heads h
  // and its n queries i.
  void block(int seq, int qb) {
    const int b = seq / a_.kv_heads, g = seq % a_.kv_heads, D = a_.head_dim, L = a_.keys;
    const int i0 = qb * qb_, n = std::min(qb_, a_.queries - i0), M = G_ * n;
    const int first_pos = L - a_.queries + i0;  // the block's first query's position
    thread_local std::vector<bf16_t> q, p;
    thread_local std::vector<float> s, o, m, l;
    q.resize(static_cast<size_t>(M) * D);
    p.resize(static_cast<size_t>(M) * kKeyBlock);
    s.resize(static_cast<size_t>(M) * kKeyBlock);
    o.assign(static_cast<size_t>(M) * dv_, 0.f);
    m.assign(M, -std::numeric_limits<float>::infinity());
    l.assign(M, 0.f);
    for (int h = 0; h < G_; ++h)
      for (int i = 0; i < n; ++i)
        std::memcpy(q.data() + static_cast<size_t>(h * n + i) * D,
                    a_.q + b * a_.q_b + (g * G_ + h) * a_.q_h + (i0 + i) * a_.q_l, sizeof(bf16_t) * D);
    // Under a causal mask the block's last query sees keys up to its position.
    const int key_end = a_.causal ? std::min(L, first_pos + n) : L;
    const GemmFn gemm = kt_.bf16.pick(M).gemm;
    for (int j = 0; j * kKeyBlock < key_end; ++j) {
      const int j0 = j * kKeyBlock, nk = std::min(kKeyBlock, key_end - j0);
      std::byte* keys = kpack(seq) + static_cast<size_t>(kBlockPanels * j) * kpanel_bytes_;
      const PackedWeight kw = panel_view(keys, nk, D, (nk + kPanel - 1) / kPanel, kpanel_bytes_);
      GemmArgs sa;
      sa.a = q.data(), sa.lda = D, sa.m = M, sa.c = s.data(), sa.ldc = kKeyBlock;
      gemm(kw, sa);
      bool touched = false;  // any row with a key in this block
      for (int r = 0; r < M; ++r) {
        const int i = i0 + r % n;
        const int lim = a_.causal ? std::min(nk, L - a_.queries + i + 1 - j0) : nk;
        const uint8_t* mask = a_.mask ? a_.mask + b * a_.mask_b + i * a_.mask_l + j0 : nullptr;
        const float alpha = f_.prefill_row(s.data() + static_cast<size_t>(r) * kKeyBlock, nk, lim, mask, a_.scale,
                                           m[r], l[r], p.data() + static_cast<size_t>(r) * kKeyBlock);
        if (alpha < 0.f) continue;  // no key of this block for the row
        touched = true;
        if (alpha != 1.f) {
          float* orow = o.data() + static_cast<size_t>(r) * dv_;
          for (int c = 0; c < dv_; ++c) orow[c] *= alpha;
        }
      }
      if (!touched) continue;
      const PackedWeight vw = panel_view(vpack(seq) + static_cast<size_t>(j) * vblock_bytes_, dv_, nk, vpanels_,
                                         (kKeyBlock / 2) * kPairRow);
      GemmArgs pa;
      pa.a = p.data(), pa.lda = kKeyBlock, pa.m = M, pa.c = o.data(), pa.ldc = dv_, pa.accumulate = true;
      gemm(vw, pa);
    }
    for (int r = 0; r < M; ++r) {
      const int h = g * G_ + r / n, i = i0 + r % n;
      bf16_t* out = a_.out + b * a_.out_b + i * a_.out_l + h * a_.out_h;
      const float* orow = o.data() + static_cast<size_t>(r) * dv_;
      const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
      for (int c = 0; c < dv_; ++c) out[c] = round_to_bf16(orow[c] * inv);
    }
  }

  PrefillAttention a_;
  const Loops& f_;
  const KernelTable& kt_;
  int subpools_ = 1;
  int G_ = 1, dv_ = 0, qb_ = 1, qblocks_ = 1, kblocks_ = 1, kpanels_ = 1, vpanels_ = 1;
  size_t kpanel_bytes_ = 0, vblock_bytes_ = 0, kseq_bytes_ = 0, vseq_bytes_ = 0;
  AlignedBuffer packs_;  // every sequence's key panels, then every sequence's value blocks
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

void prefill_attention(Pool& pool, IsaLevel level, const PrefillAttention& in) {
  PrefillAttention a = in;
  if (a.value_dim == 0) a.value_dim = a.head_dim;
  TANDEM_CHECK(a.batch >= 1 && a.q_heads >= 1 && a.kv_heads >= 1 && a.queries >= 1 && a.head_dim >= 1 &&
                   a.value_dim >= 1 && a.keys >= 1,
               Errc::invalid_argument, "prefill attention: batch ", a.batch, ", q_heads ", a.q_heads, ", kv_heads ",
               a.kv_heads, ", queries ", a.queries, ", head_dim ", a.head_dim, ", value_dim ", a.value_dim, ", keys ",
               a.keys, ": each must be positive");
  TANDEM_CHECK(a.q_heads % a.kv_heads == 0, Errc::invalid_argument, "prefill attention: q_heads ", a.q_heads,
               " is not a multiple of kv_heads ", a.kv_heads);
  TANDEM_CHECK(!a.causal || a.queries <= a.keys, Errc::invalid_argument, "prefill attention: causal with ",
               a.queries, " queries and only ", a.keys, " keys (the queries are the keys' last positions)");
  TANDEM_CHECK(a.q && a.k && a.v && a.out, Errc::invalid_argument, "prefill attention: ",
               !a.q ? "q" : !a.k ? "k" : !a.v ? "v" : "out", " is null");
  TANDEM_CHECK(std::isfinite(a.scale) && a.scale > 0.f, Errc::invalid_argument, "prefill attention: scale ",
               a.scale, " is not positive and finite");
  pool.run(std::make_shared<PrefillTask>(a, loops_for(level), kernel_table(level), pool.total_threads(),
                                         pool.subpools()));
}

}  // namespace tandem
