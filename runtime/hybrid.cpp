#include "tandem/hybrid.h"

#include <algorithm>

#include "tandem/error.h"

namespace tandem {

// Pinned host memory of one slot.
struct HybridMoe::Slot {
  void* x = nullptr;          // [T x H] copy of the layer input
  int32_t* ids3 = nullptr;    // [3][T x K] hot | cold | deferred
  float* w = nullptr;         // [T x K]
  float* out = nullptr;       // [T x H] cold experts' output
  float* dout = nullptr;      // [T x H] deferred experts' output
};

// The host functions' argument for one (batch shape, layer): fixed address, fixed
// contents after creation (the stream's thread writes only the tickets and spans).
struct HybridMoe::Job {
  HybridMoe* self = nullptr;
  int layer = 0, tokens = 0, top_k = 0;
  Slot* slot = nullptr;
  bool defers = false;        // this layer defers experts to the next
  Job* prev = nullptr;        // the layer whose deferred output this one adds
  MoeInput cold, deferred;    // point into the slot
  uint64_t ticket_cold = 0, ticket_deferred = 0;
  StreamSpan copy_in, hot, copy_out;
};

struct HybridMoe::Batch {
  Stream* stream = nullptr;
  int tokens = 0, top_k = 0;
  XType xt = XType::bf16;
  std::vector<Slot> slots;
  std::vector<void*> pinned, device;  // owned allocations
  int32_t* ids3_dev = nullptr;        // [3][T x K]
  float* back_dev = nullptr;          // [T x H] cold output, copied back
  float* dback_dev = nullptr;         // [T x H] deferred output, copied back
  std::vector<std::unique_ptr<Job>> jobs;
  uint64_t last_use = 0;  // enqueue counter at its last use (least recently used goes first)
  bool captured = false;  // used while a graph was captured: kept for the graph's lifetime
  ~Batch() {
    for (void* p : pinned) stream->free_pinned(p);
    for (void* p : device) stream->free_device(p);
  }
};

namespace {
enum Where { kHot = 0, kCold = 1, kDeferred = 2 };
}

HybridMoe::HybridMoe(Stream& stream, std::vector<MoeLayer*> cpu, HybridOptions options)
    : stream_(stream), cpu_(std::move(cpu)), opt_(options) {
  TANDEM_CHECK(!cpu_.empty(), Errc::invalid_argument, "hybrid: no layers");
  for (size_t i = 0; i < cpu_.size(); ++i)
    TANDEM_CHECK(cpu_[i] != nullptr, Errc::invalid_argument, "hybrid: layer ", i, " is null");
  shape_ = cpu_[0]->shape();
  for (size_t i = 1; i < cpu_.size(); ++i) {
    const MoeShape& s = cpu_[i]->shape();
    TANDEM_CHECK(s.experts == shape_.experts && s.hidden == shape_.hidden && s.inter == shape_.inter,
                 Errc::invalid_argument, "hybrid: layer ", i, " has shape (experts ", s.experts, ", hidden ", s.hidden,
                 ", intermediate ", s.inter, "), layer 0 has (", shape_.experts, ", ", shape_.hidden, ", ", shape_.inter,
                 ")");
    TANDEM_CHECK(&cpu_[i]->pool() == &cpu_[0]->pool(), Errc::invalid_argument,
                 "hybrid: all layers must run on one pool (layer ", i, " does not)");
  }
  TANDEM_CHECK(opt_.pinned_slots >= 1 && opt_.pinned_slots <= 4, Errc::invalid_argument, "hybrid: pinned_slots = ",
               opt_.pinned_slots, " is outside [1, 4]");
  TANDEM_CHECK(opt_.max_tokens >= 1, Errc::invalid_argument, "hybrid: max_tokens = ", opt_.max_tokens,
               " must be positive");
  TANDEM_CHECK(opt_.deferred >= 0 && opt_.deferred <= kRouterMaxTopK, Errc::invalid_argument,
               "hybrid: deferred_experts = ", opt_.deferred, " is outside [0, ", kRouterMaxTopK, "]");
  TANDEM_CHECK(opt_.deferred == 0 || opt_.pinned_slots >= 2, Errc::invalid_argument,
               "hybrid: deferred experts need at least 2 pinned slots (buffers.pinned_slots = ", opt_.pinned_slots, ")");
  const int L = layers(), E = shape_.experts;
  hot_.resize(L);
  hot_ids_.resize(L);
  hot_mask_dev_.resize(L, nullptr);
  const size_t n = static_cast<size_t>(L) * (3 * E + 1);
  counts_ = std::make_unique<std::atomic<uint64_t>[]>(n);
  for (size_t i = 0; i < n; ++i) counts_[i].store(0, std::memory_order_relaxed);
  const std::vector<uint8_t> none(E, 0);
  for (int l = 0; l < L; ++l) {
    hot_mask_dev_[l] = static_cast<uint8_t*>(stream_.alloc_device(E));
    stream_.upload(hot_mask_dev_[l], none.data(), E);
  }
}

void HybridMoe::check_layer(int layer) const {
  TANDEM_CHECK(layer >= 0 && layer < layers(), Errc::invalid_argument, "hybrid: layer ", layer, " is outside [0, ",
               layers(), ")");
}

HybridMoe::~HybridMoe() {
  try {
    stream_.synchronize();  // nothing may still use the slots, jobs or masks
  } catch (...) {
  }
  try {
    cpu_[0]->pool().sync();  // nor a CPU task
  } catch (...) {
  }
  for (int l = 0; l < layers(); ++l)
    if (hot_mask_dev_[l]) stream_.free_device(hot_mask_dev_[l]);
}

void HybridMoe::set_hot(int layer, std::vector<int> experts, const std::function<ExpertSource(int)>& source) {
  check_layer(layer);
  std::sort(experts.begin(), experts.end());
  std::vector<uint8_t> mask(shape_.experts, 0);
  for (int e : experts) {
    TANDEM_CHECK(e >= 0 && e < shape_.experts, Errc::invalid_argument, "hybrid: layer ", layer, ": hot expert ", e,
                 " is outside [0, ", shape_.experts, ")");
    TANDEM_CHECK(!mask[e], Errc::invalid_argument, "hybrid: layer ", layer, ": hot expert ", e, " is listed twice");
    mask[e] = 1;
  }
  TANDEM_CHECK(experts.empty() || shape_.plain(), Errc::unsupported, "hybrid: layer ", layer, ": hot experts run "
               "silu(gate) * up experts without biases only; this layer's experts are ", describe_experts(shape_));
  stream_.synchronize();  // no enqueued work may still use the old set
  hot_[layer].reset();
  if (!experts.empty()) hot_[layer] = stream_.upload_experts(shape_, experts, source);
  hot_ids_[layer] = std::move(experts);
  stream_.upload(hot_mask_dev_[layer], mask.data(), mask.size());
}

const std::vector<int>& HybridMoe::hot(int layer) const {
  check_layer(layer);
  return hot_ids_[layer];
}

HybridMoe::Batch& HybridMoe::batch(int tokens, int top_k, XType xt, bool defer) {
  const std::tuple<int, int, int, bool> key{tokens, top_k, static_cast<int>(xt), defer};
  if (auto it = batches_.find(key); it != batches_.end()) return *it->second;
  evict_batches();
  // Built aside and entered only when complete: an allocation that fails (out of memory, or
  // refused while torch captures the stream) leaves no half-made batch behind.
  auto b = std::make_unique<Batch>();
  b->stream = &stream_;
  b->tokens = tokens;
  b->top_k = top_k;
  b->xt = xt;
  const size_t T = tokens, K = top_k, H = shape_.hidden;
  auto pinned = [&](size_t bytes) {
    void* p = stream_.alloc_pinned(bytes);
    b->pinned.push_back(p);
    return p;
  };
  auto device = [&](size_t bytes) {
    void* p = stream_.alloc_device(bytes);
    b->device.push_back(p);
    return p;
  };
  b->slots.resize(opt_.pinned_slots);
  for (Slot& s : b->slots) {
    s.x = pinned(T * H * xtype_size(xt));
    s.ids3 = static_cast<int32_t*>(pinned(3 * T * K * sizeof(int32_t)));
    s.w = static_cast<float*>(pinned(T * K * sizeof(float)));
    s.out = static_cast<float*>(pinned(T * H * sizeof(float)));
    s.dout = defer ? static_cast<float*>(pinned(T * H * sizeof(float))) : nullptr;
  }
  b->ids3_dev = static_cast<int32_t*>(device(3 * T * K * sizeof(int32_t)));
  b->back_dev = static_cast<float*>(device(T * H * sizeof(float)));
  b->dback_dev = defer ? static_cast<float*>(device(T * H * sizeof(float))) : nullptr;
  for (int l = 0; l < layers(); ++l) {
    auto j = std::make_unique<Job>();
    j->self = this;
    j->layer = l;
    j->tokens = tokens;
    j->top_k = top_k;
    j->slot = &b->slots[l % opt_.pinned_slots];
    j->defers = defer && l + 1 < layers();
    j->prev = defer && l > 0 ? b->jobs[l - 1].get() : nullptr;
    MoeInput in;
    (xt == XType::bf16 ? reinterpret_cast<const void*&>(in.x) : reinterpret_cast<const void*&>(in.x_f32)) = j->slot->x;
    in.tokens = tokens;
    in.top_k = top_k;
    in.weights = j->slot->w;
    j->cold = in;
    j->cold.ids = j->slot->ids3 + T * K * kCold;
    j->cold.out = j->slot->out;
    j->deferred = in;
    j->deferred.ids = j->slot->ids3 + T * K * kDeferred;
    j->deferred.out = j->slot->dout;
    const trace::Args args{cpu_[l]->layer_index(), -1, tokens};
    j->copy_in = {"copy_in", args};
    j->hot = {"hot_experts", args};
    j->copy_out = {"copy_back", args};
    b->jobs.push_back(std::move(j));
  }
  return *(batches_[key] = std::move(b));
}

void HybridMoe::submit_fn(void* p) {
  Job& j = *static_cast<Job*>(p);
  HybridMoe& h = *j.self;
  if (h.stream_.failed()) return;  // the split (or an earlier layer) failed: nothing valid to submit
  trace::Span span("submit_cpu", {h.cpu_[j.layer]->layer_index(), -1, j.tokens});
  try {
    const int E = h.shape_.experts;
    const size_t n = static_cast<size_t>(j.tokens) * j.top_k;
    std::atomic<uint64_t>* c = &h.counts_[static_cast<size_t>(j.layer) * (3 * E + 1)];
    for (int where = 0; where < 3; ++where) {
      const int32_t* ids = j.slot->ids3 + n * where;
      for (size_t i = 0; i < n; ++i)
        if (ids[i] >= 0 && ids[i] < E) c[where * E + ids[i]].fetch_add(1, std::memory_order_relaxed);
    }
    c[3 * E].fetch_add(j.tokens, std::memory_order_relaxed);
    MoeLayer& cpu = *h.cpu_[j.layer];
    j.ticket_cold = cpu.submit(j.cold);
    j.ticket_deferred = j.defers ? cpu.submit(j.deferred) : 0;
  } catch (...) {
    h.stream_.set_error(std::current_exception());
  }
}

void HybridMoe::wait_fn(void* p) {
  Job& j = *static_cast<Job*>(p);
  HybridMoe& h = *j.self;
  // No failed() check: a task submitted before a failure must still finish before the
  // stream moves on (its slot is reused); tickets of skipped submits are old and done.
  trace::Span span("wait_cpu", {h.cpu_[j.layer]->layer_index(), -1, j.tokens});
  try {
    Pool& pool = h.cpu_[j.layer]->pool();
    if (j.prev) pool.wait(j.prev->ticket_deferred);
    pool.wait(j.ticket_cold);
  } catch (...) {
    h.stream_.set_error(std::current_exception());
  }
}

void HybridMoe::evict_batches() {
  // Generation meets a new prompt length per request: without a bound, buffers per batch
  // shape would pile up. Past kMaxBatchShapes, the least recently used shapes go, except
  // ones a captured graph may replay and the one a step with deferral is in the middle of.
  // Freeing needs the stream and the pool idle; this runs only when a shape is new.
  if (static_cast<int>(batches_.size()) < kMaxBatchShapes || stream_.capturing()) return;
  std::vector<std::pair<uint64_t, std::tuple<int, int, int, bool>>> lru;
  for (const auto& [k, b] : batches_)
    if (!b->captured && b.get() != last_batch_) lru.push_back({b->last_use, k});
  if (lru.empty()) return;
  std::sort(lru.begin(), lru.end());
  stream_.synchronize();
  cpu_[0]->pool().sync();
  const size_t drop = std::min(lru.size(), batches_.size() - kMaxBatchShapes / 2);
  for (size_t i = 0; i < drop; ++i) batches_.erase(lru[i].second);
}

void HybridMoe::check_io(int layer, const LayerIO& io) const {
  check_layer(layer);
  TANDEM_CHECK(io.tokens >= 1, Errc::invalid_argument, "hybrid: layer ", layer, ": tokens = ", io.tokens,
               " must be positive");
  TANDEM_CHECK(io.top_k >= 1 && io.top_k <= kRouterMaxTopK, Errc::invalid_argument, "hybrid: layer ", layer,
               ": top_k = ", io.top_k, " is outside [1, ", kRouterMaxTopK, "]");
  TANDEM_CHECK(io.x && io.ids && io.weights && io.out, Errc::invalid_argument, "hybrid: layer ", layer, ": ",
               !io.x ? "x" : !io.ids ? "ids" : !io.weights ? "weights" : "out", " is null");
  TANDEM_CHECK(io.x_type == XType::bf16 || io.x_type == XType::f32, Errc::invalid_argument, "hybrid: layer ", layer,
               ": unknown x dtype ", static_cast<int>(io.x_type));
}

void HybridMoe::enqueue(int layer, const LayerIO& io) {
  check_io(layer, io);
  for (const MoeLayer* l : cpu_)
    TANDEM_CHECK(l->loaded(), Errc::invalid_argument, "hybrid: model layer ", l->layer_index(), " has no CPU weights");
  if (io.tokens <= opt_.max_tokens) {
    enqueue_batch(layer, io, opt_.deferred > 0);
    return;
  }
  // A batch larger than the buffers: consecutive chunks of max_tokens rows, each a batch
  // of its own through the same path, so every token gets what one call would give it.
  // Chunks defer nothing: layer L's deferred output would have to outlive the next
  // chunks of layer L, so every CPU expert runs in its own layer (the exact MoE).
  TANDEM_CHECK(opt_.deferred == 0 || layer == 0 || last_batch_ == nullptr || last_layer_ != layer - 1 ||
                   !last_batch_->jobs[layer - 1]->defers,
               Errc::invalid_argument, "hybrid: layer ", layer, ": ", io.tokens, " tokens after layer ", layer - 1,
               " of ", last_batch_ ? last_batch_->tokens : 0,
               " (whose deferred experts this layer would drop); with deferred experts each step enqueues layers 0, 1, "
               "2, ... in order with one batch shape");
  const size_t H = shape_.hidden, K = io.top_k;
  for (int t0 = 0; t0 < io.tokens; t0 += opt_.max_tokens) {
    LayerIO c = io;
    c.tokens = std::min(opt_.max_tokens, io.tokens - t0);
    c.x = static_cast<const char*>(io.x) + t0 * H * xtype_size(io.x_type);
    c.ids = static_cast<const char*>(io.ids) + t0 * K * (io.ids_i64 ? sizeof(int64_t) : sizeof(int32_t));
    c.weights = io.weights + t0 * K;
    c.out = io.out + t0 * H;
    enqueue_batch(layer, c, false);
  }
  last_batch_ = nullptr;  // a deferring layer cannot follow (checked there)
}

bool HybridMoe::run_direct(int layer, const LayerIO& io) {
  check_layer(layer);  // before hot_[layer] is read
  if (stream_.is_cuda() || stream_.capturing() || hot_[layer] || opt_.deferred > 0) return false;
  check_io(layer, io);
  stream_.synchronize();
  MoeLayer& cpu = *cpu_[layer];
  MoeInput in;
  if (io.x_type == XType::bf16)
    in.x = static_cast<const bf16_t*>(io.x);
  else
    in.x_f32 = static_cast<const float*>(io.x);
  in.tokens = io.tokens;
  if (io.ids_i64)
    in.ids_i64 = static_cast<const int64_t*>(io.ids);
  else
    in.ids = static_cast<const int32_t*>(io.ids);
  in.top_k = io.top_k;
  in.weights = io.weights;
  in.out = io.out;
  trace::Span span("run_cpu", {cpu.layer_index(), -1, io.tokens});
  if (in.tokens > 0)
    cpu.forward(in);  // validates the ids and weights first, naming the slot
  else
    cpu.submit(in);  // (validates; nothing to run or wait for)
  const int E = shape_.experts;
  std::atomic<uint64_t>* c = &counts_[static_cast<size_t>(layer) * (3 * E + 1)];
  const size_t n = static_cast<size_t>(io.tokens) * io.top_k;
  for (size_t i = 0; i < n; ++i) {
    const int64_t id = io.ids_i64 ? static_cast<const int64_t*>(io.ids)[i] : static_cast<const int32_t*>(io.ids)[i];
    if (id >= 0 && id < E) c[kCold * E + id].fetch_add(1, std::memory_order_relaxed);
  }
  c[3 * E].fetch_add(io.tokens, std::memory_order_relaxed);
  return true;
}

void HybridMoe::enqueue_batch(int layer, const LayerIO& io, bool defer) {
  TANDEM_CHECK(!(opt_.hot_may_change && stream_.capturing()), Errc::invalid_argument, "hybrid: layer ", layer,
               ": enqueued while ", stream_.name(), " is being captured into a graph, but this engine's hot experts move "
               "while it runs (gpu.hot_experts.dynamic): a replayed graph would use freed device memory. Turn dynamic "
               "hot experts off to capture graphs");
  Batch& b = batch(io.tokens, io.top_k, io.x_type, defer);
  if (defer && layer > 0) {
    TANDEM_CHECK(last_layer_ == layer - 1 && last_batch_ == &b, Errc::invalid_argument, "hybrid: layer ", layer,
                 " enqueued after ", last_layer_ < 0 ? std::string("no layer") : str_cat("layer ", last_layer_),
                 last_batch_ && last_batch_ != &b ? " of another batch shape" : "",
                 "; with deferred experts each step enqueues layers 0, 1, 2, ... in order with one batch shape");
  }
  b.last_use = ++uses_;
  b.captured = b.captured || stream_.capturing();
  Job& j = *b.jobs[layer];
  Slot& sl = *j.slot;
  const size_t T = io.tokens, K = io.top_k, H = shape_.hidden;
  const bool tracing = trace::enabled();
  const SplitSpec split{shape_.experts, io.top_k, j.defers ? opt_.deferred : 0};
  validate_split(split);

  if (tracing) j.copy_in.begin(stream_);
  stream_.split(io.ids, io.ids_i64, io.weights, io.tokens, hot_mask_dev_[layer], split, b.ids3_dev);
  stream_.copy(sl.x, io.x, T * H * xtype_size(io.x_type));
  stream_.copy(sl.ids3, b.ids3_dev, 3 * T * K * sizeof(int32_t));
  stream_.copy(sl.w, io.weights, T * K * sizeof(float));
  if (tracing) j.copy_in.end(stream_);
  stream_.host(submit_fn, &j);
  if (tracing) j.hot.begin(stream_);
  if (hot_[layer])
    hot_[layer]->forward(io.x, io.x_type, io.tokens, b.ids3_dev + T * K * kHot, io.weights, io.top_k, io.out);
  else
    stream_.zero(io.out, T * H * sizeof(float));
  if (tracing) j.hot.end(stream_);
  stream_.host(wait_fn, &j);
  if (tracing) j.copy_out.begin(stream_);
  stream_.copy(b.back_dev, sl.out, T * H * sizeof(float));
  stream_.add(io.out, b.back_dev, T * H);
  if (j.prev) {
    stream_.copy(b.dback_dev, j.prev->slot->dout, T * H * sizeof(float));
    stream_.add(io.out, b.dback_dev, T * H);
  }
  if (tracing) j.copy_out.end(stream_);
  last_layer_ = layer;
  last_batch_ = &b;
}

PlacementCounts HybridMoe::counts(int layer) const {
  check_layer(layer);
  const int E = shape_.experts;
  const std::atomic<uint64_t>* c = &counts_[static_cast<size_t>(layer) * (3 * E + 1)];
  PlacementCounts p;
  for (auto [where, v] : {std::pair{kHot, &p.hot}, {kCold, &p.cold}, {kDeferred, &p.deferred}}) {
    v->resize(E);
    for (int e = 0; e < E; ++e) (*v)[e] = c[where * E + e].load(std::memory_order_relaxed);
  }
  p.tokens = c[3 * E].load(std::memory_order_relaxed);
  return p;
}

void HybridMoe::reset_counts() {
  const size_t n = static_cast<size_t>(layers()) * (3 * shape_.experts + 1);
  for (size_t i = 0; i < n; ++i) counts_[i].store(0, std::memory_order_relaxed);
}

void HybridMoe::write_statistics(const std::filesystem::path& path) const {
  RoutingStatistics st;
  st.experts = shape_.experts;
  for (int l = 0; l < layers(); ++l) {
    const PlacementCounts p = counts(l);
    std::vector<uint64_t> total(shape_.experts);
    for (int e = 0; e < shape_.experts; ++e) total[e] = p.hot[e] + p.cold[e] + p.deferred[e];
    st.layers[cpu_[l]->layer_index()] = std::move(total);
  }
  save_routing_statistics(st, path);
}

}  // namespace tandem
