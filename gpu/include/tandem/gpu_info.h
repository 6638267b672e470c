// tandem/gpu_info.h: which CUDA devices this process can use, and whether a kernel
// built into tandem actually runs on them. Plain C++ (no CUDA types), so host code
// and builds without CUDA include it alike; without CUDA, cuda_built is false.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tandem::gpu {

struct GpuInfo {
  int index = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int multiprocessors = 0;
  uint64_t total_memory = 0, free_memory = 0;
  bool kernel_ok = false;     // a tandem kernel launched, ran and gave the right answer
  std::string kernel_error;   // why not, when it did not
};

struct GpuReport {
  bool cuda_built = false;    // tandem was compiled with CUDA
  std::string status;         // "ok", or why no GPU is usable ("no CUDA driver", ...)
  int runtime_version = 0;    // e.g. 13000
  int driver_version = 0;     // 0 when no driver
  int nccl_version = 0;       // 0 when NCCL is not linked
  std::string archs;          // architectures the device code was built for: "80;90"
  std::vector<GpuInfo> gpus;
};

// Never throws for a missing GPU or driver: that is reported in `status`.
GpuReport query_gpus(bool run_kernel_check = true);

}  // namespace tandem::gpu
