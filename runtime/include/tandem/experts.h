// tandem/experts.h: what a layer's routed experts are, independent of where they run:
// the shape, one expert's source weights (views into memory or a checkpoint), how a
// checkpoint names them, and a loading progress callback. The CPU layers (moe.h, lora.h)
// and the streams' device experts (stream.h) build on it.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/kernels.h"
#include "tandem/safetensors.h"

namespace tandem {

struct MoeShape {
  int experts = 0, hidden = 0, inter = 0;
  // The experts' activation (kernels.h: GateAct) and whether each expert has biases on
  // gate, up ([inter], before the activation) and down ([hidden], added to the expert's
  // output before its routing weight scales it): gpt-oss's experts; DeepSeek-V4's clamp
  // without biases. Plain: silu, none.
  GateAct act;
  bool bias = false;
  bool plain() const { return act.plain() && !bias; }
};
// "silu(gate) * up" or "a clamped SwiGLU (alpha .., limit .., up + ..)", "with biases".
std::string describe_experts(const MoeShape& shape);

// One expert's three projections as they sit in memory (nn.Linear layout):
// gate, up [inter x hidden], down [hidden x inter]; with MoeShape::bias, its biases as
// views of one row: gate_bias, up_bias [1 x inter], down_bias [1 x hidden].
struct ExpertSource {
  WeightView gate, up, down;
  WeightView gate_bias, up_bias, down_bias;
  // What quantized views point to (q4_gptq sources), kept alive with the source.
  std::vector<std::shared_ptr<const Q4Source>> keep;
};

// Errors name the projection of expert `expert` whose shape is not the layer's.
void check_expert_source(const ExpertSource& src, const MoeShape& shape, int expert);

// progress(done, total): called on the loading thread, at least every 100 ms and at the end.
using Progress = std::function<void(int done, int total)>;

// How a checkpoint names a layer's experts. {L} is the layer, {E} the expert; a weight
// stored as FP8 may have a "<name>_scale_inv" block-scale tensor next to it. Fused experts
// (transformers v5's layout, also what some families store): patterns without {E}, gate
// and up both naming the [experts, 2 x intermediate, hidden] gate_up tensor (gate the first
// half of each expert's rows), down the [experts, hidden, intermediate] one.
struct ExpertNaming {
  std::string gate, up, down;
  // Whether the patterns name fused tensors; an inconsistent mix is an error.
  bool fused() const;
  static ExpertNaming qwen3();    // model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.weight (also DeepSeek)
  static ExpertNaming mixtral();  // model.layers.{L}.block_sparse_moe.experts.{E}.{w1,w3,w2}.weight
  // The first scheme whose expert-0 gate key for `layer` exists in the checkpoint.
  static ExpertNaming detect(const Checkpoint& ckpt, int layer);
  // The tensor name of a projection ("gate", "up" or "down" pattern) of one expert.
  static std::string name(const std::string& pattern, int layer, int expert);
};

// Views of one expert's tensors in a checkpoint (read in place), checked against `shape`:
// errors name the missing key, or the shape / dtype that does not fit. A projection stored
// GPTQ-quantized (<name without .weight>.qweight, .scales, .qzeros, optional .g_idx; 4 bits,
// groups in order, the original format's zero - 1) is a q4_gptq view; act-order is refused.
ExpertSource checkpoint_expert(const Checkpoint& ckpt, int layer, int expert, const ExpertNaming& naming,
                               const MoeShape& shape);
// The checkpoint tensors holding the weight called `name` (name, its FP8 block scales, or
// its GPTQ tensors), those present.
std::vector<std::string> expert_tensor_names(const Checkpoint& ckpt, const std::string& name);
// Gives back the pages of one expert's source tensors (after packing): the mapped file
// stays valid, its pages leave this process's resident set.
void release_checkpoint_expert(const Checkpoint& ckpt, int layer, int expert, const ExpertNaming& naming);

// Every expert tensor of model layers `layers` checked (checkpoint_expert on each), so that a
// load fails naming the tensor (missing, wrong shape or dtype) before any layer is half loaded.
void check_checkpoint_experts(const Checkpoint& ckpt, const std::vector<int>& layers, const ExpertNaming& naming,
                              const MoeShape& shape);

// Packs one MoE layer (index i into `layers`) from `source`; progress counts that layer's work.
using LoadLayer = std::function<void(int i, const std::function<ExpertSource(int)>& source, const Progress& progress)>;

// How every engine loads a model's MoE layers from a checkpoint: check_checkpoint_experts
// first, then load_layer(i, ...) for each MoE layer i in order, reading the checkpoint in place,
// and the layer's source pages given back (release_checkpoint_expert) once it is packed, so the
// resident set stays near the packed size. progress(done, total) counts experts over all layers.
void load_checkpoint_layers(const Checkpoint& ckpt, const std::vector<int>& layers, const ExpertNaming& naming,
                            const MoeShape& shape, const LoadLayer& load_layer, const Progress& progress = {});

}  // namespace tandem
