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
// With a config, its fit is checked: ISA level, NUMA nodes, GPU index, paths, and, when it
// names a model (model.path), memory (tandem/memory_plan.h; JSON "config.memory"): RAM and
// GPU memory needed against what this machine has, "does not fit" being a problem. Without
// a model the report says memory was not checked (never "fits").
DoctorReport run_doctor(const std::string& config_path = {}, bool gpu_kernel_check = true);

// "0.1.0"
const char* version();

}  // namespace tandem
