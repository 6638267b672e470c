// The stream factory: host or CUDA stream as the config's gpu.device asks (see
// tandem/streams.h). Built with and without CUDA; without it make_cuda_stream throws.
#include "tandem/streams.h"

#include "tandem/error.h"
#include "tandem/gpu_info.h"

namespace tandem {

std::unique_ptr<Stream> make_stream(const Config& config) {
  const int index = config.gpu_index();
  if (index == -1) return make_host_stream(config.isa());
  if (index == -2) {
    const gpu::GpuReport r = gpu::query_gpus(false);
    return r.cuda_built && !r.gpus.empty() ? make_cuda_stream(0) : make_host_stream(config.isa());
  }
  try {
    return make_cuda_stream(index);
  } catch (const Error& e) {
    TANDEM_FAIL(e.code(), config.source, ": gpu.device: ", config.gpu.device, ": ", e.message());
  }
}

#if !defined(TANDEM_WITH_CUDA)
std::unique_ptr<Stream> make_cuda_stream(int index, void*) {
  TANDEM_FAIL(Errc::unsupported, "cuda:", index, ": tandem was built without CUDA (TANDEM_CUDA=OFF or no nvcc)");
}
#endif

}  // namespace tandem
