// tandem/config.h: the placement file (YAML), parsed and validated in one place.
//
// The same parser serves C++ and Python (through the bindings), so a file means
// the same thing everywhere. Every error names the file, the line, the key path
// and what is allowed, e.g.
//   configs/x.yaml:7:11: cpu.format: 'fp8' is not one of: bf16, int8, int4
// Unknown keys are errors (a typo must not silently fall back to a default).
// The schema, version 1 (all keys optional except where noted):
//
//   version: 1
//   model:
//     path: /models/Qwen3-30B-A3B     # checkpoint dir/file; relative to this file
//   cpu:
//     format: bf16                    # bf16 | int8 | int4 | mxfp4 (the routed experts)
//     dense_format: auto              # auto | torch | bf16 | int8 | int4: the other linear
//                                     # layers that run on the CPU (tandem.load_model)
//     group_size: 128                 # int4 only (either format): 32 | 64 | 128
//     zero_point: false               # int4 only (either format): asymmetric groups
//     numa_nodes: auto                # auto | [0, 1] (physical node ids)
//     virtual_subpools: 1             # subpools per node (tests NUMA paths on 1 node)
//     threads: auto                   # auto | threads per subpool
//     isa: auto                       # auto | scalar | avx2 | avx512 | avx512_vnni | avx512_bf16 | amx
//     store: q-int4/                  # the experts packed once by `tandem convert` (expert_store.h),
//                                     # loaded instead of packing the checkpoint; relative to this file
//   gpu:
//     device: auto                    # auto | none | N | cuda:N
//     hot_experts:                    # experts per layer kept on the GPU
//       count: 8                      # uniform count per layer ...
//       statistics: stats.json        # ... chosen by routing frequency from this file
//       layers: {0: [1, 5], 3: [2]}   # or explicit lists (exclusive with count)
//     deferred_experts: 0             # lowest-scoring CPU experts deferred to next layer
//   buffers:
//     pinned_slots: 2                 # 1 (no double buffering) .. 4
//     max_tokens: 4096                # largest batch the pinned slots hold
//   trace:
//     path: trace.json                # Chrome trace written here when enabled
//     enabled: false
#pragma once

#include <cstddef>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/cpu_features.h"

namespace tandem {

struct HotExpertsConfig {
  enum class Policy { none, uniform, statistics, explicit_lists };
  Policy policy = Policy::none;
  int count = 0;                              // uniform / statistics: experts per layer
  // count: auto: as many per layer as fit in the device memory left for them (resolved by
  // the engine: Engine's hot_budget, else the device's free memory less a reserve); 0 on
  // the host stream unless a budget is given.
  bool auto_count = false;
  std::filesystem::path statistics;           // statistics: routing-frequency file
  std::map<int, std::vector<int>> layers;     // explicit_lists: layer -> expert ids
  // Dynamic: the hot set (same count per layer) is re-chosen from the routing seen while
  // running, every `rebalance_steps` steps (calls of the first MoE layer); a cold expert
  // replaces a hot one only when its decayed count exceeds the hot one's by `hysteresis`
  // (a fraction). uniform / statistics give the starting set.
  bool dynamic = false;
  int rebalance_steps = 64;
  double hysteresis = 0.25;

  // For experts the hot-expert paths cannot compute (they run silu(gate) * up without
  // biases): auto finds no room for them (none), a count or a list is refused, naming what
  // the experts compute. `where` starts the message (the config's source). The engine and
  // the doctor's memory plan both apply it.
  void keep_on_cpu(const std::string& where, const std::string& experts);
};

struct Config {
  std::string source;  // the file it came from ("<string>" when parsed from text)
  int version = 1;

  struct Model {
    std::filesystem::path path;  // empty: not given (the caller supplies the model)
  } model;

  struct Cpu {
    std::string format = "bf16";
    // The CPU's other linear layers: "auto" (tandem's bf16 kernels for bf16 weights,
    // torch for the rest), "torch" (transformers' own), or a format every one is packed in.
    std::string dense_format = "auto";
    int group_size = 128;       // meaningful for int4
    bool zero_point = false;    // meaningful for int4
    std::vector<int> numa_nodes;  // empty: all nodes
    int virtual_subpools = 1;
    int threads = 0;            // 0: one per physical core of the subpool
    std::string isa = "auto";
    std::filesystem::path store;  // empty: pack the experts from the checkpoint
  } cpu;

  struct Gpu {
    std::string device = "auto";  // "auto", "none" or "cuda:N"
    HotExpertsConfig hot_experts;
    int deferred_experts = 0;
  } gpu;

  struct Buffers {
    int pinned_slots = 2;
    int max_tokens = 4096;
  } buffers;

  struct Trace {
    std::filesystem::path path = "tandem_trace.json";
    bool enabled = false;
  } trace;

  struct Train {
    // Format of the transposed expert packs LoRA's backward reads: bf16, or int8 (half the
    // memory; int4 is not supported there).
    std::string backward_format = "bf16";
  } train;

  // Several ranks (torch.distributed) on one machine; read by the Python side.
  struct Distributed {
    // "auto" (shared when a machine runs several ranks), "shared" (one rank per machine
    // holds the CPU experts and its pool; the others send their tokens to it) or "per_rank"
    // (every rank packs its own copy and runs its own pool).
    std::string cpu_experts = "auto";
    // How tokens reach the experts' owner: "auto" (by token count), "allgather" (all-gather,
    // then reduce-scatter) or "alltoall".
    std::string comm = "auto";
    // comm auto: all-to-all from this many tokens on the busiest rank; 0 ("auto"): by the
    // transport (gloo: always, as measured; NCCL: from 64).
    int alltoall_from_tokens = 0;
  } distributed;

  // -1 for "none", -2 for "auto", else the CUDA device index.
  int gpu_index() const;
  // The kernel level this config runs: select_isa(cpu.isa) (lowered by TANDEM_ISA,
  // capped by the hardware; an error naming this file's cpu.isa above it).
  IsaLevel isa() const;
  // The validated config as JSON (what Python sees; what `tandem doctor` prints).
  std::string to_json() const;
};

std::string_view hot_policy_name(HotExpertsConfig::Policy p) noexcept;

// What the parser reads at most, so that no file makes it run long or take much memory
// (a placement config is a few KB: tens of keys, 4 levels deep, or explicit expert
// lists of some 10^4 ids). Going over one is an error naming the file and the limit.
// YAML anchors and aliases are refused outright, so the tree is never larger than the
// text. Each limit can be raised (or lowered) through the environment variable beside it.
struct ConfigLimits {
  size_t max_bytes = size_t(1) << 20;  // TANDEM_CONFIG_MAX_BYTES: the file's size
  int max_depth = 32;                  // TANDEM_CONFIG_MAX_DEPTH: nested lists / mappings
  size_t max_nodes = size_t(1) << 18;  // TANDEM_CONFIG_MAX_NODES: scalars, lists and mappings (keys included)
  // The defaults above, with each variable that is set taking their place (an error
  // naming the variable when it is not a positive integer).
  static ConfigLimits from_env();
};

// Parse a file; relative paths inside it are resolved against its directory.
Config load_config(const std::filesystem::path& path, const ConfigLimits& limits = ConfigLimits::from_env());
// Parse text; `origin` names it in errors; relative paths resolve against `base_dir`.
Config parse_config(std::string_view yaml, std::string_view origin = "<string>",
                    const std::filesystem::path& base_dir = {},
                    const ConfigLimits& limits = ConfigLimits::from_env());

}  // namespace tandem
