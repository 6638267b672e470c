// runtime/expert_core.h (internal, not installed): the one CPU expert core that every
// "run routed experts on the CPU" path is built from: the inference layer (MoeLayer),
// the training layer (LoraMoe) and the host stream's hot experts (HostExperts).
//
//   ExpertPacks     a layer's experts packed per subpool slice of the intermediate
//                   dimension, gate/up fused (inference) or apart (training adds LoRA
//                   to the pre-activations), loaded from views or a checkpoint
//   Scratch         uninitialized grow-only buffers, first touched by their writers
//   WorkRuns        the work-item planner: runs of ~512 KB of one expert's panels
//   gather_rows     a group's input rows copied to bf16 and / or quantized
//   run_gemm, run_gate_up   one run of panels of one expert's product on its rows
//   merge_block     the deterministic weighted merge over top-k slots and subpools
//   ExpertForward   the inference forward as a pool task (gather, gate_up, act, down,
//                   merge), run on a pool (MoeLayer) or inline on one thread (host stream)
// The SiLU is the kernel table's (kernels.h: silu_mul, the gate_up epilogue's own code),
// so a training forward whose LoRA adds nothing gives the inference forward's bits.
#pragma once

#include <array>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "tandem/error.h"
#include "tandem/expert_store.h"
#include "tandem/experts.h"
#include "tandem/kernels.h"
#include "tandem/moe.h"
#include "tandem/pool.h"

namespace tandem::core {

// An uninitialized, grow-only array: pages are first touched by whoever writes them (a
// subpool's own threads), not by the allocating thread. Reused by a layer's tasks, which
// run one at a time.
template <typename T>
struct Scratch {
  std::unique_ptr<T[]> p;
  size_t cap = 0;
  T* get(size_t n) {
    if (n > cap) {
      p.reset(new T[n]);
      cap = n;
    }
    return p.get();
  }
  T* data() const { return p.get(); }
  T& operator[](size_t i) const { return p[i]; }
};

class ExpertPacks {
 public:
  enum class Layout { fused, separate };  // gate and up: one pack (panels alternate) or two
  // layer: the model layer, for error messages (-1: not a model layer's, e.g. a stream's
  // hot set).
  ExpertPacks(const MoeShape& shape, const PackOptions& format, int subpools, Layout layout, int layer = -1);

  // Experts not held here (placed elsewhere): load skips them. Empty: all held.
  void set_skipped(std::vector<uint8_t> skipped) { skipped_ = std::move(skipped); }
  bool skipped(int e) const { return !skipped_.empty() && skipped_[e]; }

  // Packs subpool s's slice of expert e from src (checked against the shape first).
  // Non-finite weights are refused in every format, the error naming the layer, expert,
  // projection and element (and the tensor and file when src comes from a checkpoint).
  void pack_slice(int s, int e, const ExpertSource& src);
  // Every held expert, each subpool its slices on its own threads (first touch on its node).
  void load(Pool& pool, const std::function<ExpertSource(int)>& source, const Progress& progress = {});
  // Every held expert on the calling thread (one subpool, e.g. a stream's executor).
  void load_here(const std::function<ExpertSource(int)>& source);
  // Every held expert's checkpoint views, resolved up front so a missing key fails before
  // any packing.
  std::function<ExpertSource(int)> checkpoint_source(const Checkpoint& ckpt, int layer, const ExpertNaming& naming);
  void drop();  // frees every pack
  void drop(int e);  // frees expert e's packs
  // Every held expert from a store (expert_store.h: MoE layer `index` of it), each subpool
  // reading its slices on its own threads (fused layout only).
  void load_store(Pool& pool, const ExpertStore& store, int index, const Progress& progress = {});

  const MoeShape& shape() const { return shape_; }
  const PackOptions& format() const { return format_; }
  Layout layout() const { return layout_; }
  int subpools() const { return static_cast<int>(shards_.size()); }
  std::pair<int, int> slice(int s) const { return {slices_[s], slices_[s + 1]}; }
  int len(int s) const { return slices_[s + 1] - slices_[s]; }
  const PackedWeight& gate_up(int s, int e) const { return shards_[s].gate_up[e]; }  // fused
  const PackedWeight& gate(int s, int e) const { return shards_[s].gate[e]; }        // separate
  const PackedWeight& up(int s, int e) const { return shards_[s].up[e]; }
  const PackedWeight& down(int s, int e) const { return shards_[s].down[e]; }
  // With MoeShape::bias: expert e's gate / up biases from subpool s's slice on (fp32), and
  // every expert's down biases [experts x hidden]; null without.
  const float* gate_bias(int s, int e) const { return bias_.empty() ? nullptr : bias_.data() + bias_at(e, 0) + slices_[s]; }
  const float* up_bias(int s, int e) const { return bias_.empty() ? nullptr : bias_.data() + bias_at(e, 1) + slices_[s]; }
  const float* down_bias() const { return bias_.empty() ? nullptr : bias_.data() + bias_at(shape_.experts, 0); }
  // A pack of expert e whose layout the gate/up input must be quantized for.
  const PackedWeight& gate_up_layout(int e) const;
  size_t bytes() const;
  // Expert e's weights as packed, dequantized to fp32 in nn.Linear layout: gate and up
  // [inter x hidden], down [hidden x inter].
  std::array<std::vector<float>, 3> dequantized(int e) const;

 private:
  struct Shard {
    std::vector<PackedWeight> gate_up, gate, up, down;
  };
  MoeShape shape_;
  PackOptions format_;
  Layout layout_;
  int layer_;
  std::vector<int> slices_;
  std::vector<Shard> shards_;
  std::vector<uint8_t> skipped_;
  // With MoeShape::bias, fp32: per expert gate [inter] then up [inter]; then every
  // expert's down [hidden].
  std::vector<float> bias_;
  size_t bias_at(int e, int which) const { return (2 * static_cast<size_t>(e) + which) * shape_.inter; }
};

// A bf16 pack holds its source's values as they are, NaN / Inf included, where the integer
// packs refuse them: false when p (bf16) holds one. One pass over the pack just written; the
// callers look for the element in the source only on error. Other formats: true.
bool finite_bf16(const PackedWeight& p);

// Work items that are runs of `chunk` panels of one active expert's weight(s): about
// kItemBytes of weights each (one panel of a small expert is too little to amortize an
// item's fixed cost and the prefetcher's ramp), more for many rows (kInputReuse), but at
// least 4 items per thread.
struct WorkRuns {
  static constexpr size_t kItemBytes = 512 << 10;
  // An item holds at least kInputReuse times what a call reads of its expert's input rows
  // (input_bytes, their mean over the active experts): an AMX call streams all of those
  // rows through its tiles (and packs them into tile order first, where the caller has not:
  // the forward's RowTiles do it once per expert), so at prefill sizes (128 rows of 4096
  // bf16: 1 MB) items of kItemBytes would spend as much on the rows as on the weights.
  static constexpr size_t kInputReuse = 4;
  int panels = 0, chunk = 1, per = 1, weights = 1;  // per = ceil(panels / chunk)
  // n active experts, `weights` weights of `panels` panels of panel_bytes each per expert.
  static WorkRuns plan(int n, int weights, int panels, size_t panel_bytes, int threads, size_t input_bytes = 0);
  int items(int n) const { return panels ? n * weights * per : 0; }
  struct Item {
    int i, w, begin, end;  // active expert, which weight, panel range
  };
  // What a call on w reads of an active expert's input rows, for `rows` rows over n
  // experts (their mean; bf16, or int8 for the integer formats): plan's input_bytes.
  static size_t input_bytes(const PackedWeight& w, int rows, int n) {
    return n > 0 ? static_cast<size_t>(rows) * w.k * (w.format == WeightFormat::bf16 ? 2 : 1) / n : 0;
  }
  Item item(int k) const {
    const int b = (k % per) * chunk;
    return {k / (per * weights), (k / per) % weights, b, std::min(panels, b + chunk)};
  }
};

// Rows [r0, r1) of active expert i's group: the input rows as bf16 into xg (the group's
// first row, row stride hidden; null: not wanted) and / or quantized into qa (null: not
// wanted). The experts see x as bf16 in every format: fp32 input is rounded to bf16
// before it is quantized, as the bf16 kernels round it and the training layer saves it.
// qtok (optional): every token already quantized the same way (quantize_token_rows), whose
// rows are copied into qa instead of quantizing each (token, expert) row again.
void gather_rows(const MoeInput& in, const TokenGroups& g, int i, int r0, int r1, int hidden, bf16_t* xg,
                 QuantizedActs* qa, const KernelTable& kt, const QuantizedActs* qtok = nullptr);
// Tokens [t0, t1) of the input, rounded to bf16 and quantized into qt (prepared for all
// the input's tokens): what gather_rows would make of each of their rows.
void quantize_token_rows(const MoeInput& in, int t0, int t1, int hidden, QuantizedActs& qt, const KernelTable& kt);

// c (ldc) = the rows of active expert i (a, lda: their bf16 rows, or qa) . w^T over
// panels [begin, end).
// a_tiles (optional): the same rows in tile order (kernels.h, GemmArgs::a_tiles).
void run_gemm(const KernelTable& kt, const PackedWeight& w, int m, int begin, int end, const bf16_t* a,
              const QuantizedActs* qa, int lda, float* c, int ldc, const std::byte* a_tiles = nullptr);
// h (ldh, bf16) = silu(a . Wg^T) * (a . Wu^T) over gate panels [begin, end) of a fused pack
// (or act's activation, biases added first when given: kernels.h, GateUpArgs).
void run_gate_up(const KernelTable& kt, const PackedWeight& w, int m, int begin, int end, const bf16_t* a,
                 const QuantizedActs* qa, int lda, bf16_t* h, int ldh, const GateAct& act = {},
                 const float* gate_bias = nullptr, const float* up_bias = nullptr, const std::byte* a_tiles = nullptr);

// out[t, j0:j1] (+)= sum_k w[t, k] * (sum_s y_s[r, j0:j1] + bias[row_expert[r], j0:j1]),
// r = slot_row[t, k] (w null: 1; bias null: none; bias is [experts x hidden]), the slots
// in order and, inside each, the subpools in order, then the bias: the same bits on
// every run and every thread count. y[s] null: subpool s has nothing.
inline constexpr int kMergeCols = 512;
inline int merge_blocks(int hidden) { return (hidden + kMergeCols - 1) / kMergeCols; }
void merge_block(float* out, bool accumulate, int t, int top_k, const int* slot_row, const float* weights,
                 const float* const* y, int subpools, int hidden, int j0, int j1, const float* bias = nullptr,
                 const int* row_expert = nullptr);

// One phase's inputs in the AMX kernels' tile order (kernels.h: pack_row_tiles), packed
// once per active expert for all the work items of that expert, for the experts whose
// kernel at their row count takes them (takes_row_tiles).
struct RowTiles {
  static constexpr size_t kNone = ~size_t(0);
  AlignedBuffer buf;
  std::vector<size_t> at;  // per active expert: its offset in buf, or kNone
  std::vector<int> count;  // per active expert: its rows
  size_t row_bytes = 0;
  // Expert i (of n, expert_rows[i] rows of row_bytes) gets a place when wants(i).
  template <class Wants>
  void plan(int n, const std::vector<int>& expert_rows, size_t bytes_per_row, Wants wants) {
    row_bytes = bytes_per_row;
    count.assign(expert_rows.begin(), expert_rows.begin() + n);
    at.assign(n, kNone);
    size_t total = 0;
    for (int i = 0; i < n; ++i)
      if (wants(i)) {
        at[i] = total;
        total += (row_tiles_bytes(count[i], row_bytes) + 63) / 64 * 64;
      }
    if (total > buf.size) buf = AlignedBuffer::allocate(total);
  }
  bool any() const {
    for (size_t a : at)
      if (a != kNone) return true;
    return false;
  }
  std::byte* of(int i) const { return i < static_cast<int>(at.size()) && at[i] != kNone ? buf.data() + at[i] : nullptr; }
  // Packs all of expert i's rows (lda_bytes apart) when it has a place.
  void pack(int i, const void* rows, size_t lda_bytes) const { pack_rows(i, rows, lda_bytes, 0, count[i]); }
  // Packs rows [r0, r1) of expert i (its first row at rows, lda_bytes apart) when it has a
  // place: one block of its rows, packed by whichever thread made them. r0 is a multiple
  // of 16, and so is r1 - r0 unless r1 is the expert's last row (the padding goes there).
  void pack_rows(int i, const void* rows, size_t lda_bytes, int r0, int r1) const {
    if (std::byte* out = of(i)) {
      TANDEM_CHECK(r0 % 16 == 0 && r0 < r1 && r1 <= count[i] && ((r1 - r0) % 16 == 0 || r1 == count[i]), Errc::internal,
                   "RowTiles::pack_rows: rows [", r0, ", ", r1, ") of ", count[i], " are not whole tiles");
      pack_row_tiles(static_cast<const std::byte*>(rows) + static_cast<size_t>(r0) * lda_bytes, lda_bytes, r1 - r0, row_bytes,
                     out + static_cast<size_t>(r0) * row_bytes);
    }
  }
};

// The one T of `pool`, shared by every layer made on it: the pool runs their tasks one
// after another and a task uses its scratch only while it runs, so one layer's buffers
// are free for the next, and a long batch grows one set of buffers instead of one per
// layer. Made by the first layer of a pool, freed with the last (MoeLayer: ForwardScratch;
// LoraMoe: its training scratch).
template <class T>
std::shared_ptr<T> pool_shared(const Pool& pool) {
  static std::mutex mu;
  static std::map<const Pool*, std::weak_ptr<T>> by_pool;
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = by_pool.begin(); it != by_pool.end();) it = it->second.expired() ? by_pool.erase(it) : std::next(it);
  std::weak_ptr<T>& w = by_pool[&pool];
  if (auto s = w.lock()) return s;
  auto s = std::make_shared<T>();
  w = s;
  return s;
}

// Scratch of the inference forward, kept by its owner between calls.
struct ForwardScratch {
  Scratch<bf16_t> xg;                          // gathered input rows (bf16 weights)
  QuantizedActs qtok;                          // per token, quantized once (integer weights)
  std::vector<QuantizedActs> qin;              // per active expert (integer weights)
  std::vector<Scratch<bf16_t>> h;              // per subpool: [rows x slice]
  std::vector<std::vector<QuantizedActs>> qmid;  // per subpool, per active expert
  std::vector<Scratch<float>> y;               // per subpool: [rows x hidden]
  RowTiles tiles_in;                           // the gate_up input (xg or qin) in tile order
  std::vector<RowTiles> tiles_mid;             // per subpool: the down input (h or qmid) in tile order
};

// The inference forward of one layer's experts (fused gate/up packs) as a pool task:
//   quantize int8 / int4 weights, when the batch has more (token, expert) rows than
//            tokens: each token quantized once
//   gather   tokens grouped per expert (their quantized rows copied, or quantized here)
//   gate_up  silu(x Wg^T) * (x Wu^T) per (expert, run of panels of the slice)
//   act      the intermediate activations quantized (int8 / int4 only)
//   down     each subpool's partial y_s = h_s Wd_s^T per (expert, run of panels of hidden)
//   merge    out[t] (+)= sum_k w[t,k] * sum_s y_s[e_k][t], per block of tokens x hidden
class ExpertForward : public Task, public TokenGroups {
 public:
  // threads[s]: subpool s's thread count (planning only).
  ExpertForward(const ExpertPacks& packs, ForwardScratch& scratch, const KernelTable& kt, std::vector<int> threads,
                int layer, const MoeInput& in, TokenGroups groups);
  int phases() const override { return kPhases; }
  int items(int phase, int s) override;
  void run(int phase, int s, int item, int worker) override;
  void finished() override;

 private:
  enum Phase { kQuantize, kGather, kGateUp, kAct, kDown, kMerge, kPhases };
  bool quantize_tokens() const;  // quantize each token once, then gather its rows (integer formats)
  void prepare();
  const ExpertPacks& P;
  ForwardScratch& sc;
  const KernelTable& kt;
  std::vector<int> threads_;
  int layer_;
  MoeInput in_;
  int64_t begin_ns_ = 0;
  std::vector<WorkRuns> gu_runs_, dn_runs_;
  std::vector<const float*> ys_;  // per subpool: its partial y, null for an empty slice
  std::vector<int> row_expert_;   // grouped row -> expert (experts with down biases only)
};

// Runs a task's phases in order on the calling thread, as a pool of one subpool would.
void run_inline(Task& task);

}  // namespace tandem::core
