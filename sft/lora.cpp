#include "tandem/lora.h"

#include <dnnl.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "bf16_round.h"
#include "expert_core.h"
#include "tandem/error.h"
#include "tandem/trace.h"

namespace tandem {
namespace {

// Uninitialized storage: pages are first touched by the pool threads that write them.
template <typename T>
std::unique_ptr<T[]> raw(size_t n) {
  return std::unique_ptr<T[]>(new T[std::max<size_t>(n, 1)]);
}

template <typename T>
using Grow = core::Scratch<T>;

// A logical fp32 matrix: element (i, j) at p[i * ld + j], or p[j * ld + i] when t.
struct Mat {
  const float* p;
  int64_t ld;
  bool t = false;
  Mat T() const { return {p, ld, !t}; }
  Mat at(int i, int j) const { return {p + (t ? int64_t(j) * ld + i : int64_t(i) * ld + j), ld, t}; }
};

// C[M x N] (row-major, ldc) = alpha * A[M x K] B[K x N] + beta * C, single-threaded
// (pool workers run with one OpenMP thread) in oneDNN's sgemm.
void mm(int M, int N, int K, float alpha, Mat A, Mat B, float beta, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < N; ++j) C[int64_t(i) * ldc + j] = beta == 0 ? 0.0f : beta * C[int64_t(i) * ldc + j];
    return;
  }
  const dnnl_status_t st = dnnl_sgemm(A.t ? 'T' : 'N', B.t ? 'T' : 'N', M, N, K, alpha, A.p, std::max<int64_t>(A.ld, 1), B.p,
                                      std::max<int64_t>(B.ld, 1), beta, C, ldc);
  TANDEM_CHECK(st == dnnl_success, Errc::internal, "lora: oneDNN sgemm failed (status ", int(st), ") for [", M, " x ", K,
               "] x [", K, " x ", N, "]");
}
// The same into a logical matrix C that may be stored transposed: C^T = B^T A^T.
void mm_into(Mat C, int M, int N, int K, float alpha, Mat A, Mat B, float beta) {
  if (C.t)
    mm(N, M, K, alpha, B.T(), A.T(), beta, const_cast<float*>(C.p), C.ld);
  else
    mm(M, N, K, alpha, A, B, beta, const_cast<float*>(C.p), C.ld);
}

// A LoraMatrix with its defaults resolved, for one expert.
struct Lm {
  float* data = nullptr;
  int64_t es = 0, ld = 0;
  bool t = false;
  explicit operator bool() const { return data != nullptr; }
  Mat of(int e) const { return {data + int64_t(e) * es, ld, t}; }
};

Lm resolve(const LoraMatrix& m, int rows, int cols) {
  Lm r;
  r.data = m.data;
  r.t = m.transposed;
  r.ld = m.ld ? m.ld : (m.transposed ? rows : cols);
  r.es = m.expert_stride ? m.expert_stride : int64_t(rows) * cols;
  return r;
}

// bf16 -> fp32 is a shift; inline so the conversion loops vectorize.
inline float widen(bf16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
void widen(const bf16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = widen(src[i]);
}

using Runs = core::WorkRuns;

// Row blocks of the active experts (for row-independent work) and column chunks (for
// gradient work that reduces over an expert's rows).
struct Block {
  int i, begin, end;
};
std::vector<Block> blocks(const std::vector<int>& count, int per_block) {
  std::vector<Block> b;
  for (int i = 0; i < static_cast<int>(count.size()); ++i)
    for (int r = 0; r < count[i]; r += per_block) b.push_back({i, r, std::min(count[i], r + per_block)});
  return b;
}

constexpr int kRowBlock = 256, kColChunk = 256;
static_assert(kRowBlock % 16 == 0, "row blocks are packed into AMX tile order (16-row tiles) one block at a time");
using core::kMergeCols;
std::atomic<uint64_t> next_layer_id{1};

}  // namespace

float LoraConfig::scaling() const { return rslora ? alpha / std::sqrt(float(rank)) : alpha / float(rank); }

// ---- context -------------------------------------------------------------------------

struct LoraContext::State {
  uint64_t layer_id = 0;
  int layer_index = 0;
  TokenGroups g;
  int tokens = 0, top_k = 0;
  bool lora = false;
  LoraConfig config;                  // rank and scaling the forward ran with
  std::unique_ptr<float[]> wrow;      // [R] routing weight of each grouped row
  std::unique_ptr<bf16_t[]> xg;       // [R x H] gathered input, as the products saw it
  std::unique_ptr<float[]> pgu;       // [R x 2r] x Ag^T | x Au^T
  std::unique_ptr<float[]> pd;        // [R x r] h Ad^T (summed over subpools)
  std::vector<std::unique_ptr<float[]>> gu;  // per subpool [R x 2 len]: g | u pre-activations
  size_t bytes = 0;
};

LoraContext::LoraContext() = default;
LoraContext::~LoraContext() = default;
LoraContext::LoraContext(LoraContext&&) noexcept = default;
LoraContext& LoraContext::operator=(LoraContext&&) noexcept = default;
bool LoraContext::valid() const { return s_ && !consumed_; }
int LoraContext::tokens() const { return s_ ? s_->tokens : 0; }
size_t LoraContext::bytes() const { return s_ ? s_->bytes : 0; }

// ---- layer ---------------------------------------------------------------------------

// What a task needs only while it runs (what the backward reads of the forward is in the
// context, and a task sizes it when it starts), so the layers of one pool share one
// (core::pool_shared): a long batch grows one set of rows and partial outputs instead of
// one per layer (Qwen3-235B at 2048 tokens: ~1 GB, 94 layers).
struct LoraMoe::Scratch {
  // forward
  std::vector<QuantizedActs> qin;                 // per active expert (integer base)
  core::RowTiles tiles_in;                        // the base gate / up input (xg or qin) in tile order
  std::vector<core::RowTiles> tiles_mid;          // per subpool: the base down input (h or qmid) in tile order
  std::vector<Grow<bf16_t>> h;                    // per subpool [R x len] bf16 h
  std::vector<std::vector<QuantizedActs>> qmid;   // per subpool, per active expert
  std::vector<Grow<float>> y, pdp;                // per subpool [R x H] (y, then backward's dx), [R x r]
  std::vector<int> row_expert;                    // grouped row -> expert (experts with down biases only)
  // backward
  Grow<bf16_t> dog;                               // [R x H] dOut rows, bf16
  Grow<float> dogf, qd, wqd, wpd, qgu;            // [R x H], [R x r] x 3, [R x 2r]
  Grow<double> dwb;                               // [R] down bias . dOut row (experts with biases only)
  std::vector<QuantizedActs> qbin;                // per active expert (integer backward packs)
  std::vector<std::vector<QuantizedActs>> qbmid;  // per subpool, per active expert
  std::vector<Grow<float>> dh, dguf, qgup, dwp;  // per subpool (dh then holds h: act overwrites it in place)
  std::vector<Grow<bf16_t>> dgub;                 // per subpool [R x 2 len]
  core::RowTiles tiles_bin;                       // dog (or qbin) in tile order, for down_t
  std::vector<core::RowTiles> tiles_bmid;         // per subpool: dgub (or qbmid) in tile order, for gu_t
};

LoraMoe::LoraMoe(Pool& pool, MoeShape shape, SftOptions options, int layer_index)
    : pool_(pool), shape_(shape), options_(options), layer_(layer_index), kt_(&kernel_table(effective_isa())),
      scratch_(core::pool_shared<Scratch>(pool)) {
  TANDEM_CHECK(shape.experts >= 1 && shape.hidden >= 1 && shape.inter >= 1, Errc::invalid_argument, "lora: shape (experts ",
               shape.experts, ", hidden ", shape.hidden, ", intermediate ", shape.inter, ") must be positive");
  check_gate_act(str_cat("lora: layer ", layer_index), shape.act);
  set_lora(options.lora);
  TANDEM_CHECK(options.backward_format != WeightFormat::int4, Errc::unsupported,
               "lora: backward_format int4 is not supported (use bf16, or int8 to halve the backward packs)");
  if (options.format.format == WeightFormat::int4)
    TANDEM_CHECK(shape.hidden % options.format.group == 0 && shape.inter % options.format.group == 0,
                 Errc::invalid_argument, "lora: int4 group ", options.format.group, " must divide hidden (", shape.hidden,
                 ") and intermediate (", shape.inter, ")");
  id_ = next_layer_id.fetch_add(1);
  packs_ = std::make_unique<core::ExpertPacks>(shape, options.format, pool.subpools(), core::ExpertPacks::Layout::separate, layer_index);
  back_.resize(pool.subpools());
  for (auto& b : back_)
    for (auto* v : {&b.gu_t, &b.down_t}) v->resize(shape.experts);
}

std::pair<int, int> LoraMoe::slice(int subpool) const { return packs_->slice(subpool); }

LoraMoe::~LoraMoe() = default;

void LoraMoe::unload() {
  loaded_ = backward_ready_ = false;
  packs_->drop();
  for (auto& b : back_)
    for (auto* v : {&b.gu_t, &b.down_t})
      for (auto& w : *v) w = {};
}

void LoraMoe::load(const std::function<ExpertSource(int)>& source, const Progress& progress) {
  TANDEM_CHECK(static_cast<bool>(source), Errc::invalid_argument, "lora: load without a weight source");
  unload();
  packs_->load(pool_, source, progress);
  loaded_ = true;
}

void LoraMoe::load(const Checkpoint& ckpt, int layer, const ExpertNaming& naming, const Progress& progress) {
  load(packs_->checkpoint_source(ckpt, layer, naming), progress);
}

void LoraMoe::prepare_backward(const Progress& progress) {
  TANDEM_CHECK(loaded_, Errc::invalid_argument, "lora: layer ", layer_, " has no weights (call load first)");
  if (backward_ready_) return;
  const int H = shape_.hidden;
  PackOptions bo;
  bo.format = options_.backward_format;
  const std::function<void(int, int)> pack_one = [&](int s, int e) {
    const auto [i0, i1] = slice(s);
    const int len = i1 - i0;
    if (!len) return;
    BackwardPacks& sh = back_[s];
    {  // [dg du] [Wg; Wu]: W^T = [H x 2 len]
      const std::vector<float> g = unpack(packs_->gate(s, e)), u = unpack(packs_->up(s, e));
      std::vector<float> t(size_t(H) * 2 * len);
      for (int c = 0; c < len; ++c)
        for (int j = 0; j < H; ++j) {
          t[size_t(j) * 2 * len + c] = g[size_t(c) * H + j];
          t[size_t(j) * 2 * len + len + c] = u[size_t(c) * H + j];
        }
      sh.gu_t[e] = pack(WeightView{t.data(), SourceType::f32, H, 2 * len}, bo);
    }
    {  // dOut Wd: Wd^T = [len x H]
      const std::vector<float> d = unpack(packs_->down(s, e));
      std::vector<float> t(size_t(len) * H);
      for (int j = 0; j < H; ++j)
        for (int c = 0; c < len; ++c) t[size_t(c) * H + j] = d[size_t(j) * len + c];
      sh.down_t[e] = pack(WeightView{t.data(), SourceType::f32, len, H}, bo);
    }
  };
  for_each_item(pool_, shape_.experts, pack_one, progress, "pack_backward");
  backward_ready_ = true;
}

size_t LoraMoe::packed_bytes() const { return packs_->bytes(); }

size_t LoraMoe::backward_bytes() const {
  size_t b = 0;
  for (const auto& sh : back_)
    for (int e = 0; e < shape_.experts; ++e) b += sh.gu_t[e].bytes() + sh.down_t[e].bytes();
  return b;
}

std::array<std::vector<float>, 3> LoraMoe::dequantized(int e) const {
  TANDEM_CHECK(loaded_ && e >= 0 && e < shape_.experts, Errc::invalid_argument, "lora: expert ", e,
               " is not a loaded expert of layer ", layer_);
  return packs_->dequantized(e);
}

void LoraMoe::set_lora(const LoraConfig& lora) {
  TANDEM_CHECK(lora.rank >= 1, Errc::invalid_argument, "lora: layer ", layer_, ": rank ", lora.rank,
               " must be at least 1");
  TANDEM_CHECK(std::isfinite(lora.alpha), Errc::invalid_argument, "lora: layer ", layer_, ": alpha ", lora.alpha,
               " is not finite");
  options_.lora = lora;
}

std::array<std::pair<int, int>, 6> LoraMoe::lora_shapes() const {
  const int r = options_.lora.rank, H = shape_.hidden, I = shape_.inter;
  return {{{r, H}, {I, r}, {r, H}, {I, r}, {r, I}, {H, r}}};
}

void LoraMoe::check_lora(const LoraWeights& w, const char* what, bool allow_null) const {
  const LoraMatrix* m[6] = {&w.a_gate, &w.b_gate, &w.a_up, &w.b_up, &w.a_down, &w.b_down};
  static constexpr const char* kNames[6] = {"a_gate", "b_gate", "a_up", "b_up", "a_down", "b_down"};
  const auto shapes = lora_shapes();
  int given = 0;
  for (int i = 0; i < 6; ++i) given += m[i]->data != nullptr;
  if (!allow_null)
    TANDEM_CHECK(given == 0 || given == 6, Errc::invalid_argument, "lora: layer ", layer_, ": ", what, " gives ", given,
                 " of the 6 adapter matrices; give all (LoRA on gate, up and down) or none (the base alone)");
  for (int i = 0; i < 6; ++i) {
    const LoraMatrix& x = *m[i];
    if (!x.data) continue;
    const auto [rows, cols] = shapes[i];
    const Lm r = resolve(x, rows, cols);
    const int64_t E = shape_.experts;
    TANDEM_CHECK(r.ld >= (x.transposed ? rows : cols) && r.es >= 0, Errc::invalid_argument, "lora: layer ", layer_, ": ",
                 what, ".", kNames[i], ": leading dimension ", r.ld, " is smaller than the ", x.transposed ? "rows" : "columns",
                 " of a [", rows, " x ", cols, "] matrix");
    const int64_t last = (E - 1) * r.es + (x.transposed ? int64_t(cols - 1) * r.ld + rows - 1 : int64_t(rows - 1) * r.ld + cols - 1);
    const bool dense = !x.ld && !x.expert_stride;
    const int64_t want = E * rows * cols;
    TANDEM_CHECK(dense ? int64_t(x.size) == want : int64_t(x.size) > last, Errc::invalid_argument, "lora: layer ", layer_,
                 ": ", what, ".", kNames[i], " holds ", x.size, " elements; ", E, " experts x [", rows, " x ", cols,
                 "] (rank ", options_.lora.rank, ") need ", dense ? want : last + 1);
  }
}

// ---- forward ---------------------------------------------------------------------------

// What the forward and backward tasks share: the layer, its scratch, the context, the
// resolved adapter matrices, and how lists and base products map onto subpools.
class SftTask : public Task {
 protected:
  enum { AG, BG, AU, BU, AD, BD };
  SftTask(LoraMoe& l, LoraContext::State& st, const LoraWeights& w)
      : L(l), sc(*l.scratch_), st_(st), g(st.g), S(l.pool_.subpools()), H(l.shape_.hidden), r(l.options_.lora.rank),
        s_(l.options_.lora.scaling()) {
    resolve_all(w, wt);
    rows = blocks(g.count, kRowBlock);
    ys.assign(S, nullptr);
    for (int s = S - 1; s >= 0; --s)
      if (len(s)) s0 = s;  // the first subpool with a slice
  }
  void resolve_all(const LoraWeights& w, Lm* out) const {
    const auto sh = L.lora_shapes();
    const LoraMatrix* m[6] = {&w.a_gate, &w.b_gate, &w.a_up, &w.b_up, &w.a_down, &w.b_down};
    for (int k = 0; k < 6; ++k) out[k] = resolve(*m[k], sh[k].first, sh[k].second);
  }
  // Items of a list shared by all subpools: subpool s takes s, s + S, s + 2S, ...
  int spread(int total, int s) const { return total / S + (s < total % S ? 1 : 0); }
  int len(int s) const { return L.packs_->len(s); }
  int merge_blocks() const { return (H + kMergeCols - 1) / kMergeCols; }
  // One run of panels of a base product: C[rows of active expert i] (ldc) = A . w^T, A the
  // expert's bf16 rows (lda) or, for an integer pack, their quantized form qa.
  // tiles: the same rows in tile order (RowTiles), or null.
  void base_gemm(const PackedWeight& w, Runs::Item it, const bf16_t* a, const QuantizedActs* qa, int lda, float* c,
                 int ldc, const core::RowTiles& tiles) const {
    const size_t off = g.offset[it.i];
    core::run_gemm(*L.kt_, w, g.count[it.i], it.begin, it.end, a + off * lda, qa, lda, c + off * ldc, ldc, tiles.of(it.i));
  }
  // Plans t for a base product on packs like w(i) (active expert i's): a place for each
  // expert whose kernel at its row count takes its input in tile order.
  template <class PackOf>
  void plan_tiles(core::RowTiles& t, PackOf w) const {
    const int n = static_cast<int>(g.active.size());
    t.at.clear();
    if (!n) return;
    const FormatKernels& fk = L.kt_->of(w(0).format);
    t.plan(n, g.count, row_tile_row_bytes(w(0)), [&](int i) { return takes_row_tiles(fk.pick(g.count[i]), w(i)); });
  }

  LoraMoe& L;
  LoraMoe::Scratch& sc;
  LoraContext::State& st_;
  const TokenGroups& g;
  const int S, H, r;
  const float s_;
  int s0 = 0;
  Lm wt[6];
  std::vector<const float*> ys;  // per subpool: its partial y (or dx), null for an empty slice
  std::vector<Block> rows;
};

class SftForwardTask : public SftTask {
 public:
  enum Phase { kGather, kBaseGU, kLoraGU, kBaseDown, kLoraDown, kMerge, kPhases };
  static constexpr const char* kNames[kPhases] = {"sft_gather", "sft_gate_up", "sft_lora_gu", "sft_down", "sft_lora_down",
                                                   "sft_merge"};

  SftForwardTask(LoraMoe& l, const MoeInput& in, const LoraWeights& w, LoraContext::State& st)
      : SftTask(l, st, w), in_(in), gu_runs(S), dn_runs(S) {
    quant = l.options_.format.format != WeightFormat::bf16;
  }
  int phases() const override { return kPhases; }

  int items(int phase, int s) override {
    const int n = static_cast<int>(g.active.size());
    switch (phase) {
      case kGather:
        if (s == 0) allocate();  // here, not when built: the pool's scratch is this task's once it runs
        return spread(int(rows.size()), s);
      case kBaseGU:
        if (!len(s)) return 0;
        gu_runs[s] = Runs::plan(n, 2, (len(s) + kPanel - 1) / kPanel, L.packs_->gate(s, g.active[0]).panel_stride, L.pool_.threads(s),
                                Runs::input_bytes(L.packs_->gate(s, g.active[0]), g.total_rows, n));
        return gu_runs[s].items(n);
      case kLoraGU: return len(s) ? static_cast<int>(rows.size()) : 0;
      case kBaseDown:
        if (!len(s)) return 0;
        dn_runs[s] = Runs::plan(n, 1, (H + kPanel - 1) / kPanel, L.packs_->down(s, g.active[0]).panel_stride, L.pool_.threads(s),
                                Runs::input_bytes(L.packs_->down(s, g.active[0]), g.total_rows, n));
        return dn_runs[s].items(n);
      case kLoraDown: return st_.lora ? spread(int(rows.size()), s) : 0;
      case kMerge: return spread(in_.tokens * merge_blocks(), s);
    }
    return 0;
  }

  void run(int phase, int s, int item, int) override {
    trace::Span span(kNames[phase], {L.layer_, static_cast<int>(g.active.size()), in_.tokens});
    switch (phase) {
      case kGather: gather(rows[s + item * S]); break;
      case kBaseGU: base_gu(s, gu_runs[s].item(item)); break;
      case kLoraGU: lora_gu(s, rows[item]); break;
      case kBaseDown: base_down(s, dn_runs[s].item(item)); break;
      case kLoraDown: lora_down(rows[s + item * S]); break;
      case kMerge: merge(s + item * S); break;
    }
  }

 private:
  void allocate() {
    const size_t R = g.total_rows;
    const int n = static_cast<int>(g.active.size());
    st_.xg = raw<bf16_t>(R * H);
    st_.gu.resize(S);
    sc.h.resize(S);
    sc.y.resize(S);
    sc.pdp.resize(S);
    sc.qmid.resize(S);
    if (st_.lora) {
      st_.pgu = raw<float>(R * 2 * r);
      st_.pd = raw<float>(R * r);
    }
    if (quant) {
      sc.qin.resize(n);
      for (int i = 0; i < n; ++i) sc.qin[i].prepare(L.packs_->gate(s0, g.active[i]), g.count[i]);
    }
    if (L.packs_->down_bias()) {
      sc.row_expert.resize(R);
      for (int i = 0; i < n; ++i) std::fill_n(sc.row_expert.begin() + g.offset[i], g.count[i], g.active[i]);
    }
    plan_tiles(sc.tiles_in, [&](int i) -> const PackedWeight& { return L.packs_->gate(s0, g.active[i]); });
    sc.tiles_mid.resize(S);
    for (int s = 0; s < S; ++s) {
      sc.tiles_mid[s].at.clear();
      if (!len(s)) continue;
      plan_tiles(sc.tiles_mid[s], [&](int i) -> const PackedWeight& { return L.packs_->down(s, g.active[i]); });
      st_.gu[s] = raw<float>(R * 2 * len(s));
      sc.h[s].get(R * len(s));
      ys[s] = sc.y[s].get(R * H);
      if (st_.lora) sc.pdp[s].get(R * r);
      if (quant) {
        sc.qmid[s].resize(n);
        for (int i = 0; i < n; ++i) sc.qmid[s][i].prepare(L.packs_->down(s, g.active[i]), g.count[i]);
      }
    }
    st_.bytes = R * (H * sizeof(bf16_t) + sizeof(float) + (st_.lora ? 3 * r * sizeof(float) : 0)) +
                R * 2 * L.shape_.inter * sizeof(float) + (g.rows_token.size() + g.slot_row.size()) * sizeof(int);
  }

  void gather(const Block& b) {
    const int i = b.i, off = g.offset[i], m = b.end - b.begin;
    bf16_t* xg = st_.xg.get() + size_t(off) * H;
    core::gather_rows(in_, g, i, b.begin, b.end, H, xg, quant ? &sc.qin[i] : nullptr, *L.kt_);
    if (quant)
      sc.tiles_in.pack_rows(i, sc.qin[i].q.data(), sc.qin[i].k_pad, b.begin, b.end);
    else
      sc.tiles_in.pack_rows(i, xg, sizeof(bf16_t) * H, b.begin, b.end);
    if (!st_.lora) return;
    thread_local std::vector<float> xf;
    xf.resize(size_t(m) * H);
    widen(xg + size_t(b.begin) * H, xf.data(), xf.size());
    const int e = g.active[i];
    float* p = st_.pgu.get() + size_t(off + b.begin) * 2 * r;
    mm(m, r, H, 1.0f, {xf.data(), H}, wt[AG].of(e).T(), 0.0f, p, 2 * r);
    mm(m, r, H, 1.0f, {xf.data(), H}, wt[AU].of(e).T(), 0.0f, p + r, 2 * r);
  }

  void base_gu(int s, Runs::Item it) {
    const int e = g.active[it.i], l = len(s);
    const PackedWeight& w = it.w == 0 ? L.packs_->gate(s, e) : L.packs_->up(s, e);
    base_gemm(w, it, st_.xg.get(), quant ? &sc.qin[it.i] : nullptr, H, st_.gu[s].get() + it.w * l, 2 * l, sc.tiles_in);
  }

  void lora_gu(int s, const Block& b) {
    const int i = b.i, e = g.active[i], l = len(s), i0 = L.packs_->slice(s).first, m = b.end - b.begin;
    const size_t row0 = size_t(g.offset[i]) + b.begin;
    float* gu = st_.gu[s].get() + row0 * 2 * l;
    if (st_.lora) {
      const float* p = st_.pgu.get() + row0 * 2 * r;
      mm(m, l, r, s_, {p, 2 * r}, wt[BG].of(e).at(i0, 0).T(), 1.0f, gu, 2 * l);
      mm(m, l, r, s_, {p + r, 2 * r}, wt[BU].of(e).at(i0, 0).T(), 1.0f, gu + l, 2 * l);
    }
    // The biases, added to base + LoRA as the inference epilogue adds them to the base
    // (the same fp32 additions: with B = 0 the two forwards are the same bits). The saved
    // pre-activations include them, so the backward's derivatives see what the forward did.
    if (const float* gb = L.packs_->gate_bias(s, e)) {
      const float* ub = L.packs_->up_bias(s, e);
      for (int q = 0; q < m; ++q) {
        float* gq = gu + size_t(q) * 2 * l;
        for (int j = 0; j < l; ++j) {
          gq[j] += gb[j];
          gq[l + j] += ub[j];
        }
      }
    }
    thread_local std::vector<float> h;
    h.resize(size_t(m) * l);
    bf16_t* hb = sc.h[s].data() + row0 * l;
    const GateAct& act = L.shape_.act;
    for (int q = 0; q < m; ++q) {
      const float* gq = gu + size_t(q) * 2 * l;
      if (act.plain())
        L.kt_->silu_mul(gq, gq + l, h.data() + size_t(q) * l, l);
      else
        L.kt_->clamped_swiglu(gq, gq + l, h.data() + size_t(q) * l, l, act.alpha, act.limit, act.up_offset);
    }
    fp32_to_bf16(h.data(), hb, h.size());
    if (quant) {
      quantize_activations(sc.qmid[s][i], sc.h[s].data() + size_t(g.offset[i]) * l, l, b.begin, b.end, L.kt_);
      sc.tiles_mid[s].pack_rows(i, sc.qmid[s][i].q.data(), sc.qmid[s][i].k_pad, b.begin, b.end);
    } else {
      sc.tiles_mid[s].pack_rows(i, sc.h[s].data() + size_t(g.offset[i]) * l, sizeof(bf16_t) * l, b.begin, b.end);
    }
    if (st_.lora) mm(m, r, l, 1.0f, {h.data(), l}, wt[AD].of(e).at(0, i0).T(), 0.0f, sc.pdp[s].data() + row0 * r, r);
  }

  void base_down(int s, Runs::Item it) {
    const int l = len(s);
    base_gemm(L.packs_->down(s, g.active[it.i]), it, sc.h[s].data(), quant ? &sc.qmid[s][it.i] : nullptr, l,
              sc.y[s].data(), H, sc.tiles_mid[s]);
  }

  void lora_down(const Block& b) {
    const int i = b.i, e = g.active[i], m = b.end - b.begin;
    const size_t row0 = size_t(g.offset[i]) + b.begin;
    float* pd = st_.pd.get() + row0 * r;
    std::fill(pd, pd + size_t(m) * r, 0.0f);
    for (int s = 0; s < S; ++s) {
      if (!len(s)) continue;
      const float* p = sc.pdp[s].data() + row0 * r;
      for (size_t k = 0; k < size_t(m) * r; ++k) pd[k] += p[k];
    }
    mm(m, H, r, s_, {pd, r}, wt[BD].of(e).T(), 1.0f, sc.y[s0].data() + row0 * H, H);
  }

  void merge(int idx) {
    const int t = idx / merge_blocks(), j0 = (idx % merge_blocks()) * kMergeCols;
    core::merge_block(in_.out, in_.accumulate, t, in_.top_k, g.slot_row.data(), in_.weights, ys.data(), S, H, j0,
                      std::min(H, j0 + kMergeCols), L.packs_->down_bias(), sc.row_expert.data());
  }

  MoeInput in_;
  bool quant = false;
  std::vector<Runs> gu_runs, dn_runs;
};

LoraContext LoraMoe::forward(const MoeInput& in, const LoraWeights& lora, bool train) {
  TANDEM_CHECK(loaded_, Errc::invalid_argument, "lora: layer ", layer_, " has no weights (call load first)");
  TANDEM_CHECK(in.expert_mask == nullptr, Errc::unsupported, "lora: layer ", layer_,
               ": expert_mask is not supported in training (every expert of a LoRA layer is on the CPU)");
  check_lora(lora, "forward weights", false);
  auto st = std::make_unique<LoraContext::State>();
  st->g = group_tokens(in, shape_.experts, layer_);
  st->layer_id = id_;
  st->layer_index = layer_;
  st->tokens = in.tokens;
  st->top_k = in.top_k;
  st->lora = lora.a_gate.data != nullptr;
  st->config = options_.lora;
  LoraContext ctx;
  if (in.tokens == 0) {
    if (train) ctx.s_ = std::move(st);
    return ctx;
  }
  const TokenGroups& g = st->g;
  st->wrow = raw<float>(g.total_rows);
  for (size_t i = 0; i < g.slot_row.size(); ++i)
    if (g.slot_row[i] >= 0) st->wrow[g.slot_row[i]] = in.weights[i];
  if (g.total_rows == 0) {  // every slot empty: out = 0 (or unchanged)
    if (!in.accumulate) std::fill(in.out, in.out + size_t(in.tokens) * shape_.hidden, 0.0f);
  } else {
    pool_.wait(pool_.submit(std::make_shared<SftForwardTask>(*this, in, lora, *st)));
  }
  if (train) ctx.s_ = std::move(st);
  return ctx;
}

// ---- backward --------------------------------------------------------------------------

class SftBackwardTask : public SftTask {
 public:
  enum Phase { kGather, kDBd, kBaseDh, kAct, kSliceGrads, kBaseDx, kLoraDx, kAGrads, kMerge, kPhases };
  static constexpr const char* kNames[kPhases] = {"sft_bw_gather", "sft_bw_dBd", "sft_bw_dh", "sft_bw_act", "sft_bw_grads",
                                                   "sft_bw_dx", "sft_bw_lora_dx", "sft_bw_dA", "sft_bw_merge"};

  SftBackwardTask(LoraMoe& l, LoraContext::State& st, const LoraWeights& w, const SftGrad& grad)
      : SftTask(l, st, w), gr(grad), dh_runs(S), dx_runs(S) {
    resolve_all(grad.grads, gw);
    for (int i = 0; i < static_cast<int>(g.count.size()); ++i)
      for (int c = 0; c < H; c += kColChunk) hcols.push_back({i, c, std::min(H, c + kColChunk)});
    for (int s = 0; s < S; ++s) {
      scols.emplace_back();
      for (int i = 0; i < static_cast<int>(g.count.size()); ++i)
        for (int c = 0; c < len(s); c += kColChunk) scols[s].push_back({i, c, std::min(len(s), c + kColChunk)});
    }
    quant = l.options_.backward_format != WeightFormat::bf16;
  }
  int phases() const override { return kPhases; }

  int items(int phase, int s) override {
    const int n = static_cast<int>(g.active.size());
    const bool lora = st_.lora;
    switch (phase) {
      case kGather:
        if (s == 0) allocate();  // here, not when built: the pool's scratch is this task's once it runs
        return spread(int(rows.size()), s);
      case kDBd: return lora && gw[5] ? spread(int(hcols.size()), s) : 0;
      case kBaseDh:
        if (!len(s)) return 0;
        dh_runs[s] = Runs::plan(n, 1, (len(s) + kPanel - 1) / kPanel, L.back_[s].down_t[g.active[0]].panel_stride,
                                L.pool_.threads(s), Runs::input_bytes(L.back_[s].down_t[g.active[0]], g.total_rows, n));
        return dh_runs[s].items(n);
      case kAct: return len(s) ? static_cast<int>(rows.size()) : 0;
      case kSliceGrads: return lora && len(s) ? static_cast<int>(scols[s].size()) : 0;
      case kBaseDx:
        if (!len(s) || !gr.d_x) return 0;
        dx_runs[s] = Runs::plan(n, 1, (H + kPanel - 1) / kPanel, L.back_[s].gu_t[g.active[0]].panel_stride, L.pool_.threads(s),
                                Runs::input_bytes(L.back_[s].gu_t[g.active[0]], g.total_rows, n));
        return dx_runs[s].items(n);
      case kLoraDx: return lora ? spread(int(rows.size()), s) : 0;
      case kAGrads: return lora && (gw[0] || gw[2]) ? spread(int(hcols.size()), s) : 0;
      case kMerge: return gr.d_x || gr.d_weights ? spread(st_.tokens * merge_blocks(), s) : 0;
    }
    return 0;
  }

  void run(int phase, int s, int item, int) override {
    trace::Span span(kNames[phase], {L.layer_, static_cast<int>(g.active.size()), st_.tokens});
    switch (phase) {
      case kGather: gather(rows[s + item * S]); break;
      case kDBd: d_bd(hcols[s + item * S]); break;
      case kBaseDh: base_dh(s, dh_runs[s].item(item)); break;
      case kAct: act(s, rows[item]); break;
      case kSliceGrads: slice_grads(s, scols[s][item]); break;
      case kBaseDx: base_dx(s, dx_runs[s].item(item)); break;
      case kLoraDx: lora_dx(rows[s + item * S]); break;
      case kAGrads: a_grads(hcols[s + item * S]); break;
      case kMerge: merge(s + item * S); break;
    }
  }

 private:
  void allocate() {
    const size_t R = g.total_rows;
    const int n = static_cast<int>(g.active.size());
    sc.dog.get(R * H);
    if (L.packs_->down_bias() && gr.d_weights) sc.dwb.get(R);
    if (st_.lora) {
      sc.dogf.get(R * H);
      sc.qd.get(R * r);
      sc.wqd.get(R * r);
      sc.wpd.get(R * r);
      sc.qgu.get(R * 2 * r);
    }
    for (auto* v : {&sc.dh, &sc.dguf, &sc.qgup, &sc.y, &sc.dwp}) v->resize(S);
    sc.dgub.resize(S);
    sc.qbmid.resize(S);
    plan_tiles(sc.tiles_bin, [&](int i) -> const PackedWeight& { return L.back_[s0].down_t[g.active[i]]; });
    sc.tiles_bmid.resize(S);
    if (quant) {
      sc.qbin.resize(n);
      for (int i = 0; i < n; ++i) sc.qbin[i].prepare(L.back_[s0].down_t[g.active[i]], g.count[i]);
    }
    for (int s = 0; s < S; ++s) {
      const size_t l = len(s);
      sc.tiles_bmid[s].at.clear();
      if (!l) continue;
      if (gr.d_x)  // only the dx product reads them
        plan_tiles(sc.tiles_bmid[s], [&](int i) -> const PackedWeight& { return L.back_[s].gu_t[g.active[i]]; });
      sc.dh[s].get(R * l);
      sc.dguf[s].get(R * 2 * l);
      sc.dgub[s].get(R * 2 * l);
      sc.dwp[s].get(R);
      if (st_.lora) sc.qgup[s].get(R * 2 * r);
      if (gr.d_x) ys[s] = sc.y[s].get(R * H);  // dx partials
      if (quant) {
        sc.qbmid[s].resize(n);
        for (int i = 0; i < n; ++i) sc.qbmid[s][i].prepare(L.back_[s].gu_t[g.active[i]], g.count[i]);
      }
    }
  }

  void gather(const Block& b) {
    const int i = b.i, off = g.offset[i], m = b.end - b.begin;
    const size_t row0 = size_t(off) + b.begin;
    bf16_t* dog = sc.dog.data() + size_t(off) * H;
    for (int q = b.begin; q < b.end; ++q) {
      const int t = g.rows_token[off + q];
      if (gr.d_out) {
        fp32_to_bf16(gr.d_out + size_t(t) * H, dog + size_t(q) * H, H);
        if (st_.lora) std::memcpy(sc.dogf.data() + size_t(off + q) * H, gr.d_out + size_t(t) * H, sizeof(float) * H);
      } else {
        std::memcpy(dog + size_t(q) * H, gr.d_out_bf16 + size_t(t) * H, sizeof(bf16_t) * H);
        if (st_.lora)
          widen(gr.d_out_bf16 + size_t(t) * H, sc.dogf.data() + size_t(off + q) * H, H);
      }
    }
    if (quant) {
      quantize_activations(sc.qbin[i], dog, H, b.begin, b.end, L.kt_);
      sc.tiles_bin.pack_rows(i, sc.qbin[i].q.data(), sc.qbin[i].k_pad, b.begin, b.end);
    } else {
      sc.tiles_bin.pack_rows(i, dog, sizeof(bf16_t) * H, b.begin, b.end);
    }
    const int e = g.active[i];
    // d out_row / d weight includes the down bias: b_d . dOut (fp32 dOut, in double).
    if (const float* bd = L.packs_->down_bias(); bd && gr.d_weights) {
      bd += size_t(e) * H;
      for (int q = b.begin; q < b.end; ++q) {
        const int t = g.rows_token[off + q];
        double d = 0;
        if (gr.d_out) {
          const float* o = gr.d_out + size_t(t) * H;
          for (int j = 0; j < H; ++j) d += double(bd[j]) * o[j];
        } else {
          const bf16_t* o = gr.d_out_bf16 + size_t(t) * H;
          for (int j = 0; j < H; ++j) d += double(bd[j]) * widen(o[j]);
        }
        sc.dwb[size_t(off) + q] = d;
      }
    }
    if (!st_.lora) return;
    float* qd = sc.qd.data() + row0 * r;
    mm(m, r, H, 1.0f, {sc.dogf.data() + row0 * H, H}, wt[BD].of(e), 0.0f, qd, r);
    for (int q = 0; q < m; ++q) {
      const float w = st_.wrow[row0 + q];
      for (int k = 0; k < r; ++k) {
        sc.wqd[(row0 + q) * r + k] = w * qd[size_t(q) * r + k];
        sc.wpd[(row0 + q) * r + k] = w * st_.pd[(row0 + q) * r + k];
      }
    }
  }

  // dBd[c0:c1, :] += s (w dOut)^T[c0:c1] (h Ad^T)
  void d_bd(const Block& c) {
    const int i = c.i, e = g.active[i], off = g.offset[i], m = g.count[i];
    mm_into(gw[BD].of(e).at(c.begin, 0), c.end - c.begin, r, m, s_, Mat{sc.dogf.data() + size_t(off) * H + c.begin, H}.T(),
            {sc.wpd.data() + size_t(off) * r, r}, 1.0f);
  }

  void base_dh(int s, Runs::Item it) {
    base_gemm(L.back_[s].down_t[g.active[it.i]], it, sc.dog.data(), quant ? &sc.qbin[it.i] : nullptr, H,
              sc.dh[s].data(), len(s), sc.tiles_bin);
  }

  void act(int s, const Block& b) {
    const int i = b.i, e = g.active[i], l = len(s), i0 = L.packs_->slice(s).first, m = b.end - b.begin;
    const size_t row0 = size_t(g.offset[i]) + b.begin;
    float* dh = sc.dh[s].data() + row0 * l;
    if (st_.lora) mm(m, l, r, s_, {sc.qd.data() + row0 * r, r}, wt[AD].of(e).at(0, i0), 1.0f, dh, l);
    const float* gu = st_.gu[s].get() + row0 * 2 * l;
    float* dguf = sc.dguf[s].data() + row0 * 2 * l;
    bf16_t* dgub = sc.dgub[s].data() + row0 * 2 * l;
    thread_local std::vector<float> hrow, sgrow;
    hrow.resize(l);
    sgrow.resize(l);
    const GateAct& act = L.shape_.act;
    for (int q = 0; q < m; ++q) {
      const float w = st_.wrow[row0 + q];
      const float* gq = gu + size_t(q) * 2 * l;
      const float* uq = gq + l;
      float* dhq = dh + size_t(q) * l;
      // h as the forward computed it (the kernels' SiLU); the derivative from sigmoid(g),
      // with the same exponential (the kernel table's, vectorized under its level's flags).
      // In passes, so that the rest vectorizes too (the dw sum keeps its order).
      float* sg = sgrow.data();
      float* dgq = dguf + size_t(q) * 2 * l;
      bf16_t* dgbq = dgub + size_t(q) * 2 * l;
      if (act.plain()) {
        L.kt_->silu_mul(gq, uq, hrow.data(), l);
        L.kt_->sigmoid(gq, sg, l);
      } else {
        L.kt_->clamped_swiglu(gq, uq, hrow.data(), l, act.alpha, act.limit, act.up_offset);
        for (int j = 0; j < l; ++j) dgq[j] = act.alpha * std::min(gq[j], act.limit);  // scratch: alpha g'
        L.kt_->sigmoid(dgq, sg, l);
      }
      double dw = 0;
      for (int j = 0; j < l; ++j) dw += double(hrow[j]) * dhq[j];
      if (act.plain()) {
        for (int j = 0; j < l; ++j) {
          const float gv = gq[j], uv = uq[j], sj = sg[j];
          const float d = w * dhq[j];
          const float dg = d * uv * sj * (1.0f + gv * (1.0f - sj)), du = d * (gv * sj);
          dgq[j] = dg;
          dgq[l + j] = du;
        }
      } else {
        // h = g' sigmoid(alpha g') (u' + c), g' = min(g, L), u' = clamp(u, -L, L): the clamps
        // pass the gradient where they do not bind (torch's rule: g <= L, -L <= u <= L).
        const float a = act.alpha, lim = act.limit, c = act.up_offset;
        for (int j = 0; j < l; ++j) {
          const float gv = std::min(gq[j], lim), uv = std::min(std::max(uq[j], -lim), lim), sj = sg[j];
          const float d = w * dhq[j];
          const float dg = gq[j] <= lim ? d * (uv + c) * sj * (1.0f + a * gv * (1.0f - sj)) : 0.0f;
          const float du = uq[j] >= -lim && uq[j] <= lim ? d * (gv * sj) : 0.0f;
          dgq[j] = dg;
          dgq[l + j] = du;
        }
      }
      for (int j = 0; j < 2 * l; ++j) dgbq[j] = round_to_bf16(dgq[j]);  // fp32_to_bf16's rule, inline
      std::memcpy(dhq, hrow.data(), sizeof(float) * l);  // h replaces the row of dh after its last read
      sc.dwp[s][row0 + q] = static_cast<float>(dw);
    }
    if (quant) {
      quantize_activations(sc.qbmid[s][i], sc.dgub[s].data() + size_t(g.offset[i]) * 2 * l, 2 * l, b.begin, b.end, L.kt_);
      sc.tiles_bmid[s].pack_rows(i, sc.qbmid[s][i].q.data(), sc.qbmid[s][i].k_pad, b.begin, b.end);
    } else {
      sc.tiles_bmid[s].pack_rows(i, sc.dgub[s].data() + size_t(g.offset[i]) * 2 * l, sizeof(bf16_t) * 2 * l, b.begin, b.end);
    }
    if (st_.lora) {
      float* q = sc.qgup[s].data() + row0 * 2 * r;
      mm(m, r, l, 1.0f, {dguf, 2 * l}, wt[BG].of(e).at(i0, 0), 0.0f, q, 2 * r);
      mm(m, r, l, 1.0f, {dguf + l, 2 * l}, wt[BU].of(e).at(i0, 0), 0.0f, q + r, 2 * r);
    }
  }

  // The gradients over this subpool's slice: dAd[:, slice], dBg[slice, :], dBu[slice, :].
  void slice_grads(int s, const Block& c) {
    const int i = c.i, e = g.active[i], off = g.offset[i], m = g.count[i], l = len(s), i0 = L.packs_->slice(s).first;
    const int c0 = c.begin, w = c.end - c.begin;
    if (gw[AD])
      mm_into(gw[AD].of(e).at(0, i0 + c0), r, w, m, s_, Mat{sc.wqd.data() + size_t(off) * r, r}.T(),
              {sc.dh[s].data() + size_t(off) * l + c0, l}, 1.0f);
    const float* dguf = sc.dguf[s].data() + size_t(off) * 2 * l;
    const float* pgu = st_.pgu.get() + size_t(off) * 2 * r;
    if (gw[BG]) mm_into(gw[BG].of(e).at(i0 + c0, 0), w, r, m, s_, Mat{dguf + c0, 2 * l}.T(), {pgu, 2 * r}, 1.0f);
    if (gw[BU]) mm_into(gw[BU].of(e).at(i0 + c0, 0), w, r, m, s_, Mat{dguf + l + c0, 2 * l}.T(), {pgu + r, 2 * r}, 1.0f);
  }

  void base_dx(int s, Runs::Item it) {
    base_gemm(L.back_[s].gu_t[g.active[it.i]], it, sc.dgub[s].data(), quant ? &sc.qbmid[s][it.i] : nullptr, 2 * len(s),
              sc.y[s].data(), H, sc.tiles_bmid[s]);
  }

  void lora_dx(const Block& b) {
    const int i = b.i, e = g.active[i], m = b.end - b.begin;
    const size_t row0 = size_t(g.offset[i]) + b.begin;
    float* q = sc.qgu.data() + row0 * 2 * r;
    std::fill(q, q + size_t(m) * 2 * r, 0.0f);
    for (int s = 0; s < S; ++s) {
      if (!len(s)) continue;
      const float* p = sc.qgup[s].data() + row0 * 2 * r;
      for (size_t k = 0; k < size_t(m) * 2 * r; ++k) q[k] += p[k];
    }
    if (!gr.d_x) return;
    float* dx = sc.y[s0].data() + row0 * H;
    mm(m, H, r, s_, {q, 2 * r}, wt[AG].of(e), 1.0f, dx, H);
    mm(m, H, r, s_, {q + r, 2 * r}, wt[AU].of(e), 1.0f, dx, H);
  }

  // dAg[:, c0:c1] += s (dg Bg)^T x[:, c0:c1], and the same for up.
  void a_grads(const Block& c) {
    const int i = c.i, e = g.active[i], off = g.offset[i], m = g.count[i], w = c.end - c.begin;
    thread_local std::vector<float> xf;
    xf.resize(size_t(m) * w);
    for (int q = 0; q < m; ++q) widen(st_.xg.get() + size_t(off + q) * H + c.begin, xf.data() + size_t(q) * w, w);
    const float* q = sc.qgu.data() + size_t(off) * 2 * r;
    if (gw[AG]) mm_into(gw[AG].of(e).at(0, c.begin), r, w, m, s_, Mat{q, 2 * r}.T(), {xf.data(), w}, 1.0f);
    if (gw[AU]) mm_into(gw[AU].of(e).at(0, c.begin), r, w, m, s_, Mat{q + r, 2 * r}.T(), {xf.data(), w}, 1.0f);
  }

  void merge(int idx) {
    const int K = st_.top_k, t = idx / merge_blocks(), blk = idx % merge_blocks(), j0 = blk * kMergeCols,
              j1 = std::min(H, j0 + kMergeCols);
    if (gr.d_weights && blk == 0)
      for (int k = 0; k < K; ++k) {
        const int row = g.slot_row[size_t(t) * K + k];
        float dw = 0;
        if (row >= 0) {
          for (int s = 0; s < S; ++s)
            if (len(s)) dw += sc.dwp[s][row];
          if (L.packs_->down_bias()) dw += static_cast<float>(sc.dwb[row]);
        }
        gr.d_weights[size_t(t) * K + k] = dw;
      }
    if (!gr.d_x) return;
    core::merge_block(gr.d_x, gr.accumulate_x, t, K, g.slot_row.data(), nullptr, ys.data(), S, H, j0, j1);
  }

  const SftGrad& gr;
  bool quant = false;
  Lm gw[6];
  std::vector<Block> hcols;
  std::vector<std::vector<Block>> scols;
  std::vector<Runs> dh_runs, dx_runs;
};

void LoraMoe::backward(LoraContext& ctx, const LoraWeights& lora, const SftGrad& grad) {
  TANDEM_CHECK(!ctx.consumed_, Errc::invalid_argument, "lora: layer ", layer_,
               ": this context was already used by a backward (each forward's context serves one backward)");
  TANDEM_CHECK(ctx.s_ != nullptr, Errc::invalid_argument, "lora: layer ", layer_,
               ": backward without a forward context (the context is empty: was forward called with train = true?)");
  LoraContext::State& st = *ctx.s_;
  TANDEM_CHECK(st.layer_id == id_, Errc::invalid_argument, "lora: layer ", layer_,
               ": the context comes from another layer's forward (layer ", st.layer_index, ")");
  TANDEM_CHECK((grad.d_out != nullptr) != (grad.d_out_bf16 != nullptr), Errc::invalid_argument, "lora: layer ", layer_,
               ": give exactly one dL/dout (fp32 d_out or bf16 d_out_bf16)");
  TANDEM_CHECK(!st.lora || (st.config.rank == options_.lora.rank && st.config.scaling() == options_.lora.scaling()),
               Errc::invalid_argument, "lora: layer ", layer_, ": the forward ran with rank ", st.config.rank,
               " and scaling ", st.config.scaling(), ", the layer now has rank ", options_.lora.rank, " and scaling ",
               options_.lora.scaling(), " (set_lora between a forward and its backward)");
  check_lora(lora, "backward weights", false);
  check_lora(grad.grads, "gradients", true);
  const bool has = lora.a_gate.data != nullptr;
  TANDEM_CHECK(has == st.lora, Errc::invalid_argument, "lora: layer ", layer_, ": the forward ran ",
               st.lora ? "with" : "without", " LoRA weights but backward was given ", has ? "some" : "none");
  const LoraMatrix* gm[6] = {&grad.grads.a_gate, &grad.grads.b_gate, &grad.grads.a_up,
                             &grad.grads.b_up,   &grad.grads.a_down, &grad.grads.b_down};
  if (!st.lora)
    for (const LoraMatrix* m : gm)
      TANDEM_CHECK(m->data == nullptr, Errc::invalid_argument, "lora: layer ", layer_,
                   ": LoRA gradients were asked for, but the forward ran without LoRA weights");
  prepare_backward();
  ctx.consumed_ = true;
  const int T = st.tokens, H = shape_.hidden;
  if (T == 0) return;
  if (st.g.total_rows == 0) {
    if (grad.d_x && !grad.accumulate_x) std::fill(grad.d_x, grad.d_x + size_t(T) * H, 0.0f);
    if (grad.d_weights) std::fill(grad.d_weights, grad.d_weights + size_t(T) * st.top_k, 0.0f);
  } else {
    pool_.wait(pool_.submit(std::make_shared<SftBackwardTask>(*this, st, lora, grad)));
  }
  ctx.s_.reset();  // the saved state is freed as soon as it has served
}

}  // namespace tandem
