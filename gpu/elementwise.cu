// Elementwise kernels of the hybrid layer: adding partial outputs, fp32 -> bf16, and the
// hot experts' dense routing weights and SiLU * up.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "tandem/gpu_ops.h"

namespace tandem::gpu {
namespace {

constexpr int kBlock = 256;

unsigned grid(size_t n) {
  const size_t b = (n + kBlock - 1) / kBlock;
  return static_cast<unsigned>(b < 65535u * 16 ? b : 65535u * 16);
}

__global__ void add_kernel(float* out, const float* src, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] += src[i];
}

__global__ void to_bf16_kernel(const float* src, __nv_bfloat16* dst, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = __float2bfloat16_rn(src[i]);
}

__global__ void dense_weights_kernel(const int32_t* hot_ids, const float* weights, int tokens, int top_k,
                                     const int32_t* slot_of, int experts, int n_hot, float* wd) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  float* row = wd + static_cast<size_t>(t) * n_hot;
  for (int j = 0; j < n_hot; ++j) row[j] = 0.0f;
  for (int k = 0; k < top_k; ++k) {
    const int32_t id = hot_ids[static_cast<size_t>(t) * top_k + k];
    if (id < 0 || id >= experts) continue;
    const int j = slot_of[id];
    if (j >= 0) row[j] += weights[static_cast<size_t>(t) * top_k + k];
  }
}

__global__ void silu_mul_kernel(const float* gu, const float* wd, int tokens, int n_hot, int inter, __nv_bfloat16* h) {
  const size_t per_token = static_cast<size_t>(n_hot) * inter, n = per_token * tokens;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t t = i / per_token, r = i % per_token;
    const int j = static_cast<int>(r / inter), c = static_cast<int>(r % inter);
    const float w = wd[t * n_hot + j];
    float v = 0.0f;
    if (w != 0.0f) {
      const float* row = gu + t * 2 * per_token + static_cast<size_t>(j) * 2 * inter;
      const float g = row[c], u = row[inter + c];
      v = w * (g / (1.0f + __expf(-g))) * u;
    }
    h[i] = __float2bfloat16_rn(v);
  }
}

}  // namespace

int launch_add(float* out, const float* src, size_t n, void* stream) {
  if (!n) return 0;
  add_kernel<<<grid(n), kBlock, 0, static_cast<cudaStream_t>(stream)>>>(out, src, n);
  return static_cast<int>(cudaGetLastError());
}

int launch_to_bf16(const float* src, uint16_t* dst, size_t n, void* stream) {
  if (!n) return 0;
  to_bf16_kernel<<<grid(n), kBlock, 0, static_cast<cudaStream_t>(stream)>>>(src, reinterpret_cast<__nv_bfloat16*>(dst), n);
  return static_cast<int>(cudaGetLastError());
}

int launch_dense_weights(const int32_t* hot_ids, const float* weights, int tokens, int top_k, const int32_t* slot_of,
                         int experts, int n_hot, float* wd, void* stream) {
  if (tokens <= 0) return 0;
  dense_weights_kernel<<<(tokens + 127) / 128, 128, 0, static_cast<cudaStream_t>(stream)>>>(
      hot_ids, weights, tokens, top_k, slot_of, experts, n_hot, wd);
  return static_cast<int>(cudaGetLastError());
}

int launch_silu_mul(const float* gu, const float* wd, int tokens, int n_hot, int inter, uint16_t* h, void* stream) {
  const size_t n = static_cast<size_t>(tokens) * n_hot * inter;
  if (!n) return 0;
  silu_mul_kernel<<<grid(n), kBlock, 0, static_cast<cudaStream_t>(stream)>>>(gu, wd, tokens, n_hot, inter,
                                                                             reinterpret_cast<__nv_bfloat16*>(h));
  return static_cast<int>(cudaGetLastError());
}

}  // namespace tandem::gpu
