// The host stream: an executor thread that runs enqueued work in order, standing in for
// a GPU stream. Its "device" memory is host memory and its hot experts run the CPU
// BF16 kernels on the executor thread (bf16 weights, as on a GPU).
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>

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

class HostExperts : public DeviceExperts {
 public:
  HostExperts(class HostStream& s, const MoeShape& shape, std::vector<int> experts,
              const std::function<ExpertSource(int)>& source);
  size_t bytes() const override {
    size_t b = 0;
    for (size_t j = 0; j < gate_up_.size(); ++j) b += gate_up_[j].bytes() + down_[j].bytes();
    return b;
  }
  void forward(const void* x, XType xt, int tokens, const int32_t* hot_ids, const float* weights, int top_k,
               float* out) override;

 private:
  void run(const void* x, XType xt, int tokens, const int32_t* hot_ids, const float* weights, int top_k, float* out);
  HostStream& stream_;
  std::vector<int> slot_;  // global id -> index in experts_, -1: not here
  std::vector<PackedWeight> gate_up_, down_;
  std::vector<bf16_t> xg_, h_;  // scratch, used on the executor thread only
  std::vector<float> y_;
  std::vector<int> rows_;
  std::vector<float> w_;
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
    : DeviceExperts(shape, std::move(experts)), stream_(s), slot_(shape.experts, -1) {
  for (size_t j = 0; j < experts_.size(); ++j) {
    const int e = experts_[j];
    TANDEM_CHECK(e >= 0 && e < shape.experts, Errc::invalid_argument, "hot experts: expert ", e, " is outside [0, ",
                 shape.experts, ")");
    TANDEM_CHECK(slot_[e] < 0, Errc::invalid_argument, "hot experts: expert ", e, " is listed twice");
    slot_[e] = static_cast<int>(j);
    const ExpertSource src = source(e);
    TANDEM_CHECK(src.gate.n == shape.inter && src.gate.k == shape.hidden && src.up.n == shape.inter &&
                     src.up.k == shape.hidden && src.down.n == shape.hidden && src.down.k == shape.inter,
                 Errc::invalid_argument, "hot experts: expert ", e, " has gate [", src.gate.n, " x ", src.gate.k,
                 "], up [", src.up.n, " x ", src.up.k, "], down [", src.down.n, " x ", src.down.k, "]; the layer needs [",
                 shape.inter, " x ", shape.hidden, "] and [", shape.hidden, " x ", shape.inter, "]");
    gate_up_.push_back(pack_gate_up(src.gate, src.up, {WeightFormat::bf16}));
    down_.push_back(pack(src.down, {WeightFormat::bf16}));
  }
}

void HostExperts::forward(const void* x, XType xt, int tokens, const int32_t* hot_ids, const float* weights, int top_k,
                          float* out) {
  TANDEM_CHECK(tokens >= 0 && top_k >= 1, Errc::invalid_argument, "hot experts: tokens = ", tokens, ", top_k = ", top_k);
  stream_.enqueue([=, this] { run(x, xt, tokens, hot_ids, weights, top_k, out); });
}

void HostExperts::run(const void* x, XType xt, int tokens, const int32_t* hot_ids, const float* weights, int top_k,
                      float* out) {
  const int H = shape_.hidden, I = shape_.inter;
  std::fill(out, out + static_cast<size_t>(tokens) * H, 0.0f);
  const KernelTable& kt = stream_.kernels();
  for (size_t j = 0; j < experts_.size(); ++j) {
    const int e = experts_[j];
    rows_.clear();
    w_.clear();
    for (int t = 0; t < tokens; ++t)
      for (int k = 0; k < top_k; ++k)
        if (hot_ids[static_cast<size_t>(t) * top_k + k] == e) {
          rows_.push_back(t);
          w_.push_back(weights[static_cast<size_t>(t) * top_k + k]);
        }
    const int m = static_cast<int>(rows_.size());
    if (!m) continue;
    xg_.resize(static_cast<size_t>(m) * H);
    for (int r = 0; r < m; ++r) {
      const size_t src = static_cast<size_t>(rows_[r]) * H;
      if (xt == XType::bf16)
        std::memcpy(&xg_[static_cast<size_t>(r) * H], static_cast<const bf16_t*>(x) + src, sizeof(bf16_t) * H);
      else
        fp32_to_bf16(static_cast<const float*>(x) + src, &xg_[static_cast<size_t>(r) * H], H);
    }
    h_.resize(static_cast<size_t>(m) * I);
    y_.resize(static_cast<size_t>(m) * H);
    GateUpArgs g;
    g.a = xg_.data();
    g.m = m;
    g.lda = H;
    g.h_bf16 = h_.data();
    g.ldh = I;
    kt.bf16.pick(m).gate_up(gate_up_[j], g);
    GemmArgs d;
    d.a = h_.data();
    d.m = m;
    d.lda = I;
    d.c = y_.data();
    d.ldc = H;
    d.row_scale = w_.data();
    kt.bf16.pick(m).gemm(down_[j], d);
    for (int r = 0; r < m; ++r) {
      float* o = out + static_cast<size_t>(rows_[r]) * H;
      const float* y = &y_[static_cast<size_t>(r) * H];
      for (int c = 0; c < H; ++c) o[c] += y[c];
    }
  }
}

}  // namespace

std::unique_ptr<Stream> make_host_stream(IsaLevel isa) { return std::make_unique<HostStream>(isa); }

}  // namespace tandem
