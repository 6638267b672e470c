// tandem/doctor.h: a report of what tandem can use on this machine (ISA features,
// NUMA nodes and cores, memory, GPUs, libraries), and validation of a placement
// config against it. Backs `tandem doctor`; never needs a GPU.
#pragma once

#include <string>

namespace tandem {

struct DoctorReport {
  std::string json;  // machine-readable (stable keys; tests read it)
  std::string text;  // what a person reads
  bool ok = true;    // false when the config is invalid or cannot run here
};

// config_path empty: no config check. gpu_kernel_check: launch a test kernel per GPU.
DoctorReport run_doctor(const std::string& config_path = {}, bool gpu_kernel_check = true);

// "0.1.0"
const char* version();

}  // namespace tandem
