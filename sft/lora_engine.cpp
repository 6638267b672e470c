// The training side of a whole model from a placement config (tandem/lora_engine.h).
#include "tandem/lora_engine.h"

#include <algorithm>

#include "tandem/error.h"
#include "tandem/pool_config.h"

namespace tandem {

LoraEngine::LoraEngine(const Config& config, EngineSpec spec, LoraEngineOptions options)
    : config_(config), spec_(std::move(spec)) {
  spec_.check();
  options_.format = pack_options(config_.cpu);
  options_.backward_format = options.backward_format;
  options_.lora = options.lora;
  isa_ = config_.isa();
  pool_ = std::make_unique<Pool>(pool_options(config_.cpu));
  for (int l : spec_.layers) {
    layers_.push_back(std::make_unique<LoraMoe>(*pool_, spec_.shape, options_, l));
    layers_.back()->use_isa(isa_);
  }
}

LoraEngine::~LoraEngine() = default;

void LoraEngine::check_index(int i) const {
  TANDEM_CHECK(i >= 0 && i < moe_layers(), Errc::invalid_argument, "lora engine: MoE layer ", i, " is outside [0, ",
               moe_layers(), ")");
}

LoraMoe& LoraEngine::layer(int i) {
  check_index(i);
  return *layers_[i];
}

const LoraMoe& LoraEngine::layer(int i) const {
  check_index(i);
  return *layers_[i];
}

void LoraEngine::load_layer(int i, const std::function<ExpertSource(int)>& source, const Progress& progress) {
  layer(i).load(source, progress);
}

void LoraEngine::load(const Checkpoint& ckpt, const ExpertNaming& naming, const Progress& progress) {
  try {
    load_checkpoint_layers(
        ckpt, spec_.layers, naming, spec_.shape,
        [this](int i, const std::function<ExpertSource(int)>& source, const Progress& p) { load_layer(i, source, p); },
        progress);
  } catch (...) {  // e.g. a non-finite weight found while packing: nothing stays half loaded
    for (auto& l : layers_) l->unload();
    throw;
  }
}

bool LoraEngine::loaded() const {
  return std::all_of(layers_.begin(), layers_.end(), [](const auto& l) { return l->loaded(); });
}

void LoraEngine::prepare_backward(const Progress& progress) {
  for (auto& l : layers_) l->prepare_backward(progress);
}

size_t LoraEngine::packed_bytes() const {
  size_t b = 0;
  for (const auto& l : layers_) b += l->packed_bytes();
  return b;
}

size_t LoraEngine::backward_bytes() const {
  size_t b = 0;
  for (const auto& l : layers_) b += l->backward_bytes();
  return b;
}

}  // namespace tandem
