// tandem/gpu_ops.h: host launchers of tandem's CUDA kernels (gpu/*.cu). Plain C++
// signatures (the stream is a cudaStream_t passed as void*), so C++20 host code calls
// them without CUDA headers. Each returns the launch's cudaError_t as an int (0: ok);
// gpu/cuda_stream.cpp turns a failure into a tandem::Error naming the op.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tandem/routing.h"

namespace tandem::gpu {

// routing.cu: one thread per token, the same split_token as the host.
int launch_split(const void* ids, bool ids_i64, const float* weights, int tokens, const uint8_t* hot_mask,
                 const SplitSpec& spec, int32_t* out3, void* stream);

// elementwise.cu
int launch_add(float* out, const float* src, size_t n, void* stream);              // out += src
int launch_to_bf16(const float* src, uint16_t* dst, size_t n, void* stream);       // round to nearest even
// hot experts, dense form: wd[t, j] = sum of weights[t, k] over slots k whose id maps to
// hot index j (slot_of[id] = j, -1: not hot); [tokens x n_hot], fully written.
int launch_dense_weights(const int32_t* hot_ids, const float* weights, int tokens, int top_k, const int32_t* slot_of,
                         int experts, int n_hot, float* wd, void* stream);
// h[t, j*I + i] = bf16(wd[t, j] * silu(gu[t, j*2I + i]) * gu[t, j*2I + I + i]).
int launch_silu_mul(const float* gu, const float* wd, int tokens, int n_hot, int inter, uint16_t* h, void* stream);

}  // namespace tandem::gpu
