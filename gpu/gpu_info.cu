// CUDA device discovery and a launch self-test, used by `tandem doctor`.
#include <cuda_runtime.h>

#include <vector>

#include "tandem/gpu_info.h"
#ifdef TANDEM_HAVE_NCCL
#include <nccl.h>
#endif

namespace tandem::gpu {
namespace {

__global__ void axpy_iota(int n, float a, const float* x, float* y) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + static_cast<float>(i);
}

// Runs axpy_iota on the current device and checks every element on the host.
std::string kernel_check() {
  constexpr int n = 4099;  // not a multiple of the block: exercises the tail guard
  std::vector<float> x(n), y(n, -1.f);
  for (int i = 0; i < n; ++i) x[i] = 0.5f * static_cast<float>(i % 97);
  float *dx = nullptr, *dy = nullptr;
  auto err = [&](cudaError_t e) { return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e); };
  std::string result;
  cudaError_t e = cudaMalloc(&dx, n * sizeof(float));
  if (e == cudaSuccess) e = cudaMalloc(&dy, n * sizeof(float));
  if (e == cudaSuccess) e = cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  if (e == cudaSuccess) {
    axpy_iota<<<(n + 255) / 256, 256>>>(n, 3.f, dx, dy);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaMemcpy(y.data(), dy, n * sizeof(float), cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) {
    result = err(e);
  } else {
    for (int i = 0; i < n; ++i)
      if (y[i] != 3.f * x[i] + static_cast<float>(i)) {
        result = "wrong result at element " + std::to_string(i);
        break;
      }
  }
  cudaFree(dx);
  cudaFree(dy);
  return result;
}

}  // namespace

GpuReport query_gpus(bool run_kernel_check) {
  GpuReport r;
  r.cuda_built = true;
  r.archs = TANDEM_CUDA_ARCHS;
  cudaRuntimeGetVersion(&r.runtime_version);
  cudaDriverGetVersion(&r.driver_version);
#ifdef TANDEM_HAVE_NCCL
  ncclGetVersion(&r.nccl_version);
#endif
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    r.status = std::string("no usable GPU (") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e) + ")";
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return r;
  }
  if (count == 0) {
    r.status = "no GPU found";
    return r;
  }
  r.status = "ok";
  for (int d = 0; d < count; ++d) {
    GpuInfo g;
    g.index = d;
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, d) != cudaSuccess) continue;
    g.name = p.name;
    g.cc_major = p.major;
    g.cc_minor = p.minor;
    g.multiprocessors = p.multiProcessorCount;
    g.total_memory = p.totalGlobalMem;
    if (cudaSetDevice(d) == cudaSuccess) {
      size_t free_b = 0, total_b = 0;
      if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) g.free_memory = free_b;
      if (run_kernel_check) {
        g.kernel_error = kernel_check();
        g.kernel_ok = g.kernel_error.empty();
      }
    }
    r.gpus.push_back(std::move(g));
  }
  return r;
}

}  // namespace tandem::gpu
