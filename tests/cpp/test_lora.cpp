// LoraMoe (LoRA fine-tuning of one MoE layer's routed experts) against an fp64 reference.
//
// The reference runs the math of lora.h in double on the layer's own base weights
// (LoraMoe::dequantized) and mimics every rounding of the layer that is a deterministic
// function of the inputs:
//   - x rounded to bf16 once; for int8 / int4 bases that bf16 x quantized per row
//     (quantize_activations, deterministic) for the base gate / up products;
//   - dOut rounded to bf16 and the weights rounded to bf16 for the base product dOut Wd,
//     and the weights rounded to bf16 for the base product [dg du] [Wg; Wu].
// Next to every value it carries a first-order bound on the layer's error, built from
// sums of |terms| (as test_moe.cpp does):
//   - an fp32 accumulation of K terms (any order, blocked or FMA) errs by at most
//     K * 2^-24 * sum |terms|; we allow gam(K) = 2 (K + 4) 2^-24 * sum |terms|: the +4 for
//     the few products and additions around a dot product (the scaling s, base + LoRA, the
//     routing weight), the 2 for the second-order terms this first-order analysis drops;
//   - the errors of the inputs of a product propagate through it: sum |a| err(b) + |b| err(a);
//   - silu / sigmoid are evaluated to 2^-20 relative (16 fp32 ulps: an expf of a few ulps, a
//     division, the products), and their errors propagate through their derivatives
//     (|silu''| <= 1/2 everywhere);
//   - what the reference does not mimic is rounding to bf16 of values the layer computes in
//     fp32 (the reference holds them in double): h before the base down product (and, for
//     int8 / int4 bases, its per-row quantization to int8 over each subpool's slice, step
//     max|h| / 127), and [dg du] before the base product with [Wg; Wu]. Round to nearest
//     in bf16 (8 significant bits) errs by at most 2^-8 relative, the int8 step by step / 2.
// So out and d_x carry bf16-level bounds, and d_weights and the six LoRA gradients (whose
// every input is mimicked or fp32) fp32-level ones: a gradient off by a factor, a sign, a
// missing s or w, or one expert's contribution dropped is far outside them.
// Each element must lie within its bound. The bounds are worst cases and compound along a
// chain (d_weights = h . (dOut Wd + ...) ends near 1e-3 relative), so besides, the relative
// L2 error over all elements is checked against what rounding noise gives:
//   - out and d_x: below twice what the rounding model predicts (each unmimicked bf16
//     rounding an independent uniform error, variance ulp^2 / 12, int8 step^2 / 12), plus
//     2^-20 for the fp32 noise;
//   - d_weights and the LoRA gradients (fp32 arithmetic on mimicked inputs): below 2^-14.
//     fp32 noise over these chains is ~sqrt(K) 2^-24 (measured <= 1e-6 here, K <= a few
//     hundred pairs per expert), while a single bf16 rounding of an fp32 operand in the
//     chain (h, dOut, x A^T, ...) gives ~2^-8 / sqrt(3) ~ 2e-3: 2^-14 ~ 6e-5 separates them.
// So a systematic error hiding under the worst-case bound still fails.
//
// Every test prints its seed; TANDEM_TEST_SEED replays it. TANDEM_TEST_VERBOSE=1 prints,
// per checked quantity, the largest error / bound ratio.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <sstream>

#include "tandem/error.h"
#include "tandem/lora.h"
#include "tandem/pool_config.h"
#include "test_util.h"

namespace tandem {
namespace {

constexpr double kU32 = 0x1p-24;      // fp32 unit roundoff
constexpr double kUbf = 0x1p-8;       // bf16 unit roundoff (8 significant bits)
constexpr double kEvalRel = 0x1p-20;  // silu / sigmoid evaluation, relative
double gam(double k) { return 2 * (k + 4) * kU32; }
double bf16_ulp(double v) { return v == 0 ? 0 : std::ldexp(1.0, std::ilogb(v) - 7); }
bool verbose() { return std::getenv("TANDEM_TEST_VERBOSE") != nullptr; }

std::unique_ptr<Pool> make_pool(int subpools) {
  Config::Cpu cpu;
  cpu.virtual_subpools = subpools;
  cpu.threads = 1;
  return std::make_unique<Pool>(pool_options(cpu));
}

// ---- LoRA buffers in the layouts LoraMatrix can describe ------------------------------

enum class Layout {
  dense,                   // zero strides: the layer's default
  explicit_dense,          // the same, with the strides spelled out
  padded,                  // row-major, ld = cols + 3, experts 5 elements apart
  interleaved,             // one row-major [rows x cols * experts] (a PEFT fused lora_B)
  transposed,              // per expert column-major [cols x rows] blocks
  transposed_interleaved,  // one row-major [cols x rows * experts], read transposed
};
constexpr int kLayouts = 6;
const char* layout_name(Layout l) {
  static const char* names[] = {"dense", "explicit_dense", "padded", "interleaved", "transposed", "transposed_interleaved"};
  return names[int(l)];
}

enum Mat { AG, BG, AU, BU, AD, BD };
const char* mat_name(int m) {
  static const char* names[] = {"A_gate", "B_gate", "A_up", "B_up", "A_down", "B_down"};
  return names[m];
}
// {rows, cols} of matrix m: A [r x in], B [out x r].
std::pair<int, int> mat_dims(int m, int hidden, int inter, int r) {
  switch (m) {
    case AG: case AU: return {r, hidden};
    case BG: case BU: return {inter, r};
    case AD: return {r, inter};
    default: return {hidden, r};
  }
}

struct LoraBuf {
  int experts = 0, rows = 0, cols = 0;
  Layout layout = Layout::dense;
  int64_t stride = 0, ld = 0;
  bool transposed = false;
  std::vector<float> buf;

  LoraBuf() = default;
  LoraBuf(int e_, int rows_, int cols_, Layout l) : experts(e_), rows(rows_), cols(cols_), layout(l) {
    switch (l) {
      case Layout::dense: case Layout::explicit_dense: stride = int64_t(rows) * cols, ld = cols; break;
      case Layout::padded: ld = cols + 3, stride = rows * ld + 5; break;
      case Layout::interleaved: stride = cols, ld = int64_t(cols) * experts; break;
      case Layout::transposed: transposed = true, stride = int64_t(rows) * cols, ld = rows; break;
      case Layout::transposed_interleaved: transposed = true, stride = rows, ld = int64_t(rows) * experts; break;
    }
    size_t n = index(experts - 1, rows - 1, cols - 1) + 1;
    if (l == Layout::padded) n += 7;  // trailing elements the layer must not touch
    buf.assign(n, 0.f);
  }
  size_t index(int e, int i, int j) const {
    return size_t(e * stride + (transposed ? int64_t(j) * ld + i : int64_t(i) * ld + j));
  }
  float& at(int e, int i, int j) { return buf[index(e, i, j)]; }
  float at(int e, int i, int j) const { return buf[index(e, i, j)]; }
  LoraMatrix matrix() {
    LoraMatrix m;
    m.data = buf.data();
    m.size = buf.size();
    m.transposed = transposed;
    if (layout != Layout::dense) m.expert_stride = stride, m.ld = ld;
    return m;
  }
  // 1 for the elements the layout reaches.
  std::vector<uint8_t> reached() const {
    std::vector<uint8_t> r(buf.size(), 0);
    for (int e = 0; e < experts; ++e)
      for (int i = 0; i < rows; ++i)
        for (int j = 0; j < cols; ++j) r[index(e, i, j)] = 1;
    return r;
  }
};

LoraWeights weights_of(std::array<LoraBuf, 6>& b, int skip = -1) {
  LoraWeights w;
  LoraMatrix* f[6] = {&w.a_gate, &w.b_gate, &w.a_up, &w.b_up, &w.a_down, &w.b_down};
  for (int m = 0; m < 6; ++m)
    if (m != skip) *f[m] = b[m].matrix();
  return w;
}

// ---- a problem: base weights, LoRA, inputs, initial gradients --------------------------

struct Case {
  int experts = 4, hidden = 64, inter = 64, top_k = 2, tokens = 8, rank = 8;
  PackOptions fmt{WeightFormat::bf16};
  int subpools = 1;
  float alpha = 16;
  bool rslora = false, fp32_x = false, bf16_dout = false, i64 = false;
  bool accumulate = false, accumulate_x = false;
  bool one_expert = false;   // every slot of every token on expert one_expert_id
  int one_expert_id = 0;
  bool want_dx = true, want_dw = true, null_lora = false;
  int skip_grad = -1;        // this gradient (Mat) not wanted
  bool mixed_layouts = false;  // strided / transposed LoRA and gradient buffers
  bool zero_down = false;    // base down = 0 (finite differences without bf16 h)
  int isa = -1;              // the layer's kernel level (-1: its default, effective_isa())
  bool bf16_exact_x = false;  // fp32 x already on the bf16 grid
  GateAct act;               // the experts' activation
  bool bias = false;         // gate / up / down biases (gpt-oss)
};

std::string describe(const Case& c) {
  std::ostringstream os;
  os << "experts " << c.experts << " hidden " << c.hidden << " inter " << c.inter << " top_k " << c.top_k << " tokens "
     << c.tokens << " rank " << c.rank << " format " << format_name(c.fmt.format)
     << (c.fmt.format == WeightFormat::int4 ? (c.fmt.symmetric ? " sym" : " asym") : "") << " subpools " << c.subpools
     << " alpha " << c.alpha << (c.rslora ? " rslora" : "") << (c.fp32_x ? " x fp32" : " x bf16")
     << (c.bf16_dout ? " d_out bf16" : " d_out fp32") << (c.i64 ? " ids i64" : "") << (c.accumulate ? " accumulate" : "")
     << (c.accumulate_x ? " accumulate_x" : "") << (c.one_expert ? " one_expert" : "") << (c.want_dx ? "" : " no d_x")
     << (c.want_dw ? "" : " no d_weights") << (c.null_lora ? " null_lora" : "") << (c.act.plain() ? "" : " clamped") << (c.bias ? " biases" : "")
     << (c.skip_grad >= 0 ? std::string(" no d") + mat_name(c.skip_grad) : "") << (c.mixed_layouts ? " mixed layouts" : "");
  return os.str();
}

double scaling_of(const Case& c) { return c.rslora ? c.alpha / std::sqrt(double(c.rank)) : double(c.alpha) / c.rank; }

struct Problem {
  Case c;
  std::vector<std::vector<float>> g, u, d;  // base per expert, fp32 nn.Linear layout
  std::vector<std::vector<float>> gb, ub, db;  // biases per expert (c.bias): [inter], [inter], [hidden]
  std::vector<float> xf;                    // [T x H] (bf16 values when !fp32_x)
  std::vector<bf16_t> xb;                   // bf16(xf)
  std::vector<int32_t> ids;
  std::vector<int64_t> ids64;
  std::vector<float> wts, dout, out0, dx0;
  std::vector<bf16_t> dout_b;
  std::array<LoraBuf, 6> lora, grad0;  // grad0: initial gradient values (also in the gaps)
};

Problem make_problem(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  Problem p;
  p.c = c;
  const int E = c.experts, H = c.hidden, I = c.inter, T = c.tokens, K = c.top_k, R = c.rank;
  const float sg = 1.0f / std::sqrt(float(H)), sd = 1.0f / std::sqrt(float(I));
  for (int e = 0; e < E; ++e) {  // magnitudes as in test_moe.cpp
    std::vector<float> g(size_t(I) * H), u(g.size()), d(size_t(H) * I);
    for (auto& v : g) v = nd(rng) * sg * 2;
    for (auto& v : u) v = nd(rng) * sg * 2;
    for (auto& v : d) v = c.zero_down ? 0.f : nd(rng) * sd;
    p.g.push_back(std::move(g));
    p.u.push_back(std::move(u));
    p.d.push_back(std::move(d));
  }
  p.xf.resize(size_t(T) * H);
  for (auto& v : p.xf) v = nd(rng);
  p.xb.resize(p.xf.size());
  fp32_to_bf16(p.xf.data(), p.xb.data(), p.xf.size());
  if (!c.fp32_x || c.bf16_exact_x)
    for (size_t i = 0; i < p.xf.size(); ++i) p.xf[i] = bf16_to_fp32(p.xb[i]);
  // Routing: distinct experts per token, every 11th slot empty, token 1 (when there are
  // at least 3 tokens) entirely empty.
  p.ids.resize(size_t(T) * K);
  p.wts.resize(p.ids.size());
  std::vector<int> perm(E);
  for (int t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int k = 0; k < K; ++k) {
      const size_t i = size_t(t) * K + k;
      p.ids[i] = c.one_expert ? c.one_expert_id : (i % 11 == 10 || (T >= 3 && t == 1)) ? -1 : perm[k];
      p.wts[i] = std::abs(nd(rng)) / K + 0.05f;
    }
  }
  p.ids64.assign(p.ids.begin(), p.ids.end());
  p.dout.resize(size_t(T) * H);
  for (auto& v : p.dout) v = nd(rng);
  p.dout_b.resize(p.dout.size());
  fp32_to_bf16(p.dout.data(), p.dout_b.data(), p.dout.size());
  p.out0.resize(size_t(T) * H);
  for (auto& v : p.out0) v = c.accumulate ? nd(rng) : 12345.f;  // "=": must be overwritten
  p.dx0.resize(size_t(T) * H);
  for (auto& v : p.dx0) v = c.accumulate_x ? nd(rng) : -777.f;
  // LoRA: A ~ N(0, 1 / in) (so x A^T ~ N(0, 1)), B such that s (x A^T) B^T ~ N(0, 1/4):
  // comparable to, not dominating, the base. The gaps of strided buffers hold NaN (a read
  // outside the layout shows); gradient buffers start from random values everywhere.
  const double s = scaling_of(c);
  for (int m = 0; m < 6; ++m) {
    const auto [rows, cols] = mat_dims(m, H, I, R);
    const Layout l = c.mixed_layouts ? Layout((m + seed) % kLayouts) : Layout::dense;
    const Layout lg = c.mixed_layouts ? Layout((m + 3 + seed / 7) % kLayouts) : Layout::dense;
    p.lora[m] = LoraBuf(E, rows, cols, l);
    std::fill(p.lora[m].buf.begin(), p.lora[m].buf.end(), std::nanf(""));
    const bool is_a = m == AG || m == AU || m == AD;
    const float scale = is_a ? 1.0f / std::sqrt(float(cols)) : float(0.5 / (s * std::sqrt(double(R))));
    for (int e = 0; e < E; ++e)
      for (int i = 0; i < rows; ++i)
        for (int j = 0; j < cols; ++j) p.lora[m].at(e, i, j) = nd(rng) * scale;
    p.grad0[m] = LoraBuf(E, rows, cols, lg);
    for (auto& v : p.grad0[m].buf) v = nd(rng);
  }
  if (c.bias)  // drawn last: the other values stay those of the same case without biases
    for (int e = 0; e < E; ++e) {
      auto [bg, bu] = test::random_biases(I, rng);
      for (auto* v : {&bg, &bu})
        for (auto& x : *v) x /= 3;  // N(0, 1): about the base pre-activations' spread
      std::vector<float> bd(H);
      for (auto& x : bd) x = nd(rng);
      p.gb.push_back(std::move(bg));
      p.ub.push_back(std::move(bu));
      p.db.push_back(std::move(bd));
    }
  return p;
}

// Expert e of the problem as a weight source (biases included when it has them).
ExpertSource source_of(const Problem& p, int e) {
  const Case& c = p.c;
  if (!c.bias) return test::f32_expert(p.g[e].data(), p.u[e].data(), p.d[e].data(), c.hidden, c.inter);
  return test::f32_expert(p.g[e].data(), p.u[e].data(), p.d[e].data(), c.hidden, c.inter, p.gb[e].data(),
                          p.ub[e].data(), p.db[e].data());
}

// ---- running the layer ----------------------------------------------------------------

// p's layer on pool, loaded.
std::unique_ptr<LoraMoe> layer_on(Pool& pool, const Problem& p, int layer_index = 3) {
  const Case& c = p.c;
  SftOptions o;
  o.format = c.fmt;
  o.lora.rank = c.rank;
  o.lora.alpha = c.alpha;
  o.lora.rslora = c.rslora;
  MoeShape shape{c.experts, c.hidden, c.inter};
  shape.act = c.act;
  shape.bias = c.bias;
  auto moe = std::make_unique<LoraMoe>(pool, shape, o, layer_index);
  if (c.isa >= 0) moe->use_isa(static_cast<IsaLevel>(c.isa));
  moe->load([&](int e) { return source_of(p, e); });
  return moe;
}

struct TestLayer {
  std::unique_ptr<Pool> pool;
  std::unique_ptr<LoraMoe> moe;
  TestLayer(const Problem& p, int subpools, int layer_index = 3) : pool(make_pool(subpools)), moe(layer_on(*pool, p, layer_index)) {}
};

MoeInput input_of(const Problem& p, float* out) {
  MoeInput in;
  if (p.c.fp32_x) in.x_f32 = p.xf.data();
  else in.x = p.xb.data();
  in.tokens = p.c.tokens;
  if (p.c.i64) in.ids_i64 = p.ids64.data();
  else in.ids = p.ids.data();
  in.top_k = p.c.top_k;
  in.weights = p.wts.data();
  in.out = out;
  in.accumulate = p.c.accumulate;
  return in;
}

LoraWeights lora_of(Problem& p) { return p.c.null_lora ? LoraWeights{} : weights_of(p.lora); }

struct Outputs {
  std::vector<float> out, dx, dw;
  std::array<LoraBuf, 6> grads;
  int ctx_tokens = -1;
  size_t ctx_bytes = 0;
};

// Forward (train) into o.out, then the SftGrad for the backward into o's buffers.
LoraContext forward_into(LoraMoe& m, Problem& p, Outputs& o) {
  o.out = p.out0;
  LoraContext ctx = m.forward(input_of(p, o.out.data()), lora_of(p), true);
  o.ctx_tokens = ctx.tokens();
  o.ctx_bytes = ctx.bytes();
  return ctx;
}
void backward_into(LoraMoe& m, Problem& p, LoraContext& ctx, Outputs& o) {
  const Case& c = p.c;
  if (c.want_dx) o.dx = p.dx0;
  if (c.want_dw) o.dw.assign(size_t(c.tokens) * c.top_k, 999.f);
  o.grads = p.grad0;
  SftGrad g;
  if (c.bf16_dout) g.d_out_bf16 = p.dout_b.data();
  else g.d_out = p.dout.data();
  g.d_x = c.want_dx ? o.dx.data() : nullptr;
  g.accumulate_x = c.accumulate_x;
  g.d_weights = c.want_dw ? o.dw.data() : nullptr;
  if (!c.null_lora) g.grads = weights_of(o.grads, c.skip_grad);
  m.backward(ctx, lora_of(p), g);
}
Outputs run(LoraMoe& m, Problem& p) {
  Outputs o;
  LoraContext ctx = forward_into(m, p, o);
  EXPECT_TRUE(ctx.valid());
  backward_into(m, p, ctx, o);
  EXPECT_FALSE(ctx.valid());
  return o;
}

// The layer's base weights as packed, and its slices, for the reference.
struct Base {
  std::vector<std::array<std::vector<float>, 3>> deq;
  std::vector<int> slices;
};
Base base_of(const LoraMoe& m) {
  Base b;
  for (int e = 0; e < m.shape().experts; ++e) b.deq.push_back(m.dequantized(e));
  for (int s = 0; s < const_cast<LoraMoe&>(m).pool().subpools(); ++s) {
    if (s == 0) b.slices.push_back(m.slice(0).first);
    b.slices.push_back(m.slice(s).second);
  }
  return b;
}

// ---- the fp64 reference ----------------------------------------------------------------

struct Ref {
  std::vector<double> out, out_tol, out_layer;  // out includes out0 when accumulating
  std::vector<double> dx, dx_tol, dx_layer;
  std::vector<double> dw, dw_tol;
  double out_var = 0, dx_var = 0;  // predicted sums of squared errors (rounding model)
  std::array<std::vector<double>, 6> grad, grad_tol;  // dense [E][rows][cols], initial values included
  std::vector<int> pairs;                             // (token, slot) pairs per expert
};

// bf16_terms = false leaves out the bounds of the bf16 roundings the reference does not
// mimic (the fp32-only part of each bound).
Ref reference(const Problem& p, const Base& b, bool bf16_terms = true) {
  const Case& c = p.c;
  const int E = c.experts, H = c.hidden, I = c.inter, R = c.rank, T = c.tokens, K = c.top_k;
  const double s = c.null_lora ? 0.0 : scaling_of(c);
  const double ub = bf16_terms ? kUbf : 0.0;
  const bool quant = c.fmt.format != WeightFormat::bf16;
  const int S = int(b.slices.size()) - 1;

  std::vector<double> x(size_t(T) * H), xq(x.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = bf16_to_fp32(p.xb[i]);
  if (quant) {
    const int kpad = (H + 63) / 64 * 64;
    std::vector<int8_t> q(size_t(T) * kpad);
    std::vector<float> sc(T);
    std::vector<int32_t> sums(T);
    quantize_activations(p.xb.data(), T, H, H, kpad, kpad, q.data(), sc.data(), sums.data());
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < H; ++j) xq[size_t(t) * H + j] = double(sc[t]) * q[size_t(t) * kpad + j];
  } else {
    xq = x;
  }
  std::vector<double> dof(size_t(T) * H), dob(dof.size());
  for (size_t i = 0; i < dof.size(); ++i) {
    const float f = c.bf16_dout ? bf16_to_fp32(p.dout_b[i]) : p.dout[i];
    dof[i] = f;
    dob[i] = bf16_to_fp32(fp32_to_bf16(f));
  }
  std::array<std::vector<double>, 6> L;
  std::array<int, 6> rows{}, cols{};
  for (int m = 0; m < 6; ++m) {
    std::tie(rows[m], cols[m]) = mat_dims(m, H, I, R);
    L[m].assign(size_t(E) * rows[m] * cols[m], 0.0);
    if (!c.null_lora)
      for (int e = 0; e < E; ++e)
        for (int i = 0; i < rows[m]; ++i)
          for (int j = 0; j < cols[m]; ++j) L[m][(size_t(e) * rows[m] + i) * cols[m] + j] = p.lora[m].at(e, i, j);
  }
  // The backward's base weights: bf16 of the dequantized ones.
  std::vector<std::array<std::vector<float>, 3>> wb(E);
  for (int e = 0; e < E; ++e)
    for (int q = 0; q < 3; ++q) {
      wb[e][q] = b.deq[e][q];
      for (auto& v : wb[e][q]) v = bf16_to_fp32(fp32_to_bf16(v));
    }
  std::vector<int> slice_of(I);
  for (int sp = 0; sp < S; ++sp)
    for (int j = b.slices[sp]; j < b.slices[sp + 1]; ++j) slice_of[j] = sp;

  Ref r;
  r.out_layer.assign(size_t(T) * H, 0);
  r.out_tol = r.out_layer;
  r.dx_layer = r.out_layer;
  r.dx_tol = r.out_layer;
  std::vector<double> out_mag(r.out_layer.size(), 0), dx_mag(r.out_layer.size(), 0);
  r.dw.assign(size_t(T) * K, 0);
  r.dw_tol = r.dw;
  r.pairs.assign(E, 0);
  std::array<std::vector<double>, 6> gsum, gmag, gerr;
  for (int m = 0; m < 6; ++m) gsum[m].assign(L[m].size(), 0), gmag[m] = gsum[m], gerr[m] = gsum[m];

  // Work arrays as raw pointers, and std::fabs (a builtin) rather than std::abs: the
  // sanitizer builds are unoptimized, where every vector index or abs is a call.
  std::vector<double> work(size_t(12) * R + size_t(35) * I + size_t(7) * H);
  double* next = work.data();
  auto take = [&](int n) {
    double* q = next;
    next += n;
    return q;
  };
  double *Pg = take(R), *Pu = take(R), *EPg = take(R), *EPu = take(R), *Pd = take(R), *EPd = take(R), *Q = take(R),
         *EQ = take(R), *Rg = take(R), *Ru = take(R), *ERg = take(R), *ERu = take(R);
  double *g = take(I), *up = take(I), *Eg = take(I), *Eu = take(I), *sig = take(I), *sil = take(I), *d1 = take(I),
         *h = take(I), *Eh = take(I), *hbnd = take(I), *hvar = take(I), *step = take(I);
  double *dhb = take(I), *mdhb = take(I), *lq = take(I), *mlq = take(I), *elq = take(I), *dhu = take(I), *Edhu = take(I),
         *dg = take(I), *du = take(I), *Edg = take(I), *Edu = take(I);
  double *bdg = take(I), *bdu = take(I), *vdg = take(I), *vdu = take(I);
  // The clamped SwiGLU (c.act): u' + c, the clamps' derivatives (1 where they pass), the
  // activation's g-derivative from below the limit (for bounds), and whether the layer's
  // pre-activation may sit on the other side of a clamp (within twice its error bound).
  double *upc = take(I), *du1 = take(I), *d1l = take(I), *flip = take(I);
  const bool clamped = !c.act.plain();
  const double A = c.act.alpha, Lim = c.act.limit, C = c.act.up_offset;
  double *dxb = take(H), *mdxb = take(H), *edxb = take(H), *vx = take(H), *lx = take(H), *mlx = take(H), *elx = take(H);
  double *out_layer = r.out_layer.data(), *out_tol = r.out_tol.data(), *dx_layer = r.dx_layer.data(),
         *dx_tol = r.dx_tol.data();

  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      const int e = p.ids[size_t(t) * K + k];
      if (e < 0) continue;  // dw = 0 exactly
      ++r.pairs[e];
      const double w = p.wts[size_t(t) * K + k];
      const float *G = b.deq[e][0].data(), *U = b.deq[e][1].data(), *D = b.deq[e][2].data();
      const float *Gb = wb[e][0].data(), *Ub = wb[e][1].data(), *Db = wb[e][2].data();
      const double* Ag = &L[AG][size_t(e) * R * H];
      const double* Bg = &L[BG][size_t(e) * I * R];
      const double* Au = &L[AU][size_t(e) * R * H];
      const double* Bu = &L[BU][size_t(e) * I * R];
      const double* Ad = &L[AD][size_t(e) * R * I];
      const double* Bd = &L[BD][size_t(e) * H * R];
      const double* xt = &x[size_t(t) * H];
      const double* xqt = &xq[size_t(t) * H];
      // ---- forward
      for (int a = 0; a < R; ++a) {
        double pg = 0, mg = 0, pu = 0, mu = 0;
        for (int j = 0; j < H; ++j) {
          const double tg = xt[j] * Ag[size_t(a) * H + j], tu = xt[j] * Au[size_t(a) * H + j];
          pg += tg, mg += std::fabs(tg), pu += tu, mu += std::fabs(tu);
        }
        Pg[a] = pg, EPg[a] = gam(H) * mg, Pu[a] = pu, EPu[a] = gam(H) * mu;
      }
      for (int i = 0; i < I; ++i) {
        double bg = 0, mbg = 0, bu = 0, mbu = 0;
        const float *gi = G + size_t(i) * H, *ui = U + size_t(i) * H;
        for (int j = 0; j < H; ++j) {
          const double tg = xqt[j] * gi[j], tu = xqt[j] * ui[j];
          bg += tg, mbg += std::fabs(tg), bu += tu, mbu += std::fabs(tu);
        }
        double lg = 0, mlg = 0, elg = 0, lu = 0, mlu = 0, elu = 0;
        for (int a = 0; a < R; ++a) {
          const double bgv = Bg[size_t(i) * R + a], buv = Bu[size_t(i) * R + a];
          lg += Pg[a] * bgv, mlg += std::fabs(Pg[a] * bgv), elg += std::fabs(bgv) * EPg[a];
          lu += Pu[a] * buv, mlu += std::fabs(Pu[a] * buv), elu += std::fabs(buv) * EPu[a];
        }
        g[i] = bg + s * lg, Eg[i] = gam(H + R) * (mbg + s * mlg) + s * elg;
        up[i] = bu + s * lu, Eu[i] = gam(H + R) * (mbu + s * mlu) + s * elu;
        if (c.bias) {  // one more fp32 addition each
          g[i] += p.gb[e][i], Eg[i] += kU32 * (std::fabs(g[i]) + Eg[i]);
          up[i] += p.ub[e][i], Eu[i] += kU32 * (std::fabs(up[i]) + Eu[i]);
        }
        if (!clamped) {
          sig[i] = 1 / (1 + std::exp(-g[i]));
          sil[i] = g[i] * sig[i];
          d1[i] = sig[i] * (1 + g[i] * (1 - sig[i]));  // silu'
          d1l[i] = d1[i], upc[i] = up[i], du1[i] = 1, flip[i] = 0;
        } else {  // h = g' sigmoid(A g') (u' + C), g' = min(g, Lim), u' = clamp(u, -Lim, Lim)
          const double gc = std::min(g[i], Lim);
          sig[i] = 1 / (1 + std::exp(-A * gc));
          sil[i] = gc * sig[i];
          d1l[i] = sig[i] * (1 + A * gc * (1 - sig[i]));
          d1[i] = g[i] <= Lim ? d1l[i] : 0;
          du1[i] = std::fabs(up[i]) <= Lim ? 1 : 0;
          upc[i] = std::min(std::max(up[i], -Lim), Lim) + C;
          flip[i] = (std::fabs(g[i] - Lim) <= 2 * Eg[i] ? 1 : 0) + (std::fabs(std::fabs(up[i]) - Lim) <= 2 * Eu[i] ? 2 : 0);
        }
        h[i] = sil[i] * upc[i];
        Eh[i] = std::fabs(upc[i] * d1l[i]) * Eg[i] + std::fabs(sil[i]) * Eu[i] + kEvalRel * std::fabs(h[i]);
      }
      // h for the base down product: bf16, and for integer bases quantized per slice.
      std::vector<double> hmax(S, 0);
      for (int i = 0; i < I; ++i) hmax[slice_of[i]] = std::max(hmax[slice_of[i]], (std::fabs(h[i]) + Eh[i]) * (1 + 1.0 / 128));
      for (int i = 0; i < I; ++i) {
        step[i] = quant && bf16_terms ? hmax[slice_of[i]] / 127 : 0;
        hbnd[i] = Eh[i] + ub * std::fabs(h[i]) + step[i] / 2;
        const double ul = bf16_ulp(h[i]);
        hvar[i] = (ul * ul + step[i] * step[i]) / 12;
      }
      for (int a = 0; a < R; ++a) {
        double pd = 0, m = 0, er = 0;
        for (int i = 0; i < I; ++i) {
          const double av = Ad[size_t(a) * I + i];
          pd += h[i] * av, m += std::fabs(h[i] * av), er += std::fabs(av) * Eh[i];
        }
        Pd[a] = pd, EPd[a] = gam(I) * m + er;
      }
      for (int rr = 0; rr < H; ++rr) {
        const float* dr = D + size_t(rr) * I;
        double by = 0, mby = 0, eby = 0, var = 0;
        for (int i = 0; i < I; ++i) {
          const double dv = dr[i];
          by += dv * h[i], mby += std::fabs(dv * h[i]), eby += std::fabs(dv) * hbnd[i], var += dv * dv * hvar[i];
        }
        double ly = 0, mly = 0, ely = 0;
        for (int a = 0; a < R; ++a) {
          const double bv = Bd[size_t(rr) * R + a];
          ly += Pd[a] * bv, mly += std::fabs(Pd[a] * bv), ely += std::fabs(bv) * EPd[a];
        }
        const double bias = c.bias ? p.db[e][rr] : 0.0;
        const double y = by + s * ly + bias, Ey = gam(I + R) * (mby + s * mly + std::fabs(bias)) + eby + s * ely;
        const size_t o = size_t(t) * H + rr;
        out_layer[o] += w * y;
        out_tol[o] += std::fabs(w) * Ey;
        out_mag[o] += std::fabs(w * y);
        r.out_var += w * w * var;
      }
      // ---- backward
      const double* dft = &dof[size_t(t) * H];
      const double* dbt = &dob[size_t(t) * H];
      std::fill(Q, Q + R, 0.0);
      std::fill(EQ, EQ + R, 0.0);
      std::fill(dhb, dhb + I, 0.0);
      std::fill(mdhb, mdhb + I, 0.0);
      for (int rr = 0; rr < H; ++rr) {
        for (int a = 0; a < R; ++a) {
          const double tq = dft[rr] * Bd[size_t(rr) * R + a];
          Q[a] += tq, EQ[a] += std::fabs(tq);
        }
        const float* dr = Db + size_t(rr) * I;
        for (int i = 0; i < I; ++i) {
          const double tt = dbt[rr] * dr[i];
          dhb[i] += tt, mdhb[i] += std::fabs(tt);
        }
      }
      for (int a = 0; a < R; ++a) EQ[a] *= gam(H);
      std::fill(lq, lq + I, 0.0);
      std::fill(mlq, mlq + I, 0.0);
      std::fill(elq, elq + I, 0.0);
      for (int a = 0; a < R; ++a)
        for (int i = 0; i < I; ++i) {
          const double av = Ad[size_t(a) * I + i];
          lq[i] += Q[a] * av, mlq[i] += std::fabs(Q[a] * av), elq[i] += std::fabs(av) * EQ[a];
        }
      double dw = 0, mdw = 0, edw = 0;
      for (int i = 0; i < I; ++i) {
        dhu[i] = dhb[i] + s * lq[i];
        Edhu[i] = gam(H + R) * (mdhb[i] + s * mlq[i]) + s * elq[i];
        dw += h[i] * dhu[i], mdw += std::fabs(h[i] * dhu[i]), edw += std::fabs(h[i]) * Edhu[i] + std::fabs(dhu[i]) * Eh[i];
      }
      if (c.bias)  // the down bias is part of the expert's output: b_d . dOut
        for (int rr = 0; rr < H; ++rr) dw += p.db[e][rr] * dft[rr], mdw += std::fabs(p.db[e][rr] * dft[rr]);
      r.dw[size_t(t) * K + k] = dw;
      r.dw_tol[size_t(t) * K + k] = edw + gam(I) * mdw;
      for (int i = 0; i < I; ++i) {
        const double dh = w * dhu[i], Edh = std::fabs(w) * Edhu[i] + kU32 * std::fabs(dh);
        dg[i] = dh * upc[i] * d1[i];
        du[i] = dh * sil[i] * du1[i];
        // (A / 2 bounds the activation's second derivative in g, as 1/2 does silu's.)
        Edg[i] = std::fabs(upc[i] * d1l[i]) * Edh + std::fabs(dh * d1l[i]) * Eu[i] +
                 0.5 * (clamped ? A : 1.0) * std::fabs(dh * upc[i]) * Eg[i] +
                 kEvalRel * std::fabs(dh * upc[i]) * sig[i] * (1 + (clamped ? A : 1.0) * std::fabs(g[i]) * (1 - sig[i]));
        Edu[i] = std::fabs(sil[i]) * Edh + std::fabs(dh * d1l[i]) * Eg[i] + kEvalRel * std::fabs(dh * sil[i]);
        if (int(flip[i]) & 1) Edg[i] += std::fabs(dh * upc[i] * d1l[i]);  // the other branch of the gate's clamp
        if (int(flip[i]) & 2) Edu[i] += std::fabs(dh * sil[i]);            // of the up clamp
        bdg[i] = Edg[i] + ub * std::fabs(dg[i]);
        bdu[i] = Edu[i] + ub * std::fabs(du[i]);
        const double ug = bf16_ulp(dg[i]), uu = bf16_ulp(du[i]);
        vdg[i] = ug * ug / 12, vdu[i] = uu * uu / 12;
      }
      for (int a = 0; a < R; ++a) {
        double rg = 0, mrg = 0, erg = 0, ru = 0, mru = 0, eru = 0;
        for (int i = 0; i < I; ++i) {
          const double bgv = Bg[size_t(i) * R + a], buv = Bu[size_t(i) * R + a];
          rg += dg[i] * bgv, mrg += std::fabs(dg[i] * bgv), erg += std::fabs(bgv) * Edg[i];
          ru += du[i] * buv, mru += std::fabs(du[i] * buv), eru += std::fabs(buv) * Edu[i];
        }
        Rg[a] = rg, ERg[a] = gam(I) * mrg + erg, Ru[a] = ru, ERu[a] = gam(I) * mru + eru;
      }
      if (c.want_dx) {
        for (int j = 0; j < H; ++j) dxb[j] = mdxb[j] = edxb[j] = vx[j] = lx[j] = mlx[j] = elx[j] = 0;
        for (int i = 0; i < I; ++i) {
          const float *gr = Gb + size_t(i) * H, *ur = Ub + size_t(i) * H;
          for (int j = 0; j < H; ++j) {
            const double tg = dg[i] * gr[j], tu = du[i] * ur[j];
            dxb[j] += tg + tu, mdxb[j] += std::fabs(tg) + std::fabs(tu);
            edxb[j] += std::fabs(gr[j]) * bdg[i] + std::fabs(ur[j]) * bdu[i];
            vx[j] += double(gr[j]) * gr[j] * vdg[i] + double(ur[j]) * ur[j] * vdu[i];
          }
        }
        for (int a = 0; a < R; ++a)
          for (int j = 0; j < H; ++j) {
            const double ag = Ag[size_t(a) * H + j], au = Au[size_t(a) * H + j];
            lx[j] += Rg[a] * ag + Ru[a] * au, mlx[j] += std::fabs(Rg[a] * ag) + std::fabs(Ru[a] * au);
            elx[j] += std::fabs(ag) * ERg[a] + std::fabs(au) * ERu[a];
          }
        for (int j = 0; j < H; ++j) {
          const double v = dxb[j] + s * lx[j];
          const size_t o = size_t(t) * H + j;
          dx_layer[o] += v;
          dx_tol[o] += gam(2 * I + 2 * R) * (mdxb[j] + s * mlx[j]) + edxb[j] + s * elx[j];
          dx_mag[o] += std::fabs(v);
          r.dx_var += vx[j];
        }
      }
      // ---- LoRA gradients of expert e
      double *gs[6], *gm[6], *ge[6];
      for (int m = 0; m < 6; ++m) {
        const size_t off = size_t(e) * rows[m] * cols[m];
        gs[m] = gsum[m].data() + off, gm[m] = gmag[m].data() + off, ge[m] = gerr[m].data() + off;
      }
      for (int rr = 0; rr < H; ++rr)
        for (int a = 0; a < R; ++a) {
          const size_t at = size_t(rr) * R + a;
          const double v = s * w * dft[rr] * Pd[a];
          gs[BD][at] += v, gm[BD][at] += std::fabs(v), ge[BD][at] += s * std::fabs(w * dft[rr]) * EPd[a];
        }
      for (int a = 0; a < R; ++a)
        for (int i = 0; i < I; ++i) {
          const size_t at = size_t(a) * I + i;
          const double v = s * w * Q[a] * h[i];
          gs[AD][at] += v, gm[AD][at] += std::fabs(v);
          ge[AD][at] += s * std::fabs(w) * (std::fabs(Q[a]) * Eh[i] + std::fabs(h[i]) * EQ[a]);
        }
      for (int i = 0; i < I; ++i)
        for (int a = 0; a < R; ++a) {
          const size_t at = size_t(i) * R + a;
          const double vg = s * dg[i] * Pg[a], vu = s * du[i] * Pu[a];
          gs[BG][at] += vg, gm[BG][at] += std::fabs(vg), ge[BG][at] += s * (std::fabs(dg[i]) * EPg[a] + std::fabs(Pg[a]) * Edg[i]);
          gs[BU][at] += vu, gm[BU][at] += std::fabs(vu), ge[BU][at] += s * (std::fabs(du[i]) * EPu[a] + std::fabs(Pu[a]) * Edu[i]);
        }
      for (int a = 0; a < R; ++a)
        for (int j = 0; j < H; ++j) {
          const size_t at = size_t(a) * H + j;
          const double vg = s * Rg[a] * xt[j], vu = s * Ru[a] * xt[j];
          gs[AG][at] += vg, gm[AG][at] += std::fabs(vg), ge[AG][at] += s * std::fabs(xt[j]) * ERg[a];
          gs[AU][at] += vu, gm[AU][at] += std::fabs(vu), ge[AU][at] += s * std::fabs(xt[j]) * ERu[a];
        }
    }

  r.out.resize(r.out_layer.size());
  r.dx.resize(r.out_layer.size());
  for (size_t o = 0; o < r.out.size(); ++o) {
    const double o0 = c.accumulate ? p.out0[o] : 0.0, x0 = c.accumulate_x ? p.dx0[o] : 0.0;
    r.out[o] = o0 + r.out_layer[o];
    r.out_tol[o] += gam(K) * (out_mag[o] + std::fabs(o0));
    r.dx[o] = x0 + r.dx_layer[o];
    r.dx_tol[o] += gam(2 * K) * (dx_mag[o] + std::fabs(x0));
  }
  for (int m = 0; m < 6; ++m) {
    r.grad[m].resize(L[m].size());
    r.grad_tol[m].resize(L[m].size());
    for (int e = 0; e < E; ++e)
      for (int i = 0; i < rows[m]; ++i)
        for (int j = 0; j < cols[m]; ++j) {
          const size_t at = (size_t(e) * rows[m] + i) * cols[m] + j;
          const double init = p.grad0[m].at(e, i, j);
          r.grad[m][at] = init + gsum[m][at];
          r.grad_tol[m][at] = gerr[m][at] + gam(r.pairs[e]) * (gmag[m][at] + std::fabs(init));
        }
  }
  return r;
}

// ---- comparisons ------------------------------------------------------------------------

// |got - want| <= tol for every element; a failure names the count, the first few and the
// worst (error / bound). Returns the largest error / bound ratio.
double expect_within(const std::string& what, const std::vector<float>& got, const std::vector<double>& want,
                     const std::vector<double>& tol, const std::function<std::string(size_t)>& where) {
  EXPECT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, worst_i = 0;
  double worst = 0;
  std::ostringstream first;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    const double err = std::abs(double(got[i]) - want[i]);
    const double ratio = err == 0 ? 0 : tol[i] > 0 ? err / tol[i] : INFINITY;
    if (!(err <= tol[i])) {
      if (++bad <= 3)
        first << "\n  " << what << where(i) << " = " << got[i] << ", reference " << want[i] << ", |error| " << err
              << " > bound " << tol[i];
    }
    if (!(ratio <= worst)) worst = std::isnan(ratio) ? INFINITY : ratio, worst_i = i;
  }
  if (bad)
    ADD_FAILURE() << what << ": " << bad << " of " << got.size() << " elements outside their bound" << first.str()
                  << "\n  worst: " << what << where(worst_i) << " = " << got[worst_i] << ", reference " << want[worst_i]
                  << ", bound " << tol[worst_i] << " (ratio " << worst << ")";
  if (verbose()) std::printf("  %-10s max |error| / bound = %.3g\n", what.c_str(), worst);
  return worst;
}

// The relative L2 error against what the rounding model predicts: var is the predicted
// sum of squared errors of the unmimicked bf16 roundings; 2^-20 allows the fp32 noise.
// Quantities with no unmimicked bf16 rounding (var = 0: d_weights, the LoRA gradients)
// instead get kFp32Rel (see the top).
constexpr double kFp32Rel = 0x1p-14;
void expect_rms(const std::string& what, const std::vector<float>& got, const std::vector<double>& want,
                const std::vector<double>& layer, double var) {
  double err2 = 0, ref2 = 0;
  for (size_t i = 0; i < got.size(); ++i) err2 += (got[i] - want[i]) * (got[i] - want[i]), ref2 += layer[i] * layer[i];
  if (ref2 == 0) return;
  const double rel = std::sqrt(err2 / ref2), pred = std::sqrt(var / ref2);
  const double limit = var > 0 ? 2 * pred + 0x1p-20 : kFp32Rel;
  EXPECT_LE(rel, limit) << what << ": relative L2 error " << rel << ", limit " << limit << " (rounding model " << pred << ")";
  if (verbose()) std::printf("  %-10s relative L2 %.3g, model %.3g\n", what.c_str(), rel, pred);
}

std::function<std::string(size_t)> at2(int cols) {
  return [cols](size_t i) { return "[" + std::to_string(i / cols) + ", " + std::to_string(i % cols) + "]"; };
}

// The gradient of matrix m read through its layout, dense [E][rows][cols].
std::vector<float> dense_of(const LoraBuf& b) {
  std::vector<float> v(size_t(b.experts) * b.rows * b.cols);
  for (int e = 0; e < b.experts; ++e)
    for (int i = 0; i < b.rows; ++i)
      for (int j = 0; j < b.cols; ++j) v[(size_t(e) * b.rows + i) * b.cols + j] = b.at(e, i, j);
  return v;
}

void check_outputs(const Problem& p, const Outputs& o, const Ref& r) {
  const Case& c = p.c;
  expect_within("out", o.out, r.out, r.out_tol, at2(c.hidden));
  expect_rms("out", o.out, r.out, r.out_layer, r.out_var);
  if (c.want_dx) {
    expect_within("d_x", o.dx, r.dx, r.dx_tol, at2(c.hidden));
    expect_rms("d_x", o.dx, r.dx, r.dx_layer, r.dx_var);
  }
  if (c.want_dw) {
    expect_within("d_weights", o.dw, r.dw, r.dw_tol, at2(c.top_k));
    expect_rms("d_weights", o.dw, r.dw, r.dw, 0);
  }
  for (int m = 0; m < 6; ++m) {
    const LoraBuf &got = o.grads[m], &init = p.grad0[m];
    if (c.null_lora || m == c.skip_grad) {  // not wanted: untouched
      EXPECT_EQ(0, std::memcmp(got.buf.data(), init.buf.data(), init.buf.size() * sizeof(float)))
          << "d" << mat_name(m) << " was not asked for but changed";
      continue;
    }
    const int rows = got.rows, cols = got.cols;
    auto where = [&](size_t i) {
      return "[expert " + std::to_string(i / (size_t(rows) * cols)) + ", " + std::to_string(i / cols % rows) + ", " +
             std::to_string(i % cols) + "]";
    };
    expect_within(std::string("d") + mat_name(m), dense_of(got), r.grad[m], r.grad_tol[m], where);
    {
      std::vector<double> added = r.grad[m];
      const std::vector<float> init_d = dense_of(init);
      for (size_t i = 0; i < added.size(); ++i) added[i] -= init_d[i];
      expect_rms(std::string("d") + mat_name(m), dense_of(got), r.grad[m], added, 0);
    }
    // Experts without tokens get nothing added (exactly), and elements outside the layout
    // (gaps of strided buffers) stay as they were.
    for (int e = 0; e < c.experts; ++e)
      if (r.pairs[e] == 0)
        for (int i = 0; i < rows; ++i)
          for (int j = 0; j < cols; ++j)
            if (std::memcmp(&got.buf[got.index(e, i, j)], &init.buf[init.index(e, i, j)], sizeof(float)) != 0) {
              ADD_FAILURE() << "d" << mat_name(m) << " of expert " << e << " (no tokens) changed at [" << i << ", " << j
                            << "]: " << init.at(e, i, j) << " -> " << got.at(e, i, j);
              i = rows, j = cols;
            }
    const auto reached = got.reached();
    for (size_t i = 0; i < reached.size(); ++i)
      if (!reached[i] && std::memcmp(&got.buf[i], &init.buf[i], sizeof(float)) != 0) {
        ADD_FAILURE() << "d" << mat_name(m) << " (" << layout_name(got.layout) << "): element " << i
                      << " outside the layout changed";
        break;
      }
  }
}

void check_case(const Case& c, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << describe(c) << " seed " << seed);
  if (verbose()) std::printf("case %s seed %llu\n", describe(c).c_str(), (unsigned long long)seed);
  Problem p = make_problem(c, seed);
  TestLayer layer(p, c.subpools);
  const Outputs o = run(*layer.moe, p);
  EXPECT_EQ(o.ctx_tokens, c.tokens);
  check_outputs(p, o, reference(p, base_of(*layer.moe)));
}

// ---- 1. forward and every gradient vs the reference over random configs ----------------

Case random_case(std::mt19937_64& rng, int i) {
  auto pick = [&](auto... v) {
    const int vals[] = {v...};
    return vals[std::uniform_int_distribution<int>(0, sizeof...(v) - 1)(rng)];
  };
  auto coin = [&] { return (rng() & 1) != 0; };
  Case c;
  const PackOptions formats[] = {{WeightFormat::bf16}, {WeightFormat::int8}, {WeightFormat::int4, 32, false},
                                 {WeightFormat::bf16}, {WeightFormat::int8}, {WeightFormat::int4, 32, true}};
  c.fmt = formats[i % 6];
  const bool int4 = c.fmt.format == WeightFormat::int4;
  c.rank = pick(1, 8, 16, 64);
  c.experts = pick(1, 2, 5, 16, 64);
  c.hidden = int4 ? pick(64, 96, 128, 160, 256) : pick(64, 96, 128, 200, 256);
  c.inter = int4 ? pick(64, 96, 160, 224, 320) : pick(64, 100, 136, 192, 320);
  c.top_k = std::uniform_int_distribution<int>(1, std::min(8, c.experts))(rng);
  c.tokens = pick(1, 3, 17, 64, 300);
  // Keep the fp64 reference (and sanitizer builds) cheap: the layer's memory and the
  // reference's work (pairs x hidden x inter) bounded.
  while (int64_t(c.experts) * c.hidden * c.inter > 64 * 128 * 128) (c.hidden > c.inter ? c.hidden : c.inter) /= 2;
  if (int4) c.hidden = std::max(64, c.hidden / 32 * 32), c.inter = std::max(64, c.inter / 32 * 32);
  while (int64_t(c.tokens) * c.top_k * c.hidden * c.inter > 3'000'000 && c.tokens > 1) c.tokens /= 2;
  c.subpools = 1 + i % 2;
  c.alpha = float(pick(4, 16, 32));
  c.rslora = coin();
  c.fp32_x = coin();
  c.bf16_dout = coin();
  c.i64 = i % 4 == 3;
  c.accumulate = coin();
  c.accumulate_x = coin();
  c.want_dx = i % 7 != 3;
  c.want_dw = i % 7 != 5;
  c.skip_grad = i % 5 == 4 ? i % 6 : -1;
  c.mixed_layouts = i % 4 == 2;
  return c;
}

TEST(LoraReference, ForwardAndEveryGradientOverRandomConfigs) {
  const uint64_t seed = test::test_seed();
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 20; ++i) {
    const Case c = random_case(rng, i);
    check_case(c, seed + 100 + i);
    if (HasFailure()) break;  // one case's report is enough to start with
  }
}

// A clamped SwiGLU (DeepSeek-V4's form: alpha 1, u + 0; gpt-oss's without biases: alpha
// 1.702, u + 1) with a limit that binds for a sizable share of the pre-activations.
TEST(LoraReference, ClampedSwigluForwardAndEveryGradient) {
  const uint64_t seed = test::test_seed();
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 6; ++i) {
    Case c = random_case(rng, i);
    c.act = i % 2 ? GateAct{GateAct::Kind::clamped, 1.702f, 0.5f, 1.0f} : GateAct{GateAct::Kind::clamped, 1.0f, 0.5f, 0.0f};
    check_case(c, seed + 300 + i);
    if (HasFailure()) break;
  }
}

// Experts with biases on gate, up and down (gpt-oss's), plain and clamped: the biases
// move the pre-activations (so every derivative) and the outputs (so d_weights).
TEST(LoraReference, BiasesForwardAndEveryGradient) {
  const uint64_t seed = test::test_seed();
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 6; ++i) {
    Case c = random_case(rng, i);
    c.bias = true;
    if (i % 3) c.act = GateAct{GateAct::Kind::clamped, 1.702f, i % 3 == 1 ? 0.5f : 7.0f, 1.0f};
    check_case(c, seed + 400 + i);
    if (HasFailure()) break;
  }
}

// Every token on one expert (all slots, so the expert appears twice per token), the
// others unused: their gradients stay exactly at the initial values.
TEST(LoraReference, AllTokensOnOneExpert) {
  const uint64_t seed = test::test_seed();
  // 400 rows on one expert: two row blocks, each put into tile order by its own item.
  for (const PackOptions fmt : {PackOptions{WeightFormat::bf16}, PackOptions{WeightFormat::int8},
                                PackOptions{WeightFormat::int4, 32, false}}) {
    Case c;
    c.experts = 16, c.hidden = 128, c.inter = 96, c.top_k = 2, c.tokens = 200, c.rank = 16;
    c.fmt = fmt;
    c.subpools = 2;
    c.one_expert = true, c.one_expert_id = 5;
    c.accumulate = true, c.accumulate_x = true, c.fp32_x = true;
    check_case(c, seed + 7);
  }
}

// The layer runs the level it is given (the training path passes the config's cpu.isa,
// lowered by TANDEM_ISA) in every product, forward and backward; its default follows
// TANDEM_ISA.
TEST(LoraReference, EveryKernelLevelThisCpuHas) {
  const uint64_t seed = test::test_seed();
  for (IsaLevel level : all_isa_levels()) {
    if (level > hardware_isa()) continue;
    for (const PackOptions fmt : {PackOptions{WeightFormat::bf16}, PackOptions{WeightFormat::int8}}) {
      Case c;
      c.experts = 4, c.hidden = 128, c.inter = 96, c.top_k = 2, c.tokens = 24, c.rank = 8;
      c.fmt = fmt;
      c.isa = static_cast<int>(level);
      SCOPED_TRACE(std::string(isa_name(level)) + " " + std::string(format_name(fmt.format)));
      Problem p = make_problem(c, seed + 3);
      TestLayer layer(p, 1);
      EXPECT_EQ(layer.moe->isa(), level);
      check_outputs(p, run(*layer.moe, p), reference(p, base_of(*layer.moe)));
    }
    test::ScopedEnv env("TANDEM_ISA", std::string(isa_name(level)).c_str());
    Case c;
    Problem p = make_problem(c, seed);
    EXPECT_EQ(TestLayer(p, 1).moe->isa(), level);
  }
}

// The base alone: every LoRA pointer null (s = 0), d_x and d_weights still flow.
TEST(LoraReference, NullLoraRunsTheBaseAlone) {
  Case c;
  c.experts = 5, c.hidden = 128, c.inter = 192, c.top_k = 3, c.tokens = 40, c.rank = 8;
  c.fmt = {WeightFormat::int8};
  c.subpools = 2;
  c.null_lora = true;
  check_case(c, test::test_seed() + 11);
}

// LoRA weights are read through their pointers on every call: an in-place update (an
// optimizer step) is what the next forward and backward see.
TEST(LoraReference, InPlaceUpdatesAreSeenByTheNextCall) {
  Case c;
  c.experts = 4, c.hidden = 64, c.inter = 128, c.top_k = 2, c.tokens = 30, c.rank = 8;
  c.fmt = {WeightFormat::int4, 32, true};
  c.subpools = 2;
  const uint64_t seed = test::test_seed() + 13;
  Problem p = make_problem(c, seed);
  TestLayer layer(p, c.subpools);
  check_outputs(p, run(*layer.moe, p), reference(p, base_of(*layer.moe)));
  std::mt19937_64 rng(seed + 1);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& b : p.lora)
    for (int e = 0; e < b.experts; ++e)
      for (int i = 0; i < b.rows; ++i)
        for (int j = 0; j < b.cols; ++j) b.at(e, i, j) -= 0.5f * b.at(e, i, j) + 0.1f * nd(rng) * std::abs(b.at(e, i, j));
  check_outputs(p, run(*layer.moe, p), reference(p, base_of(*layer.moe)));
}

// ---- 2. one vs two subpools ---------------------------------------------------------------

TEST(LoraSubpools, OneAndTwoSubpoolsAgree) {
  const uint64_t seed = test::test_seed();
  for (const PackOptions fmt : {PackOptions{WeightFormat::bf16}, PackOptions{WeightFormat::int8}, PackOptions{WeightFormat::int4, 32, false}}) {
    Case c;
    c.experts = 6, c.hidden = 128, c.inter = 192, c.top_k = 3, c.tokens = 50, c.rank = 8;
    c.fmt = fmt;
    c.bf16_dout = true;
    SCOPED_TRACE(describe(c));
    Problem p = make_problem(c, seed + 21);
    TestLayer l1(p, 1), l2(p, 2);
    ASSERT_EQ(l2.moe->slice(0).second, 64);  // the slices [0, 64), [64, 192)
    const Outputs o1 = run(*l1.moe, p), o2 = run(*l2.moe, p);
    const Ref r1 = reference(p, base_of(*l1.moe)), r2 = reference(p, base_of(*l2.moe));
    check_outputs(p, o1, r1);
    check_outputs(p, o2, r2);
    // Directly: each lies within its bound of its own reference, and the two references
    // differ exactly by what the bases differ by (bf16: nothing; int8 / int4: down is
    // quantized per row of each slice, so its scales, and the dequantized weights, differ).
    const Base b1 = base_of(*l1.moe), b2 = base_of(*l2.moe);
    if (fmt.format == WeightFormat::bf16)
      for (int e = 0; e < c.experts; ++e) ASSERT_EQ(b1.deq[e], b2.deq[e]) << "expert " << e;
    auto bound = [](const std::vector<double>& t1, const std::vector<double>& t2, const std::vector<double>& w1,
                    const std::vector<double>& w2) {
      std::vector<double> t(t1.size());
      for (size_t i = 0; i < t.size(); ++i) t[i] = t1[i] + t2[i] + std::abs(w1[i] - w2[i]);
      return t;
    };
    auto as_double = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
    expect_within("out 1 vs 2", o2.out, as_double(o1.out), bound(r1.out_tol, r2.out_tol, r1.out, r2.out), at2(c.hidden));
    expect_within("d_x 1 vs 2", o2.dx, as_double(o1.dx), bound(r1.dx_tol, r2.dx_tol, r1.dx, r2.dx), at2(c.hidden));
    expect_within("d_w 1 vs 2", o2.dw, as_double(o1.dw), bound(r1.dw_tol, r2.dw_tol, r1.dw, r2.dw), at2(c.top_k));
    for (int m = 0; m < 6; ++m)
      expect_within(std::string("d") + mat_name(m) + " 1 vs 2", dense_of(o2.grads[m]), as_double(dense_of(o1.grads[m])),
                    bound(r1.grad_tol[m], r2.grad_tol[m], r1.grad[m], r2.grad[m]), at2(o1.grads[m].cols));
  }
}

// ---- 3. finite differences ------------------------------------------------------------------
//
// L = sum(out * R) in double, R fixed (bf16-exact values, so the layer's bf16(dOut) = R).
// Central differences (L(p + d) - L(p - d)) / (2d) against the analytic gradient (backward
// with d_out = R). Three error sources, each bounded:
//   - the analytic gradient's own rounding: its bound from the reference;
//   - truncation, O(d^2): estimated from the reference model in double (no noise) as
//     |FD_ref(2d) - FD_ref(d)| (three times the Richardson estimate);
//   - the forwards' rounding: L_layer - L_ref at p +- d is known exactly, so the noise it
//     adds to the layer's difference quotient is measured, not guessed.
// The forward rounds h to bf16 before the base down product, which makes L a step
// function of anything h depends on (steps of 2^-8 relative): case (a) therefore zeroes
// the base down weight (h reaches out only through the fp32 LoRA path) and perturbs
// everything; case (b) keeps a random base down and perturbs only what leaves h alone
// (A_down, B_down, the routing weights; L is linear in each). x is rounded to bf16 inside
// the layer, so x holds bf16 values and is perturbed by 2 bf16 ulps (about 1 %): x +- d,
// x +- 2d are exactly representable, the layer sees them unrounded.
struct FdProbe {
  std::string what;
  float* param;
  double analytic, tol;
};

void finite_differences(bool zero_down, uint64_t seed) {
  Case c;
  c.experts = 3, c.hidden = 64, c.inter = 64, c.top_k = 2, c.tokens = 5, c.rank = 4;
  c.fmt = {WeightFormat::bf16};
  c.alpha = 8;
  c.fp32_x = true, c.bf16_exact_x = true;
  c.zero_down = zero_down;
  SCOPED_TRACE(describe(c) + (zero_down ? " base down = 0" : ""));
  Problem p = make_problem(c, seed);
  std::mt19937_64 rng(seed + 1);
  for (size_t i = 0; i < p.dout.size(); ++i) p.dout[i] = bf16_to_fp32(p.dout_b[i]);  // R on the bf16 grid
  for (auto& b : p.grad0) std::fill(b.buf.begin(), b.buf.end(), 0.f);
  TestLayer layer(p, 1);
  const Base base = base_of(*layer.moe);
  const Outputs o = run(*layer.moe, p);
  const Ref r0 = reference(p, base);
  check_outputs(p, o, r0);

  auto loss_layer = [&] {
    std::vector<float> out(p.out0.size());
    LoraContext ctx = layer.moe->forward(input_of(p, out.data()), lora_of(p), false);
    EXPECT_FALSE(ctx.valid());
    double l = 0;
    for (size_t i = 0; i < out.size(); ++i) l += double(out[i]) * p.dout[i];
    return l;
  };
  auto loss_ref = [&] {
    const Ref r = reference(p, base);
    double l = 0;
    for (size_t i = 0; i < r.out.size(); ++i) l += r.out_layer[i] * p.dout[i];
    return l;
  };

  std::vector<FdProbe> probes;
  const bool all = zero_down;
  const int H = c.hidden;
  std::vector<int> used;
  for (int e = 0; e < c.experts; ++e)
    if (r0.pairs[e]) used.push_back(e);
  ASSERT_FALSE(used.empty());
  for (int m = 0; m < 6; ++m) {
    if (!all && m != AD && m != BD) continue;
    LoraBuf& b = p.lora[m];
    for (int n = 0; n < 3; ++n) {
      const int e = used[rng() % used.size()], i = int(rng() % b.rows), j = int(rng() % b.cols);
      const size_t at = (size_t(e) * b.rows + i) * b.cols + j;
      probes.push_back({std::string(mat_name(m)) + "[" + std::to_string(e) + "," + std::to_string(i) + "," + std::to_string(j) + "]",
                        &b.at(e, i, j), dense_of(o.grads[m])[at], r0.grad_tol[m][at]});
    }
  }
  std::vector<size_t> slots;  // routing weights of used slots
  for (size_t i = 0; i < p.wts.size(); ++i)
    if (p.ids[i] >= 0) slots.push_back(i);
  std::shuffle(slots.begin(), slots.end(), rng);
  for (int n = 0; n < 3 && n < int(slots.size()); ++n) {
    const size_t i = slots[n];
    probes.push_back({"w[" + std::to_string(i / c.top_k) + "," + std::to_string(i % c.top_k) + "]", &p.wts[i], o.dw[i], r0.dw_tol[i]});
  }
  if (all)
    for (int n = 0, tries = 0; n < 4 && tries < 1000; ++tries) {  // x: 2 bf16 ulps, within one binade
      const size_t i = rng() % p.xf.size();
      const float v = p.xf[i];
      const int t = int(i / H);
      bool routed = false;
      for (int k = 0; k < c.top_k; ++k) routed |= p.ids[size_t(t) * c.top_k + k] >= 0;
      const double d = 2 * bf16_ulp(v);
      if (!routed || v == 0 || std::ilogb(std::abs(v) - 2 * d) != std::ilogb(v) || std::ilogb(std::abs(v) + 2 * d) != std::ilogb(v))
        continue;
      probes.push_back({"x[" + std::to_string(t) + "," + std::to_string(i % H) + "]", &p.xf[i], o.dx[i], r0.dx_tol[i]});
      ++n;
    }

  double sum_grad = 0, sum_tol = 0;
  for (const FdProbe& pr : probes) {
    const float v0 = *pr.param;
    const bool is_x = pr.what[0] == 'x';
    double rms = 0;  // the step: 2^-6 of the parameter's scale (its matrix's RMS)
    for (const auto& b : p.lora)
      if (pr.param >= b.buf.data() && pr.param < b.buf.data() + b.buf.size()) {
        for (float v : dense_of(b)) rms += double(v) * v;
        rms = std::sqrt(rms / (double(b.experts) * b.rows * b.cols));
      }
    if (pr.what[0] == 'w') rms = 0.25;
    const double d = is_x ? 2 * bf16_ulp(v0) : std::ldexp(rms, -6);
    struct Quot { double layer, ref, noise; };
    auto quotient = [&](double step) {
      *pr.param = float(v0 + step);
      const double pp = *pr.param;
      if (is_x) p.xb[pr.param - p.xf.data()] = fp32_to_bf16(*pr.param);
      const double lp = loss_layer(), rp = loss_ref();
      *pr.param = float(v0 - step);
      const double pm = *pr.param;
      if (is_x) p.xb[pr.param - p.xf.data()] = fp32_to_bf16(*pr.param);
      const double lm = loss_layer(), rm = loss_ref();
      *pr.param = v0;
      if (is_x) p.xb[pr.param - p.xf.data()] = fp32_to_bf16(v0);
      return Quot{(lp - lm) / (pp - pm), (rp - rm) / (pp - pm), ((lp - rp) - (lm - rm)) / (pp - pm)};
    };
    const Quot q1 = quotient(d), q2 = quotient(2 * d);
    const double trunc = std::abs(q2.ref - q1.ref);
    const double tol = pr.tol + trunc + std::abs(q1.noise);
    EXPECT_LE(std::abs(q1.layer - pr.analytic), tol)
        << pr.what << ": finite difference " << q1.layer << " (reference model " << q1.ref << "), analytic " << pr.analytic
        << "; bounds: analytic " << pr.tol << ", truncation " << trunc << ", forward noise " << std::abs(q1.noise);
    sum_grad += std::abs(pr.analytic), sum_tol += tol;
    if (verbose())
      std::printf("  %-16s fd %.7g analytic %.7g |diff| %.3g tol %.3g (trunc %.3g noise %.3g)\n", pr.what.c_str(), q1.layer,
                  pr.analytic, std::abs(q1.layer - pr.analytic), tol, trunc, std::abs(q1.noise));
  }
  // The probes must be able to fail: derivatives well above the tolerances (on the whole;
  // a single derivative may happen to be near zero).
  EXPECT_GT(sum_grad, 10 * sum_tol) << "finite differences too loose to check anything";
}

TEST(LoraFiniteDifferences, EveryParameterWithoutBaseDown) { finite_differences(true, test::test_seed() + 31); }
TEST(LoraFiniteDifferences, DownAndRoutingWeightsWithBaseDown) { finite_differences(false, test::test_seed() + 37); }

// ---- 4. contexts: recompute (checkpointing) and several in flight ----------------------------

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}
void expect_identical(const Outputs& a, const Outputs& b, const std::string& what) {
  EXPECT_TRUE(same_bits(a.out, b.out)) << what << ": out differs";
  EXPECT_TRUE(same_bits(a.dx, b.dx)) << what << ": d_x differs";
  EXPECT_TRUE(same_bits(a.dw, b.dw)) << what << ": d_weights differs";
  for (int m = 0; m < 6; ++m) EXPECT_TRUE(same_bits(a.grads[m].buf, b.grads[m].buf)) << what << ": d" << mat_name(m) << " differs";
}

TEST(LoraContexts, RecomputedForwardGivesBitwiseIdenticalGradients) {
  Case c;
  c.experts = 8, c.hidden = 128, c.inter = 192, c.top_k = 4, c.tokens = 60, c.rank = 16;
  c.fmt = {WeightFormat::int8};
  c.subpools = 2;
  Problem p = make_problem(c, test::test_seed() + 41);
  TestLayer layer(p, 2);
  Outputs a, b;
  LoraContext ca = forward_into(*layer.moe, p, a);
  LoraContext cb = forward_into(*layer.moe, p, b);  // the recompute forward
  EXPECT_TRUE(same_bits(a.out, b.out));
  backward_into(*layer.moe, p, cb, b);  // the second context first
  backward_into(*layer.moe, p, ca, a);
  expect_identical(a, b, "recompute");
  check_outputs(p, a, reference(p, base_of(*layer.moe)));
}

TEST(LoraContexts, SeveralContextsInFlightInAnyOrder) {
  const uint64_t seed = test::test_seed();
  Case c;
  c.experts = 6, c.hidden = 64, c.inter = 128, c.top_k = 2, c.rank = 8;
  c.fmt = {WeightFormat::bf16};
  c.subpools = 2;
  std::vector<Problem> ps;
  for (int i = 0; i < 3; ++i) {  // micro-batches: different tokens, same layer and LoRA
    Case ci = c;
    ci.tokens = 10 + 7 * i;
    ps.push_back(make_problem(ci, seed + 51 + i));
    ps[i].lora = ps[0].lora;
  }
  TestLayer layer(ps[0], 2);
  // Each alone: forward then backward.
  std::vector<Outputs> alone(3), inflight(3);
  for (int i = 0; i < 3; ++i) alone[i] = run(*layer.moe, ps[i]);
  // All three forwards, then the backwards in the order 2, 0, 1.
  std::vector<LoraContext> ctx;
  for (int i = 0; i < 3; ++i) ctx.push_back(forward_into(*layer.moe, ps[i], inflight[i]));
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(ctx[i].valid());
    EXPECT_EQ(ctx[i].tokens(), ps[i].c.tokens);
  }
  for (int i : {2, 0, 1}) backward_into(*layer.moe, ps[i], ctx[i], inflight[i]);
  for (int i = 0; i < 3; ++i) {
    EXPECT_FALSE(ctx[i].valid());
    expect_identical(alone[i], inflight[i], "micro-batch " + std::to_string(i));
    check_outputs(ps[i], inflight[i], reference(ps[i], base_of(*layer.moe)));
  }
  // A moved context still works.
  Outputs m;
  LoraContext c0 = forward_into(*layer.moe, ps[1], m);
  LoraContext moved = std::move(c0);
  EXPECT_TRUE(moved.valid());
  backward_into(*layer.moe, ps[1], moved, m);
  expect_identical(alone[1], m, "moved context");
}

// The LoRA layers of one pool share one scratch (their tasks run one at a time): layers
// of different shapes and formats, forwards and backwards interleaved, give the bits of
// each on a pool of its own (the backward must need nothing the forward left in it).
TEST(LoraContexts, LayersOfOnePoolShareTheirScratchAndStayExact) {
  const uint64_t seed = test::test_seed();
  Case a;
  a.experts = 4, a.hidden = 128, a.inter = 96, a.top_k = 2, a.tokens = 300, a.rank = 8;  // ~150 rows per expert
  a.fmt = {WeightFormat::bf16};
  a.one_expert = true, a.one_expert_id = 1;  // 600 rows on one expert: three row blocks
  Case b;
  b.experts = 6, b.hidden = 64, b.inter = 128, b.top_k = 3, b.tokens = 40, b.rank = 16;
  b.fmt = {WeightFormat::int8};
  Problem pa = make_problem(a, seed + 71), pb = make_problem(b, seed + 72);
  Outputs alone_a, alone_b;
  {
    TestLayer la(pa, 1), lb(pb, 1);
    alone_a = run(*la.moe, pa);
    alone_b = run(*lb.moe, pb);
  }
  auto pool = make_pool(1);
  auto la = layer_on(*pool, pa, 0), lb = layer_on(*pool, pb, 1);
  Outputs oa, ob;
  LoraContext ca = forward_into(*la, pa, oa);
  LoraContext cb = forward_into(*lb, pb, ob);
  backward_into(*la, pa, ca, oa);
  backward_into(*lb, pb, cb, ob);
  expect_identical(alone_a, oa, "layer a on the shared pool");
  expect_identical(alone_b, ob, "layer b on the shared pool");
  check_outputs(pa, oa, reference(pa, base_of(*la)));
  check_outputs(pb, ob, reference(pb, base_of(*lb)));
}

// ---- 5. strided / transposed layouts ------------------------------------------------------

TEST(LoraLayouts, StridedAndTransposedMatchDense) {
  const uint64_t seed = test::test_seed();
  for (int variant = 0; variant < kLayouts; ++variant) {
    Case c;
    c.experts = 5, c.hidden = 96, c.inter = 128, c.top_k = 2, c.tokens = 24, c.rank = 8;
    c.fmt = variant % 2 ? PackOptions{WeightFormat::int8} : PackOptions{WeightFormat::bf16};
    c.subpools = 1 + variant % 2;
    SCOPED_TRACE(describe(c) + " variant " + std::to_string(variant));
    Problem dense = make_problem(c, seed + 61);
    Problem strided = dense;
    for (int m = 0; m < 6; ++m) {  // the same values, every matrix (and its gradient) in another layout
      const Layout l = Layout((m + variant) % kLayouts), lg = Layout((m + variant + 2) % kLayouts);
      LoraBuf a(c.experts, dense.lora[m].rows, dense.lora[m].cols, l), g(c.experts, a.rows, a.cols, lg);
      std::fill(a.buf.begin(), a.buf.end(), std::nanf(""));
      for (auto& v : g.buf) v = -3.25f;  // gaps: must stay
      for (int e = 0; e < c.experts; ++e)
        for (int i = 0; i < a.rows; ++i)
          for (int j = 0; j < a.cols; ++j) {
            a.at(e, i, j) = dense.lora[m].at(e, i, j);
            g.at(e, i, j) = dense.grad0[m].at(e, i, j);
          }
      strided.lora[m] = std::move(a);
      strided.grad0[m] = std::move(g);
    }
    TestLayer layer(dense, c.subpools);
    const Outputs od = run(*layer.moe, dense), os = run(*layer.moe, strided);
    const Ref r = reference(dense, base_of(*layer.moe));
    check_outputs(dense, od, r);
    check_outputs(strided, os, r);  // also: gaps untouched
    // And directly (the rank-r products may run with other transposition flags, so not
    // necessarily bitwise): both within their bound of the reference.
    auto twice = [](std::vector<double> t) {
      for (auto& v : t) v *= 2;
      return t;
    };
    auto as_double = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
    expect_within("out strided vs dense", os.out, as_double(od.out), twice(r.out_tol), at2(c.hidden));
    expect_within("d_x strided vs dense", os.dx, as_double(od.dx), twice(r.dx_tol), at2(c.hidden));
    for (int m = 0; m < 6; ++m)
      expect_within(std::string("d") + mat_name(m) + " strided vs dense", dense_of(os.grads[m]),
                    as_double(dense_of(od.grads[m])), twice(r.grad_tol[m]), at2(od.grads[m].cols));
  }
}

// ---- 6. bad input ------------------------------------------------------------------------

bool contains(std::string s, std::string part) {  // case-insensitive
  for (auto* v : {&s, &part})
    for (char& ch : *v) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  return s.find(part) != std::string::npos;
}
#define EXPECT_ERROR_HAS(stmt, ...)                                                  \
  do {                                                                               \
    const std::string msg_ = test::error_of([&] { stmt; });                          \
    if (verbose()) std::printf("  error: %s\n", msg_.c_str());                       \
    for (const char* part_ : {__VA_ARGS__}) EXPECT_TRUE(contains(msg_, part_)) << "message: " << msg_ << "\n  lacks: " << part_; \
  } while (0)

TEST(LoraApi, BadInputIsRefusedWithAClearMessage) {
  Case c;
  c.experts = 4, c.hidden = 64, c.inter = 64, c.top_k = 2, c.tokens = 3, c.rank = 8;
  Problem p = make_problem(c, test::test_seed() + 71);
  auto pool = make_pool(2);
  SftOptions o;
  o.lora.rank = 8;
  LoraMoe layer(*pool, {4, 64, 64}, o, 5);
  std::vector<float> out(p.out0.size(), 7.0f);
  const std::vector<float> out_before = out;
  MoeInput in = input_of(p, out.data());
  LoraWeights lw = weights_of(p.lora);

  // Forward before load.
  EXPECT_ERROR_HAS(layer.forward(in, lw), "layer 5", "no weights", "load");
  EXPECT_TRUE(same_bits(out, out_before));
  layer.load([&](int e) {
    return ExpertSource{{p.g[e].data(), SourceType::f32, 64, 64}, {p.u[e].data(), SourceType::f32, 64, 64},
                        {p.d[e].data(), SourceType::f32, 64, 64}};
  });
  // ids out of range.
  p.ids[3] = 4;
  EXPECT_ERROR_HAS(layer.forward(in, lw), "topk_ids[1, 1] = 4", "outside");
  p.ids[3] = -2;
  EXPECT_ERROR_HAS(layer.forward(in, lw), "topk_ids[1, 1] = -2", "outside");
  p.ids[3] = -1;
  EXPECT_TRUE(same_bits(out, out_before));
  // expert_mask.
  std::vector<uint8_t> mask(4, 1);
  in.expert_mask = mask.data();
  EXPECT_ERROR_HAS(layer.forward(in, lw), "expert_mask");
  in.expert_mask = nullptr;
  EXPECT_TRUE(same_bits(out, out_before));
  // A LoRA buffer sized for another rank (4 instead of 8): too small.
  {
    Case c4 = c;
    c4.rank = 4;
    Problem p4 = make_problem(c4, 1);
    LoraWeights bad = lw;
    bad.b_up = p4.lora[BU].matrix();
    EXPECT_ERROR_HAS(layer.forward(in, bad), "b_up", "1024", "2048", "rank 8");
    bad = lw;
    bad.a_down = p4.lora[AD].matrix();
    EXPECT_ERROR_HAS(layer.forward(in, bad), "a_down", "1024", "2048");
    // One for a larger rank (16), dense: its size does not match either.
    Case c16 = c;
    c16.rank = 16;
    Problem p16 = make_problem(c16, 1);
    bad = lw;
    bad.a_gate = p16.lora[AG].matrix();
    EXPECT_ERROR_HAS(layer.forward(in, bad), "a_gate", "4096", "2048");
    // Strided: the last expert's block reaching past the end.
    LoraBuf strided(4, 64, 8, Layout::padded);  // b_gate [inter x r]
    LoraMatrix short_m = strided.matrix();
    short_m.size -= 8;  // the 7 slack elements and one more
    bad = lw;
    bad.b_gate = short_m;
    EXPECT_ERROR_HAS(layer.forward(in, bad), "b_gate", "2827", "2828");
    // Only some of the six (LoRA on gate and up but not down).
    bad = lw;
    bad.a_down = bad.b_down = LoraMatrix{};
    EXPECT_ERROR_HAS(layer.forward(in, bad), "4 of the 6");
    EXPECT_TRUE(same_bits(out, out_before));
  }

  // Backward errors.
  Outputs ok;
  LoraContext ctx = forward_into(layer, p, ok);
  std::vector<float> dx(p.out0.size(), 5.0f), dw(6, 5.0f);
  std::array<LoraBuf, 6> grads = p.grad0;
  const std::array<LoraBuf, 6> grads_before = p.grad0;
  SftGrad g;
  g.d_x = dx.data();
  g.d_weights = dw.data();
  g.grads = weights_of(grads);
  auto untouched = [&] {
    for (float v : dx) if (v != 5.0f) return false;
    for (float v : dw) if (v != 5.0f) return false;
    for (int m = 0; m < 6; ++m) if (!same_bits(grads[m].buf, grads_before[m].buf)) return false;
    return true;
  };
  EXPECT_ERROR_HAS(layer.backward(ctx, lw, g), "d_out");  // null d_out
  EXPECT_TRUE(untouched());
  g.d_out = p.dout.data();
  g.d_out_bf16 = p.dout_b.data();
  EXPECT_ERROR_HAS(layer.backward(ctx, lw, g), "d_out");  // both
  g.d_out_bf16 = nullptr;
  EXPECT_TRUE(untouched());
  {  // a gradient buffer for another rank
    Case c4 = c;
    c4.rank = 4;
    Problem p4 = make_problem(c4, 1);
    SftGrad bad = g;
    bad.grads.b_down = p4.grad0[BD].matrix();
    EXPECT_ERROR_HAS(layer.backward(ctx, lw, bad), "b_down", "1024", "2048");
    EXPECT_TRUE(untouched());
  }
  if (ctx.valid()) {  // (a refused backward may leave the context usable)
    layer.backward(ctx, lw, g);
    EXPECT_FALSE(untouched());
  }
  // The same context again.
  EXPECT_ERROR_HAS(layer.backward(ctx, lw, g), "already used");
  // An empty context.
  LoraContext empty;
  EXPECT_FALSE(empty.valid());
  EXPECT_ERROR_HAS(layer.backward(empty, lw, g), "context", "empty");
  // A context from forward(train = false).
  LoraContext inference = layer.forward(in, lw, false);
  EXPECT_FALSE(inference.valid());
  EXPECT_ERROR_HAS(layer.backward(inference, lw, g), "context", "empty");
  // A context from another layer.
  LoraMoe other(*pool, {4, 64, 64}, o, 6);
  other.load([&](int e) {
    return ExpertSource{{p.g[e].data(), SourceType::f32, 64, 64}, {p.u[e].data(), SourceType::f32, 64, 64},
                        {p.d[e].data(), SourceType::f32, 64, 64}};
  });
  LoraContext foreign = other.forward(in, lw, true);
  EXPECT_ERROR_HAS(layer.backward(foreign, lw, g), "another layer");
  // LoRA given to the forward but not to the backward.
  LoraContext with_lora = layer.forward(in, lw, true);
  EXPECT_ERROR_HAS(layer.backward(with_lora, LoraWeights{}, g), "LoRA", "none");
}

// ---- 7. backward packs, sizes, shapes ---------------------------------------------------

TEST(LoraApi, PrepareBackwardMatchesLazyPacking) {
  for (const PackOptions fmt : {PackOptions{WeightFormat::bf16}, PackOptions{WeightFormat::int4, 32, true}}) {
    Case c;
    c.experts = 4, c.hidden = 96, c.inter = 128, c.top_k = 2, c.tokens = 20, c.rank = 8;
    c.fmt = fmt;
    c.subpools = 2;
    SCOPED_TRACE(describe(c));
    Problem p = make_problem(c, test::test_seed() + 81);
    TestLayer lazy(p, 2), eager(p, 2);
    EXPECT_EQ(lazy.moe->backward_bytes(), 0u);
    EXPECT_FALSE(lazy.moe->backward_ready());
    EXPECT_GT(lazy.moe->packed_bytes(), 0u);
    int calls = 0;
    eager.moe->prepare_backward([&](int, int) { ++calls; });
    EXPECT_TRUE(eager.moe->backward_ready());
    EXPECT_GT(eager.moe->backward_bytes(), 0u);
    EXPECT_GE(calls, 1);
    const Outputs a = run(*lazy.moe, p), b = run(*eager.moe, p);
    EXPECT_TRUE(lazy.moe->backward_ready());
    EXPECT_EQ(lazy.moe->backward_bytes(), eager.moe->backward_bytes());
    expect_identical(a, b, "prepare_backward vs lazy");
    EXPECT_EQ(a.ctx_tokens, c.tokens);
    EXPECT_GT(a.ctx_bytes, 0u);
  }
}

TEST(LoraApi, ShapesScalingAndContextState) {
  auto pool = make_pool(1);
  SftOptions o;
  o.lora.rank = 16;
  o.lora.alpha = 32;
  LoraMoe layer(*pool, {3, 96, 160}, o);
  const auto sh = layer.lora_shapes();
  const std::pair<int, int> want[6] = {{16, 96}, {160, 16}, {16, 96}, {160, 16}, {16, 160}, {96, 16}};
  for (int m = 0; m < 6; ++m) EXPECT_EQ(sh[m], want[m]) << mat_name(m);
  EXPECT_FLOAT_EQ(o.lora.scaling(), 2.0f);
  o.lora.rslora = true;
  EXPECT_FLOAT_EQ(o.lora.scaling(), 8.0f);
  LoraContext empty;
  EXPECT_FALSE(empty.valid());
  EXPECT_EQ(empty.tokens(), 0);
}

}  // namespace
// The training layer's forward and the inference layer's (MoeLayer) are one computation on
// the expert core: for the same weights and input, without an adapter or with a fresh one
// (B = 0, as PEFT initializes it), their outputs are the same bits, in every format, for
// bf16 and fp32 input, one or two subpools, at every kernel level this CPU has.
// Plain experts and a clamped SwiGLU (limit 0.5: about half the pre-activations clamp here),
// each without and with biases (gate and up added before the activation, down in the merge).
TEST(LoraMoe, ForwardIsTheInferenceForwardBitForBit) {
  const uint64_t seed = test::test_seed();
  for (const GateAct act : {GateAct{}, GateAct{GateAct::Kind::clamped, 1.702f, 0.5f, 1.0f}})
  for (const bool bias : {false, true})
  for (IsaLevel level : all_isa_levels()) {
    if (level > hardware_isa()) continue;
    for (const PackOptions fmt : {PackOptions{WeightFormat::bf16}, PackOptions{WeightFormat::int8},
                                  PackOptions{WeightFormat::int4, 32, false}})
      for (const bool fp32_x : {false, true})
        for (const int subpools : {1, 2}) {
          Case c;
          c.experts = 6, c.hidden = 128, c.inter = 160, c.top_k = 3, c.tokens = 40, c.rank = 4;
          c.fmt = fmt, c.fp32_x = fp32_x, c.subpools = subpools, c.isa = static_cast<int>(level), c.act = act;
          c.bias = bias;
          SCOPED_TRACE(std::string(isa_name(level)) + " " + describe(c));
          Problem p = make_problem(c, seed + 11);
          TestLayer train(p, subpools);
          MoeShape shape{c.experts, c.hidden, c.inter};
          shape.act = act;
          shape.bias = bias;
          MoeLayer infer(*train.pool, shape, fmt, 3);
          infer.use_isa(level);
          infer.load([&](int e) { return source_of(p, e); });
          const size_t n = size_t(c.tokens) * c.hidden;
          std::vector<float> want(n), base(n), fresh(n);
          infer.forward(input_of(p, want.data()));
          train.moe->forward(input_of(p, base.data()), LoraWeights{}, /*train=*/true);
          for (const int m : {BG, BU, BD}) std::fill(p.lora[m].buf.begin(), p.lora[m].buf.end(), 0.0f);
          train.moe->forward(input_of(p, fresh.data()), weights_of(p.lora), /*train=*/true);
          size_t differ_base = 0, differ_fresh = 0;
          for (size_t i = 0; i < n; ++i) {
            differ_base += std::memcmp(&want[i], &base[i], sizeof(float)) != 0;
            differ_fresh += want[i] != fresh[i];  // +0 and -0 alike: LoRA adds s * 0
          }
          EXPECT_EQ(differ_base, 0u) << "without an adapter: " << differ_base << " of " << n << " outputs differ";
          EXPECT_EQ(differ_fresh, 0u) << "with B = 0: " << differ_fresh << " of " << n << " outputs differ";
          if (!act.plain() && !bias) {  // the clamp must bind: plain experts give other outputs
            MoeLayer silu(*train.pool, MoeShape{c.experts, c.hidden, c.inter}, fmt, 3);
            silu.use_isa(level);
            silu.load([&](int e) {
              return ExpertSource{{p.g[e].data(), SourceType::f32, c.inter, c.hidden},
                                  {p.u[e].data(), SourceType::f32, c.inter, c.hidden},
                                  {p.d[e].data(), SourceType::f32, c.hidden, c.inter}};
            });
            std::vector<float> other(n);
            silu.forward(input_of(p, other.data()));
            double d2 = 0, w2 = 0;
            for (size_t i = 0; i < n; ++i) d2 += double(other[i] - want[i]) * (other[i] - want[i]), w2 += double(want[i]) * want[i];
            EXPECT_GT(d2, 0.01 * w2) << "the clamp hardly changed the outputs: it did not bind";
          }
        }
  }
}

}  // namespace tandem
