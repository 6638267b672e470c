// DenseLinear (tandem/dense.h): a dense layer's weight packed per subpool slice of its
// output panels; forward as one pool task of two phases (prepare the input once, then
// runs of panels).
#include "tandem/dense.h"

#include <algorithm>
#include <atomic>

#include "expert_core.h"
#include "tandem/error.h"
#include "tandem/trace.h"

namespace tandem {

DenseLinear::DenseLinear(Pool& pool, const KernelTable& kernels, const WeightView& w, const PackOptions& format,
                         std::string name)
    : pool_(pool), kt_(kernels), format_(format), name_(std::move(name)), n_(w.n), k_(w.k) {
  TANDEM_CHECK(w.data && w.n > 0 && w.k > 0, Errc::invalid_argument, name_, ": dense weight [", w.n, " x ", w.k,
               "] is empty");
  TANDEM_CHECK(format.format != WeightFormat::int4 || w.k % format.group == 0, Errc::invalid_argument, name_,
               ": k = ", w.k, " is not a multiple of the int4 group size ", format.group,
               " (choose a group that divides it, or another dense_format)");
  const int S = pool.subpools(), panels = (w.n + kPanel - 1) / kPanel;
  slices_.resize(S);
  for (int s = 0; s < S; ++s) {
    const int p0 = static_cast<int>(static_cast<int64_t>(panels) * s / S);
    const int p1 = static_cast<int>(static_cast<int64_t>(panels) * (s + 1) / S);
    slices_[s].n0 = std::min(w.n, p0 * kPanel);
    slices_[s].n = std::min(w.n, p1 * kPanel) - slices_[s].n0;
  }
  WeightView named = w;
  if (!named.name) named.name = name_.c_str();
  // Each subpool packs (first touches) its own slice on its own threads.
  for_each_item(pool, 1, [&](int s, int) {
    Slice& sl = slices_[s];
    if (sl.n > 0) sl.w = pack(sub_view(named, sl.n0, sl.n, 0, w.k), format_);
  }, {}, "pack_dense");
}

DenseLinear::~DenseLinear() = default;

size_t DenseLinear::bytes() const {
  size_t b = 0;
  for (const Slice& s : slices_) b += s.w.bytes();
  return b;
}

std::vector<float> DenseLinear::dequantized() const {
  std::vector<float> out(static_cast<size_t>(n_) * k_);
  for (const Slice& s : slices_) {
    if (s.n == 0) continue;
    const std::vector<float> part = unpack(s.w);
    std::copy(part.begin(), part.end(), out.begin() + static_cast<size_t>(s.n0) * k_);
  }
  return out;
}

// phase 0: fp32 input rounded to bf16, and quantized (integer formats), in blocks of
//          kPrepRows rows;
// phase 1: per subpool, runs of its slice's panels (WorkRuns) through the kernel table.
class DenseLinear::Forward final : public Task {
 public:
  Forward(DenseLinear& d, const void* x, bool x_bf16, int m, int ldx, float* y, int ldy)
      : d_(d), x_(x), x_bf16_(x_bf16), m_(m), ldx_(ldx), y_(y), ldy_(ldy), runs_(d.slices_.size()) {
    const bool quant = d.format_.format != WeightFormat::bf16;
    if (quant) {
      for (const Slice& s : d.slices_)
        if (s.n > 0) {
          qa_.prepare(s.w, m);
          break;
        }
    }
    if (!x_bf16) xb_.resize(static_cast<size_t>(m) * d.k_);
  }
  int phases() const override { return 2; }
  int items(int phase, int s) override {
    const int S = static_cast<int>(d_.slices_.size());
    if (phase == 0) {
      const bool work = d_.format_.format != WeightFormat::bf16 || !x_bf16_;
      const int blocks = work ? (m_ + kPrepRows - 1) / kPrepRows : 0;
      return blocks * (s + 1) / S - blocks * s / S;
    }
    const Slice& sl = d_.slices_[s];
    if (sl.n == 0 || m_ == 0) return 0;
    const size_t input = static_cast<size_t>(m_) * d_.k_ * (sl.w.format == WeightFormat::bf16 ? 2 : 1);
    runs_[s] = core::WorkRuns::plan(1, 1, sl.w.panels, sl.w.panel_stride, d_.pool_.threads(s), input);
    return runs_[s].items(1);
  }
  void run(int phase, int s, int item, int) override {
    const int S = static_cast<int>(d_.slices_.size());
    if (phase == 0) {
      const int blocks = (m_ + kPrepRows - 1) / kPrepRows;
      const int b = blocks * s / S + item;
      const int r0 = b * kPrepRows, r1 = std::min(m_, r0 + kPrepRows);
      // fp32 input is rounded to bf16 first in every format (as the experts see it), so
      // the result does not depend on the input's dtype.
      if (!x_bf16_)
        for (int r = r0; r < r1; ++r)
          fp32_to_bf16(static_cast<const float*>(x_) + static_cast<size_t>(r) * ldx_,
                       xb_.data() + static_cast<size_t>(r) * d_.k_, d_.k_);
      if (d_.format_.format != WeightFormat::bf16) {
        const bf16_t* a = x_bf16_ ? static_cast<const bf16_t*>(x_) : xb_.data();
        quantize_activations(qa_, a, x_bf16_ ? ldx_ : d_.k_, r0, r1, &d_.kt_);
      }
      return;
    }
    const Slice& sl = d_.slices_[s];
    const auto it = runs_[s].item(item);
    const bf16_t* a = x_bf16_ ? static_cast<const bf16_t*>(x_) : xb_.data();
    const int lda = x_bf16_ ? ldx_ : d_.k_;
    const bool quant = d_.format_.format != WeightFormat::bf16;
    core::run_gemm(d_.kt_, sl.w, m_, it.begin, it.end, quant ? nullptr : a, quant ? &qa_ : nullptr, lda,
                   y_ + sl.n0, ldy_);
  }
  void finished() override { trace::record("dense", begin_ns_, trace::now_ns(), {-1, -1, m_}); }

 private:
  static constexpr int kPrepRows = 16;
  DenseLinear& d_;
  const void* x_;
  bool x_bf16_;
  int m_, ldx_;
  float* y_;
  int ldy_;
  std::vector<core::WorkRuns> runs_;
  QuantizedActs qa_;
  std::vector<bf16_t> xb_;
  int64_t begin_ns_ = trace::now_ns();
};

void DenseLinear::forward(const void* x, bool x_bf16, int m, int ldx, float* y, int ldy) {
  TANDEM_CHECK(m >= 0, Errc::invalid_argument, name_, ": rows = ", m, " is negative");
  if (m == 0) return;
  TANDEM_CHECK(x && y, Errc::invalid_argument, name_, ": null input or output");
  TANDEM_CHECK(ldx >= k_ && ldy >= n_, Errc::invalid_argument, name_, ": row strides ", ldx, " / ", ldy,
               " are below the weight's k = ", k_, " / n = ", n_);
  pool_.run(std::make_shared<Forward>(*this, x, x_bf16, m, ldx, y, ldy));
}

}  // namespace tandem
