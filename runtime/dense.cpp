// DenseLinear (tandem/dense.h): a dense layer's weight packed per subpool slice of its
// output panels; forward as one pool task of two phases (prepare the input once, then
// runs of panels).
#include "tandem/dense.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "bf16_round.h"
#include "expert_core.h"
#include "tandem/cpu_features.h"
#include "tandem/error.h"
#include "tandem/trace.h"

namespace tandem {

namespace {
// The first non-finite element of rows [r0, r0 + rows) of w, as an error naming it.
[[noreturn]] void refuse_non_finite(const WeightView& w, int r0, int rows, const std::string& name) {
  std::vector<float> row(w.k);
  for (int r = r0; r < r0 + rows; ++r) {
    decode_rows(w, r, 1, row.data());
    for (int c = 0; c < w.k; ++c)
      if (!std::isfinite(row[c]))
        TANDEM_FAIL(Errc::bad_format, name, ": weight element (", r, ", ", c, ") is ",
                    std::isnan(row[c]) ? "nan" : row[c] > 0 ? "inf" : "-inf", ": not finite");
  }
  TANDEM_FAIL(Errc::bad_format, name, ": the packed weight holds a non-finite value");
}
}  // namespace

DenseLinear::DenseLinear(Pool& pool, const KernelTable& kernels, const WeightView& w, const PackOptions& format,
                         std::string name)
    : DenseLinear(pool, kernels, w, format, std::move(name), 1) {}

DenseLinear::DenseLinear(Pool& pool, const KernelTable& kernels, const WeightView& w, const PackOptions& format,
                         std::string name, int groups)
    : pool_(pool), kt_(kernels), format_(format), name_(std::move(name)), n_(w.n), k_(w.k), groups_(groups) {
  TANDEM_CHECK(w.data && w.n > 0 && w.k > 0, Errc::invalid_argument, name_, ": dense weight [", w.n, " x ", w.k,
               "] is empty");
  TANDEM_CHECK(groups >= 1 && w.n % groups == 0 && (groups == 1 || (w.n / groups) % kPanel == 0),
               Errc::invalid_argument, name_, ": ", groups, " groups of a weight with n = ", w.n,
               " rows: each group needs a multiple of ", kPanel, " rows");
  TANDEM_CHECK(groups == 1 || format.format == WeightFormat::bf16, Errc::invalid_argument, name_,
               ": a grouped dense layer runs on bf16 weights, not ", format_name(format));
  TANDEM_CHECK(format.format != WeightFormat::int4 || w.k % format.group == 0, Errc::invalid_argument, name_,
               ": k = ", w.k, " is not a multiple of the int4 group size ", format.group,
               " (choose a group that divides it, or another dense_format)");
  const int S = pool.subpools(), panels = (w.n + kPanel - 1) / kPanel;
  pieces_.resize(S);
  int most = 0;
  for (int s = 0; s < S; ++s) {
    const int p0 = static_cast<int>(static_cast<int64_t>(panels) * s / S);
    const int p1 = static_cast<int>(static_cast<int64_t>(panels) * (s + 1) / S);
    const int T = std::max(1, std::min(pool.threads(s), p1 - p0));
    for (int t = 0; t < T && p1 > p0; ++t) {
      const int a = p0 + (p1 - p0) * t / T, b = p0 + (p1 - p0) * (t + 1) / T;
      const int n0 = std::min(w.n, a * kPanel), n1 = std::min(w.n, b * kPanel);
      if (n1 > n0) pieces_[s].push_back({n0, n1 - n0, {}});
    }
    most = std::max(most, static_cast<int>(pieces_[s].size()));
  }
  WeightView named = w;
  if (!named.name) named.name = name_.c_str();
  // Each subpool packs (first touches) its own pieces on its own threads.
  for_each_item(pool, most, [&](int s, int i) {
    if (i >= static_cast<int>(pieces_[s].size())) return;
    Piece& pc = pieces_[s][i];
    pc.w = pack(sub_view(named, pc.n0, pc.n, 0, w.k), format_);
    // The integer packs refuse non-finite weights themselves; bf16 would carry them.
    if (!core::finite_bf16(pc.w)) refuse_non_finite(w, pc.n0, pc.n, name_);
  }, {}, "pack_dense");
}

DenseLinear::~DenseLinear() = default;

size_t DenseLinear::bytes() const {
  size_t b = 0;
  for (const auto& ps : pieces_)
    for (const Piece& p : ps) b += p.w.bytes();
  return b;
}

namespace {
// The rows, inlined into each of the ISA-specific copies below so that the compiler
// vectorizes them at that width.
__attribute__((always_inline)) inline void norm_rows(const uint16_t* x, const uint16_t* w, float eps, int64_t rows,
                                                     int n, uint16_t* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* xr = x + r * n;
    uint16_t* yr = y + r * n;
    double acc[8] = {};  // independent partial sums: no add waits for the one before
    int i = 0;
    for (; i + 8 <= n; i += 8)
      for (int j = 0; j < 8; ++j) {
        const double v = from_bf16(xr[i + j]);
        acc[j] += v * v;
      }
    for (; i < n; ++i) {
      const double v = from_bf16(xr[i]);
      acc[0] += v * v;
    }
    const double ss = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    const float inv = 1.0f / std::sqrt(static_cast<float>(ss / n) + eps);
    for (int k = 0; k < n; ++k) yr[k] = round_to_bf16(from_bf16(w[k]) * from_bf16(round_to_bf16(from_bf16(xr[k]) * inv)));
  }
}

__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma"))) void norm_rows_avx512(
    const uint16_t* x, const uint16_t* w, float eps, int64_t rows, int n, uint16_t* y) {
  norm_rows(x, w, eps, rows, n, y);
}
__attribute__((target("avx2,fma"))) void norm_rows_avx2(const uint16_t* x, const uint16_t* w, float eps, int64_t rows,
                                                        int n, uint16_t* y) {
  norm_rows(x, w, eps, rows, n, y);
}
}  // namespace

// One copy per vector width, picked by the kernels' ISA level (effective_isa: the
// hardware's, or TANDEM_ISA's), not by an ifunc (sanitizer builds cannot run ifunc
// resolvers): the library's baseline build leaves the normalization in 128-bit vectors
// (3.3-3.6x slower at 1-2048 rows of 2048 values on the AMX Xeon).
void rms_norm_bf16(const uint16_t* x, const uint16_t* w, float eps, int64_t rows, int n, uint16_t* y) {
  TANDEM_CHECK(rows >= 0 && n >= 1, Errc::invalid_argument, "rms_norm: ", rows, " rows of ", n, " values");
  static const IsaLevel level = effective_isa();
  static const int width = level >= IsaLevel::avx512 ? 512 : level >= IsaLevel::avx2 ? 256 : 128;
  if (width == 512)
    norm_rows_avx512(x, w, eps, rows, n, y);
  else if (width == 256)
    norm_rows_avx2(x, w, eps, rows, n, y);
  else
    norm_rows(x, w, eps, rows, n, y);
}

std::vector<float> DenseLinear::dequantized() const {
  std::vector<float> out(static_cast<size_t>(n_) * k_);
  for (const auto& ps : pieces_)
    for (const Piece& p : ps) {
      const std::vector<float> part = unpack(p.w);
      std::copy(part.begin(), part.end(), out.begin() + static_cast<size_t>(p.n0) * k_);
    }
  return out;
}

// phase 0: fp32 input rounded to bf16, and quantized (integer formats), in blocks of
//          kPrepRows rows;
// phase 1: per subpool, runs of its pieces' panels (chunk from WorkRuns over the whole
//          slice) through the kernel table.
class DenseLinear::Forward final : public Task {
 public:
  Forward(DenseLinear& d, const void* x, bool x_bf16, int m, int ldx, float* y, int ldy, uint16_t* yb = nullptr)
      : d_(d), x_(x), x_bf16_(x_bf16), m_(m), ldx_(ldx), y_(y), ldy_(ldy), yb_(yb), chunk_(d.pieces_.size(), 1),
        first_(d.pieces_.size()) {
    if (yb_) {  // fp32 results into scratch, each item's columns rounded into yb_ by the thread that made them
      yf_.resize(static_cast<size_t>(m) * d.n_);
      y_ = yf_.data();
      ldy_ = d.n_;
      ldyb_ = ldy;
    }
    if (d.format_.format != WeightFormat::bf16)
      for (const auto& ps : d.pieces_)
        if (!ps.empty()) {
          qa_.prepare(ps[0].w, m);
          break;
        }
    if (!x_bf16) xb_.resize(static_cast<size_t>(m) * d.k_ * d.groups_);
  }
  int phases() const override { return 2; }
  int items(int phase, int s) override {
    const int S = static_cast<int>(d_.pieces_.size());
    if (phase == 0) {
      const bool work = d_.format_.format != WeightFormat::bf16 || !x_bf16_;
      const int blocks = work ? (m_ + kPrepRows - 1) / kPrepRows : 0;
      return blocks * (s + 1) / S - blocks * s / S;
    }
    const auto& ps = d_.pieces_[s];
    if (ps.empty() || m_ == 0) return 0;
    int panels = 0;
    for (const Piece& p : ps) panels += p.w.panels;
    const PackedWeight& w0 = ps[0].w;
    const size_t input = core::WorkRuns::input_bytes(w0, m_, 1);
    chunk_[s] = core::WorkRuns::plan(1, 1, panels, w0.panel_stride, d_.pool_.threads(s), input).chunk;
    first_[s].assign(1, 0);  // first_[s][i]: the first item of piece i
    for (const Piece& p : ps) first_[s].push_back(first_[s].back() + (p.w.panels + chunk_[s] - 1) / chunk_[s]);
    return first_[s].back();
  }
  void run(int phase, int s, int item, int) override {
    const int S = static_cast<int>(d_.pieces_.size());
    if (phase == 0) {
      const int blocks = (m_ + kPrepRows - 1) / kPrepRows;
      const int b = blocks * s / S + item;
      const int r0 = b * kPrepRows, r1 = std::min(m_, r0 + kPrepRows);
      // fp32 input is rounded to bf16 first in every format (as the experts see it), so
      // the result does not depend on the input's dtype.
      const int row = d_.k_ * d_.groups_;
      if (!x_bf16_)
        for (int r = r0; r < r1; ++r)
          fp32_to_bf16(static_cast<const float*>(x_) + static_cast<size_t>(r) * ldx_,
                       xb_.data() + static_cast<size_t>(r) * row, row);
      if (d_.format_.format != WeightFormat::bf16) {
        const bf16_t* a = x_bf16_ ? static_cast<const bf16_t*>(x_) : xb_.data();
        quantize_activations(qa_, a, x_bf16_ ? ldx_ : d_.k_, r0, r1, &d_.kt_);
      }
      return;
    }
    const std::vector<int>& first = first_[s];
    const int i = static_cast<int>(std::upper_bound(first.begin(), first.end(), item) - first.begin()) - 1;
    const Piece& pc = d_.pieces_[s][i];
    const int begin = (item - first[i]) * chunk_[s], end = std::min(pc.w.panels, begin + chunk_[s]);
    const bf16_t* a = x_bf16_ ? static_cast<const bf16_t*>(x_) : xb_.data();
    const int lda = x_bf16_ ? ldx_ : d_.k_ * d_.groups_;
    const bool quant = d_.format_.format != WeightFormat::bf16;
    if (d_.groups_ == 1) {
      core::run_gemm(d_.kt_, pc.w, m_, begin, end, quant ? nullptr : a, quant ? &qa_ : nullptr, lda, y_ + pc.n0, ldy_);
      round_out(pc, begin, end);
      return;
    }
    // Grouped (bf16): the panels of each group against that group's k inputs of every row.
    const int per_group = d_.n_ / d_.groups_ / kPanel;  // panels per group
    for (int p = begin; p < end;) {
      const int g = (pc.n0 / kPanel + p) / per_group;
      const int q = std::min(end, (g + 1) * per_group - pc.n0 / kPanel);
      core::run_gemm(d_.kt_, pc.w, m_, p, q, a + static_cast<size_t>(g) * d_.k_, nullptr, lda, y_ + pc.n0, ldy_);
      p = q;
    }
    round_out(pc, begin, end);
  }
  void finished() override { trace::record("dense", begin_ns_, trace::now_ns(), {-1, -1, m_}); }

 private:
  // bf16 output: the columns of panels [begin, end) of piece pc, every row, rounded.
  void round_out(const Piece& pc, int begin, int end) {
    if (!yb_) return;
    const int c0 = pc.n0 + begin * kPanel, c1 = std::min(pc.n0 + pc.n, pc.n0 + end * kPanel);
    for (int r = 0; r < m_; ++r)
      fp32_to_bf16(y_ + static_cast<size_t>(r) * ldy_ + c0, yb_ + static_cast<size_t>(r) * ldyb_ + c0, c1 - c0);
  }
  static constexpr int kPrepRows = 16;
  DenseLinear& d_;
  const void* x_;
  bool x_bf16_;
  int m_, ldx_;
  float* y_;
  int ldy_;
  uint16_t* yb_;
  int ldyb_ = 0;
  std::vector<float> yf_;
  std::vector<int> chunk_;                // per subpool: panels per item
  std::vector<std::vector<int>> first_;  // per subpool: prefix sums of its pieces' items
  QuantizedActs qa_;
  std::vector<bf16_t> xb_;
  int64_t begin_ns_ = trace::now_ns();
};

// Whether forward has work (m > 0); refuses bad arguments naming the layer.
static bool forward_checks(const std::string& name, int m, const void* x, const void* y, int ldx, int ldy, int k,
                           int groups, int n) {
  TANDEM_CHECK(m >= 0, Errc::invalid_argument, name, ": rows = ", m, " is negative");
  if (m == 0) return false;
  TANDEM_CHECK(x && y, Errc::invalid_argument, name, ": null input or output");
  TANDEM_CHECK(ldx >= k * groups && ldy >= n, Errc::invalid_argument, name, ": row strides ", ldx, " / ", ldy,
               " are below the input's ", k * groups, " values (k = ", k, " x ", groups, " groups) / n = ", n);
  return true;
}

void DenseLinear::forward(const void* x, bool x_bf16, int m, int ldx, float* y, int ldy) {
  if (forward_checks(name_, m, x, y, ldx, ldy, k_, groups_, n_))
    pool_.run(std::make_shared<Forward>(*this, x, x_bf16, m, ldx, y, ldy));
}

void DenseLinear::forward_bf16(const void* x, bool x_bf16, int m, int ldx, uint16_t* y, int ldy) {
  if (forward_checks(name_, m, x, y, ldx, ldy, k_, groups_, n_))
    pool_.run(std::make_shared<Forward>(*this, x, x_bf16, m, ldx, nullptr, ldy, y));  // ldy: of y_bf16
}

}  // namespace tandem

namespace tandem {

void DenseLinear::route(const void* x, bool x_bf16, int m, int ldx, int top_k, bool renorm, void* logits,
                        void* scores, bool scores_f32, int64_t* index, const RouteOptions& o) {
  TANDEM_CHECK(format_.format == WeightFormat::bf16 && groups_ == 1, Errc::invalid_argument, name_,
               ": a router runs on a bf16 weight, not ", groups_ > 1 ? "a grouped one" : format_name(format_));
  TANDEM_CHECK(top_k >= 1 && top_k <= n_, Errc::invalid_argument, name_, ": top_k = ", top_k, " is outside 1..",
               n_, " (the number of experts)");
  TANDEM_CHECK(o.groups >= 1 && n_ % o.groups == 0 && o.top_groups >= 1 && o.top_groups <= o.groups,
               Errc::invalid_argument, name_, ": ", o.groups, " expert groups (", o.top_groups, " of them chosen) for ",
               n_, " experts");
  TANDEM_CHECK(o.groups == 1 || top_k <= n_ / o.groups * o.top_groups, Errc::invalid_argument, name_, ": top_k = ",
               top_k, " is more than the ", n_ / o.groups * o.top_groups, " experts of ", o.top_groups, " groups");
  TANDEM_CHECK(m >= 0 && (m == 0 || (logits && scores && index)), Errc::invalid_argument, name_,
               ": null router output");
  if (m == 0) return;
  std::vector<float> y(static_cast<size_t>(m) * n_);
  forward(x, x_bf16, m, ldx, y.data(), n_);
  using Pair = std::pair<float, int64_t>;  // (probability, expert)
  std::vector<Pair> queue(n_), gq(o.groups);
  // torch.topk's selection on CPU (aten's topk_impl_loop): (value, index) pairs in index
  // order, std::partial_sort of the first k when k * 64 <= n, else std::nth_element at k - 1,
  // then (sorted) std::sort of the first k - 1; NaN first, equal values compared false. The
  // same algorithms and ranges keep the same expert among equal probabilities as
  // transformers' router does.
  auto first = [](const Pair& a, const Pair& b) { return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first; };
  auto topk = [&](std::vector<Pair>& q, int k, bool sorted) {
    if (static_cast<int64_t>(k) * 64 <= static_cast<int64_t>(q.size())) {
      std::partial_sort(q.begin(), q.begin() + k, q.end(), first);
    } else {
      std::nth_element(q.begin(), q.begin() + k - 1, q.end(), first);
      if (sorted) std::sort(q.begin(), q.begin() + k - 1, first);
    }
  };
  for (int r = 0; r < m; ++r) {
    float* yr = y.data() + static_cast<size_t>(r) * n_;
    float mx = -INFINITY;
    if (o.logits_f32) {
      std::memcpy(static_cast<float*>(logits) + static_cast<size_t>(r) * n_, yr, sizeof(float) * n_);
      for (int e = 0; e < n_; ++e) mx = std::max(mx, yr[e]);
    } else {
      uint16_t* lr = static_cast<uint16_t*>(logits) + static_cast<size_t>(r) * n_;
      for (int e = 0; e < n_; ++e) {
        lr[e] = round_to_bf16(yr[e]);
        yr[e] = from_bf16(lr[e]);
        mx = std::max(mx, yr[e]);
      }
    }
    float sum = 0.0f;
    for (int e = 0; e < n_; ++e) sum += (queue[e].first = std::exp(yr[e] - mx));
    for (int e = 0; e < n_; ++e) queue[e] = {queue[e].first / sum, e};
    if (o.groups > 1) {  // scores.view(groups, per).max(-1), topk of those, the rest masked to 0
      const int per = n_ / o.groups;
      for (int g = 0; g < o.groups; ++g) {
        float best = queue[static_cast<size_t>(g) * per].first;
        for (int e = 1; e < per && !std::isnan(best); ++e) {
          const float v = queue[static_cast<size_t>(g) * per + e].first;
          best = std::isnan(v) || v > best ? v : best;
        }
        gq[g] = {best, g};
      }
      topk(gq, o.top_groups, false);
      std::vector<char> keep(o.groups, 0);
      for (int j = 0; j < o.top_groups; ++j) keep[gq[j].second] = 1;
      for (int e = 0; e < n_; ++e)
        if (!keep[e / per]) queue[e].first = 0.0f;
    }
    topk(queue, top_k, o.sorted);
    float* sf = scores_f32 ? static_cast<float*>(scores) + static_cast<size_t>(r) * top_k : nullptr;
    uint16_t* sb = scores_f32 ? nullptr : static_cast<uint16_t*>(scores) + static_cast<size_t>(r) * top_k;
    int64_t* ir = index + static_cast<size_t>(r) * top_k;
    float top_sum = 0.0f;
    for (int j = 0; j < top_k; ++j) {
      ir[j] = queue[j].second;
      top_sum += queue[j].first;
    }
    for (int j = 0; j < top_k; ++j) {
      const float s = (renorm ? queue[j].first / top_sum : queue[j].first) * o.scale;
      if (sf)
        sf[j] = s;
      else
        sb[j] = round_to_bf16(s);
    }
  }
}

}  // namespace tandem
