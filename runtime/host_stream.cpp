// The host stream: an executor thread that runs enqueued work in order, standing in for
// a GPU stream. Its "device" memory is host memory and its hot experts run the CPU
// BF16 kernels on the executor thread (bf16 weights, as on a GPU).
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>

#include "expert_core.h"
#include "tandem/error.h"
#include "tandem/stream.h"

namespace tandem {

// ---- Stream base ---------------------------------------------------------------------

void Stream::set_error(std::exception_ptr e) {
  std::lock_guard<std::mutex> g(error_mu_);
  if (!error_) error_ = std::move(e);
}
bool Stream::failed() const {
  std::lock_guard<std::mutex> g(error_mu_);
  return error_ != nullptr;
}
std::exception_ptr Stream::take_error() {
  std::lock_guard<std::mutex> g(error_mu_);
  std::exception_ptr e;
  std::swap(e, error_);
  return e;
}

namespace {

constexpr int kStreamTraceLane = 90;  // trace process lane of stream threads

void stamp_begin(void* p) { static_cast<StreamSpan*>(p)->begin_ns = trace::now_ns(); }
void stamp_end(void* p) {
  thread_local bool named = false;
  if (!named) {
    trace::name_thread("stream callbacks", kStreamTraceLane, "device stream");
    named = true;
  }
  auto* s = static_cast<StreamSpan*>(p);
  trace::record(s->name, s->begin_ns, trace::now_ns(), s->args);
}

void* host_alloc(size_t bytes) {
  void* p = std::aligned_alloc(64, (std::max<size_t>(bytes, 1) + 63) / 64 * 64);
  TANDEM_CHECK(p != nullptr, Errc::io, "host stream: cannot allocate ", bytes, " bytes");
  return p;
}

}  // namespace

void StreamSpan::begin(Stream& s) { s.host(stamp_begin, this); }
void StreamSpan::end(Stream& s) { s.host(stamp_end, this); }

namespace {

class HostStream;

class HostGraph : public Graph {
 public:
  HostGraph(HostStream& s, std::vector<std::function<void()>> ops) : stream_(s), ops_(std::move(ops)) {}
  void launch() override;

 private:
  HostStream& stream_;
  std::vector<std::function<void()>> ops_;
};

// The hot experts of a host stream: the expert core's inference forward (BF16 packs, as
// on a GPU), run inline on the executor thread as a pool of one subpool would run it.
class HostExperts : public DeviceExperts {
 public:
  HostExperts(class HostStream& s, const MoeShape& shape, std::vector<int> experts,
              const std::function<ExpertSource(int)>& source);
  size_t bytes() const override { return packs_.bytes(); }
  void forward(const void* x, XType xt, int tokens, const int32_t* hot_ids, const float* weights, int top_k,
               float* out) override;

 private:
  void run(const void* x, XType xt, int tokens, const int32_t* hot_ids, const float* weights, int top_k, float* out);
  HostStream& stream_;
  std::vector<uint8_t> skipped_;  // [experts]: 1 = not held here
  core::ExpertPacks packs_;
  core::ForwardScratch scratch_;  // used on the executor thread only
};

class HostStream : public Stream {
 public:
  explicit HostStream(IsaLevel isa) : kt_(kernel_table(isa)), thread_([this] { loop(); }) {}
  const KernelTable& kernels() const { return kt_; }
  ~HostStream() override {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  std::string name() const override { return "host"; }
  bool is_cuda() const override { return false; }
  void* alloc_device(size_t bytes) override { return host_alloc(bytes); }
  void free_device(void* p) noexcept override { std::free(p); }
  void* alloc_pinned(size_t bytes) override { return host_alloc(bytes); }
  void free_pinned(void* p) noexcept override { std::free(p); }
  void upload(void* dst, const void* src, size_t bytes) override {
    synchronize();
    std::memcpy(dst, src, bytes);
  }
  void download(void* dst, const void* src, size_t bytes) override {
    synchronize();
    std::memcpy(dst, src, bytes);
  }

  void copy(void* dst, const void* src, size_t bytes) override {
    enqueue([=] { std::memcpy(dst, src, bytes); });
  }
  void zero(void* dst, size_t bytes) override {
    enqueue([=] { std::memset(dst, 0, bytes); });
  }
  void add(float* out, const float* src, size_t n) override {
    enqueue([=] {
      for (size_t i = 0; i < n; ++i) out[i] += src[i];
    });
  }
  void host(HostFn fn, void* arg) override {
    TANDEM_CHECK(fn != nullptr, Errc::invalid_argument, "stream: host(nullptr)");
    enqueue([fn, arg] { fn(arg); });
  }
  void split(const void* ids, bool ids_i64, const float* weights, int tokens, const uint8_t* hot_mask,
             const SplitSpec& spec, int32_t* out3) override {
    validate_split(spec);
    enqueue([=, this] {
      const size_t n = static_cast<size_t>(tokens) * spec.top_k;
      try {
        if (ids_i64)
          tandem::split(static_cast<const int64_t*>(ids), weights, tokens, hot_mask, spec, out3, out3 + n, out3 + 2 * n);
        else
          tandem::split(static_cast<const int32_t*>(ids), weights, tokens, hot_mask, spec, out3, out3 + n, out3 + 2 * n);
      } catch (...) {
        set_error(std::current_exception());
      }
    });
  }
  std::unique_ptr<DeviceExperts> upload_experts(const MoeShape& shape, std::vector<int> experts,
                                                const std::function<ExpertSource(int)>& source) override {
    return std::make_unique<HostExperts>(*this, shape, std::move(experts), source);
  }

  void synchronize() override {
    TANDEM_CHECK(!capturing_, Errc::invalid_argument, "stream: synchronize() while capturing a graph");
    std::unique_lock<std::mutex> lock(mu_);
    idle_cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
    lock.unlock();
    if (auto e = take_error()) std::rethrow_exception(e);
  }

  void follow(void* native) override {
    TANDEM_CHECK(native == nullptr, Errc::invalid_argument, "host stream: follow(", native,
                 "): the host stream has no native streams to follow");
  }

  void* native() const override { return nullptr; }
  MemoryInfo device_memory() const override { return {}; }

  void begin_capture() override {
    TANDEM_CHECK(!capturing_, Errc::invalid_argument, "stream: begin_capture() while already capturing");
    capturing_ = true;
    captured_.clear();
  }
  std::unique_ptr<Graph> end_capture() override {
    TANDEM_CHECK(capturing_, Errc::invalid_argument, "stream: end_capture() without begin_capture()");
    capturing_ = false;
    return std::make_unique<HostGraph>(*this, std::move(captured_));
  }

  // Runs f in order with the rest (or records it while capturing).
  void enqueue(std::function<void()> f) {
    if (capturing_) {
      captured_.push_back(std::move(f));
      return;
    }
    {
      std::lock_guard<std::mutex> g(mu_);
      queue_.push_back(std::move(f));
    }
    cv_.notify_one();
  }

 private:
  void loop() {
    trace::name_thread("host stream", kStreamTraceLane, "device stream");
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      std::function<void()> f = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      try {
        f();
      } catch (...) {
        set_error(std::current_exception());
      }
      lock.lock();
      busy_ = false;
      if (queue_.empty()) idle_cv_.notify_all();
    }
  }

  const KernelTable& kt_;
  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::function<void()>> queue_;
  bool busy_ = false, stop_ = false;
  std::vector<std::function<void()>> captured_;
  std::thread thread_;  // last: starts after the members above exist
};

void HostGraph::launch() {
  for (const auto& op : ops_) stream_.enqueue(op);
}

HostExperts::HostExperts(HostStream& s, const MoeShape& shape, std::vector<int> experts,
                         const std::function<ExpertSource(int)>& source)
    : DeviceExperts(shape, std::move(experts)), stream_(s), skipped_(shape.experts, 1),
      packs_(shape, {WeightFormat::bf16}, 1, core::ExpertPacks::Layout::fused) {
  for (const int e : experts_) {
    TANDEM_CHECK(e >= 0 && e < shape.experts, Errc::invalid_argument, "hot experts: expert ", e, " is outside [0, ",
                 shape.experts, ")");
    TANDEM_CHECK(skipped_[e], Errc::invalid_argument, "hot experts: expert ", e, " is listed twice");
    skipped_[e] = 0;
  }
  packs_.set_skipped(skipped_);
  packs_.load_here(source);
}

void HostExperts::forward(const void* x, XType xt, int tokens, const int32_t* hot_ids, const float* weights, int top_k,
                          float* out) {
  TANDEM_CHECK(tokens >= 0 && top_k >= 1, Errc::invalid_argument, "hot experts: tokens = ", tokens, ", top_k = ", top_k);
  stream_.enqueue([=, this] { run(x, xt, tokens, hot_ids, weights, top_k, out); });
}

void HostExperts::run(const void* x, XType xt, int tokens, const int32_t* hot_ids, const float* weights, int top_k,
                      float* out) {
  if (tokens == 0) return;
  MoeInput in;
  if (xt == XType::bf16)
    in.x = static_cast<const bf16_t*>(x);
  else
    in.x_f32 = static_cast<const float*>(x);
  in.tokens = tokens;
  in.ids = hot_ids;
  in.top_k = top_k;
  in.weights = weights;
  in.out = out;
  TokenGroups groups = group_tokens(in, shape_.experts, -1, skipped_);
  core::ExpertForward task(packs_, scratch_, stream_.kernels(), {1}, -1, in, std::move(groups));
  core::run_inline(task);
}

}  // namespace

std::unique_ptr<Stream> make_host_stream(IsaLevel isa) { return std::make_unique<HostStream>(isa); }

}  // namespace tandem
