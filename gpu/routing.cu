// The hot / cold / deferred split on the GPU: one thread per token running the same
// per-token code as the host (tandem/routing.h), so both place every slot the same way.
#include <cuda_runtime.h>

#include "tandem/gpu_ops.h"

namespace tandem::gpu {
namespace {

constexpr int kBlock = 128;

template <typename Id>
__global__ void split_kernel(const Id* ids, const float* weights, int tokens, const uint8_t* hot_mask, SplitSpec spec,
                             int32_t* out3) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  const size_t n = static_cast<size_t>(tokens) * spec.top_k, o = static_cast<size_t>(t) * spec.top_k;
  split_token(ids + o, weights + o, hot_mask, spec, out3 + o, out3 + n + o, out3 + 2 * n + o);
}

int blocks(int n) { return (n + kBlock - 1) / kBlock; }

}  // namespace

int launch_split(const void* ids, bool ids_i64, const float* weights, int tokens, const uint8_t* hot_mask,
                 const SplitSpec& spec, int32_t* out3, void* stream) {
  if (tokens <= 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  if (ids_i64)
    split_kernel<<<blocks(tokens), kBlock, 0, s>>>(static_cast<const int64_t*>(ids), weights, tokens, hot_mask, spec, out3);
  else
    split_kernel<<<blocks(tokens), kBlock, 0, s>>>(static_cast<const int32_t*>(ids), weights, tokens, hot_mask, spec, out3);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace tandem::gpu
