// tandem/stream.h: the in-order work queue the hybrid scheduler drives (a CUDA stream,
// or a host thread standing in for one), and the hot experts that live on its device.
//
// Everything enqueued runs in order, asynchronously to the caller: copies, the device
// ops the scheduler needs (routing, the hot/cold/deferred split, adding partial outputs,
// the hot experts) and host functions (cudaLaunchHostFunc on CUDA). Two implementations:
//   host stream  one executor thread; "device" and pinned memory are plain host memory.
//                Runs everywhere, so the scheduler's logic is tested on any machine.
//   CUDA stream  gpu/cuda_stream.cu: cudaMemcpyAsync, kernels, cudaLaunchHostFunc.
// Capture: between begin_capture() and end_capture() work is recorded, not run; the
// returned Graph replays it (a CUDA graph; on the host stream, the recorded list). Work
// that may be captured must keep every pointer it was given (host function arguments
// included) alive and unchanged for as long as the graph is replayed.
//
// Host functions cannot throw into a CUDA stream: they report failures with
// set_error(); synchronize() rethrows the first one. The stream still runs the work
// behind a failure (as CUDA does), so a host function that depends on earlier work
// checks failed() first and does nothing when it is set.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tandem/config.h"
#include "tandem/experts.h"
#include "tandem/routing.h"
#include "tandem/trace.h"

namespace tandem {

using HostFn = void (*)(void* arg);

enum class XType : int { bf16 = 0, f32 = 1 };
inline size_t xtype_size(XType t) { return t == XType::bf16 ? 2 : 4; }

// The hot experts of one layer, resident in a stream's device memory in the layout its
// kernels want (bf16; on CUDA gate/up concatenated as [hot * 2I x H] and down as
// [H x hot * I], so all hot experts are two GEMMs).
class DeviceExperts {
 public:
  virtual ~DeviceExperts() = default;
  const std::vector<int>& experts() const { return experts_; }  // global ids, ascending
  const MoeShape& shape() const { return shape_; }
  virtual size_t bytes() const = 0;
  // Enqueues out[t] = sum over k with hot_ids[t, k] >= 0 of weights[t, k] * expert(x[t]);
  // out [tokens x hidden] fp32 is fully written (zero for tokens with no hot expert).
  // hot_ids [tokens x top_k] holds global ids (-1: not here); all pointers are device
  // memory; ids not held here are ignored. Capture-safe.
  virtual void forward(const void* x, XType xt, int tokens, const int32_t* hot_ids, const float* weights, int top_k,
                       float* out) = 0;

 protected:
  DeviceExperts(MoeShape shape, std::vector<int> experts) : shape_(shape), experts_(std::move(experts)) {}
  MoeShape shape_;
  std::vector<int> experts_;
};

class Graph {
 public:
  virtual ~Graph() = default;
  virtual void launch() = 0;  // enqueues the captured work on its stream
};

class Stream {
 public:
  virtual ~Stream() = default;
  virtual std::string name() const = 0;  // "host", "cuda:0"
  virtual bool is_cuda() const = 0;

  // Device memory (what the stream's work reads and writes) and page-locked host memory
  // for transfers. Freed with the matching free_*.
  virtual void* alloc_device(size_t bytes) = 0;
  virtual void free_device(void* p) noexcept = 0;
  virtual void* alloc_pinned(size_t bytes) = 0;
  virtual void free_pinned(void* p) noexcept = 0;
  // Blocking copies between the caller's host memory and device memory (setup, tests).
  virtual void upload(void* device_dst, const void* host_src, size_t bytes) = 0;
  virtual void download(void* host_dst, const void* device_src, size_t bytes) = 0;

  // ---- stream-ordered work ----
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;  // device/pinned, either way
  virtual void zero(void* dst, size_t bytes) = 0;
  virtual void add(float* out, const float* src, size_t n) = 0;  // out[i] += src[i]
  virtual void host(HostFn fn, void* arg) = 0;
  // The split of routing results; out3 = [hot | cold | deferred], each tokens x top_k.
  // ids are int32, or int64 with ids_i64 (torch.topk's indices).
  virtual void split(const void* ids, bool ids_i64, const float* weights, int tokens, const uint8_t* hot_mask,
                     const SplitSpec& spec, int32_t* out3) = 0;
  virtual std::unique_ptr<DeviceExperts> upload_experts(const MoeShape& shape, std::vector<int> experts,
                                                        const std::function<ExpertSource(int)>& source) = 0;

  // The device's free and total memory in bytes (CUDA: cudaMemGetInfo; the host stream has
  // no device memory of its own: {0, 0}).
  struct MemoryInfo {
    uint64_t free = 0, total = 0;
  };
  virtual MemoryInfo device_memory() const = 0;

  // Waits until everything enqueued so far ran; rethrows the first error set since the last call.
  virtual void synchronize() = 0;

  virtual void begin_capture() = 0;
  virtual std::unique_ptr<Graph> end_capture() = 0;
  // Whether work enqueued now is recorded rather than run: between begin_capture() and
  // end_capture(), or (CUDA) while the native stream is captured by someone else, e.g. torch.
  virtual bool capturing() const { return capturing_; }

  // Enqueue on `native` from now on (CUDA: a cudaStream_t of this stream's device, nullptr
  // for the legacy default stream; torch's current stream at each call). Work enqueued
  // before stays ordered before work enqueued after: the new stream waits for an event
  // recorded on the old one, except across a capture boundary, where the capturing side
  // orders itself (torch.cuda.graph synchronizes the device before it captures). The host
  // stream has no native handles: it accepts only nullptr.
  virtual void follow(void* native) = 0;
  // The native handle work is enqueued on now (CUDA: a cudaStream_t, cudaStreamLegacy for
  // the legacy default stream; the host stream: nullptr).
  virtual void* native() const = 0;

  // For host functions: report an error (kept until synchronize) / whether one is pending.
  void set_error(std::exception_ptr e);
  bool failed() const;

 protected:
  std::exception_ptr take_error();
  bool capturing_ = false;

 private:
  mutable std::mutex error_mu_;
  std::exception_ptr error_;
};

// A stream-ordered span for the trace: begin() and end() enqueue host functions that
// take timestamps, so the span covers the work enqueued between them as the stream ran
// it (host-callback timestamps; on CUDA they add a few microseconds each, so enqueue
// spans only while tracing). The object must outlive the work (and any graph of it).
struct StreamSpan {
  const char* name = "";
  trace::Args args;
  int64_t begin_ns = 0;
  void begin(Stream& s);
  void end(Stream& s);
};

// The host stream; its hot experts run on the CPU kernels of level `isa`.
std::unique_ptr<Stream> make_host_stream(IsaLevel isa = effective_isa());
// make_stream(config) and make_cuda_stream(): tandem/streams.h (the gpu layer).

}  // namespace tandem
