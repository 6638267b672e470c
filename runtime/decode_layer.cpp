// DecoderLayerStep (tandem/decode_layer.h): a decoder layer's one-token step as pool tasks
// and short loops on the calling thread, rounding as transformers' bf16 forward rounds.
#include "tandem/decode_layer.h"

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

// bf16(a + b), elementwise (torch's bf16 add).
void add_bf16(const bf16_t* a, const bf16_t* b, int n, bf16_t* y) {
  for (int i = 0; i < n; ++i) y[i] = round_to_bf16(from_bf16(a[i]) + from_bf16(b[i]));
}

}  // namespace

DecoderLayerStep::DecoderLayerStep(Engine& engine, DecoderLayerSpec spec, std::string name)
    : e_(engine), s_(std::move(spec)), name_(std::move(name)) {
  const auto& s = s_;
  TANDEM_CHECK(s.hidden > 0 && s.q_heads > 0 && s.kv_heads > 0 && s.head_dim > 0 && s.q_heads % s.kv_heads == 0,
               Errc::invalid_argument, name_, ": hidden ", s.hidden, ", heads ", s.q_heads, " / ", s.kv_heads,
               " kv, head_dim ", s.head_dim, ": must be positive, the query heads a multiple of the kv heads");
  TANDEM_CHECK(s.head_dim % 2 == 0 && s.head_dim <= 512, Errc::invalid_argument, name_, ": head_dim ", s.head_dim,
               " must be even and at most 512");
  TANDEM_CHECK(s.input_norm && s.post_norm && s.qkv && s.o && s.router, Errc::invalid_argument, name_,
               ": a norm weight or dense layer is missing");
  TANDEM_CHECK((s.q_norm == nullptr) == (s.k_norm == nullptr), Errc::invalid_argument, name_,
               ": q_norm and k_norm come together or not at all");
  const int nq = s.q_heads * s.head_dim, nkv = s.kv_heads * s.head_dim;
  TANDEM_CHECK(s.qkv->groups() == 1 && s.qkv->k() == s.hidden && s.qkv->n() == nq + 2 * nkv, Errc::invalid_argument,
               name_, ": q/k/v weight is [", s.qkv->n(), " x ", s.qkv->k(), "], not [", nq + 2 * nkv, " x ", s.hidden,
               "]");
  TANDEM_CHECK(s.o->groups() == 1 && s.o->k() == nq && s.o->n() == s.hidden, Errc::invalid_argument, name_,
               ": o_proj weight is [", s.o->n(), " x ", s.o->k(), "], not [", s.hidden, " x ", nq, "]");
  TANDEM_CHECK(s.router->k() == s.hidden && s.router->format().format == WeightFormat::bf16 && s.router->groups() == 1,
               Errc::invalid_argument, name_, ": the router must be a bf16 [experts x ", s.hidden, "] weight");
  experts_ = s.router->n();
  TANDEM_CHECK(s.top_k >= 1 && s.top_k <= experts_, Errc::invalid_argument, name_, ": top_k ", s.top_k,
               " is outside 1..", experts_);
  TANDEM_CHECK(s.moe_index >= 0 && s.moe_index < engine.moe_layers(), Errc::invalid_argument, name_,
               ": MoE index ", s.moe_index, " is not one of the engine's ", engine.moe_layers(), " layers");
  TANDEM_CHECK(engine.spec().shape.hidden == s.hidden && engine.spec().shape.experts == experts_,
               Errc::invalid_argument, name_, ": the engine's experts are ", engine.spec().shape.experts, " x hidden ",
               engine.spec().shape.hidden, ", the router's ", experts_, " x ", s.hidden);
}

void DecoderLayerStep::qkv(const bf16_t* x, const bf16_t* cos, const bf16_t* sin, bf16_t* q, bf16_t* k, bf16_t* v) {
  const auto& s = s_;
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

void DecoderLayerStep::rest(const bf16_t* x, const bf16_t* q, const bf16_t* k, int64_t k_h, int64_t k_l,
                            const bf16_t* v, int64_t v_h, int64_t v_l, int keys, bf16_t* y) {
  const auto& s = s_;
  TANDEM_CHECK(x && q && k && v && y, Errc::invalid_argument, name_, ": null pointer");
  TANDEM_CHECK(keys >= 1, Errc::invalid_argument, name_, ": ", keys, " cached keys");
  const int d = s.head_dim, nq = s.q_heads * d, H = s.hidden;
  thread_local std::vector<bf16_t> a, o, h, hn, logits, scores16;
  thread_local std::vector<float> out, w;
  thread_local std::vector<int64_t> ids;
  a.resize(nq), o.resize(H), h.resize(H), hn.resize(H), logits.resize(experts_), scores16.resize(s.top_k);
  out.resize(H), w.resize(s.top_k), ids.resize(s.top_k);

  DecodeAttention at;
  at.batch = 1, at.q_heads = s.q_heads, at.kv_heads = s.kv_heads, at.head_dim = d, at.value_dim = d;
  at.keys = keys, at.scale = s.scale;
  at.q = q, at.q_b = nq, at.q_h = d;
  at.k = k, at.k_b = 0, at.k_h = k_h, at.k_l = k_l;
  at.v = v, at.v_b = 0, at.v_h = v_h, at.v_l = v_l;
  at.out = a.data(), at.out_b = nq, at.out_h = d;
  decode_attention(e_.pool(), e_.isa(), at);
  s.o->forward_bf16(a.data(), true, 1, nq, o.data(), H);
  add_bf16(x, o.data(), H, h.data());

  rms_norm_bf16(h.data(), s.post_norm, s.eps, 1, H, hn.data());
  DenseLinear::RouteOptions ro;
  ro.sorted = s.sorted;
  if (s.scores_f32) {
    s.router->route(hn.data(), true, 1, H, s.top_k, s.renorm, logits.data(), w.data(), true, ids.data(), ro);
  } else {
    s.router->route(hn.data(), true, 1, H, s.top_k, s.renorm, logits.data(), scores16.data(), false, ids.data(), ro);
    for (int j = 0; j < s.top_k; ++j) w[j] = from_bf16(scores16[j]);
  }
  LayerIO io;
  io.x = hn.data(), io.x_type = XType::bf16, io.tokens = 1;
  io.ids = ids.data(), io.ids_i64 = true, io.weights = w.data(), io.top_k = s.top_k, io.out = out.data();
  e_.run(s.moe_index, io);
  for (int i = 0; i < H; ++i) y[i] = round_to_bf16(from_bf16(h[i]) + from_bf16(round_to_bf16(out[i])));
}

}  // namespace tandem
