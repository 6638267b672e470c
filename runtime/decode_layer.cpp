// DecoderLayerStep (tandem/decode_layer.h): a decoder layer's one-token step as pool tasks
// and short loops on the calling thread, rounding as transformers' bf16 forward rounds.
#include "tandem/decode_layer.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "bf16_round.h"
#include "tandem/attention.h"
#include "tandem/engine.h"
#include "tandem/error.h"

namespace tandem {

namespace {

// apply_rotary_pos_emb on `heads` rows of d values in place: t * cos + rotate_half(t) *
// sin, each product and the sum rounded to bf16 as torch's bf16 operations round them
// (rotate_half(t) = [-t[d/2:], t[:d/2]]; the negation is exact).
void rope(bf16_t* t, int heads, int d, const bf16_t* cos, const bf16_t* sin) {
  const int half = d / 2;
  for (int h = 0; h < heads; ++h) {
    bf16_t* r = t + static_cast<size_t>(h) * d;
    float a[512];  // head_dim <= 512: checked by the constructor
    for (int i = 0; i < d; ++i) a[i] = from_bf16(r[i]);
    for (int i = 0; i < d; ++i) {
      const float rot = i < half ? -a[i + half] : a[i - half];
      const float x = from_bf16(round_to_bf16(a[i] * from_bf16(cos[i])));
      const float y = from_bf16(round_to_bf16(rot * from_bf16(sin[i])));
      r[i] = round_to_bf16(x + y);
    }
  }
}

// DeepSeek-V2's apply_rotary_emb on `rows` rows (row stride `stride`) of d values in
// place: the pairs (t[2i], t[2i+1]) as complex numbers times f[i] = (c, s) in fp32, as
// torch's complex64 product computes it (four products, then ac - bd and ad + bc, each
// rounded: no fused multiply-add), rounded to bf16.
__attribute__((optimize("fp-contract=off"))) void rope_complex(bf16_t* t, int rows, int64_t stride, int d,
                                                                const float* f) {
  for (int r = 0; r < rows; ++r) {
    bf16_t* p = t + r * stride;
    for (int i = 0; i < d / 2; ++i) {
      const float a = from_bf16(p[2 * i]), b = from_bf16(p[2 * i + 1]);
      const float c = f[2 * i], s = f[2 * i + 1];
      const float ac = a * c, bd = b * s, as = a * s, bc = b * c;
      p[2 * i] = round_to_bf16(ac - bd);
      p[2 * i + 1] = round_to_bf16(as + bc);
    }
  }
}

// bf16(a + b), elementwise (torch's bf16 add).
void add_bf16(const bf16_t* a, const bf16_t* b, int n, bf16_t* y) {
  for (int i = 0; i < n; ++i) y[i] = round_to_bf16(from_bf16(a[i]) + from_bf16(b[i]));
}

}  // namespace

void check_gated_mlp(const GatedMlp& m, const std::string& name) {
  TANDEM_CHECK(m.gate_up && m.down, Errc::invalid_argument, name, ": the MLP's ", !m.gate_up ? "gate/up" : "down",
               " layer is missing");
  const int I = m.down->k(), H = m.down->n();
  TANDEM_CHECK(m.gate_up->groups() == 1 && m.down->groups() == 1 && m.gate_up->k() == H && m.gate_up->n() == 2 * I,
               Errc::invalid_argument, name, ": the MLP's gate/up weight is [", m.gate_up->n(), " x ", m.gate_up->k(),
               "] and its down weight [", H, " x ", I, "]; gate/up must be [", 2 * I, " x ", H, "]");
}

void gated_mlp_bf16(const GatedMlp& m, const bf16_t* x, int64_t rows, bf16_t* y) {
  const int I = m.down->k(), H = m.down->n();
  thread_local std::vector<bf16_t> gu, h;
  thread_local std::vector<float> g, ones, s;
  constexpr int64_t kChunk = 64;  // rows per pass (the activation's buffers stay small)
  const auto silu = m.gate_up->kernels().silu_mul;
  if (ones.size() != static_cast<size_t>(I)) ones.assign(I, 1.0f);
  g.resize(I), s.resize(I);
  for (int64_t r0 = 0; r0 < rows; r0 += kChunk) {
    const int n = static_cast<int>(std::min(kChunk, rows - r0));
    gu.resize(static_cast<size_t>(n) * 2 * I), h.resize(static_cast<size_t>(n) * I);
    m.gate_up->forward_bf16(x + r0 * H, true, n, H, gu.data(), 2 * I);
    for (int r = 0; r < n; ++r) {
      const bf16_t* gr = gu.data() + static_cast<size_t>(r) * 2 * I;
      bf16_t* hr = h.data() + static_cast<size_t>(r) * I;
      for (int j = 0; j < I; ++j) g[j] = from_bf16(gr[j]);
      silu(g.data(), ones.data(), s.data(), I);  // silu(g) * 1: silu(g) in fp32
      for (int j = 0; j < I; ++j) hr[j] = round_to_bf16(from_bf16(round_to_bf16(s[j])) * from_bf16(gr[I + j]));
    }
    m.down->forward_bf16(h.data(), true, n, I, y + r0 * H, H);
  }
}

DecoderLayerStep::DecoderLayerStep(Engine& engine, DecoderLayerSpec spec, std::string name)
    : e_(engine), s_(std::move(spec)), name_(std::move(name)) {
  const auto& s = s_;
  TANDEM_CHECK(s.hidden > 0 && s.q_heads > 0 && s.kv_heads > 0 && s.head_dim > 0 && s.q_heads % s.kv_heads == 0,
               Errc::invalid_argument, name_, ": hidden ", s.hidden, ", heads ", s.q_heads, " / ", s.kv_heads,
               " kv, head_dim ", s.head_dim, ": must be positive, the query heads a multiple of the kv heads");
  TANDEM_CHECK(s.head_dim % 2 == 0 && s.head_dim <= 512, Errc::invalid_argument, name_, ": head_dim ", s.head_dim,
               " must be even and at most 512");
  TANDEM_CHECK(s.input_norm && s.post_norm && s.qkv && s.o, Errc::invalid_argument, name_,
               ": a norm weight or dense layer is missing");
  TANDEM_CHECK((s.q_norm == nullptr) == (s.k_norm == nullptr), Errc::invalid_argument, name_,
               ": q_norm and k_norm come together or not at all");
  const int nq = s.q_heads * s.head_dim, nkv = s.kv_heads * s.head_dim;
  int attn_width = nq;
  if (s.mla_rank > 0) {
    TANDEM_CHECK(s.kv_heads == 1 && !s.q_norm && s.rope > 0 && s.rope % 2 == 0 && s.rope < s.head_dim && s.v_dim > 0,
                 Errc::invalid_argument, name_, ": MLA takes one latent head, no q/k norms, an even rope width below "
                 "head_dim and a value width; got kv heads ", s.kv_heads, ", rope ", s.rope, " of ", s.head_dim,
                 ", v_dim ", s.v_dim);
    TANDEM_CHECK(s.kv_norm && s.w_uk && s.w_uv && (s.q_b == nullptr) == (s.q_a_norm == nullptr),
                 Errc::invalid_argument, name_, ": MLA needs kv_a_layernorm, both absorbed halves of kv_b_proj, and "
                 "q_a_layernorm with q_b_proj or neither");
    const int q_rows = s.q_b ? s.q_b->k() : nq;
    TANDEM_CHECK(s.qkv->groups() == 1 && s.qkv->k() == s.hidden && s.qkv->n() == q_rows + s.mla_rank + s.rope,
                 Errc::invalid_argument, name_, ": the query / kv_a weight is [", s.qkv->n(), " x ", s.qkv->k(),
                 "], not [", q_rows + s.mla_rank + s.rope, " x ", s.hidden, "]");
    if (s.q_b)
      TANDEM_CHECK(s.q_b->groups() == 1 && s.q_b->n() == nq, Errc::invalid_argument, name_, ": q_b_proj is [",
                   s.q_b->n(), " x ", s.q_b->k(), "], not [", nq, " x ", s.q_b->k(), "]");
    attn_width = s.q_heads * s.v_dim;
  } else {
    TANDEM_CHECK(s.qkv->groups() == 1 && s.qkv->k() == s.hidden && s.qkv->n() == nq + 2 * nkv,
                 Errc::invalid_argument, name_, ": q/k/v weight is [", s.qkv->n(), " x ", s.qkv->k(), "], not [",
                 nq + 2 * nkv, " x ", s.hidden, "]");
  }
  TANDEM_CHECK(s.o->groups() == 1 && s.o->k() == attn_width && s.o->n() == s.hidden, Errc::invalid_argument, name_,
               ": o_proj weight is [", s.o->n(), " x ", s.o->k(), "], not [", s.hidden, " x ", attn_width, "]");
  if (!s.mlp.empty()) {
    check_gated_mlp(s.mlp, name_);
    TANDEM_CHECK(s.mlp.down->n() == s.hidden, Errc::invalid_argument, name_, ": the MLP's hidden size is ",
                 s.mlp.down->n(), ", the layer's ", s.hidden);
  }
  if (s.moe_index < 0) {
    TANDEM_CHECK(!s.mlp.empty(), Errc::invalid_argument, name_, ": neither routed experts nor a dense MLP");
    return;
  }
  TANDEM_CHECK(s.router && s.router->k() == s.hidden && s.router->format().format == WeightFormat::bf16 &&
                   s.router->groups() == 1,
               Errc::invalid_argument, name_, ": the router must be a bf16 [experts x ", s.hidden, "] weight");
  experts_ = s.router->n();
  TANDEM_CHECK(s.top_k >= 1 && s.top_k <= experts_, Errc::invalid_argument, name_, ": top_k ", s.top_k,
               " is outside 1..", experts_);
  TANDEM_CHECK(s.moe_index < engine.moe_layers(), Errc::invalid_argument, name_, ": MoE index ", s.moe_index,
               " is not one of the engine's ", engine.moe_layers(), " layers");
  TANDEM_CHECK(engine.spec().shape.hidden == s.hidden && engine.spec().shape.experts == experts_,
               Errc::invalid_argument, name_, ": the engine's experts are ", engine.spec().shape.experts, " x hidden ",
               engine.spec().shape.hidden, ", the router's ", experts_, " x ", s.hidden);
}

void DecoderLayerStep::qkv(const bf16_t* x, const bf16_t* cos, const bf16_t* sin, bf16_t* q, bf16_t* k, bf16_t* v) {
  const auto& s = s_;
  TANDEM_CHECK(!mla(), Errc::invalid_argument, name_, ": an MLA layer's step is qkv_mla");
  TANDEM_CHECK(x && cos && sin && q && k && v, Errc::invalid_argument, name_, ": null pointer");
  const int d = s.head_dim, nq = s.q_heads * d, nkv = s.kv_heads * d;
  thread_local std::vector<bf16_t> xn, y;
  xn.resize(s.hidden);
  y.resize(static_cast<size_t>(nq) + 2 * nkv);
  rms_norm_bf16(x, s.input_norm, s.eps, 1, s.hidden, xn.data());
  s.qkv->forward_bf16(xn.data(), true, 1, s.hidden, y.data(), nq + 2 * nkv);
  if (s.q_norm) {
    rms_norm_bf16(y.data(), s.q_norm, s.qk_eps, s.q_heads, d, q);
    rms_norm_bf16(y.data() + nq, s.k_norm, s.qk_eps, s.kv_heads, d, k);
  } else {
    std::memcpy(q, y.data(), sizeof(bf16_t) * nq);
    std::memcpy(k, y.data() + nq, sizeof(bf16_t) * nkv);
  }
  std::memcpy(v, y.data() + nq + nkv, sizeof(bf16_t) * nkv);
  rope(q, s.q_heads, d, cos, sin);
  rope(k, s.kv_heads, d, cos, sin);
}

void DecoderLayerStep::qkv_mla(const bf16_t* x, const float* freqs, bf16_t* q, bf16_t* latent, bf16_t* k_rope) {
  const auto& s = s_;
  TANDEM_CHECK(mla(), Errc::invalid_argument, name_, ": not an MLA layer (its step is qkv)");
  TANDEM_CHECK(x && freqs && q && latent && k_rope, Errc::invalid_argument, name_, ": null pointer");
  const int d = s.head_dim, nq = s.q_heads * d, r = s.mla_rank, n = s.qkv->n();
  const int q_rows = n - r - s.rope;
  thread_local std::vector<bf16_t> xn, y, qa;
  xn.resize(s.hidden), y.resize(n);
  rms_norm_bf16(x, s.input_norm, s.eps, 1, s.hidden, xn.data());
  s.qkv->forward_bf16(xn.data(), true, 1, s.hidden, y.data(), n);
  if (s.q_b) {
    qa.resize(q_rows);
    rms_norm_bf16(y.data(), s.q_a_norm, s.q_a_eps, 1, q_rows, qa.data());
    s.q_b->forward_bf16(qa.data(), true, 1, q_rows, q, nq);
  } else {
    std::memcpy(q, y.data(), sizeof(bf16_t) * nq);
  }
  rms_norm_bf16(y.data() + q_rows, s.kv_norm, s.kv_eps, 1, r, latent);
  std::memcpy(k_rope, y.data() + q_rows + r, sizeof(bf16_t) * s.rope);
  rope_complex(q + (d - s.rope), s.q_heads, d, s.rope, freqs);
  rope_complex(k_rope, 1, s.rope, s.rope, freqs);
}

void DecoderLayerStep::rest(const bf16_t* x, const bf16_t* q, const bf16_t* k, int64_t k_h, int64_t k_l,
                            const bf16_t* v, int64_t v_h, int64_t v_l, int keys, bf16_t* y) {
  const auto& s = s_;
  TANDEM_CHECK(!mla(), Errc::invalid_argument, name_, ": an MLA layer's step is rest_mla");
  TANDEM_CHECK(x && q && k && v && y, Errc::invalid_argument, name_, ": null pointer");
  TANDEM_CHECK(keys >= 1, Errc::invalid_argument, name_, ": ", keys, " cached keys");
  const int d = s.head_dim, nq = s.q_heads * d;
  thread_local std::vector<bf16_t> a;
  a.resize(nq);
  DecodeAttention at;
  at.batch = 1, at.q_heads = s.q_heads, at.kv_heads = s.kv_heads, at.head_dim = d, at.value_dim = d;
  at.keys = keys, at.scale = s.scale;
  at.q = q, at.q_b = nq, at.q_h = d;
  at.k = k, at.k_b = 0, at.k_h = k_h, at.k_l = k_l;
  at.v = v, at.v_b = 0, at.v_h = v_h, at.v_l = v_l;
  at.out = a.data(), at.out_b = nq, at.out_h = d;
  decode_attention(e_.pool(), e_.isa(), at);
  tail(x, a.data(), y);
}

void DecoderLayerStep::rest_mla(const bf16_t* x, const bf16_t* q, const bf16_t* latent, int64_t latent_l,
                                const bf16_t* k_rope, int64_t k_rope_l, int keys, bf16_t* y) {
  const auto& s = s_;
  TANDEM_CHECK(mla(), Errc::invalid_argument, name_, ": not an MLA layer (its step is rest)");
  TANDEM_CHECK(x && q && latent && k_rope && y, Errc::invalid_argument, name_, ": null pointer");
  TANDEM_CHECK(keys >= 1, Errc::invalid_argument, name_, ": ", keys, " cached keys");
  const int d = s.head_dim, H = s.q_heads;
  thread_local std::vector<bf16_t> a;
  a.resize(static_cast<size_t>(H) * s.v_dim);
  MlaDecode m;
  m.batch = 1, m.heads = H, m.nope = d - s.rope, m.rope = s.rope, m.rank = s.mla_rank, m.v_dim = s.v_dim;
  m.keys = keys, m.scale = s.scale;
  m.q = q, m.q_b = static_cast<int64_t>(H) * d, m.q_h = d;
  m.latent = latent, m.latent_b = 0, m.latent_l = latent_l;
  m.k_rope = k_rope, m.k_rope_b = 0, m.k_rope_l = k_rope_l;
  m.out = a.data(), m.out_b = static_cast<int64_t>(H) * s.v_dim, m.out_h = s.v_dim;
  mla_decode(e_.pool(), e_.isa(), *s.w_uk, *s.w_uv, m);
  tail(x, a.data(), y);
}

void DecoderLayerStep::tail(const bf16_t* x, const bf16_t* a, bf16_t* y) {
  const auto& s = s_;
  const int H = s.hidden;
  thread_local std::vector<bf16_t> o, h, hn, f, scores16, shared;
  thread_local std::vector<float> logits, out, w;
  thread_local std::vector<int64_t> ids;
  o.resize(H), h.resize(H), hn.resize(H), f.resize(H);
  s.o->forward_bf16(a, true, 1, s.o->k(), o.data(), H);
  add_bf16(x, o.data(), H, h.data());
  rms_norm_bf16(h.data(), s.post_norm, s.eps, 1, H, hn.data());
  if (s.moe_index < 0) {
    gated_mlp_bf16(s.mlp, hn.data(), 1, f.data());
  } else {
    logits.resize(experts_), scores16.resize(s.top_k), out.resize(H), w.resize(s.top_k), ids.resize(s.top_k);
    if (s.scores_f32) {
      s.router->route(hn.data(), true, 1, H, s.top_k, s.renorm, logits.data(), w.data(), true, ids.data(), s.route);
    } else {
      s.router->route(hn.data(), true, 1, H, s.top_k, s.renorm, logits.data(), scores16.data(), false, ids.data(),
                      s.route);
      for (int j = 0; j < s.top_k; ++j) w[j] = from_bf16(scores16[j]);
    }
    LayerIO io;
    io.x = hn.data(), io.x_type = XType::bf16, io.tokens = 1;
    io.ids = ids.data(), io.ids_i64 = true, io.weights = w.data(), io.top_k = s.top_k, io.out = out.data();
    e_.run(s.moe_index, io);
    fp32_to_bf16(out.data(), f.data(), H);
    if (!s.mlp.empty()) {
      shared.resize(H);
      gated_mlp_bf16(s.mlp, hn.data(), 1, shared.data());
      add_bf16(f.data(), shared.data(), H, f.data());
    }
  }
  add_bf16(h.data(), f.data(), H, y);
}

void DecoderLayerStep::step(bf16_t* x, const bf16_t* cos, const bf16_t* sin, const float* freqs, const LayerCache& c,
                            int pos) {
  TANDEM_CHECK(x && c.k && c.v && pos >= 0, Errc::invalid_argument, name_, ": null cache or input, or position ", pos);
  const DecoderLayerSpec& s = s_;
  thread_local std::vector<bf16_t> q, kv;
  q.resize(static_cast<size_t>(s.q_heads) * s.head_dim);
  if (mla()) {
    kv.resize(static_cast<size_t>(s.mla_rank + s.rope));
    qkv_mla(x, freqs, q.data(), kv.data(), kv.data() + s.mla_rank);
    std::memcpy(c.k + pos * c.k_l, kv.data(), sizeof(bf16_t) * s.mla_rank);
    std::memcpy(c.v + pos * c.v_l, kv.data() + s.mla_rank, sizeof(bf16_t) * s.rope);
    rest_mla(x, q.data(), c.k, c.k_l, c.v, c.v_l, pos + 1, x);
    return;
  }
  const size_t row = static_cast<size_t>(s.kv_heads) * s.head_dim;
  kv.resize(2 * row);
  qkv(x, cos, sin, q.data(), kv.data(), kv.data() + row);
  for (int h = 0; h < s.kv_heads; ++h) {
    std::memcpy(c.k + h * c.k_h + pos * c.k_l, kv.data() + h * s.head_dim, sizeof(bf16_t) * s.head_dim);
    std::memcpy(c.v + h * c.v_h + pos * c.v_l, kv.data() + row + h * s.head_dim, sizeof(bf16_t) * s.head_dim);
  }
  rest(x, q.data(), c.k, c.k_h, c.k_l, c.v, c.v_h, c.v_l, pos + 1, x);
}

DecoderStack::DecoderStack(std::vector<std::shared_ptr<DecoderLayerStep>> layers) : layers_(std::move(layers)) {
  TANDEM_CHECK(!layers_.empty(), Errc::invalid_argument, "decoder stack: no layers");
  for (const auto& l : layers_) {
    TANDEM_CHECK(l != nullptr, Errc::invalid_argument, "decoder stack: a null layer");
    TANDEM_CHECK(l->spec().hidden == layers_[0]->spec().hidden, Errc::invalid_argument, "decoder stack: ", l->name(),
                 " has hidden size ", l->spec().hidden, ", ", layers_[0]->name(), " ", layers_[0]->spec().hidden);
  }
}

void DecoderStack::run(bf16_t* x, const bf16_t* cos, const bf16_t* sin, const float* freqs, const LayerCache* caches,
                       int pos) {
  TANDEM_CHECK(caches != nullptr, Errc::invalid_argument, "decoder stack: null cache table");
  for (size_t i = 0; i < layers_.size(); ++i) layers_[i]->step(x, cos, sin, freqs, caches[i], pos);
}

}  // namespace tandem
