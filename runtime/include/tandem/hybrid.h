// tandem/hybrid.h: the hybrid scheduler. One MoE layer's routed experts run split
// between a stream's device (the hot experts, resident there) and the CPU pools (the
// cold ones), both busy at once; a layer's lowest-weighted CPU experts can be
// "deferred" to run while the device works on the next layer.
//
// Per layer, all in stream order (HybridMoe::enqueue):
//   split      routing ids -> hot | cold | deferred (device op)
//   copy in    x, the split ids and the weights -> pinned slot (layer % pinned_slots)
//   host fn    submit the CPU task for the cold experts, then one for the deferred ones
//   hot        the device's hot experts write out (= their weighted sum)
//   host fn    wait for the cold task (and the previous layer's deferred task)
//   copy back  the CPU partials -> device; out += cold (+ previous layer's deferred)
// Layer L's deferred experts run on the CPU after its cold ones, while the device goes on
// to layer L+1 (attention, router, ...); their output is added into layer L+1's output.
// The last layer defers nothing; deferral 0 is exactly the standard MoE.
//
// Buffers are kept per batch shape (tokens, top_k, x dtype): pinned slots, device
// scratch, and the host functions' arguments all keep fixed addresses, so a captured
// decode step (CUDA graph) replays with the CPU experts included.
#pragma once

#include <atomic>
#include <filesystem>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "tandem/config.h"
#include "tandem/moe.h"
#include "tandem/placement.h"  // RoutingStatistics (write_statistics), choose_hot_experts
#include "tandem/stream.h"

namespace tandem {

struct HybridOptions {
  int pinned_slots = 2;    // 1 .. 4; at least 2 with deferral
  int max_tokens = 4096;   // rows the buffers hold; larger batches run in chunks of this many
  int deferred = 0;        // per token, this many of its lowest-weighted CPU experts are deferred
  bool hot_may_change = false;  // the hot sets move while running (dynamic): refuse graph captures
};

// One layer's inputs and output, all in the stream's device memory.
struct LayerIO {
  const void* x = nullptr;  // [tokens x hidden]
  XType x_type = XType::bf16;
  int tokens = 0;
  const void* ids = nullptr;  // [tokens x top_k] int32 (or int64 with ids_i64); -1: empty slot
  bool ids_i64 = false;
  const float* weights = nullptr;  // [tokens x top_k]
  int top_k = 0;
  float* out = nullptr;  // [tokens x hidden] fp32, written
};

// Routed (token, expert) pairs per layer and expert, by where they ran.
struct PlacementCounts {
  std::vector<uint64_t> hot, cold, deferred;  // [experts]
  uint64_t tokens = 0;                        // tokens seen
};

class HybridMoe {
 public:
  // cpu[i]: the CPU engine of MoE layer i (the scheduler's layer index; MoeLayer's own
  // index names the model layer), all with the same shape. The layers may hold all
  // experts or only the ones not hot.
  HybridMoe(Stream& stream, std::vector<MoeLayer*> cpu, HybridOptions options);
  ~HybridMoe();
  HybridMoe(const HybridMoe&) = delete;
  HybridMoe& operator=(const HybridMoe&) = delete;

  // Puts experts (global ids) of layer i on the device, from `source` (any source type;
  // converted to bf16). Replaces the previous set; call before enqueueing. It frees the
  // old set's device memory, so graphs captured before it must not be replayed after.
  void set_hot(int layer, std::vector<int> experts, const std::function<ExpertSource(int)>& source);
  const std::vector<int>& hot(int layer) const;
  // Layer i's hot experts on the device (null: none), e.g. to time them alone.
  DeviceExperts* device_experts(int layer) { return hot_.at(layer).get(); }
  const DeviceExperts* device_experts(int layer) const { return hot_.at(layer).get(); }

  // Enqueues layer `layer` on the stream (see the header comment); returns at once. With
  // deferral, layers of one step must be enqueued in order 0, 1, 2, ... with the same
  // batch shape (layer 0 starts a step). A batch of more than max_tokens tokens runs as
  // consecutive chunks of max_tokens rows (each token's result is what one call gives it);
  // chunks defer nothing (every CPU expert runs in its own layer). Errors here name the
  // problem; errors found while the stream runs (an id out of range) are rethrown by
  // stream().synchronize().
  void enqueue(int layer, const LayerIO& io);
  // Runs layer `layer` now, on the calling thread, and returns true, when nothing of it
  // belongs on a device: a host stream that is not capturing, no hot experts in this
  // layer, no deferral. The stream is synchronized first (its earlier work reads the
  // same buffers), then the layer's CPU experts run as one pool task straight from
  // io's buffers (no slot copies, no host functions) and are waited for; the counts are
  // kept as enqueue keeps them. Returns false, having done nothing, otherwise.
  bool run_direct(int layer, const LayerIO& io);

  int layers() const { return static_cast<int>(cpu_.size()); }
  Stream& stream() { return stream_; }
  const HybridOptions& options() const { return opt_; }
  // Batch shapes with buffers (each holds pinned_slots slots). At most kMaxBatchShapes
  // are kept: a new shape beyond that frees the least recently used ones (after a
  // stream and pool sync), except shapes used inside a graph capture.
  int batch_shapes() const { return static_cast<int>(batches_.size()); }
  static constexpr int kMaxBatchShapes = 8;

  // Counted by the stream's host functions: read them after stream().synchronize().
  PlacementCounts counts(int layer) const;
  void reset_counts();
  // Writes the routing statistics (routed counts per model layer and expert, all
  // placements) as JSON, atomically; read back by load_routing_statistics.
  void write_statistics(const std::filesystem::path& path) const;

 private:
  struct Slot;
  struct Job;
  struct Batch;
  Batch& batch(int tokens, int top_k, XType xt, bool defer);
  void enqueue_batch(int layer, const LayerIO& io, bool defer);
  void evict_batches();
  void check_layer(int layer) const;
  void check_io(int layer, const LayerIO& io) const;  // check_layer and io's fields
  static void submit_fn(void* job);
  static void wait_fn(void* job);

  Stream& stream_;
  std::vector<MoeLayer*> cpu_;
  HybridOptions opt_;
  MoeShape shape_;
  std::vector<std::unique_ptr<DeviceExperts>> hot_;
  std::vector<std::vector<int>> hot_ids_;
  std::vector<uint8_t*> hot_mask_dev_;  // [experts] per layer, device memory
  std::map<std::tuple<int, int, int, bool>, std::unique_ptr<Batch>> batches_;  // tokens, top_k, x type, defers
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // [layer][3][experts] then tokens per layer
  int last_layer_ = -1;
  Batch* last_batch_ = nullptr;
  uint64_t uses_ = 0;
};

}  // namespace tandem
