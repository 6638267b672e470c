#include "tandem/doctor.h"

#include <dnnl.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tandem/config.h"
#include "tandem/cpu_features.h"
#include "tandem/error.h"
#include "tandem/expert_store.h"
#include "tandem/gpu_info.h"
#include "tandem/memory_plan.h"
#include "tandem/pool_config.h"
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

// GiB from 0.1 GiB up, MiB or KiB below (a tiny model's figures stay readable).
std::string human(uint64_t bytes) {
  std::ostringstream os;
  os.precision(1);
  os << std::fixed;
  if (bytes >= (1ull << 30) / 10) os << static_cast<double>(bytes) / (1ull << 30) << " GiB";
  else if (bytes >= (1ull << 20) / 10) os << static_cast<double>(bytes) / (1ull << 20) << " MiB";
  else os << static_cast<double>(bytes) / 1024 << " KiB";
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
  try {  // the pool the engine would start: the same check, the same message as the loaders
    pool_options(c.cpu);
  } catch (const Error& e) {
    problems.push_back(e.message());
  }
  const int idx = c.gpu_index();
  const size_t ngpu = gpu["devices"].size();
  if (idx >= 0 && static_cast<size_t>(idx) >= ngpu)
    problems.push_back(str_cat("gpu.device: ", c.gpu.device, " is not available (", ngpu, " GPUs: ",
                               gpu["status"].get<std::string>(), ")"));
  if (!c.model.path.empty() && !std::filesystem::exists(c.model.path))
    problems.push_back(str_cat("model.path: '", c.model.path.string(), "' does not exist"));
  if (!c.gpu.hot_experts.statistics.empty() && !std::filesystem::exists(c.gpu.hot_experts.statistics))
    problems.push_back(str_cat("gpu.hot_experts.statistics: '", c.gpu.hot_experts.statistics.string(), "' does not exist"));
  if (!c.cpu.store.empty()) {
    // The store opens (finished, sizes and headers whole) and holds cpu.format; whether it was
    // made from this checkpoint is checked when a model loads.
    try {
      const ExpertStore store = ExpertStore::open(c.cpu.store);
      const PackOptions want = pack_options(c.cpu);
      const PackOptions& has = store.spec().format;
      if (!same_packing(has, want))
        problems.push_back(str_cat("cpu.store: ", c.cpu.store.string(), " holds ", store_dir_name(has).substr(7),
                                   " experts, the config asks for ", store_dir_name(want).substr(7)));
    } catch (const Error& e) {
      std::string m = e.message();
      if (m.rfind("store: ", 0) == 0) m.erase(0, 7);
      problems.push_back(str_cat("cpu.store: ", m));
    }
  }
  return problems;
}

// The subpools the engine's pool would have (pool_options), or its count from the config
// alone when the config does not fit the topology (that problem is reported already).
int subpools_for(const Config& c) {
  try {
    return static_cast<int>(pool_options(c.cpu).subpools.size());
  } catch (const Error&) {
    int nodes = static_cast<int>(c.cpu.numa_nodes.size());
    if (nodes == 0)
      for (const auto& n : topology().nodes) nodes += n.cores.empty() ? 0 : 1;
    return std::max(1, nodes) * std::max(1, c.cpu.virtual_subpools);
  }
}

J parts_json(const std::vector<MemoryPart>& parts) {
  J a = J::array();
  for (const auto& p : parts) a.push_back({{"what", p.what}, {"bytes", p.bytes}, {"detail", p.detail}});
  return a;
}

std::string parts_text(const std::vector<MemoryPart>& parts) {
  std::string s;
  for (const auto& p : parts)
    if (p.bytes) s += str_cat(s.empty() ? "" : " + ", p.what, " ", human(p.bytes));
  return s;
}

// Whether the config's model fits this machine's RAM and GPU memory: the estimate
// (memory_plan.h) against MemAvailable and the GPU's free memory. Appends a
// "does not fit" problem per memory that is short; "checked": false (never "fits")
// when no model is known.
J memory_check(const Config& c, const J& gpu, const J& topo, std::vector<std::string>& problems) {
  J m;
  m["checked"] = false;
  if (c.model.path.empty()) {
    m["reason"] = "no model.path: the estimate needs the model's config.json (set model.path to the checkpoint directory)";
    return m;
  }
  if (!std::filesystem::exists(c.model.path)) {
    m["reason"] = "model.path does not exist";
    return m;
  }
  ModelInfo info;
  try {
    info = read_model_info(c.model.path);
  } catch (const Error& e) {
    // A config.json that is there but wrong (bad JSON, a missing or absurd size) is a
    // problem: the model will not load. One that cannot be read leaves memory unchecked.
    if (e.code() == Errc::bad_format) problems.push_back(e.message());
    m["reason"] = e.message();
    return m;
  }
  const int idx = c.gpu_index();
  const size_t ngpu = gpu["devices"].size();
  const bool on_gpu = idx >= 0 || (idx == -2 && ngpu > 0);
  const int dev = idx >= 0 ? idx : 0;
  MemoryPlan plan;
  try {
    plan = plan_memory(c, info, subpools_for(c), on_gpu);
  } catch (const Error& e) {
    problems.push_back(e.message());
    m["reason"] = e.message();
    return m;
  }
  m["checked"] = true;
  m["model"] = {{"config_json", info.config_json.string()}, {"model_type", info.model_type}, {"layers", info.layers},
                {"moe_layers", info.moe_layers.size()}, {"experts", info.shape.experts}, {"hidden", info.shape.hidden},
                {"intermediate", info.shape.inter}, {"top_k", info.top_k}, {"dtype", info.dtype},
                {"non_expert_bytes", info.non_expert_bytes}, {"non_expert_exact", info.non_expert_exact},
                {"non_expert_source", info.non_expert_source}};
  m["subpools"] = plan.subpools;
  m["stream"] = on_gpu ? str_cat("cuda:", dev) : std::string("host");
  m["cpu_expert_bytes"] = plan.cpu_expert_bytes;
  m["hot_expert_bytes"] = plan.hot_expert_bytes;
  m["hot_experts"] = plan.hot_experts;
  uint64_t ram_have = topo["memory_available_bytes"].get<uint64_t>();
  if (ram_have == 0) ram_have = topo["memory_total_bytes"].get<uint64_t>();
  bool fits = true;
  const uint64_t ram_need = plan.ram_bytes();
  m["ram"] = {{"needed_bytes", ram_need}, {"available_bytes", ram_have}, {"parts", parts_json(plan.ram)}};
  if (ram_need > ram_have) {
    fits = false;
    problems.push_back(str_cat("does not fit: needs ", human(ram_need), " of RAM for ", parts_text(plan.ram),
                               ", this machine has ", human(ram_have), " available (short by ",
                               human(ram_need - ram_have), ")"));
  }
  if (on_gpu) {
    const uint64_t need = plan.gpu_bytes();
    J g = {{"device", dev}, {"needed_bytes", need}, {"parts", parts_json(plan.gpu)}};
    if (static_cast<size_t>(dev) < ngpu) {
      const J& d = gpu["devices"][dev];
      const uint64_t free = d["memory_free_bytes"].get<uint64_t>(), total = d["memory_total_bytes"].get<uint64_t>();
      g["available_bytes"] = free;
      g["total_bytes"] = total;
      if (need > free) {
        fits = false;
        problems.push_back(str_cat("does not fit: needs ", human(need), " on cuda:", dev, " for ", parts_text(plan.gpu),
                                   ", the GPU has ", human(free), " free of ", human(total), " (short by ",
                                   human(need - free), ")"));
      }
    } else {
      g["available_bytes"] = nullptr;  // the missing device is reported as a problem already
    }
    m["gpu"] = g;
  }
  m["fits"] = fits;
  m["not_counted"] = "KV cache and activations, the CUDA context, allocator slack, per-layer CPU scratch, "
                     "further batch shapes' buffers";
  return m;
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
      const J& mem = c["memory"];
      const bool checked = mem["checked"].get<bool>();
      if (!c["problems"].empty()) os << "valid, but cannot run here:\n";
      else if (checked) os << "valid, fits this machine\n";
      else os << "valid; memory not checked\n";
      for (const auto& p : c["problems"]) os << "  - " << p.get<std::string>() << "\n";
      if (!checked) {
        os << "  memory not checked: " << mem["reason"].get<std::string>() << "\n";
      } else {
        const J& md = mem["model"];
        os << "  model: " << md["model_type"].get<std::string>() << ", " << md["moe_layers"].get<int>() << " of "
           << md["layers"].get<int>() << " layers MoE x " << md["experts"].get<int>() << " experts (hidden "
           << md["hidden"].get<int>() << ", expert intermediate " << md["intermediate"].get<int>() << ", top-"
           << md["top_k"].get<int>() << "), " << md["dtype"].get<std::string>() << "\n";
        auto show = [&](const std::string& where, const J& m, const std::string& have) {
          os << "  " << where << ": needs " << human(m["needed_bytes"].get<uint64_t>()) << ", " << have << "\n";
          for (const auto& p : m["parts"])
            os << "    " << p["what"].get<std::string>() << " " << human(p["bytes"].get<uint64_t>()) << " ("
               << p["detail"].get<std::string>() << ")\n";
        };
        show("RAM", mem["ram"], "has " + human(mem["ram"]["available_bytes"].get<uint64_t>()) + " available");
        if (mem.contains("gpu")) {
          const J& g = mem["gpu"];
          show(mem["stream"].get<std::string>(), g,
               g["available_bytes"].is_null() ? std::string("device not available")
                                              : "has " + human(g["available_bytes"].get<uint64_t>()) + " free of " +
                                                    human(g["total_bytes"].get<uint64_t>()));
        }
        os << "  not counted: " << mem["not_counted"].get<std::string>() << "\n";
      }
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
      std::vector<std::string> problems = config_fit(cfg, j["gpu"]);
      c["memory"] = memory_check(cfg, j["gpu"], j["topology"], problems);
      for (std::string& p : problems) p = escape_invalid_utf8(p);
      c["problems"] = problems;
      ok = ok && c["problems"].empty();
    } catch (const Error& e) {
      c["valid"] = false;
      c["error"] = escape_invalid_utf8(e.message());
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
