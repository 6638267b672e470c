#include "tandem/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "tandem/error.h"
#include "tandem/trace.h"

namespace tandem {
namespace {

// An uninitialized, growable array: pages are first touched by whoever writes them
// (the subpool's own threads), not by the allocating thread.
template <typename T>
struct RawBuffer {
  std::unique_ptr<T[]> p;
  size_t cap = 0;
  T* get(size_t n) {
    if (n > cap) {
      p.reset(new T[n]);
      cap = n;
    }
    return p.get();
  }
};

}  // namespace

struct MoeLayer::Scratch {
  RawBuffer<bf16_t> xg;                          // gathered input rows (bf16 weights)
  std::vector<QuantizedActs> qin;                // per active expert (int weights)
  std::vector<RawBuffer<bf16_t>> h;              // per subpool: [rows x slice]
  std::vector<std::vector<QuantizedActs>> qmid;  // per subpool, per active expert
  std::vector<RawBuffer<float>> y;               // per subpool: [rows x hidden]
};

MoeLayer::MoeLayer(Pool& pool, MoeShape shape, PackOptions format, int layer_index)
    : pool_(pool), shape_(shape), format_(format), layer_(layer_index), kt_(&kernel_table(effective_isa())), scratch_(std::make_unique<Scratch>()) {
  TANDEM_CHECK(shape.experts >= 1 && shape.hidden >= 1 && shape.inter >= 1, Errc::invalid_argument, "moe: shape (experts ",
               shape.experts, ", hidden ", shape.hidden, ", intermediate ", shape.inter, ") must be positive");
  if (format.format == WeightFormat::int4) {
    TANDEM_CHECK(shape.hidden % format.group == 0 && shape.inter % format.group == 0, Errc::invalid_argument,
                 "moe: int4 group ", format.group, " must divide hidden (", shape.hidden, ") and intermediate (",
                 shape.inter, ")");
  }
  slices_ = intermediate_slices(shape.inter, pool.subpools(), format);
  shards_.resize(pool.subpools());
  for (auto& sh : shards_) {
    sh.gate_up.resize(shape.experts);
    sh.down.resize(shape.experts);
  }
}

MoeLayer::~MoeLayer() = default;

size_t MoeLayer::packed_bytes() const {
  size_t b = 0;
  for (const auto& sh : shards_)
    for (int e = 0; e < shape_.experts; ++e) b += sh.gate_up[e].bytes() + sh.down[e].bytes();
  return b;
}

void MoeLayer::exclude(const std::vector<int>& experts) {
  TANDEM_CHECK(!loaded_, Errc::invalid_argument, "moe: layer ", layer_, ": exclude() after load()");
  excluded_.assign(shape_.experts, 0);
  for (int e : experts) {
    TANDEM_CHECK(e >= 0 && e < shape_.experts, Errc::invalid_argument, "moe: layer ", layer_, ": excluded expert ", e,
                 " is outside [0, ", shape_.experts, ")");
    excluded_[e] = 1;
  }
}

std::vector<int> intermediate_slices(int inter, int subpools, const PackOptions& format) {
  const int unit = format.format == WeightFormat::int4 ? std::max(kPanel, format.group) : kPanel;
  const int units = (inter + unit - 1) / unit;
  std::vector<int> slices(subpools + 1);
  for (int s = 0; s <= subpools; ++s)
    slices[s] = std::min(inter, static_cast<int>(static_cast<int64_t>(units) * s / subpools) * unit);
  return slices;
}

void MoeLayer::load(const std::function<ExpertSource(int)>& source, const Progress& progress) {
  TANDEM_CHECK(static_cast<bool>(source), Errc::invalid_argument, "moe: load without a weight source");
  const MoeShape sh = shape_;
  const std::function<void(int, int)> pack_one = [this, &source, sh](int s, int e) {
    if (excluded(e)) return;
    const ExpertSource src = source(e);
    check_expert_source(src, sh, e);
    const int i0 = slices_[s], i1 = slices_[s + 1];
    if (i0 == i1) return;
    shards_[s].gate_up[e] = pack_gate_up(sub_view(src.gate, i0, i1 - i0, 0, sh.hidden),
                                         sub_view(src.up, i0, i1 - i0, 0, sh.hidden), format_);
    shards_[s].down[e] = pack(sub_view(src.down, 0, sh.hidden, i0, i1 - i0), format_);
  };
  for_each_item(pool_, shape_.experts, pack_one, progress);
  loaded_ = true;
}

void MoeLayer::load(const Checkpoint& ckpt, int layer, const ExpertNaming& naming, const Progress& progress) {
  // Resolve every expert's tensors up front so a missing key fails before any work.
  std::vector<ExpertSource> sources(shape_.experts);
  for (int e = 0; e < shape_.experts; ++e)
    if (!excluded(e)) sources[e] = checkpoint_expert(ckpt, layer, e, naming, shape_);
  load([&](int e) { return sources[e]; }, progress);
}

// ---- forward ---------------------------------------------------------------------

class MoeTask : public Task, public TokenGroups {
 public:
  enum Phase { kGather, kGateUp, kAct, kDown, kMerge, kPhases };
  static constexpr const char* kNames[kPhases] = {"gather", "gate_up", "act", "down", "merge"};
  static constexpr int kMergeCols = 512;

  MoeTask(MoeLayer& l, const MoeInput& in)
      : L(l), in_(in), gu_runs(l.pool_.subpools()), dn_runs(l.pool_.subpools()) {}
  int phases() const override { return kPhases; }

  int items(int phase, int s) override {
    const int S = L.pool_.subpools();
    const int n = static_cast<int>(active.size());
    const bool quant = L.format_.format != WeightFormat::bf16;
    const auto [i0, i1] = L.slice(s);
    const int len = i1 - i0;
    switch (phase) {
      case kGather:
        if (s == 0) {
          begin_ns = trace::now_ns();
          prepare();
        }
        return n / S + (s < n % S ? 1 : 0);  // active expert i goes to subpool i % S
      case kGateUp:
        return len && n ? n * plan(s, (len + kPanel - 1) / kPanel, 2 * L.shards_[s].gate_up[active[0]].panel_stride, gu_runs) : 0;
      case kAct: return quant && len ? n : 0;
      case kDown:
        return len && n ? n * plan(s, (L.shape_.hidden + kPanel - 1) / kPanel, L.shards_[s].down[active[0]].panel_stride, dn_runs) : 0;
      case kMerge: {
        const int total = in_.tokens * merge_blocks();
        return static_cast<int>(static_cast<int64_t>(total) * (s + 1) / S - static_cast<int64_t>(total) * s / S);
      }
    }
    return 0;
  }

  void run(int phase, int s, int item, int) override {
    trace::Span span(kNames[phase], {L.layer_, static_cast<int>(active.size()), in_.tokens});
    switch (phase) {
      case kGather: gather(active_index(s, item)); break;
      case kGateUp: gate_up(s, item); break;
      case kAct: act(s, item); break;
      case kDown: down(s, item); break;
      case kMerge: merge(s, item); break;
    }
  }

  void finished() override { trace::record("moe_layer", begin_ns, trace::now_ns(), {L.layer_, static_cast<int>(active.size()), in_.tokens}); }

 private:
  int active_index(int s, int item) const { return s + item * L.pool_.subpools(); }
  int merge_blocks() const { return (L.shape_.hidden + kMergeCols - 1) / kMergeCols; }
  const PackedWeight& layout_gate_up(int e) const {
    for (const auto& sh : L.shards_)
      if (sh.gate_up[e].panels) return sh.gate_up[e];
    return L.shards_[0].gate_up[e];
  }

  void prepare() {
    auto& sc = *L.scratch_;
    const int S = L.pool_.subpools(), n = static_cast<int>(active.size());
    const bool quant = L.format_.format != WeightFormat::bf16;
    if (quant) {
      sc.qin.resize(n);
      for (int i = 0; i < n; ++i) sc.qin[i].prepare(layout_gate_up(active[i]), count[i]);
    } else {
      sc.xg.get(static_cast<size_t>(total_rows) * L.shape_.hidden);
    }
    sc.h.resize(S);
    sc.y.resize(S);
    sc.qmid.resize(S);
    for (int s = 0; s < S; ++s) {
      const auto [i0, i1] = L.slice(s);
      if (i0 == i1) continue;
      sc.h[s].get(static_cast<size_t>(total_rows) * (i1 - i0));
      sc.y[s].get(static_cast<size_t>(total_rows) * L.shape_.hidden);
      if (quant) {
        sc.qmid[s].resize(n);
        for (int i = 0; i < n; ++i) sc.qmid[s][i].prepare(L.shards_[s].down[active[i]], count[i]);
      }
    }
  }

  void gather(int i) {
    auto& sc = *L.scratch_;
    const int H = L.shape_.hidden;
    const bool quant = L.format_.format != WeightFormat::bf16;
    const KernelTable& kt = *L.kt_;
    for (int r = 0; r < count[i]; ++r) {
      const int t = rows_token[offset[i] + r];
      const bf16_t* xb = in_.x ? in_.x + static_cast<size_t>(t) * H : nullptr;
      const float* xf = in_.x_f32 ? in_.x_f32 + static_cast<size_t>(t) * H : nullptr;
      if (quant) {
        QuantizedActs& q = sc.qin[i];
        const int groups = q.k_pad / q.group;
        kt.quantize(xb, xf, 1, H, H, q.k_pad, q.group, q.q.data() + static_cast<size_t>(r) * q.k_pad, q.scale.data() + r,
                    q.sums.data() + static_cast<size_t>(r) * groups);
      } else {
        bf16_t* dst = sc.xg.p.get() + static_cast<size_t>(offset[i] + r) * H;
        if (xb)
          std::memcpy(dst, xb, sizeof(bf16_t) * H);
        else
          fp32_to_bf16(xf, dst, H);
      }
    }
  }

  // Work items are runs of `chunk` panels of one expert: about kItemBytes of weights
  // each (one panel of a small expert is too little to amortize an item's fixed cost and
  // the prefetcher's ramp), but at least 4 items per thread in the phase.
  static constexpr size_t kItemBytes = 512 << 10;
  struct Runs {
    int panels = 1, chunk = 1, per_expert = 1;  // per_expert = ceil(panels / chunk)
  };
  struct Run {
    int i, begin, end;  // active expert index, panel range
  };
  // Sets subpool s's runs for a phase; returns the items per expert.
  int plan(int s, int panels, size_t panel_bytes, std::vector<Runs>& runs) {
    const int threads = L.pool_.threads(s), n = static_cast<int>(active.size());
    int c = static_cast<int>(std::max<size_t>(1, kItemBytes / std::max<size_t>(1, panel_bytes)));
    c = std::min(c, std::max(1, n * panels / (4 * threads)));
    c = std::min(c, panels);
    runs[s] = {panels, c, (panels + c - 1) / c};
    return runs[s].per_expert;
  }
  static Run run_of(const Runs& r, int item) {
    const int begin = (item % r.per_expert) * r.chunk;
    return {item / r.per_expert, begin, std::min(r.panels, begin + r.chunk)};
  }

  void gate_up(int s, int item) {
    auto& sc = *L.scratch_;
    const auto [i0, i1] = L.slice(s);
    const int len = i1 - i0;
    const auto [i, begin, end] = run_of(gu_runs[s], item);
    const PackedWeight& w = L.shards_[s].gate_up[active[i]];
    GateUpArgs g;
    if (w.format == WeightFormat::bf16)
      g.a = sc.xg.p.get() + static_cast<size_t>(offset[i]) * L.shape_.hidden;
    else
      g.qa = &sc.qin[i];
    g.m = count[i];
    g.lda = L.shape_.hidden;
    g.h_bf16 = sc.h[s].p.get() + static_cast<size_t>(offset[i]) * len;
    g.ldh = len;
    g.panel_begin = begin;
    g.panel_end = end;
    L.kt_->of(w.format).pick(g.m).gate_up(w, g);
  }

  void act(int s, int i) {
    auto& sc = *L.scratch_;
    const auto [i0, i1] = L.slice(s);
    const int len = i1 - i0;
    quantize_activations(sc.qmid[s][i], sc.h[s].p.get() + static_cast<size_t>(offset[i]) * len, len, 0, count[i], L.kt_);
  }

  void down(int s, int item) {
    auto& sc = *L.scratch_;
    const auto [i0, i1] = L.slice(s);
    const int len = i1 - i0, H = L.shape_.hidden;
    const auto [i, begin, end] = run_of(dn_runs[s], item);
    const PackedWeight& w = L.shards_[s].down[active[i]];
    GemmArgs g;
    if (w.format == WeightFormat::bf16)
      g.a = sc.h[s].p.get() + static_cast<size_t>(offset[i]) * len;
    else
      g.qa = &sc.qmid[s][i];
    g.m = count[i];
    g.lda = len;
    g.c = sc.y[s].p.get() + static_cast<size_t>(offset[i]) * H;
    g.ldc = H;
    g.panel_begin = begin;
    g.panel_end = end;
    L.kt_->of(w.format).pick(g.m).gemm(w, g);
  }

  void merge(int s, int item) {
    auto& sc = *L.scratch_;
    const int S = L.pool_.subpools(), H = L.shape_.hidden, K = in_.top_k;
    const int64_t total = static_cast<int64_t>(in_.tokens) * merge_blocks();
    const int idx = static_cast<int>(total * s / S) + item;
    const int t = idx / merge_blocks(), j0 = (idx % merge_blocks()) * kMergeCols, j1 = std::min(H, j0 + kMergeCols);
    float* out = in_.out + static_cast<size_t>(t) * H;
    if (!in_.accumulate) std::fill(out + j0, out + j1, 0.0f);
    alignas(64) float sum[kMergeCols];
    for (int k = 0; k < K; ++k) {
      const int r = slot_row[static_cast<size_t>(t) * K + k];
      if (r < 0) continue;
      std::fill(sum, sum + (j1 - j0), 0.0f);
      for (int q = 0; q < S; ++q) {
        const auto [i0, i1] = L.slice(q);
        if (i0 == i1) continue;
        const float* y = sc.y[q].p.get() + static_cast<size_t>(r) * H;
        for (int j = j0; j < j1; ++j) sum[j - j0] += y[j];
      }
      const float wgt = in_.weights[static_cast<size_t>(t) * K + k];
      for (int j = j0; j < j1; ++j) out[j] += wgt * sum[j - j0];
    }
  }

  MoeLayer& L;
  MoeInput in_;
  int64_t begin_ns = 0;
  std::vector<Runs> gu_runs, dn_runs;  // per subpool: how gate_up / down items map to panels
};

TokenGroups group_tokens(const MoeInput& in, int experts, int layer, const std::vector<uint8_t>& excluded) {
  TANDEM_CHECK(in.tokens >= 0, Errc::invalid_argument, "moe: tokens = ", in.tokens, " is negative");
  TokenGroups g;
  if (in.tokens == 0) return g;
  TANDEM_CHECK((in.x != nullptr) != (in.x_f32 != nullptr), Errc::invalid_argument,
               "moe: give exactly one input (bf16 x or fp32 x_f32)");
  TANDEM_CHECK((in.ids != nullptr) != (in.ids_i64 != nullptr), Errc::invalid_argument,
               "moe: give exactly one of topk_ids (int32) and topk_ids_i64");
  TANDEM_CHECK(in.weights != nullptr, Errc::invalid_argument, "moe: topk_weights is null");
  TANDEM_CHECK(in.out != nullptr, Errc::invalid_argument, "moe: output is null");
  TANDEM_CHECK(in.top_k >= 1, Errc::invalid_argument, "moe: top_k = ", in.top_k, " must be at least 1");
  const int E = experts, K = in.top_k, T = in.tokens;
  auto is_excluded = [&](int64_t e) { return !excluded.empty() && excluded[e]; };
  std::vector<int> per_expert(E, 0);
  g.slot_row.assign(static_cast<size_t>(T) * K, -1);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      const size_t i = static_cast<size_t>(t) * K + k;
      const int64_t id = in.ids ? in.ids[i] : in.ids_i64[i];
      TANDEM_CHECK(id >= -1 && id < E, Errc::invalid_argument, "moe: topk_ids[", t, ", ", k, "] = ", id,
                   " is outside [-1, ", E, ")");
      TANDEM_CHECK(std::isfinite(in.weights[i]), Errc::invalid_argument, "moe: topk_weights[", t, ", ", k, "] = ",
                   in.weights[i], " is not finite");
      if (id < 0 || (in.expert_mask && !in.expert_mask[id])) continue;
      TANDEM_CHECK(!is_excluded(id), Errc::invalid_argument, "moe: topk_ids[", t, ", ", k, "] = ", id, ": layer ",
                   layer, " does not hold that expert on the CPU (excluded: it is placed elsewhere)");
      ++per_expert[id];
    }
  // Group rows per expert (experts ascending, tokens in order within each).
  std::vector<int> first(E, -1);
  for (int e = 0; e < E; ++e)
    if (per_expert[e]) {
      first[e] = g.total_rows;
      g.active.push_back(e);
      g.count.push_back(per_expert[e]);
      g.offset.push_back(g.total_rows);
      g.total_rows += per_expert[e];
    }
  g.rows_token.resize(g.total_rows);
  std::vector<int> fill(E, 0);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      const size_t i = static_cast<size_t>(t) * K + k;
      const int64_t id = in.ids ? in.ids[i] : in.ids_i64[i];
      if (id < 0 || (in.expert_mask && !in.expert_mask[id])) continue;
      const int row = first[id] + fill[id]++;
      g.rows_token[row] = t;
      g.slot_row[i] = row;
    }
  return g;
}

uint64_t MoeLayer::submit(const MoeInput& in) {
  TANDEM_CHECK(loaded_, Errc::invalid_argument, "moe: layer ", layer_, " has no weights (call load first)");
  TokenGroups groups = group_tokens(in, shape_.experts, layer_, excluded_);
  if (in.tokens == 0) return 0;
  auto task = std::make_shared<MoeTask>(*this, in);
  static_cast<TokenGroups&>(*task) = std::move(groups);
  return pool_.submit(std::move(task));
}

}  // namespace tandem
