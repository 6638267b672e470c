// tandem/engine.h: the routed experts of a whole model, built from a placement config.
//
// One object owns what a model's MoE layers need at run time: the worker pool
// (cpu.*), the stream (gpu.device), one MoeLayer per MoE layer (cpu.format), and the
// hybrid scheduler over them (buffers.*, gpu.deferred_experts), with each layer's hot
// experts (gpu.hot_experts) on the stream's device and the rest packed into the pools.
//
//   Engine e(load_config("configs/qwen3-30b-a3b.yaml"), {{128, 2048, 768}, moe_layers});
//   e.load(Checkpoint::open(dir), ExpertNaming::detect(ckpt, moe_layers[0]), progress);
//   e.forward(i, io);        // MoE layer i (not the model layer), stream-ordered
//
// Loading streams each expert from the mapped checkpoint straight into its packed form
// (no full-size copy) and gives the source pages back after each layer, so the resident
// set stays near the packed size. The Python package (tandem.offload, tandem.load_model)
// is a thin layer over this class.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "tandem/config.h"
#include "tandem/expert_store.h"
#include "tandem/hybrid.h"
#include "tandem/moe.h"
#include "tandem/pool_config.h"
#include "tandem/safetensors.h"
#include "tandem/streams.h"

namespace tandem {

struct EngineSpec {
  MoeShape shape;           // every MoE layer has the same one
  std::vector<int> layers;  // the model layer index of each MoE layer: distinct, ascending
  // Errors name the entry of `layers` that breaks the rule (or an empty list).
  void check() const;
  // The MoE index of a model layer, -1 when that layer has no routed experts.
  int index_of(int model_layer) const;
};

class Engine {
 public:
  // The stream is make_stream(config) unless one is given (e.g. a CUDA stream wrapping
  // the caller's own, so tandem's work is ordered with the framework's). hot_budget: the
  // device bytes gpu.hot_experts count: auto may fill (a loader that knows what else will
  // land on the device passes it); unset: the device's free memory less hot_auto_reserve,
  // 0 on the host stream.
  Engine(const Config& config, EngineSpec spec, std::unique_ptr<Stream> stream = nullptr,
         std::optional<uint64_t> hot_budget = std::nullopt);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Loads every MoE layer from a checkpoint: the config's hot experts to the stream's
  // device, the others packed into the pools. progress(done, total) counts experts over
  // all layers. Errors name the tensor (missing, wrong shape or dtype) before any layer
  // is half loaded. `only`: the MoE indices to load (empty: every layer), the others left
  // for load_layer (e.g. layers whose weights an adapter changes).
  void load(const Checkpoint& ckpt, const ExpertNaming& naming, const Progress& progress = {},
            const std::vector<int>& only = {});
  // Loads every MoE layer's CPU experts from a store made for this model and format
  // (expert_store.h; the caller checks it first: ExpertStore::check), and the config's hot
  // experts from the checkpoint as load() does. Nothing stays half loaded on error.
  void load_store(const ExpertStore& store, const Checkpoint& ckpt, const ExpertNaming& naming,
                  const Progress& progress = {});
  // Loads MoE layer i from any source (e.g. tensors an existing model holds).
  void load_layer(int i, const std::function<ExpertSource(int)>& source, const Progress& progress = {});
  bool loaded() const;
  bool loaded(int i) const;
  // Gives back MoE layer i's packs and hot experts, so that load_layer can load it again
  // (e.g. with an adapter merged into its weights). Waits for enqueued work first.
  void unload_layer(int i);

  // Enqueues MoE layer i (see HybridMoe::enqueue); io's pointers are in the stream's
  // device memory (host memory for the host stream). Every layer must be loaded.
  void forward(int i, const LayerIO& io);
  void synchronize() { stream_->synchronize(); }
  // forward + synchronize. When no part of layer i runs on a device (the host stream, no
  // hot experts there, no deferral, no dynamic hot sets, no capture) the calling thread
  // runs the CPU experts' pool task itself (HybridMoe::run_direct): the same task and
  // result, without the stream's handoffs (what a CPU decode step pays per layer).
  void run(int i, const LayerIO& io);

  const Config& config() const { return config_; }
  const EngineSpec& spec() const { return spec_; }
  int moe_layers() const { return static_cast<int>(spec_.layers.size()); }
  // The MoE index of a model layer, -1 when that layer has no routed experts.
  int index_of(int model_layer) const;
  const std::vector<int>& hot(int i) const { return hybrid_->hot(i); }
  // Dynamic hot experts (gpu.hot_experts.dynamic): rebalances done so far, and how many
  // experts changed place in them (each promotion counts once).
  uint64_t rebalances() const { return rebalances_; }
  // count: auto: the device bytes it was sized from (0 otherwise).
  uint64_t hot_budget() const { return hot_budget_; }
  uint64_t hot_moves() const { return hot_moves_; }

  Pool& pool() { return *pool_; }
  Stream& stream() { return *stream_; }
  HybridMoe& hybrid() { return *hybrid_; }
  MoeLayer& layer(int i) { return *layers_.at(i); }
  // The kernel level every CPU part of this engine runs (Config::isa()).
  IsaLevel isa() const { return isa_; }
  size_t cpu_bytes() const;     // packed CPU experts, all layers
  size_t device_bytes() const;  // hot experts on the device, all layers

 private:
  void check_index(int i) const;
  void check_call(int i) const;  // check_index, and every layer loaded (forward and run)
  void drop_layer(int i);  // packs and hot experts given back (unload_layer without the wait)
  // Puts `experts` of MoE layer i on the device: from `source` (the checkpoint's weights),
  // or with dynamic hot experts from layer i's own packs, as every later rebalance does.
  void place_hot(int i, const std::vector<int>& experts, const std::function<ExpertSource(int)>& source);
  void rebalance();  // dynamic: re-choose every layer's hot set from the routing since the last

  Config config_;
  EngineSpec spec_;
  IsaLevel isa_;
  std::unique_ptr<Pool> pool_;
  std::unique_ptr<Stream> stream_;
  std::vector<std::unique_ptr<MoeLayer>> layers_;
  std::unique_ptr<HybridMoe> hybrid_;
  std::unique_ptr<RoutingStatistics> stats_;  // for gpu.hot_experts.statistics
  std::vector<std::vector<int>> hot_;         // per MoE layer, from the config
  // Dynamic hot experts: steps seen (calls of MoE layer 0), per layer each expert's decayed
  // routed count and the cumulative count at the last rebalance.
  uint64_t steps_ = 0, rebalances_ = 0, hot_moves_ = 0, hot_budget_ = 0;
  std::vector<std::vector<double>> score_;
  std::vector<std::vector<uint64_t>> seen_;
};

}  // namespace tandem
