// tandem/moe.h: the routed experts of one MoE layer on the CPU worker pools.
//
// The layer owns its experts' packed weights, sharded along the intermediate dimension
// across the pool's subpools: subpool s holds rows [i0_s, i1_s) of every expert's gate
// and up and the same columns of its down, packed by its own threads (so the memory
// is first-touched on its NUMA node) and stored once. A forward runs as one pool task
// (gather, gate_up, act, down, merge: the expert core's ExpertForward, runtime/
// expert_core.h, which the training layer and the host stream's experts share).
// Token grouping makes decode (a few tokens, many experts) and prefill (many tokens per
// expert) take the same path; the kernels pick their small- or large-m variant per expert.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/expert_store.h"
#include "tandem/experts.h"
#include "tandem/kernels.h"
#include "tandem/pool.h"

namespace tandem {

namespace core {
class ExpertPacks;
struct ForwardScratch;
}  // namespace core

// How a layer splits the intermediate dimension over `subpools` subpools: slice s is
// [slices[s], slices[s + 1]), in whole units (a 64-row panel, or an int4 group if larger).
std::vector<int> intermediate_slices(int inter, int subpools, const PackOptions& format);
// The step those slices fall on: a panel (64), or an int4 group when wider.
int intermediate_unit(const PackOptions& format);

struct MoeInput {
  const bf16_t* x = nullptr;     // [tokens x hidden], or
  const float* x_f32 = nullptr;  //   fp32 (exactly one of the two)
  int tokens = 0;
  const int32_t* ids = nullptr;  // [tokens x top_k], or
  const int64_t* ids_i64 = nullptr;  // int64 (exactly one); -1 = no expert in this slot
  int top_k = 0;
  const float* weights = nullptr;    // [tokens x top_k] routing weights
  const uint8_t* expert_mask = nullptr;  // optional [experts]: 0 = held elsewhere, skipped here
  float* out = nullptr;              // [tokens x hidden] fp32
  bool accumulate = false;           // out += instead of out =
};

// A batch's (token, slot) rows grouped per expert, the way the CPU layers run them.
struct TokenGroups {
  std::vector<int> active;         // experts with rows, ascending
  std::vector<int> count, offset;  // per active expert: rows and first row in the grouped buffers
  std::vector<int> rows_token;     // grouped row -> token
  std::vector<int> slot_row;       // [tokens x top_k] -> grouped row, -1: nothing to add
  int total_rows = 0;
};
// Validates `in` against a layer of `experts` experts (errors name the offending slot,
// id or weight) and groups its rows; slots with id -1, masked or (an error) excluded
// experts get no row. layer < 0: the experts are not a model layer's (a stream's hot set).
TokenGroups group_tokens(const MoeInput& in, int experts, int layer, const std::vector<uint8_t>& excluded = {});

// One expert's weights as dense fp32 matrices in nn.Linear layout (gate, up [inter x hidden],
// down [hidden x inter]): what MoeLayer::dequantized rebuilds from its packs.
struct ExpertWeights {
  std::vector<float> gate, up, down;
};

class MoeLayer {
 public:
  MoeLayer(Pool& pool, MoeShape shape, PackOptions format, int layer_index = 0);
  ~MoeLayer();

  // Experts held elsewhere (hot on a GPU): load() does not pack them and routing a token
  // to one of them here (without masking it) is an error. Call before load().
  void exclude(const std::vector<int>& experts);
  bool excluded(int expert) const { return !excluded_.empty() && excluded_[expert]; }
  // The kernel level this layer runs, every phase of it (default: effective_isa() when
  // the layer is built; an engine passes select_isa(its config's cpu.isa)).
  void use_isa(IsaLevel level) { kt_ = &kernel_table(level); }
  // Runs `table`'s kernels instead (benchmarks forcing one variant: with_kernel); the
  // caller keeps the table alive while the layer uses it.
  void use_kernels(const KernelTable& table) { kt_ = &table; }
  IsaLevel isa() const { return kt_->level; }
  const KernelTable& kernel_set() const { return *kt_; }

  // Packs every expert from `source(e)`, each subpool its own slice on its own threads.
  void load(const std::function<ExpertSource(int expert)>& source, const Progress& progress = {});
  // Loads layer `layer` from a checkpoint (safetensors, mmapped: the source bytes are
  // read in place, no full-size intermediate copy). Errors name the missing key or the
  // shape / dtype that does not fit.
  void load(const Checkpoint& ckpt, int layer, const ExpertNaming& naming, const Progress& progress = {});
  // Reads every held expert from MoE layer `index` of a store (expert_store.h), each
  // subpool its own slice on its own threads: the packs load() makes, not re-packed.
  void load(const ExpertStore& store, int index, const Progress& progress = {});
  // Frees every pack: the layer is as before load() (a failed model load rolls back).
  void unload();

  // Validates (errors name the problem and leave out untouched), then queues the layer
  // on the pool and returns; x, ids, weights, mask and out must stay valid until
  // pool().sync() (or pool().wait(ticket)) says the task finished. Returns the pool
  // ticket, 0 when there was nothing to do (no tokens).
  uint64_t submit(const MoeInput& in);
  // The same, then waits for it (and every task before it); on an idle pool the calling
  // thread takes part (Pool::run).
  void forward(const MoeInput& in);

  const MoeShape& shape() const { return shape_; }
  int layer_index() const { return layer_; }
  const PackOptions& format() const { return format_; }
  Pool& pool() { return pool_; }
  bool loaded() const { return loaded_; }
  // Subpool s's slice [begin, end) of the intermediate dimension.
  std::pair<int, int> slice(int subpool) const;
  // Packed bytes held, all subpools.
  size_t packed_bytes() const;
  // The packed gate_up / down of expert e on subpool s (tests, benchmarks).
  const PackedWeight& gate_up_pack(int subpool, int expert) const;
  const PackedWeight& down_pack(int subpool, int expert) const;
  // Expert e's weights as this layer computes with them (its packs dequantized and put back
  // together from the subpools' slices): exact for bf16, the quantized values otherwise.
  // For a device copy that runs what the CPU runs (dynamic hot experts).
  ExpertWeights dequantized(int expert) const;

 private:
  Pool& pool_;
  MoeShape shape_;
  PackOptions format_;
  int layer_;
  bool loaded_ = false;
  std::vector<uint8_t> excluded_;  // [experts], empty: none
  const KernelTable* kt_;
  std::unique_ptr<core::ExpertPacks> packs_;
  std::shared_ptr<Task> task_for(const MoeInput& in);  // validated; null when there are no tokens
  // Reused by the tasks of every layer on this pool (they run one at a time): shared by them.
  std::shared_ptr<core::ForwardScratch> scratch_;
};

}  // namespace tandem
