#include "tandem/doctor.h"

#include <dnnl.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "tandem/config.h"
#include "tandem/cpu_features.h"
#include "tandem/error.h"
#include "tandem/gpu_info.h"
#include "tandem/topology.h"

namespace tandem {
namespace {

using J = nlohmann::ordered_json;

uint64_t meminfo_kb(const char* key) {
  std::ifstream in("/proc/meminfo");
  std::string k;
  uint64_t v = 0;
  std::string unit;
  while (in >> k >> v) {
    std::getline(in, unit);
    if (k == std::string(key) + ":") return v;
  }
  return 0;
}

std::string gib(uint64_t bytes) {
  std::ostringstream os;
  os.precision(1);
  os << std::fixed << static_cast<double>(bytes) / (1ull << 30) << " GiB";
  return os.str();
}

J cpu_json() {
  const CpuFeatures& f = cpu_features();
  J j;
  j["vendor"] = f.vendor;
  j["brand"] = f.brand;
  j["features"] = {{"avx", f.avx}, {"avx2", f.avx2}, {"fma", f.fma}, {"f16c", f.f16c},
                   {"avx512f", f.avx512f}, {"avx512dq", f.avx512dq}, {"avx512bw", f.avx512bw},
                   {"avx512vl", f.avx512vl}, {"avx512_vnni", f.avx512_vnni},
                   {"avx512_bf16", f.avx512_bf16}, {"avx512_fp16", f.avx512_fp16},
                   {"avx_vnni", f.avx_vnni}, {"amx_tile", f.amx_tile}, {"amx_bf16", f.amx_bf16},
                   {"amx_int8", f.amx_int8}};
  j["os_state"] = {{"xcr0", str_cat("0x", std::hex, f.xcr0)}, {"avx", f.os_avx},
                   {"avx512", f.os_avx512}, {"amx_tiles", f.os_amx}};
  j["disabled_by_os"] = f.disabled_by_os;
  j["hardware_isa"] = isa_name(hardware_isa());
  try {
    j["effective_isa"] = isa_name(effective_isa());
  } catch (const Error& e) {
    j["effective_isa"] = nullptr;
    j["isa_error"] = e.message();
  }
  return j;
}

J topology_json() {
  const Topology& t = topology();
  J nodes = J::array();
  for (const auto& n : t.nodes) {
    J cores = J::array();
    for (const auto& c : n.cores) cores.push_back(c.pus);
    nodes.push_back({{"os_index", n.os_index}, {"memory_bytes", n.memory_bytes},
                     {"cores", n.cores.size()}, {"pus_per_core", cores}});
  }
  return {{"packages", t.packages}, {"cores", t.cores}, {"pus", t.pus},
          {"numa_nodes", nodes}, {"numa_binding", t.numa_binding},
          {"memory_total_bytes", meminfo_kb("MemTotal") * 1024},
          {"memory_numa_nodes_bytes", t.total_memory},
          {"memory_available_bytes", meminfo_kb("MemAvailable") * 1024}};
}

J gpu_json(bool kernel_check) {
  const gpu::GpuReport r = gpu::query_gpus(kernel_check);
  J gpus = J::array();
  for (const auto& g : r.gpus)
    gpus.push_back({{"index", g.index}, {"name", g.name},
                    {"compute_capability", str_cat(g.cc_major, ".", g.cc_minor)},
                    {"multiprocessors", g.multiprocessors}, {"memory_total_bytes", g.total_memory},
                    {"memory_free_bytes", g.free_memory}, {"kernel_ok", g.kernel_ok},
                    {"kernel_error", g.kernel_error}});
  return {{"cuda_built", r.cuda_built}, {"status", r.status}, {"archs", r.archs},
          {"runtime_version", r.runtime_version}, {"driver_version", r.driver_version},
          {"nccl_version", r.nccl_version}, {"devices", gpus}};
}

// Checks a valid config against this machine; problems are returned, not thrown.
std::vector<std::string> config_fit(const Config& c, const J& gpu) {
  std::vector<std::string> problems;
  try {
    resolve_isa(c.cpu.isa, "cpu.isa");
  } catch (const Error& e) {
    problems.push_back(e.message());
  }
  const Topology& t = topology();
  std::set<int> have;
  for (const auto& n : t.nodes) have.insert(n.os_index);
  for (int n : c.cpu.numa_nodes)
    if (!have.count(n)) problems.push_back(str_cat("cpu.numa_nodes: node ", n, " does not exist here (nodes: ", t.nodes.size(), ")"));
  const int idx = c.gpu_index();
  const size_t ngpu = gpu["devices"].size();
  if (idx >= 0 && static_cast<size_t>(idx) >= ngpu)
    problems.push_back(str_cat("gpu.device: ", c.gpu.device, " is not available (", ngpu, " GPUs: ",
                               gpu["status"].get<std::string>(), ")"));
  if (!c.model.path.empty() && !std::filesystem::exists(c.model.path))
    problems.push_back(str_cat("model.path: '", c.model.path.string(), "' does not exist"));
  if (!c.gpu.hot_experts.statistics.empty() && !std::filesystem::exists(c.gpu.hot_experts.statistics))
    problems.push_back(str_cat("gpu.hot_experts.statistics: '", c.gpu.hot_experts.statistics.string(), "' does not exist"));
  return problems;
}

// NCCL_VERSION_CODE: major*10000 + minor*100 + patch since 2.9.
std::string nccl_str(int v) {
  if (v == 0) return "not linked";
  return str_cat(v / 10000, ".", (v / 100) % 100, ".", v % 100);
}

std::string render_text(const J& j) {
  std::ostringstream os;
  auto yn = [](bool b) { return b ? "yes" : "no"; };
  os << "tandem " << j["tandem"]["version"].get<std::string>() << "  (" << j["tandem"]["compiler"].get<std::string>()
     << ", oneDNN " << j["tandem"]["onednn"].get<std::string>() << ", hwloc "
     << j["topology"]["hwloc"].get<std::string>() << ")\n\n";
  const J& cpu = j["cpu"];
  os << "CPU      " << cpu["brand"].get<std::string>() << " (" << cpu["vendor"].get<std::string>() << ")\n";
  os << "  features:";
  for (auto& [k, v] : cpu["features"].items()) os << " " << k << "=" << yn(v.get<bool>());
  os << "\n  OS-enabled state: XCR0=" << cpu["os_state"]["xcr0"].get<std::string>()
     << " avx=" << yn(cpu["os_state"]["avx"].get<bool>())
     << " avx512=" << yn(cpu["os_state"]["avx512"].get<bool>())
     << " amx_tiles=" << yn(cpu["os_state"]["amx_tiles"].get<bool>()) << "\n";
  if (!cpu["disabled_by_os"].empty()) os << "  present but disabled by the OS: " << cpu["disabled_by_os"].dump() << "\n";
  os << "  kernel level: " << cpu["hardware_isa"].get<std::string>() << " (hardware)";
  if (cpu.contains("isa_error")) os << "; TANDEM_ISA error: " << cpu["isa_error"].get<std::string>();
  else os << ", " << cpu["effective_isa"].get<std::string>() << " (in effect)";
  os << "\n\n";
  const J& t = j["topology"];
  os << "Topology " << t["packages"].get<int>() << " package(s), " << t["numa_nodes"].size() << " NUMA node(s), "
     << t["cores"].get<int>() << " cores, " << t["pus"].get<int>() << " logical CPUs; NUMA binding: "
     << yn(t["numa_binding"].get<bool>()) << "\n";
  for (const auto& n : t["numa_nodes"])
    os << "  node " << n["os_index"].get<int>() << ": " << n["cores"].get<int>() << " cores, "
       << gib(n["memory_bytes"].get<uint64_t>()) << "\n";
  os << "Memory   " << gib(t["memory_total_bytes"].get<uint64_t>()) << " total, "
     << gib(t["memory_available_bytes"].get<uint64_t>()) << " available\n\n";
  const J& g = j["gpu"];
  os << "GPU      ";
  if (!g["cuda_built"].get<bool>()) {
    os << "none: " << g["status"].get<std::string>() << "\n";
  } else {
    int rt = g["runtime_version"].get<int>(), drv = g["driver_version"].get<int>();
    os << "CUDA runtime " << rt / 1000 << "." << (rt % 1000) / 10 << ", driver "
       << (drv ? str_cat(drv / 1000, ".", (drv % 1000) / 10) : std::string("none")) << ", device code for sm_"
       << g["archs"].get<std::string>() << ", NCCL "
       << nccl_str(g["nccl_version"].get<int>()) << "\n";
    if (g["devices"].empty()) os << "  none: " << g["status"].get<std::string>() << "\n";
    for (const auto& d : g["devices"]) {
      os << "  cuda:" << d["index"].get<int>() << " " << d["name"].get<std::string>() << ", sm "
         << d["compute_capability"].get<std::string>() << ", " << gib(d["memory_total_bytes"].get<uint64_t>())
         << " (" << gib(d["memory_free_bytes"].get<uint64_t>()) << " free), test kernel: "
         << (d["kernel_ok"].get<bool>()            ? std::string("ok")
             : d["kernel_error"].get<std::string>().empty() ? std::string("not run")
                                                             : "FAILED: " + d["kernel_error"].get<std::string>())
         << "\n";
    }
  }
  if (j.contains("config")) {
    const J& c = j["config"];
    os << "\nConfig   " << c["path"].get<std::string>() << ": ";
    if (!c["valid"].get<bool>()) {
      os << "INVALID\n  " << c["error"].get<std::string>() << "\n";
    } else {
      os << (c["problems"].empty() ? "valid, fits this machine\n" : "valid, but cannot run here:\n");
      for (const auto& p : c["problems"]) os << "  - " << p.get<std::string>() << "\n";
    }
  }
  os << "\n" << (j["ok"].get<bool>() ? "OK" : "PROBLEMS FOUND") << "\n";
  return os.str();
}

}  // namespace

const char* version() { return TANDEM_VERSION_STRING; }

DoctorReport run_doctor(const std::string& config_path, bool gpu_kernel_check) {
  J j;
  const dnnl_version_t* dv = dnnl_version();
  j["tandem"] = {{"version", version()},
                 {"compiler", str_cat(TANDEM_COMPILER_ID, " ", TANDEM_COMPILER_VERSION)},
                 {"onednn", str_cat(dv->major, ".", dv->minor, ".", dv->patch)}};
  j["cpu"] = cpu_json();
  j["topology"] = topology_json();
  j["topology"]["hwloc"] = topology().hwloc_version;
  j["gpu"] = gpu_json(gpu_kernel_check);
  bool ok = !j["cpu"].contains("isa_error");
  for (const auto& d : j["gpu"]["devices"]) ok = ok && d["kernel_ok"].get<bool>() == gpu_kernel_check;
  if (!config_path.empty()) {
    J c;
    c["path"] = config_path;
    try {
      Config cfg = load_config(config_path);
      c["valid"] = true;
      c["value"] = J::parse(cfg.to_json());
      c["problems"] = config_fit(cfg, j["gpu"]);
      ok = ok && c["problems"].empty();
    } catch (const Error& e) {
      c["valid"] = false;
      c["error"] = e.message();
      ok = false;
    }
    j["config"] = c;
  }
  j["ok"] = ok;
  // Messages may quote a user's bytes; invalid UTF-8 is replaced, never thrown on.
  std::string json = j.dump(2, ' ', false, J::error_handler_t::replace);
  return {json, render_text(J::parse(json)), ok};
}

}  // namespace tandem
