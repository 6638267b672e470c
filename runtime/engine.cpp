#include "tandem/engine.h"

#include <algorithm>
#include <map>

#include "tandem/error.h"

namespace tandem {

void EngineSpec::check() const {
  TANDEM_CHECK(!layers.empty(), Errc::invalid_argument, "engine: the model has no MoE layers");
  for (size_t i = 0; i < layers.size(); ++i)
    TANDEM_CHECK(layers[i] >= 0 && (i == 0 || layers[i] > layers[i - 1]), Errc::invalid_argument,
                 "engine: MoE layer indices must be distinct, ascending and non-negative (entry ", i, " is ",
                 layers[i], ")");
}

int EngineSpec::index_of(int model_layer) const {
  auto it = std::lower_bound(layers.begin(), layers.end(), model_layer);
  return it != layers.end() && *it == model_layer ? static_cast<int>(it - layers.begin()) : -1;
}

Engine::Engine(const Config& config, EngineSpec spec, std::unique_ptr<Stream> stream, std::optional<uint64_t> hot_budget)
    : config_(config), spec_(std::move(spec)) {
  spec_.check();
  HotExpertsConfig& hc = config_.gpu.hot_experts;
  if (hc.policy == HotExpertsConfig::Policy::statistics)
    stats_ = std::make_unique<RoutingStatistics>(load_routing_statistics(hc.statistics));
  if (hc.policy == HotExpertsConfig::Policy::explicit_lists)
    for (const auto& [layer, ids] : hc.layers)
      TANDEM_CHECK(index_of(layer) >= 0, Errc::invalid_argument, config_.source, ": gpu.hot_experts.layers: layer ",
                   layer, " is not a MoE layer of this model");

  const PackOptions format = pack_options(config_.cpu);
  isa_ = config_.isa();
  stream_ = stream ? std::move(stream) : make_stream(config_);
  // The hot-expert paths (device copies, the host stream's set) compute silu(gate) * up
  // without biases.
  if (!spec_.shape.plain()) hc.keep_on_cpu(config_.source, describe_experts(spec_.shape));
  if (hc.auto_count) {  // resolved once, here: the count every later step keeps
    if (hot_budget) {
      hot_budget_ = *hot_budget;
    } else {
      const Stream::MemoryInfo m = stream_->device_memory();
      const uint64_t reserve = hot_auto_reserve(m.total);
      hot_budget_ = m.free > reserve ? m.free - reserve : 0;
    }
    hc.count = hot_count_for_budget(hot_budget_, moe_layers(), spec_.shape);
    if (hc.count == 0) {  // no room (or no device): every expert on the CPU, nothing to move
      hc.policy = HotExpertsConfig::Policy::none;
      hc.dynamic = false;
    }
  }
  // With a CUDA stream, one core stays free for the thread that drives the GPU.
  pool_ = std::make_unique<Pool>(pool_options(config_.cpu, stream_->is_cuda() ? 1 : 0));
  std::vector<MoeLayer*> raw;
  for (int l : spec_.layers) {
    layers_.push_back(std::make_unique<MoeLayer>(*pool_, spec_.shape, format, l));
    layers_.back()->use_isa(isa_);
    raw.push_back(layers_.back().get());
  }
  HybridOptions ho;
  ho.pinned_slots = config_.buffers.pinned_slots;
  ho.max_tokens = config_.buffers.max_tokens;
  ho.deferred = config_.gpu.deferred_experts;
  ho.hot_may_change = hc.dynamic;
  hybrid_ = std::make_unique<HybridMoe>(*stream_, std::move(raw), ho);
  // Every layer's hot list is resolved (ids range-checked, naming the config key) now,
  // not halfway through a load.
  for (int i = 0; i < moe_layers(); ++i)
    hot_.push_back(choose_hot_experts(config_.gpu.hot_experts, spec_.layers[i], spec_.shape.experts, stats_.get()));
  if (hc.dynamic) {
    score_.assign(moe_layers(), std::vector<double>(spec_.shape.experts, 0.0));
    seen_.assign(moe_layers(), std::vector<uint64_t>(spec_.shape.experts, 0));
  }
}

Engine::~Engine() {
  if (stream_) {
    try {
      stream_->synchronize();
    } catch (...) {  // an error nobody collected: the work is being torn down anyway
    }
  }
  hybrid_.reset();  // before the stream and the layers it refers to
}

int Engine::index_of(int model_layer) const { return spec_.index_of(model_layer); }

void Engine::check_index(int i) const {
  TANDEM_CHECK(i >= 0 && i < moe_layers(), Errc::invalid_argument, "engine: MoE layer ", i, " is outside [0, ",
               moe_layers(), ")");
}

void Engine::load_layer(int i, const std::function<ExpertSource(int)>& source, const Progress& progress) {
  check_index(i);
  MoeLayer& l = *layers_[i];
  TANDEM_CHECK(!l.loaded(), Errc::invalid_argument, "engine: MoE layer ", i, " (model layer ", spec_.layers[i],
               ") is already loaded");
  const std::vector<int>& hot = hot_[i];
  if (!config_.gpu.hot_experts.dynamic) l.exclude(hot);  // dynamic: any expert may run on the CPU later
  l.load(source, progress);
  place_hot(i, hot, source);
}

void Engine::place_hot(int i, const std::vector<int>& experts, const std::function<ExpertSource(int)>& source) {
  if (!config_.gpu.hot_experts.dynamic) {
    hybrid_->set_hot(i, experts, source);
    return;
  }
  // From the layer's packs, so an expert computes with the same weights wherever it runs
  // (for int8 / int4 the quantized ones) and a later promotion needs no checkpoint.
  std::map<int, ExpertWeights> w;
  for (int e : experts) w.emplace(e, layers_[i]->dequantized(e));
  const int H = spec_.shape.hidden, I = spec_.shape.inter;
  hybrid_->set_hot(i, experts, [&](int e) {
    const ExpertWeights& x = w.at(e);
    ExpertSource src;
    src.gate = {x.gate.data(), SourceType::f32, I, H};
    src.up = {x.up.data(), SourceType::f32, I, H};
    src.down = {x.down.data(), SourceType::f32, H, I};
    return src;
  });
}

void Engine::rebalance() {
  const HotExpertsConfig& hc = config_.gpu.hot_experts;
  stream_->synchronize();  // the counts are final and no enqueued work uses the old sets
  bool moved = false;
  for (int i = 0; i < moe_layers(); ++i) {
    const PlacementCounts c = hybrid_->counts(i);
    for (int e = 0; e < spec_.shape.experts; ++e) {
      const uint64_t total = c.hot[e] + c.cold[e] + c.deferred[e];
      const uint64_t fresh = total >= seen_[i][e] ? total - seen_[i][e] : total;  // reset_counts() restarts them
      seen_[i][e] = total;
      score_[i][e] = 0.5 * score_[i][e] + static_cast<double>(fresh);  // halves every rebalance window
    }
    const std::vector<int>& now = hybrid_->hot(i);
    std::vector<int> next = rebalance_hot_experts(now, score_[i], hc.hysteresis);
    if (next == now) continue;
    for (int e : next) hot_moves_ += !std::binary_search(now.begin(), now.end(), e);
    place_hot(i, next, {});
    moved = true;
  }
  rebalances_ += moved;
}

void Engine::load(const Checkpoint& ckpt, const ExpertNaming& naming, const Progress& progress,
                  const std::vector<int>& only) {
  std::vector<int> index;  // MoE index of each layer loaded here
  for (int i : only) {
    check_index(i);
    TANDEM_CHECK(std::find(index.begin(), index.end(), i) == index.end(), Errc::invalid_argument,
                 "engine: MoE layer ", i, " is listed twice");
    index.push_back(i);
  }
  std::sort(index.begin(), index.end());
  if (only.empty())
    for (int i = 0; i < moe_layers(); ++i) index.push_back(i);
  std::vector<int> model_layers;
  for (int i : index) model_layers.push_back(spec_.layers[i]);
  std::vector<int> begun;  // layers this call started: what a failure rolls back
  try {
    load_checkpoint_layers(
        ckpt, model_layers, naming, spec_.shape,
        [&](int j, const std::function<ExpertSource(int)>& source, const Progress& p) {
          const int i = index.at(j);
          if (!layers_[i]->loaded()) begun.push_back(i);
          load_layer(i, source, p);
        },
        progress);
  } catch (...) {  // e.g. a non-finite weight found while packing: nothing stays half loaded
    for (int i : begun) drop_layer(i);  // nothing of theirs was enqueued
    throw;
  }
}

void Engine::load_store(const ExpertStore& store, const Checkpoint& ckpt, const ExpertNaming& naming,
                        const Progress& progress) {
  const StoreSpec& s = store.spec();
  TANDEM_CHECK(s.layers == spec_.layers, Errc::invalid_argument, "engine: store ", store.dir().string(),
               " holds other MoE layers than this model's");
  for (int i = 0; i < moe_layers(); ++i)
    TANDEM_CHECK(!layers_[i]->loaded(), Errc::invalid_argument, "engine: MoE layer ", i, " is already loaded");
  const int E = spec_.shape.experts, L = moe_layers();
  // The hot experts' tensors are checked before anything is read.
  for (int i = 0; i < L; ++i)
    for (int e : hot_[i]) checkpoint_expert(ckpt, spec_.layers[i], e, naming, spec_.shape);
  std::vector<int> begun;
  try {
    for (int i = 0; i < L; ++i) {
      const int model_layer = spec_.layers[i];
      Progress p;  // (subpool, expert) items: rescaled to experts over all layers
      if (progress)
        p = [&, i](int done, int of) { progress(i * E + (of > 0 ? static_cast<int>(int64_t{done} * E / of) : 0), L * E); };
      MoeLayer& l = *layers_[i];
      begun.push_back(i);
      if (!config_.gpu.hot_experts.dynamic) l.exclude(hot_[i]);
      l.load(store, i, p);
      place_hot(i, hot_[i], [&](int e) { return checkpoint_expert(ckpt, model_layer, e, naming, spec_.shape); });
      for (int e : hot_[i]) release_checkpoint_expert(ckpt, model_layer, e, naming);
    }
  } catch (...) {
    for (int i : begun) drop_layer(i);
    throw;
  }
  if (progress) progress(L * E, L * E);
}

bool Engine::loaded(int i) const {
  check_index(i);
  return layers_[i]->loaded();
}

void Engine::drop_layer(int i) {
  layers_[i]->unload();
  hybrid_->set_hot(i, {}, {});
}

void Engine::unload_layer(int i) {
  check_index(i);
  stream_->synchronize();
  drop_layer(i);
}

bool Engine::loaded() const {
  return std::all_of(layers_.begin(), layers_.end(), [](const auto& l) { return l->loaded(); });
}

void Engine::check_call(int i) const {
  check_index(i);
  for (int j = 0; j < moe_layers(); ++j)  // the scheduler needs every layer (deferral spans layers)
    TANDEM_CHECK(layers_[j]->loaded(), Errc::invalid_argument, "engine: MoE layer ", j, " (model layer ", spec_.layers[j],
                 ") has no weights: load every layer before the first forward");
}

void Engine::forward(int i, const LayerIO& io) {
  check_call(i);
  // Dynamic hot experts move between steps: at the start of every rebalance_steps-th step,
  // when no layer of the step before is still to be enqueued (its deferred experts end in
  // its last layer). Never inside a capture (refused there: HybridMoe::enqueue_batch).
  if (config_.gpu.hot_experts.dynamic && i == 0 && !stream_->capturing()) {
    if (steps_ > 0 && steps_ % static_cast<uint64_t>(config_.gpu.hot_experts.rebalance_steps) == 0) rebalance();
    ++steps_;
  }
  hybrid_->enqueue(i, io);
}

void Engine::run(int i, const LayerIO& io) {
  check_call(i);  // the same refusals as forward, whichever path runs
  if (!config_.gpu.hot_experts.dynamic && hybrid_->run_direct(i, io)) return;
  forward(i, io);
  synchronize();
}

size_t Engine::cpu_bytes() const {
  size_t b = 0;
  for (const auto& l : layers_) b += l->packed_bytes();
  return b;
}

size_t Engine::device_bytes() const {
  size_t b = 0;
  for (int i = 0; i < moe_layers(); ++i)
    if (const DeviceExperts* d = hybrid_->device_experts(i)) b += d->bytes();
  return b;
}

}  // namespace tandem
