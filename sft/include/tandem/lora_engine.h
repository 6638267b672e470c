// tandem/lora_engine.h: the training side of a whole model, built from a placement config.
//
// The counterpart of Engine (engine.h) for LoRA fine-tuning: one object owns the worker pool
// (cpu.*) and one LoraMoe per MoE layer (cpu.format, group_size, zero_point; kernels at
// cpu.isa, lowered by TANDEM_ISA), all on that pool. Training runs every routed expert on the
// CPU pools: the config's gpu section (hot experts, deferral, device) does not apply here.
//
//   LoraEngine t(load_config("configs/qwen3-30b-a3b.yaml"), {{128, 2048, 768}, moe_layers});
//   t.load(Checkpoint::open(dir), ExpertNaming::detect(ckpt, moe_layers[0]), progress);
//   t.layer(i).forward(in, lora);   // MoE layer i (not the model layer)
//
// Loading is the inference engine's (load_checkpoint_layers, experts.h): every expert tensor
// of every layer is checked first, then each layer is packed straight from the mapped
// checkpoint and its source pages are given back, so a training load peaks like an inference
// load (near the packed size). The Python package (tandem.load_model(train=True),
// tandem.offload(train=True)) is a thin layer over this class.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "tandem/config.h"
#include "tandem/engine.h"
#include "tandem/experts.h"
#include "tandem/lora.h"
#include "tandem/pool.h"
#include "tandem/safetensors.h"

namespace tandem {

// What the config does not say about training.
struct LoraEngineOptions {
  WeightFormat backward_format = WeightFormat::bf16;  // the transposed packs for backward (bf16 or int8)
  LoraConfig lora;  // every layer's initial rank / scaling (LoraMoe::set_lora changes one layer's)
};

class LoraEngine {
 public:
  LoraEngine(const Config& config, EngineSpec spec, LoraEngineOptions options = {});
  ~LoraEngine();
  LoraEngine(const LoraEngine&) = delete;
  LoraEngine& operator=(const LoraEngine&) = delete;

  // Packs every MoE layer's frozen base from a checkpoint, read in place, giving the source
  // pages back after each layer. progress(done, total) counts experts over all layers. Errors
  // name the tensor (missing, wrong shape or dtype) before any layer is half loaded.
  void load(const Checkpoint& ckpt, const ExpertNaming& naming, const Progress& progress = {});
  // Packs MoE layer i from any source (e.g. tensors an existing model holds).
  void load_layer(int i, const std::function<ExpertSource(int)>& source, const Progress& progress = {});
  bool loaded() const;
  // Builds every layer's backward packs now (otherwise each layer's first backward does).
  void prepare_backward(const Progress& progress = {});

  const Config& config() const { return config_; }
  const EngineSpec& spec() const { return spec_; }
  const SftOptions& options() const { return options_; }
  int moe_layers() const { return static_cast<int>(spec_.layers.size()); }
  // The MoE index of a model layer, -1 when that layer has no routed experts.
  int index_of(int model_layer) const { return spec_.index_of(model_layer); }

  Pool& pool() { return *pool_; }
  // MoE layer i (its layer_index() is the model layer).
  LoraMoe& layer(int i);
  const LoraMoe& layer(int i) const;
  // The kernel level every layer runs (Config::isa()).
  IsaLevel isa() const { return isa_; }
  size_t packed_bytes() const;    // forward packs, all layers
  size_t backward_bytes() const;  // transposed packs, all layers (0 before any backward)

 private:
  void check_index(int i) const;

  Config config_;
  EngineSpec spec_;
  SftOptions options_;
  IsaLevel isa_;
  std::unique_ptr<Pool> pool_;
  std::vector<std::unique_ptr<LoraMoe>> layers_;
};

}  // namespace tandem
