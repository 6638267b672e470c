// The CUDA implementation of tandem::Stream (runtime/include/tandem/stream.h) and the
// GPU hot experts. Host C++ (C++20) calling the CUDA runtime and cuBLAS; the kernels
// live in gpu/*.cu behind tandem/gpu_ops.h.
//
// Hot experts, dense form: with the hot experts' gate/up stacked as one [nh*2I x H]
// matrix and their downs side by side as one [H x nh*I] matrix, a layer's hot part is
//   GU = X Wgu^T            one cuBLAS GEMM, bf16 in, fp32 out and accumulate
//   Hh = bf16(wd * silu(G) * U)   wd[t, j]: token t's routing weight for hot expert j (0 if not routed)
//   out = Hh Wd^T           one cuBLAS GEMM: the weighted sum over hot experts is its k loop
// No token counts reach the host, so nothing synchronizes and a decode step captures
// into a CUDA graph. The price is computing every hot expert for every token: at decode
// sizes the GEMMs read the hot weights once either way; for prefill the extra FLOPs
// (n_hot / hot experts per token) run on a GPU whose time hides under the CPU's.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstring>
#include <map>

#include "tandem/error.h"
#include "tandem/gpu_ops.h"
#include "tandem/streams.h"

namespace tandem {
namespace {

#define TANDEM_CUDA_OK(expr)                                                                              \
  do {                                                                                                    \
    const cudaError_t err_ = (expr);                                                                      \
    TANDEM_CHECK(err_ == cudaSuccess, Errc::internal, "CUDA: ", #expr, " failed: ", cudaGetErrorName(err_), \
                 " (", cudaGetErrorString(err_), ")");                                                     \
  } while (0)

#define TANDEM_LAUNCH_OK(what, expr)                                                                      \
  do {                                                                                                    \
    const int err_ = (expr);                                                                              \
    TANDEM_CHECK(err_ == 0, Errc::internal, "CUDA: launching ", what, " failed: ",                         \
                 cudaGetErrorString(static_cast<cudaError_t>(err_)));                                     \
  } while (0)

#define TANDEM_CUBLAS_OK(expr)                                                                            \
  do {                                                                                                    \
    const cublasStatus_t st_ = (expr);                                                                    \
    TANDEM_CHECK(st_ == CUBLAS_STATUS_SUCCESS, Errc::internal, "cuBLAS: ", #expr, " failed: ",             \
                 cublasGetStatusString(st_));                                                             \
  } while (0)

class CudaStream;

class CudaGraph : public Graph {
 public:
  CudaGraph(cudaGraphExec_t exec, cudaStream_t s) : exec_(exec), stream_(s) {}
  ~CudaGraph() override { cudaGraphExecDestroy(exec_); }
  void launch() override { TANDEM_CUDA_OK(cudaGraphLaunch(exec_, stream_)); }

 private:
  cudaGraphExec_t exec_;
  cudaStream_t stream_;
};

class CudaExperts : public DeviceExperts {
 public:
  CudaExperts(CudaStream& s, const MoeShape& shape, std::vector<int> experts,
              const std::function<ExpertSource(int)>& source);
  ~CudaExperts() override;
  size_t bytes() const override { return bytes_; }
  void forward(const void* x, XType xt, int tokens, const int32_t* hot_ids, const float* weights, int top_k,
               float* out) override;

 private:
  struct Scratch {
    uint16_t* xb = nullptr;  // [T x H] bf16 input (fp32 x only)
    float* wd = nullptr;     // [T x nh]
    float* gu = nullptr;     // [T x nh*2I]
    uint16_t* h = nullptr;   // [T x nh*I]
  };
  Scratch& scratch(int tokens);
  CudaStream& s_;
  uint16_t* gate_up_ = nullptr;  // [nh*2I x H] bf16
  uint16_t* down_ = nullptr;     // [H x nh*I] bf16
  int32_t* slot_of_ = nullptr;   // [experts] -> hot index, -1
  size_t bytes_ = 0;
  std::map<int, Scratch> scratch_;  // per token count: fixed addresses for graphs
};

class CudaStream : public Stream {
 public:
  CudaStream(int index, cudaStream_t external) : index_(index) {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    TANDEM_CHECK(e == cudaSuccess && count > 0, Errc::unsupported, "cuda:", index, ": no usable CUDA device (",
                 e == cudaSuccess ? "none found" : cudaGetErrorString(e), ")");
    TANDEM_CHECK(index >= 0 && index < count, Errc::invalid_argument, "cuda:", index, ": this machine has ", count,
                 " CUDA device(s)");
    try {
      TANDEM_CUDA_OK(cudaSetDevice(index_));
      if (!external) {
        TANDEM_CUDA_OK(cudaStreamCreateWithFlags(&owned_, cudaStreamNonBlocking));
        stream_ = owned_;
      } else {
        stream_ = external;
      }
      TANDEM_CUDA_OK(cudaEventCreateWithFlags(&handoff_, cudaEventDisableTiming));
      TANDEM_CUBLAS_OK(cublasCreate(&blas_));
      TANDEM_CUBLAS_OK(cublasSetStream(blas_, stream_));  // before the workspace: it resets it
      // A fixed workspace, so cuBLAS allocates nothing while a graph is captured.
      TANDEM_CUDA_OK(cudaMalloc(&workspace_, kWorkspace));
      TANDEM_CUBLAS_OK(cublasSetWorkspace(blas_, workspace_, kWorkspace));
    } catch (...) {
      release();  // the destructor does not run for a throwing constructor
      throw;
    }
  }
  ~CudaStream() override { release(); }
  void release() noexcept {
    if (capturing_) {  // abandon an open capture so the frees below are legal
      cudaGraph_t g = nullptr;
      if (cudaStreamEndCapture(stream_, &g) == cudaSuccess && g) cudaGraphDestroy(g);
      capturing_ = false;
    }
    if (stream_) cudaStreamSynchronize(stream_);
    if (owned_ && owned_ != stream_) cudaStreamSynchronize(owned_);
    if (blas_) cublasDestroy(blas_);
    if (workspace_) cudaFree(workspace_);
    if (handoff_) cudaEventDestroy(handoff_);
    if (owned_) cudaStreamDestroy(owned_);
    stream_ = nullptr;
    owned_ = nullptr;
    blas_ = nullptr;
    workspace_ = nullptr;
    handoff_ = nullptr;
  }
  std::string name() const override { return str_cat("cuda:", index_); }
  bool is_cuda() const override { return true; }
  void* native() const override { return stream_; }
  MemoryInfo device_memory() const override {
    use();
    size_t free = 0, total = 0;
    TANDEM_CUDA_OK(cudaMemGetInfo(&free, &total));
    return {free, total};
  }
  cudaStream_t stream() const { return stream_; }
  cublasHandle_t blas() const { return blas_; }
  void use() const { TANDEM_CUDA_OK(cudaSetDevice(index_)); }

  void* alloc_device(size_t bytes) override {
    check_may_allocate("device", bytes);
    use();
    void* p = nullptr;
    TANDEM_CUDA_OK(cudaMalloc(&p, std::max<size_t>(bytes, 1)));
    return p;
  }
  void free_device(void* p) noexcept override { cudaFree(p); }
  void* alloc_pinned(size_t bytes) override {
    check_may_allocate("pinned host", bytes);
    void* p = nullptr;
    TANDEM_CUDA_OK(cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocPortable));
    return p;
  }
  void free_pinned(void* p) noexcept override { cudaFreeHost(p); }
  // On this stream, then synchronized: a blocking cudaMemcpy runs on the legacy default
  // stream, which a non-blocking stream does not wait for, and a pageable upload may
  // return before its DMA finished.
  void upload(void* dst, const void* src, size_t bytes) override {
    synchronize();
    use();
    TANDEM_CUDA_OK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
    TANDEM_CUDA_OK(cudaStreamSynchronize(stream_));
  }
  void download(void* dst, const void* src, size_t bytes) override {
    synchronize();
    use();
    TANDEM_CUDA_OK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
    TANDEM_CUDA_OK(cudaStreamSynchronize(stream_));
  }

  void copy(void* dst, const void* src, size_t bytes) override {
    use();
    TANDEM_CUDA_OK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
  }
  void zero(void* dst, size_t bytes) override {
    use();
    TANDEM_CUDA_OK(cudaMemsetAsync(dst, 0, bytes, stream_));
  }
  void add(float* out, const float* src, size_t n) override {
    use();
    TANDEM_LAUNCH_OK("add", gpu::launch_add(out, src, n, stream_));
  }
  void host(HostFn fn, void* arg) override {
    TANDEM_CHECK(fn != nullptr, Errc::invalid_argument, "stream: host(nullptr)");
    TANDEM_CUDA_OK(cudaLaunchHostFunc(stream_, fn, arg));
  }
  void split(const void* ids, bool ids_i64, const float* weights, int tokens, const uint8_t* hot_mask,
             const SplitSpec& spec, int32_t* out3) override {
    validate_split(spec);
    use();
    TANDEM_LAUNCH_OK("split", gpu::launch_split(ids, ids_i64, weights, tokens, hot_mask, spec, out3, stream_));
  }
  std::unique_ptr<DeviceExperts> upload_experts(const MoeShape& shape, std::vector<int> experts,
                                                const std::function<ExpertSource(int)>& source) override {
    return std::make_unique<CudaExperts>(*this, shape, std::move(experts), source);
  }
  void synchronize() override {
    TANDEM_CHECK(!capturing(), Errc::invalid_argument, "stream: synchronize() while ", name(),
                 capturing_ ? " is capturing a graph" : " is being captured into a CUDA graph (by torch or another caller)");
    TANDEM_CUDA_OK(cudaStreamSynchronize(stream_));
    if (auto e = take_error()) std::rethrow_exception(e);
  }
  bool capturing() const override { return capturing_ || native_capturing(stream_); }

  void follow(void* native) override {
    cudaStream_t next = native ? static_cast<cudaStream_t>(native) : cudaStreamLegacy;
    if (next == stream_) return;
    TANDEM_CHECK(!capturing_, Errc::invalid_argument, "stream: follow() between begin_capture() and end_capture()");
    use();
    // Across a capture boundary an event from the other side cannot be waited on (and is
    // not needed: torch.cuda.graph synchronizes the device before capturing, and captured
    // work has not run when the capture ends).
    if (!native_capturing(stream_) && !native_capturing(next)) {
      TANDEM_CUDA_OK(cudaEventRecord(handoff_, stream_));
      TANDEM_CUDA_OK(cudaStreamWaitEvent(next, handoff_, 0));
    }
    stream_ = next;
    TANDEM_CUBLAS_OK(cublasSetStream(blas_, stream_));
    TANDEM_CUBLAS_OK(cublasSetWorkspace(blas_, workspace_, kWorkspace));  // cublasSetStream resets it
  }

  void begin_capture() override {
    TANDEM_CHECK(!capturing_, Errc::invalid_argument, "stream: begin_capture() while already capturing");
    TANDEM_CHECK(!native_capturing(stream_), Errc::invalid_argument, "stream: begin_capture() while ", name(),
                 "'s native stream is already being captured (by torch or another caller)");
    // Relaxed: first-use allocations (a new batch shape's buffers) may happen inside.
    TANDEM_CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
    capturing_ = true;
  }
  std::unique_ptr<Graph> end_capture() override {
    TANDEM_CHECK(capturing_, Errc::invalid_argument, "stream: end_capture() without begin_capture()");
    capturing_ = false;
    cudaGraph_t graph = nullptr;
    TANDEM_CUDA_OK(cudaStreamEndCapture(stream_, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    TANDEM_CUDA_OK(e);
    return std::make_unique<CudaGraph>(exec, stream_);
  }

 private:
  // Whether `s` is being captured. The legacy stream cannot be queried while another
  // stream captures in global mode (cudaErrorStreamCaptureImplicit): that counts as
  // captured, and the error is cleared so that torch's next launch check does not see it.
  static bool native_capturing(cudaStream_t s) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(s, &st) != cudaSuccess) {
      cudaGetLastError();
      return true;
    }
    return st != cudaStreamCaptureStatusNone;
  }
  // Memory allocated while someone else (torch) captures the stream would invalidate the
  // capture (global mode forbids cudaMalloc / cudaHostAlloc), so the first call of a batch
  // shape must run before the capture; tandem's own captures are relaxed and allow it.
  void check_may_allocate(const char* what, size_t bytes) const {
    TANDEM_CHECK(capturing_ || !native_capturing(stream_), Errc::invalid_argument, name(), ": tandem needs ", bytes,
                 " bytes of new ", what, " memory while the stream is being captured into a CUDA graph: run the same "
                 "batch shape (token count) once before capturing (a warm-up step, as torch.cuda.graph expects)");
  }

  static constexpr size_t kWorkspace = 32u << 20;
  int index_;
  cudaStream_t stream_ = nullptr;  // where work is enqueued now (follow() moves it)
  cudaStream_t owned_ = nullptr;   // the stream made here when none was given (destroyed here)
  cudaEvent_t handoff_ = nullptr;  // follow(): the old stream's work, waited for on the new one
  cublasHandle_t blas_ = nullptr;
  void* workspace_ = nullptr;
};

// Source rows [r0, r0 + rows) as bf16 rows of stride ld, whatever the checkpoint's type.
void rows_to_bf16(const WeightView& v, int r0, int rows, uint16_t* dst, size_t ld) {
  std::vector<float> row(v.k);
  for (int r = 0; r < rows; ++r) {
    decode_rows(v, r0 + r, 1, row.data());
    fp32_to_bf16(row.data(), dst + static_cast<size_t>(r) * ld, v.k);
  }
}

CudaExperts::CudaExperts(CudaStream& s, const MoeShape& shape, std::vector<int> experts,
                         const std::function<ExpertSource(int)>& source)
    : DeviceExperts(shape, std::move(experts)), s_(s) {
  const int nh = static_cast<int>(experts_.size()), E = shape.experts, H = shape.hidden, I = shape.inter;
  std::vector<int32_t> slot_of(E, -1);
  std::vector<uint16_t> gu(static_cast<size_t>(nh) * 2 * I * H), dn(static_cast<size_t>(H) * nh * I);
  for (int j = 0; j < nh; ++j) {
    const int e = experts_[j];
    TANDEM_CHECK(e >= 0 && e < E, Errc::invalid_argument, "hot experts: expert ", e, " is outside [0, ", E, ")");
    TANDEM_CHECK(slot_of[e] < 0, Errc::invalid_argument, "hot experts: expert ", e, " is listed twice");
    slot_of[e] = j;
    const ExpertSource src = source(e);
    TANDEM_CHECK(src.gate.n == I && src.gate.k == H && src.up.n == I && src.up.k == H && src.down.n == H &&
                     src.down.k == I,
                 Errc::invalid_argument, "hot experts: expert ", e, " has gate [", src.gate.n, " x ", src.gate.k,
                 "], up [", src.up.n, " x ", src.up.k, "], down [", src.down.n, " x ", src.down.k, "]; the layer needs [",
                 I, " x ", H, "] and [", H, " x ", I, "]");
    rows_to_bf16(src.gate, 0, I, &gu[static_cast<size_t>(j) * 2 * I * H], H);
    rows_to_bf16(src.up, 0, I, &gu[(static_cast<size_t>(j) * 2 + 1) * I * H], H);
    rows_to_bf16(src.down, 0, H, &dn[static_cast<size_t>(j) * I], static_cast<size_t>(nh) * I);
  }
  gate_up_ = static_cast<uint16_t*>(s_.alloc_device(gu.size() * 2));
  down_ = static_cast<uint16_t*>(s_.alloc_device(dn.size() * 2));
  slot_of_ = static_cast<int32_t*>(s_.alloc_device(slot_of.size() * 4));
  s_.upload(gate_up_, gu.data(), gu.size() * 2);
  s_.upload(down_, dn.data(), dn.size() * 2);
  s_.upload(slot_of_, slot_of.data(), slot_of.size() * 4);
  bytes_ = (gu.size() + dn.size()) * 2;
}

CudaExperts::~CudaExperts() {
  cudaStreamSynchronize(s_.stream());
  for (auto& [t, sc] : scratch_) {
    s_.free_device(sc.xb);
    s_.free_device(sc.wd);
    s_.free_device(sc.gu);
    s_.free_device(sc.h);
  }
  s_.free_device(gate_up_);
  s_.free_device(down_);
  s_.free_device(slot_of_);
}

CudaExperts::Scratch& CudaExperts::scratch(int tokens) {
  auto it = scratch_.find(tokens);
  if (it != scratch_.end()) return it->second;
  const size_t T = tokens, nh = experts_.size(), H = shape_.hidden, I = shape_.inter;
  Scratch sc;
  try {
    sc.xb = static_cast<uint16_t*>(s_.alloc_device(T * H * 2));
    sc.wd = static_cast<float*>(s_.alloc_device(T * nh * 4));
    sc.gu = static_cast<float*>(s_.alloc_device(T * nh * 2 * I * 4));
    sc.h = static_cast<uint16_t*>(s_.alloc_device(T * nh * I * 2));
  } catch (...) {
    for (void* p : {static_cast<void*>(sc.xb), static_cast<void*>(sc.wd), static_cast<void*>(sc.gu),
                    static_cast<void*>(sc.h)})
      if (p) s_.free_device(p);
    throw;
  }
  return scratch_.emplace(tokens, sc).first->second;
}

void CudaExperts::forward(const void* x, XType xt, int tokens, const int32_t* hot_ids, const float* weights, int top_k,
                          float* out) {
  TANDEM_CHECK(tokens >= 0 && top_k >= 1, Errc::invalid_argument, "hot experts: tokens = ", tokens, ", top_k = ", top_k);
  if (!tokens) return;
  s_.use();
  const int nh = static_cast<int>(experts_.size()), H = shape_.hidden, I = shape_.inter;
  Scratch& sc = scratch(tokens);
  cudaStream_t st = s_.stream();
  const uint16_t* xb = static_cast<const uint16_t*>(x);
  if (xt == XType::f32) {
    TANDEM_LAUNCH_OK("to_bf16", gpu::launch_to_bf16(static_cast<const float*>(x), sc.xb, size_t(tokens) * H, st));
    xb = sc.xb;
  }
  TANDEM_LAUNCH_OK("dense_weights", gpu::launch_dense_weights(hot_ids, weights, tokens, top_k, slot_of_,
                                                               shape_.experts, nh, sc.wd, st));
  const float one = 1.0f, zero = 0.0f;
  // Row-major GU[T x nh*2I] = X[T x H] Wgu[nh*2I x H]^T, as column-major GU^T = Wgu X^T.
  TANDEM_CUBLAS_OK(cublasGemmEx(s_.blas(), CUBLAS_OP_T, CUBLAS_OP_N, nh * 2 * I, tokens, H, &one, gate_up_, CUDA_R_16BF,
                                H, xb, CUDA_R_16BF, H, &zero, sc.gu, CUDA_R_32F, nh * 2 * I, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT));
  TANDEM_LAUNCH_OK("silu_mul", gpu::launch_silu_mul(sc.gu, sc.wd, tokens, nh, I, sc.h, st));
  // Row-major out[T x H] = Hh[T x nh*I] Wd[H x nh*I]^T, as column-major out^T = Wd Hh^T.
  TANDEM_CUBLAS_OK(cublasGemmEx(s_.blas(), CUBLAS_OP_T, CUBLAS_OP_N, H, tokens, nh * I, &one, down_, CUDA_R_16BF,
                                nh * I, sc.h, CUDA_R_16BF, nh * I, &zero, out, CUDA_R_32F, H, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT));
}

}  // namespace

std::unique_ptr<Stream> make_cuda_stream(int index, void* external) {
  return std::make_unique<CudaStream>(index, static_cast<cudaStream_t>(external));
}

}  // namespace tandem
