// tandem/lora.h: LoRA fine-tuning of one MoE layer's routed experts on the CPU pools.
//
// Every routed expert e gets LoRA on gate, up and down (s = alpha / r, or alpha / sqrt(r)
// with rsLoRA), over frozen base weights in any engine format (BF16, INT8, INT4):
//   g = x Wg^T + s (x Ag^T) Bg^T + bg     u = x Wu^T + s (x Au^T) Bu^T + bu     h = act(g, u)
//   y = h Wd^T + s (h Ad^T) Bd^T + bd     out[t] = sum_k w[t,k] y_{e(t,k)}(x[t])
// A: [r x in], B: [out x r] (nn.Linear layout, as PEFT stores lora_A / lora_B); act the
// shape's GateAct (silu(g) * u, or a clamped SwiGLU); the biases bg, bu, bd (fp32, frozen)
// only with MoeShape::bias (gpt-oss), added as the inference forward adds them.
//
// forward() returns the output and a LoraContext holding what backward() needs: the
// token grouping, the gathered bf16 input, the gate/up pre-activations (fp32) and the
// rank-r products x A^T and h Ad^T. Contexts are independent objects: several may be in
// flight (micro-batches, the recompute forward of gradient checkpointing), each is
// consumed by exactly one backward. backward() gives dL/dx, dL/dw for every (token, slot)
// routing weight (so the router trains) and accumulates dL/dA, dL/dB for every expert
// into caller-owned fp32 buffers (experts without tokens get nothing added).
//
// LoRA weights and gradients are caller-owned fp32 buffers read through pointers on every
// call (an optimizer's in-place update is seen by the next call; nothing is registered or
// packed). Base weights are packed once for the forward direction; the transposed packs
// the backward products need (dOut Wd, [dg du] [Wg; Wu]) are built from the dequantized
// forward packs on the first backward (or prepare_backward()), in backward_format:
// BF16 by default (for INT8 / INT4 bases this is QLoRA's "dequantize, then matmul").
//
// Work is split like the inference engine: subpool s holds slice [i0, i1) of the
// intermediate dimension of every expert (gate/up rows, down columns); products over the
// full intermediate dimension (y, h Ad^T, dx, dg Bg) are reduced over subpools.
// The base products run in the engine's kernels (bf16 or integer dot products, fp32
// accumulation); the rank-r products in fp32 (oneDNN sgemm, one thread per work item).
//
// A LoraMoe is driven by one thread at a time (its calls run on the pool and wait); layers
// sharing a pool run their tasks in submission order.
//
// Not supported: dropout on the LoRA input (PEFT's lora_dropout must be 0), LoRA on
// experts held on a GPU (hot experts), gradients for the biases (they stay frozen).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "tandem/kernels.h"
#include "tandem/moe.h"
#include "tandem/pool.h"

namespace tandem {

namespace core {
class ExpertPacks;
}  // namespace core

struct LoraConfig {
  int rank = 8;
  float alpha = 16.0f;
  bool rslora = false;  // scaling alpha / sqrt(rank) instead of alpha / rank
  float scaling() const;
};

// One of the six [experts x rows x cols] fp32 tensors of a layer's adapters (or their
// gradients). Expert e's matrix starts at data + e * expert_stride; element (i, j) is at
// i * ld + j, or at j * ld + i when `transposed` (a column-major matrix, e.g. a slice of
// PEFT's [out x r * experts] lora_B). Zero strides mean dense: expert_stride = rows * cols,
// ld = cols (rows when transposed). `size` is the buffer's length in elements; every
// element the layout reaches must lie inside it (checked on every call).
struct LoraMatrix {
  float* data = nullptr;
  size_t size = 0;
  int64_t expert_stride = 0;
  int64_t ld = 0;
  bool transposed = false;
};

// A layer's adapters (or gradients): A [r x in] and B [out x r] per projection.
struct LoraWeights {
  LoraMatrix a_gate, b_gate;  // [r x hidden], [inter x r]
  LoraMatrix a_up, b_up;      // [r x hidden], [inter x r]
  LoraMatrix a_down, b_down;  // [r x inter],  [hidden x r]
};

struct SftOptions {
  PackOptions format;                               // the frozen base weights
  WeightFormat backward_format = WeightFormat::bf16;  // the transposed packs for backward
  LoraConfig lora;
};

// What a forward saved for its backward. Move-only; consumed by one backward().
class LoraContext {
 public:
  LoraContext();
  ~LoraContext();
  LoraContext(LoraContext&&) noexcept;
  LoraContext& operator=(LoraContext&&) noexcept;
  bool valid() const;         // holds a forward's state, not yet consumed
  int tokens() const;
  size_t bytes() const;       // saved bytes (for "saved bytes per token per layer")

 private:
  friend class LoraMoe;
  friend class SftTask;
  friend class SftForwardTask;
  friend class SftBackwardTask;
  struct State;
  std::unique_ptr<State> s_;
  bool consumed_ = false;
};

struct SftGrad {
  const float* d_out = nullptr;       // [tokens x hidden] dL/dout, fp32, or
  const bf16_t* d_out_bf16 = nullptr;  //   bf16 (exactly one)
  float* d_x = nullptr;               // [tokens x hidden] dL/dx (null: not wanted)
  bool accumulate_x = false;          // d_x += instead of d_x =
  float* d_weights = nullptr;         // [tokens x top_k] dL/dw (null: not wanted); 0 for id -1
  LoraWeights grads;                  // dL/dA, dL/dB accumulated (+=); null data: not wanted
};

class LoraMoe {
 public:
  LoraMoe(Pool& pool, MoeShape shape, SftOptions options, int layer_index = 0);
  ~LoraMoe();

  // Packs the frozen base from `source(e)` (or a checkpoint, read in place), each
  // subpool its slice on its own threads. Errors name the key / shape that does not fit.
  void load(const std::function<ExpertSource(int expert)>& source, const Progress& progress = {});
  void load(const Checkpoint& ckpt, int layer, const ExpertNaming& naming, const Progress& progress = {});
  // Frees every pack, forward and backward: the layer is as before load().
  void unload();
  // Builds the backward packs now (otherwise the first backward does).
  void prepare_backward(const Progress& progress = {});
  bool loaded() const { return loaded_; }
  bool backward_ready() const { return backward_ready_; }
  // Changes the adapters' rank and scaling (e.g. to the PEFT adapter in use). Nothing is
  // repacked; contexts saved under the previous config are refused by backward().
  void set_lora(const LoraConfig& lora);

  // out (+)= the layer with LoRA. With train = true, returns the context for backward;
  // otherwise an empty one (no state kept). `lora` with every data pointer null runs the
  // base alone. in.expert_mask must be null (every expert is on the CPU here).
  LoraContext forward(const MoeInput& in, const LoraWeights& lora, bool train = true);
  // Consumes ctx (an error if it is empty, already consumed, or from another layer).
  // `lora` must hold the values the forward saw.
  void backward(LoraContext& ctx, const LoraWeights& lora, const SftGrad& grad);

  const MoeShape& shape() const { return shape_; }
  const SftOptions& options() const { return options_; }
  // The kernel level every product of this layer runs (default: effective_isa() when the
  // layer is built; the training path passes select_isa(its config's cpu.isa)).
  void use_isa(IsaLevel level) { kt_ = &kernel_table(level); }
  IsaLevel isa() const { return kt_->level; }
  int layer_index() const { return layer_; }
  Pool& pool() { return pool_; }
  std::pair<int, int> slice(int subpool) const;
  size_t packed_bytes() const;    // forward packs
  size_t backward_bytes() const;  // transposed packs (0 before the first backward)
  // Expert e's base weights as packed (dequantized, fp32, nn.Linear layout): gate
  // [inter x hidden], up [inter x hidden], down [hidden x inter]. For tests / references.
  std::array<std::vector<float>, 3> dequantized(int expert) const;
  // The layout LoraWeights must have for this layer: {rows, cols} of each of the six.
  std::array<std::pair<int, int>, 6> lora_shapes() const;

 private:
  struct BackwardPacks {
    std::vector<PackedWeight> gu_t, down_t;  // per expert: [H x 2 len], [len x H]
  };
  struct Scratch;
  friend class SftTask;
  friend class SftForwardTask;
  friend class SftBackwardTask;
  void check_lora(const LoraWeights& w, const char* what, bool allow_null) const;

  Pool& pool_;
  MoeShape shape_;
  SftOptions options_;
  int layer_;
  const KernelTable* kt_;
  std::unique_ptr<core::ExpertPacks> packs_;  // forward: gate and up apart (LoRA adds before the SiLU)
  std::vector<BackwardPacks> back_;           // per subpool
  bool loaded_ = false, backward_ready_ = false;
  uint64_t id_ = 0;                   // this layer, as its contexts name it
  std::shared_ptr<Scratch> scratch_;  // one per pool: its LoRA layers' tasks run one at a time
};

}  // namespace tandem
