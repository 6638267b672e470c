// Built instead of gpu_info.cu when tandem is configured without CUDA.
#include "tandem/gpu_info.h"

namespace tandem::gpu {

GpuReport query_gpus(bool) {
  GpuReport r;
  r.cuda_built = false;
  r.status = "tandem was built without CUDA (configure with -DTANDEM_CUDA=ON on a machine with the CUDA toolkit)";
  return r;
}

}  // namespace tandem::gpu
