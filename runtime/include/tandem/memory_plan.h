// tandem/memory_plan.h: how much RAM and GPU memory a placement config needs for a
// model, estimated before anything is loaded (backs `tandem doctor --config F`).
//
// The model comes from its Hugging Face config.json (shapes, which layers are MoE,
// top-k, dtype) and, when present, its safetensors headers (the non-expert weights'
// exact element counts). The routed experts are always sized from config.json: they
// are what the engine will pack, whatever the checkpoint files hold, so a config.json
// alone is enough for the part that dominates. The non-expert weights are summed from
// the safetensors headers when the checkpoint has any, else estimated from config.json
// (embeddings, attention incl. DeepSeek MLA, norms, router, shared experts, dense MLPs).
//
// Counted, with the sizes the code really allocates:
//   cpu experts     MoeLayer packs: each subpool's slice of every non-hot expert, padded
//                   as the packed format requires (packed_bytes, tandem/kernels.h)
//   hot experts     CUDA: bf16 gate/up/down, unpadded, plus the expert->slot map; host
//                   stream (no GPU): BF16 packs in RAM
//   pinned buffers  HybridMoe, one batch of buffers.max_tokens tokens: per slot x, the
//                   hot/cold/deferred ids, the weights, the CPU output (+ the deferred
//                   output with deferral)
//   device buffers  HybridMoe's device side for that batch (ids, copied-back outputs,
//                   the hot masks), the CUDA hot experts' per-layer scratch for it and
//                   cuBLAS's 32 MiB workspace (on the host stream: RAM)
//   non-expert      attention, embeddings, norms, routers, shared experts and dense MLPs
//                   in the model's dtype, on the GPU when one is used, else in RAM
// Not counted: the KV cache and activations (they grow with the prompt), the CUDA
// context and torch's allocator slack, per-layer CPU scratch, and the extra batch
// shapes HybridMoe may keep (up to HybridMoe::kMaxBatchShapes, each at most this size).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "tandem/config.h"
#include "tandem/kernels.h"
#include "tandem/moe.h"

namespace tandem {

// A checkpoint's model, as far as memory goes.
struct ModelInfo {
  std::filesystem::path config_json;  // the config.json read
  std::string model_type;
  int layers = 0;                     // num_hidden_layers
  std::vector<int> moe_layers;        // model layer index of each MoE layer
  MoeShape shape;                     // routed experts per layer, hidden, expert intermediate
  int top_k = 0;                      // num_experts_per_tok
  std::string dtype = "float32";      // torch_dtype / dtype ("float32" when absent, as the loader)
  int dtype_bytes = 4;                // bytes per non-expert weight element
  uint64_t non_expert_bytes = 0;      // non-expert weights in `dtype`
  bool non_expert_exact = false;      // from safetensors headers (else from config.json shapes)
  std::string non_expert_source;      // what the figure came from, for people
  // Empty for plain silu(gate) * up experts without biases; otherwise what makes them
  // something else, and where it was read (config.json's swiglu_limit, the checkpoint's
  // expert bias tensors): the engine places no hot experts for such a model.
  std::string expert_math;
};

// Sane bounds on config.json's sizes: far above any real model, low enough that nothing is
// built or allocated from an absurd value (a layer count in the billions, a hidden size of
// 2^32 + 1 that a 32-bit read would take for 1). A value outside [min, max], or not an
// integer, is an error naming the file and the key. One table for the doctor's memory plan
// (read_model_info checks every key of it present in the file) and the Python loader
// (tandem._C.config_size_bounds()).
struct ConfigSizeBound {
  const char* key;
  int64_t min, max;
};
const std::vector<ConfigSizeBound>& config_size_bounds();

// Reads config.json next to (or in) model_path: a checkpoint directory, its index json
// or a .safetensors file. Throws tandem::Error naming the file and the missing or bad
// key; safetensors files that cannot be read are an error too (a checkpoint with no
// safetensors at all is not: the non-expert weights are then estimated).
ModelInfo read_model_info(const std::filesystem::path& model_path);

// Bytes one MoE layer's CPU packs take: `cpu_experts` experts, each split over
// `subpools` subpools (intermediate_slices) and packed in `format`. Equals
// MoeLayer::packed_bytes() after load() with that many experts not excluded.
uint64_t moe_layer_cpu_bytes(const MoeShape& shape, const PackOptions& format, int subpools, int cpu_experts);

// Hot experts of model layer `layer` under the config's policy (count only; see
// choose_hot_experts in hybrid.h for which ones).
int hot_expert_count(const HotExpertsConfig& hot, int layer, int experts);

struct MemoryPart {
  std::string what;  // "cpu experts", "hot experts", "pinned buffers", ...
  uint64_t bytes = 0;
  std::string detail;  // how it was counted, for people
};

struct MemoryPlan {
  bool on_gpu = false;               // hot experts, device buffers and non-expert weights on a GPU
  int subpools = 1;
  std::vector<MemoryPart> ram, gpu;  // gpu: empty without a GPU
  uint64_t cpu_expert_bytes = 0;     // equals Engine::cpu_bytes() after a load
  uint64_t hot_expert_bytes = 0;     // equals Engine::device_bytes() after a load
  int hot_experts = 0;               // all layers
  uint64_t ram_bytes() const;
  uint64_t gpu_bytes() const;
};

// The memory `config` needs for `model` with its CPU experts on `subpools` subpools
// (pool_options(config.cpu).subpools.size()) and, with on_gpu, a CUDA stream. Throws
// tandem::Error when the format cannot hold the model (an int4 group that does not
// divide hidden or the intermediate size).
MemoryPlan plan_memory(const Config& config, const ModelInfo& model, int subpools, bool on_gpu);

}  // namespace tandem
