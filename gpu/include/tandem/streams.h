// tandem/streams.h: making streams. The Stream interface and the host stream are the
// runtime's (tandem/stream.h); choosing a stream from the config and the CUDA stream
// belong to the gpu layer above it (gpu/streams.cpp, gpu/cuda_stream.cpp).
#pragma once

#include <memory>

#include "tandem/config.h"
#include "tandem/stream.h"

namespace tandem {

// The stream the config's gpu.device asks for: "none" -> host; "cuda:N" -> that GPU (an
// error naming gpu.device when it is not usable); "auto" -> cuda:0 when a GPU is usable,
// else the host stream.
std::unique_ptr<Stream> make_stream(const Config& config);
// CUDA stream on device `index` (gpu/cuda_stream.cu). Throws Errc::unsupported when
// tandem was built without CUDA or the device is missing. With `external` (a
// cudaStream_t, e.g. torch.cuda.current_stream().cuda_stream) tandem enqueues on that
// stream, so its work is ordered with the caller's and can join the caller's graph
// capture; the caller keeps it alive and destroys it.
std::unique_ptr<Stream> make_cuda_stream(int index, void* external = nullptr);

}  // namespace tandem
