#include "expert_core.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <xmmintrin.h>
#include <string>

#include "tandem/error.h"
#include "tandem/trace.h"

namespace tandem::core {

// ---- packs -------------------------------------------------------------------------

ExpertPacks::ExpertPacks(const MoeShape& shape, const PackOptions& format, int subpools, Layout layout, int layer)
    : shape_(shape), format_(format), layout_(layout), layer_(layer), slices_(intermediate_slices(shape.inter, subpools, format)),
      shards_(subpools) {
  for (auto& sh : shards_)
    for (auto* v : {&sh.gate_up, &sh.gate, &sh.up, &sh.down}) v->resize(shape.experts);
  if (shape.bias) bias_.assign(bias_at(shape.experts, 0) + static_cast<size_t>(shape.experts) * shape.hidden, 0.0f);
}

bool finite_bf16(const PackedWeight& p) {
  if (p.format != WeightFormat::bf16) return true;
  const auto* v = reinterpret_cast<const uint16_t*>(p.data.data());
  uint16_t bad = 0;
  for (size_t i = 0; i < p.data.size / 2; ++i) bad |= static_cast<uint16_t>((v[i] & 0x7f80) == 0x7f80);
  return !bad;
}

namespace {

struct Source {
  const WeightView* w;
  std::string where;  // "layer 3, expert 5 gate"
};

// The first non-finite element of the sources, as an error naming it (its tensor and file
// when known); without one, `cause` (a packing error) said of the first source's place.
[[noreturn]] void refuse_non_finite(std::initializer_list<Source> sources, const Error* cause = nullptr) {
  for (const Source& s : sources) {
    const WeightView& w = *s.w;
    std::vector<float> row(w.k);
    for (int r = 0; r < w.n; ++r) {
      decode_rows(w, r, 1, row.data());
      for (int c = 0; c < w.k; ++c) {
        if (std::isfinite(row[c])) continue;
        if (w.name)
          TANDEM_FAIL(Errc::bad_format, s.where, ": tensor ", w.name, w.file ? " of " : "", w.file ? w.file : "",
                      ": element [", w.row0 + r, ", ", w.col0 + c, "] is ", row[c],
                      "; non-finite weights are refused (fix the checkpoint)");
        TANDEM_FAIL(Errc::bad_format, s.where, ": element [", w.row0 + r, ", ", w.col0 + c, "] is ", row[c],
                    "; non-finite weights are refused");
      }
    }
  }
  if (cause) TANDEM_FAIL(cause->code(), sources.begin()->where, ": ", cause->message());
  TANDEM_FAIL(Errc::internal, sources.begin()->where, ": a packed weight holds a non-finite value its source does not");
}

// Runs make() (a pack of the sources); errors come out naming the layer, expert and
// projection, and for checkpoints the tensor and file.
template <class Make>
PackedWeight packed(std::initializer_list<Source> sources, Make&& make) {
  PackedWeight p;
  try {
    p = make();
  } catch (const Error& err) {
    if (err.code() != Errc::bad_format) throw;
    refuse_non_finite(sources, &err);  // the integer packs refuse NaN / Inf: say exactly where
  }
  if (!finite_bf16(p)) refuse_non_finite(sources);
  return p;
}

}  // namespace

void ExpertPacks::pack_slice(int s, int e, const ExpertSource& src) {
  check_expert_source(src, shape_, e);
  if (shape_.bias && s == 0) {  // one writer per expert (subpool 0's), all of them
    decode_rows(src.gate_bias, 0, 1, bias_.data() + bias_at(e, 0));
    decode_rows(src.up_bias, 0, 1, bias_.data() + bias_at(e, 1));
    float* db = bias_.data() + bias_at(shape_.experts, 0) + static_cast<size_t>(e) * shape_.hidden;
    decode_rows(src.down_bias, 0, 1, db);
    const float* parts[] = {bias_.data() + bias_at(e, 0), bias_.data() + bias_at(e, 1), db};
    const char* names[] = {"gate bias", "up bias", "down bias"};
    const int lens[] = {shape_.inter, shape_.inter, shape_.hidden};
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < lens[i]; ++j)
        TANDEM_CHECK(std::isfinite(parts[i][j]), Errc::bad_format, layer_ >= 0 ? str_cat("layer ", layer_, ", ") : "",
                     "expert ", e, " ", names[i], ": element ", j, " is ", parts[i][j], "; non-finite biases are refused");
  }
  const auto [i0, i1] = slice(s);
  if (i0 == i1) return;
  const int H = shape_.hidden;
  Shard& sh = shards_[s];
  const WeightView g = sub_view(src.gate, i0, i1 - i0, 0, H), u = sub_view(src.up, i0, i1 - i0, 0, H);
  auto where = [&](const char* proj) {
    return layer_ >= 0 ? str_cat("layer ", layer_, ", expert ", e, " ", proj) : str_cat("expert ", e, " ", proj);
  };
  // down is cut along k: pack_cols keeps int8's row scales whole-row, so every slicing
  // (subpool count) holds the same numbers, the store's (expert_store.h) included.
  const Source sg{&g, where("gate")}, su{&u, where("up")}, sd{&src.down, where("down")};
  if (layout_ == Layout::fused) {
    sh.gate_up[e] = packed({sg, su}, [&] { return pack_gate_up(g, u, format_); });
  } else {
    sh.gate[e] = packed({sg}, [&] { return pack(g, format_); });
    sh.up[e] = packed({su}, [&] { return pack(u, format_); });
  }
  sh.down[e] = packed({sd}, [&] { return pack_cols(src.down, i0, i1 - i0, format_); });
}

void ExpertPacks::load(Pool& pool, const std::function<ExpertSource(int)>& source, const Progress& progress) {
  TANDEM_CHECK(static_cast<bool>(source), Errc::invalid_argument, "experts: load without a weight source");
  TANDEM_CHECK(pool.subpools() == subpools(), Errc::internal, "experts: packs for ", subpools(), " subpools, pool of ",
               pool.subpools());
  const std::function<void(int, int)> pack_one = [&](int s, int e) {
    if (!skipped(e)) pack_slice(s, e, source(e));
  };
  for_each_item(pool, shape_.experts, pack_one, progress);
}

void ExpertPacks::load_here(const std::function<ExpertSource(int)>& source) {
  TANDEM_CHECK(static_cast<bool>(source), Errc::invalid_argument, "experts: load without a weight source");
  for (int e = 0; e < shape_.experts; ++e)
    if (!skipped(e)) {
      const ExpertSource src = source(e);
      for (int s = 0; s < subpools(); ++s) pack_slice(s, e, src);
    }
}

std::function<ExpertSource(int)> ExpertPacks::checkpoint_source(const Checkpoint& ckpt, int layer,
                                                                const ExpertNaming& naming) {
  auto sources = std::make_shared<std::vector<ExpertSource>>(shape_.experts);
  for (int e = 0; e < shape_.experts; ++e)
    if (!skipped(e)) (*sources)[e] = checkpoint_expert(ckpt, layer, e, naming, shape_);
  return [sources](int e) { return (*sources)[e]; };
}

void ExpertPacks::drop() {
  for (auto& sh : shards_)
    for (auto* v : {&sh.gate_up, &sh.gate, &sh.up, &sh.down})
      for (auto& w : *v) w = {};
}

void ExpertPacks::drop(int e) {
  for (auto& sh : shards_)
    for (auto* v : {&sh.gate_up, &sh.gate, &sh.up, &sh.down}) (*v)[e] = {};
}

void ExpertPacks::load_store(Pool& pool, const ExpertStore& store, int index, const Progress& progress) {
  TANDEM_CHECK(!shape_.bias, Errc::invalid_argument, "experts: a packed expert store holds experts without biases; "
               "these are ", describe_experts(shape_), " (load them from the checkpoint)");
  TANDEM_CHECK(layout_ == Layout::fused, Errc::internal, "experts: a store holds fused gate/up packs");
  TANDEM_CHECK(pool.subpools() == subpools(), Errc::internal, "experts: packs for ", subpools(), " subpools, pool of ",
               pool.subpools());
  const int H = shape_.hidden;
  const std::function<void(int, int)> read_one = [&](int s, int e) {
    const auto [i0, i1] = slice(s);
    if (skipped(e) || i0 == i1) return;
    PackedWeight gu = empty_pack(format_, i1 - i0, H, true), dn = empty_pack(format_, H, i1 - i0);
    store.read(index, e, i0, i1, gu, dn);
    shards_[s].gate_up[e] = std::move(gu);
    shards_[s].down[e] = std::move(dn);
  };
  for_each_item(pool, shape_.experts, read_one, progress);
}

const PackedWeight& ExpertPacks::gate_up_layout(int e) const {
  for (const auto& sh : shards_) {
    const PackedWeight& w = layout_ == Layout::fused ? sh.gate_up[e] : sh.gate[e];
    if (w.panels) return w;
  }
  return layout_ == Layout::fused ? shards_[0].gate_up[e] : shards_[0].gate[e];
}

size_t ExpertPacks::bytes() const {
  size_t b = 0;
  for (const auto& sh : shards_)
    for (int e = 0; e < shape_.experts; ++e)
      b += sh.gate_up[e].bytes() + sh.gate[e].bytes() + sh.up[e].bytes() + sh.down[e].bytes();
  return b;
}

std::array<std::vector<float>, 3> ExpertPacks::dequantized(int e) const {
  const int H = shape_.hidden, I = shape_.inter;
  std::array<std::vector<float>, 3> w{std::vector<float>(size_t(I) * H), std::vector<float>(size_t(I) * H),
                                      std::vector<float>(size_t(H) * I)};
  for (int s = 0; s < subpools(); ++s) {
    const auto [i0, i1] = slice(s);
    const int l = i1 - i0;
    if (!l) continue;
    const Shard& sh = shards_[s];
    if (layout_ == Layout::fused) {
      const std::vector<float> gu = unpack(sh.gate_up[e]);  // gate rows, then up rows
      std::copy_n(gu.begin(), size_t(l) * H, w[0].begin() + size_t(i0) * H);
      std::copy_n(gu.begin() + size_t(l) * H, size_t(l) * H, w[1].begin() + size_t(i0) * H);
    } else {
      const std::vector<float> g = unpack(sh.gate[e]), u = unpack(sh.up[e]);
      std::copy(g.begin(), g.end(), w[0].begin() + size_t(i0) * H);
      std::copy(u.begin(), u.end(), w[1].begin() + size_t(i0) * H);
    }
    const std::vector<float> d = unpack(sh.down[e]);
    for (int j = 0; j < H; ++j) std::copy_n(d.begin() + size_t(j) * l, l, w[2].begin() + size_t(j) * I + i0);
  }
  return w;
}

// ---- planner, gather, products, merge -----------------------------------------------

WorkRuns WorkRuns::plan(int n, int weights, int panels, size_t panel_bytes, int threads, size_t input_bytes) {
  WorkRuns r;
  r.panels = panels;
  r.weights = weights;
  const size_t item_bytes = std::max(kItemBytes, kInputReuse * input_bytes);
  int c = static_cast<int>(std::max<size_t>(1, item_bytes / std::max<size_t>(1, panel_bytes)));
  c = std::min(c, std::max(1, n * weights * panels / (4 * std::max(1, threads))));
  r.chunk = std::max(1, std::min(c, panels));
  r.per = (panels + r.chunk - 1) / r.chunk;
  return r;
}

namespace {
// Row t of the input as bf16: x itself, or x_f32 rounded into `row`.
const bf16_t* bf16_row(const MoeInput& in, int t, int H, std::vector<bf16_t>& row) {
  if (in.x) return in.x + static_cast<size_t>(t) * H;
  row.resize(H);
  fp32_to_bf16(in.x_f32 + static_cast<size_t>(t) * H, row.data(), H);
  return row.data();
}

// Row r of qa quantized from the bf16 row x (hidden H) with kt's quantizer.
void quantize_row(const bf16_t* x, int H, QuantizedActs& qa, int r, const KernelTable& kt) {
  const size_t groups = static_cast<size_t>(qa.k_pad / qa.group);
  kt.quantize(x, nullptr, 1, H, H, qa.k_pad, qa.group, qa.q.data() + static_cast<size_t>(r) * qa.k_pad,
              qa.scale.data() + r, qa.sums.data() + r * groups);
}
}  // namespace

void gather_rows(const MoeInput& in, const TokenGroups& g, int i, int r0, int r1, int H, bf16_t* xg, QuantizedActs* qa,
                 const KernelTable& kt, const QuantizedActs* qtok) {
  const int groups = qa ? qa->k_pad / qa->group : 0;
  for (int r = r0; r < r1; ++r) {
    const int t = g.rows_token[g.offset[i] + r];
    const bf16_t* xb = in.x ? in.x + static_cast<size_t>(t) * H : nullptr;
    const float* xf = in.x_f32 ? in.x_f32 + static_cast<size_t>(t) * H : nullptr;
    if (xg) {
      bf16_t* dst = xg + static_cast<size_t>(r) * H;
      if (xb)
        std::memcpy(dst, xb, sizeof(bf16_t) * H);
      else
        fp32_to_bf16(xf, dst, H);
    }
    if (!qa) continue;
    if (qtok) {  // the token's row, quantized once for all its experts
      std::memcpy(qa->q.data() + static_cast<size_t>(r) * qa->k_pad, qtok->q.data() + static_cast<size_t>(t) * qa->k_pad,
                  qa->k_pad);
      qa->scale[r] = qtok->scale[t];
      std::memcpy(qa->sums.data() + static_cast<size_t>(r) * groups, qtok->sums.data() + static_cast<size_t>(t) * groups,
                  sizeof(int32_t) * groups);
      continue;
    }
    // The experts see x as bf16 in every format and path (the bf16 kernels round it,
    // the training layer saves it so): fp32 rows are rounded before quantizing too.
    thread_local std::vector<bf16_t> row;
    quantize_row(xb ? xb : xg ? xg + static_cast<size_t>(r) * H : bf16_row(in, t, H, row), H, *qa, r, kt);
  }
}

void quantize_token_rows(const MoeInput& in, int t0, int t1, int H, QuantizedActs& qt, const KernelTable& kt) {
  if (in.x) return quantize_activations(qt, in.x, H, t0, t1, &kt);  // bf16 rows: as they are
  thread_local std::vector<bf16_t> row;
  for (int t = t0; t < t1; ++t) quantize_row(bf16_row(in, t, H, row), H, qt, t, kt);
}

namespace {
// The input and panel range of a kernel call (GemmArgs or GateUpArgs).
template <typename Args>
Args product_args(const PackedWeight& w, int m, int begin, int end, const bf16_t* a, const QuantizedActs* qa, int lda) {
  Args g;
  if (w.format == WeightFormat::bf16)
    g.a = a;
  else
    g.qa = qa;
  g.m = m;
  g.lda = lda;
  g.panel_begin = begin;
  g.panel_end = end;
  return g;
}
}  // namespace

void run_gemm(const KernelTable& kt, const PackedWeight& w, int m, int begin, int end, const bf16_t* a,
              const QuantizedActs* qa, int lda, float* c, int ldc, const std::byte* a_tiles) {
  GemmArgs g = product_args<GemmArgs>(w, m, begin, end, a, qa, lda);
  g.a_tiles = a_tiles;
  g.c = c;
  g.ldc = ldc;
  kt.of(w.format).pick(m).gemm(w, g);
}

void run_gate_up(const KernelTable& kt, const PackedWeight& w, int m, int begin, int end, const bf16_t* a,
                 const QuantizedActs* qa, int lda, bf16_t* h, int ldh, const GateAct& act, const float* gate_bias,
                 const float* up_bias, const std::byte* a_tiles) {
  GateUpArgs g = product_args<GateUpArgs>(w, m, begin, end, a, qa, lda);
  g.a_tiles = a_tiles;
  g.h_bf16 = h;
  g.ldh = ldh;
  g.act = act;
  g.gate_bias = gate_bias;
  g.up_bias = up_bias;
  kt.of(w.format).pick(m).gate_up(w, g);
}

namespace {
// dst[j] (+)= ... over n floats, in blocks of 16 with a constant trip count (which GCC 12
// vectorizes at -O2, unlike a loop of unknown length: the merge ran scalar, at ~2 GB/s),
// then the remainder; each element's arithmetic is the scalar loop's, so the bits are too.
template <class F>
inline void columns(int n, F f) {
  int j = 0;
  for (; j + 16 <= n; j += 16)
    for (int u = 0; u < 16; ++u) f(j + u);
  for (; j < n; ++j) f(j);
}
}  // namespace

void merge_block(float* out, bool accumulate, int t, int K, const int* slot_row, const float* weights,
                 const float* const* y, int subpools, int H, int j0, int j1, const float* bias, const int* row_expert) {
  float* o = out + static_cast<size_t>(t) * H + j0;
  const int n = j1 - j0;
  if (!accumulate) std::fill(o, o + n, 0.0f);
  alignas(64) float sum[kMergeCols];
  // The rows are scattered over y (written by the down products, far larger than the
  // caches): each slot's columns are asked for one slot ahead, so their reads overlap the
  // current slot's sums (int8 layer at 2048 tokens, AMX Xeon: merge 68-73 ms of thread
  // time against 75-78 without).
  const auto fetch = [&](int k) {
    const int r = k < K ? slot_row[static_cast<size_t>(t) * K + k] : -1;
    if (r < 0) return;
    for (int q = 0; q < subpools; ++q)
      if (y[q])
        for (int j = 0; j < n; j += 16) _mm_prefetch(reinterpret_cast<const char*>(y[q] + static_cast<size_t>(r) * H + j0 + j), _MM_HINT_T0);
  };
  fetch(0);
  for (int k = 0; k < K; ++k) {
    fetch(k + 1);
    const int r = slot_row[static_cast<size_t>(t) * K + k];
    if (r < 0) continue;
    std::fill(sum, sum + n, 0.0f);
    for (int q = 0; q < subpools; ++q) {
      const float* ys = y[q];
      if (!ys) continue;
      const float* yr = ys + static_cast<size_t>(r) * H + j0;
      columns(n, [&](int j) { sum[j] += yr[j]; });
    }
    if (bias) {
      const float* b = bias + static_cast<size_t>(row_expert[r]) * H + j0;
      columns(n, [&](int j) { sum[j] += b[j]; });
    }
    const float w = weights ? weights[static_cast<size_t>(t) * K + k] : 1.0f;
    columns(n, [&](int j) { o[j] += w * sum[j]; });
  }
}

// ---- the inference forward ------------------------------------------------------------

namespace {
constexpr const char* kPhaseNames[] = {"quantize", "gather", "gate_up", "act", "down", "merge"};
constexpr int kQuantizeTokens = 16;  // tokens per item of the quantize phase
}

ExpertForward::ExpertForward(const ExpertPacks& packs, ForwardScratch& scratch, const KernelTable& kernels,
                             std::vector<int> threads, int layer, const MoeInput& in, TokenGroups groups)
    : TokenGroups(std::move(groups)), P(packs), sc(scratch), kt(kernels), threads_(std::move(threads)), layer_(layer),
      in_(in), gu_runs_(threads_.size()), dn_runs_(threads_.size()) {}

int ExpertForward::items(int phase, int s) {
  const int S = P.subpools(), n = static_cast<int>(active.size());
  const bool quant = P.format().format != WeightFormat::bf16;
  const int len = P.len(s);
  switch (phase) {
    case kQuantize: {
      if (s == 0) {
        begin_ns_ = trace::now_ns();
        prepare();
      }
      if (!quantize_tokens()) return 0;
      const int blocks = (in_.tokens + kQuantizeTokens - 1) / kQuantizeTokens;
      return blocks * (s + 1) / S - blocks * s / S;
    }
    case kGather: return n / S + (s < n % S ? 1 : 0);  // active expert i goes to subpool i % S
    case kGateUp:
      if (!len || !n) return 0;
      gu_runs_[s] = WorkRuns::plan(n, 1, (len + kPanel - 1) / kPanel, 2 * P.gate_up(s, active[0]).panel_stride, threads_[s],
                                   WorkRuns::input_bytes(P.gate_up(s, active[0]), total_rows, n));
      return gu_runs_[s].items(n);
    case kAct: return (quant || sc.tiles_mid[s].any()) && len ? n : 0;
    case kDown:
      if (!len || !n) return 0;
      dn_runs_[s] = WorkRuns::plan(n, 1, (P.shape().hidden + kPanel - 1) / kPanel, P.down(s, active[0]).panel_stride,
                                   threads_[s], WorkRuns::input_bytes(P.down(s, active[0]), total_rows, n));
      return dn_runs_[s].items(n);
    case kMerge: {
      const int64_t total = static_cast<int64_t>(in_.tokens) * merge_blocks(P.shape().hidden);
      return static_cast<int>(total * (s + 1) / S - total * s / S);
    }
  }
  return 0;
}

// Worth it when tokens have several rows (top-k > 1, experts on this CPU); not when most
// of a batch's experts run elsewhere and fewer rows than tokens are left here.
bool ExpertForward::quantize_tokens() const {
  return P.format().format != WeightFormat::bf16 && !active.empty() && total_rows > in_.tokens;
}

void ExpertForward::prepare() {
  const int S = P.subpools(), n = static_cast<int>(active.size());
  const bool quant = P.format().format != WeightFormat::bf16;
  if (quantize_tokens()) sc.qtok.prepare(P.gate_up_layout(active[0]), in_.tokens);
  if (quant) {
    sc.qin.resize(n);
    for (int i = 0; i < n; ++i) sc.qin[i].prepare(P.gate_up_layout(active[i]), count[i]);
  } else {
    sc.xg.get(static_cast<size_t>(total_rows) * P.shape().hidden);
  }
  if (P.down_bias()) {
    row_expert_.resize(total_rows);
    for (int i = 0; i < n; ++i) std::fill_n(row_expert_.begin() + offset[i], count[i], active[i]);
  }
  // Inputs in the AMX kernels' tile order, for the experts whose kernel takes them.
  const FormatKernels& fk = kt.of(P.format().format);
  sc.tiles_in.at.clear();
  if (n > 0)
    sc.tiles_in.plan(n, count, row_tile_row_bytes(P.gate_up_layout(active[0])),
                     [&](int i) { return takes_row_tiles(fk.pick(count[i]), P.gate_up_layout(active[i])); });
  sc.h.resize(S);
  sc.y.resize(S);
  sc.qmid.resize(S);
  sc.tiles_mid.resize(S);
  ys_.assign(S, nullptr);
  for (int s = 0; s < S; ++s) {
    sc.tiles_mid[s].at.clear();
    if (!P.len(s)) continue;
    sc.h[s].get(static_cast<size_t>(total_rows) * P.len(s));
    ys_[s] = sc.y[s].get(static_cast<size_t>(total_rows) * P.shape().hidden);
    if (quant) {
      sc.qmid[s].resize(n);
      for (int i = 0; i < n; ++i) sc.qmid[s][i].prepare(P.down(s, active[i]), count[i]);
    }
    if (n > 0)
      sc.tiles_mid[s].plan(n, count, row_tile_row_bytes(P.down(s, active[0])),
                           [&](int i) { return takes_row_tiles(fk.pick(count[i]), P.down(s, active[i])); });
  }
}

void ExpertForward::run(int phase, int s, int item, int) {
  trace::Span span(kPhaseNames[phase], {layer_, static_cast<int>(active.size()), in_.tokens});
  const int H = P.shape().hidden, len = P.len(s);
  const bool quant = P.format().format != WeightFormat::bf16;
  switch (phase) {
    case kQuantize: {
      const int S = P.subpools(), blocks = (in_.tokens + kQuantizeTokens - 1) / kQuantizeTokens;
      const int b = blocks * s / S + item;
      quantize_token_rows(in_, b * kQuantizeTokens, std::min(in_.tokens, (b + 1) * kQuantizeTokens), H, sc.qtok, kt);
      break;
    }
    case kGather: {
      const int i = s + item * P.subpools();
      bf16_t* xg = quant ? nullptr : sc.xg.data() + size_t(offset[i]) * H;
      gather_rows(in_, *this, i, 0, count[i], H, xg, quant ? &sc.qin[i] : nullptr, kt, quantize_tokens() ? &sc.qtok : nullptr);
      if (quant)
        sc.tiles_in.pack(i, sc.qin[i].q.data(), sc.qin[i].k_pad);
      else
        sc.tiles_in.pack(i, xg, sizeof(bf16_t) * H);
      break;
    }
    case kGateUp: {
      const auto it = gu_runs_[s].item(item);
      run_gate_up(kt, P.gate_up(s, active[it.i]), count[it.i], it.begin, it.end,
                  quant ? nullptr : sc.xg.data() + size_t(offset[it.i]) * H,
                  quant ? &sc.qin[it.i] : nullptr, H, sc.h[s].data() + size_t(offset[it.i]) * len, len, P.shape().act,
                  P.gate_bias(s, active[it.i]), P.up_bias(s, active[it.i]), sc.tiles_in.of(it.i));
      break;
    }
    case kAct: {
      const bf16_t* h = sc.h[s].data() + size_t(offset[item]) * len;
      if (quant) {
        QuantizedActs& q = sc.qmid[s][item];
        quantize_activations(q, h, len, 0, count[item], &kt);
        sc.tiles_mid[s].pack(item, q.q.data(), q.k_pad);
      } else {
        sc.tiles_mid[s].pack(item, h, sizeof(bf16_t) * len);
      }
      break;
    }
    case kDown: {
      const auto it = dn_runs_[s].item(item);
      run_gemm(kt, P.down(s, active[it.i]), count[it.i], it.begin, it.end, sc.h[s].data() + size_t(offset[it.i]) * len,
               quant ? &sc.qmid[s][it.i] : nullptr, len, sc.y[s].data() + size_t(offset[it.i]) * H, H,
               sc.tiles_mid[s].of(it.i));
      break;
    }
    case kMerge: {
      const int S = P.subpools(), blocks = merge_blocks(H);
      const int64_t total = static_cast<int64_t>(in_.tokens) * blocks;
      const int idx = static_cast<int>(total * s / S) + item;
      const int t = idx / blocks, j0 = (idx % blocks) * kMergeCols;
      merge_block(in_.out, in_.accumulate, t, in_.top_k, slot_row.data(), in_.weights, ys_.data(), S, H, j0,
                  std::min(H, j0 + kMergeCols), P.down_bias(), row_expert_.data());
      break;
    }
  }
}

void ExpertForward::finished() {
  trace::record("moe_layer", begin_ns_, trace::now_ns(), {layer_, static_cast<int>(active.size()), in_.tokens});
}

void run_inline(Task& task) {
  for (int p = 0; p < task.phases(); ++p) {
    const int n = task.items(p, 0);
    for (int i = 0; i < n; ++i) task.run(p, 0, i, 0);
  }
  task.finished();
}

}  // namespace tandem::core
