// tandem._C: the C++ runtime as seen from Python. Thin: validation and logic live
// in C++; this file converts types, releases the GIL around long work, and maps
// tandem::Error to Python exceptions with the same message:
//   invalid_argument, bad_format, unsupported -> ValueError
//   io -> OSError;  internal -> RuntimeError
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include <cstring>
#include <type_traits>


#include "tandem/config.h"
#include "tandem/cpu_features.h"
#include "tandem/doctor.h"
#include "tandem/engine.h"
#include "tandem/error.h"
#include "tandem/lora.h"
#include "tandem/attention.h"
#include "tandem/decode_layer.h"
#include "tandem/dense.h"
#include "tandem/lora_engine.h"
#include "tandem/memory_plan.h"
#include "tandem/pool_config.h"
#include "tandem/safetensors.h"
#include "tandem/trace.h"

namespace py = pybind11;
using namespace tandem;

namespace {

SourceType source_type(const std::string& dtype) {
  if (dtype == "float32") return SourceType::f32;
  if (dtype == "bfloat16") return SourceType::bf16;
  if (dtype == "float16") return SourceType::f16;
  TANDEM_FAIL(Errc::unsupported, "expert weights of dtype ", dtype, " (supported: float32, bfloat16, float16)");
}

// A progress callback that may run with the GIL released; Python errors (Ctrl-C) propagate.
Progress py_progress(const py::object& fn) {
  if (fn.is_none()) return {};
  return [fn](int done, int total) {
    py::gil_scoped_acquire gil;
    fn(done, total);
  };
}

// Loads an inference or training engine from a checkpoint, (gate, up, down) key patterns
// from Python, with the GIL released while packing.
using NamingTuple = std::tuple<std::string, std::string, std::string>;
template <typename E>
void load_from_checkpoint(E& engine, const Checkpoint& c, const NamingTuple& n, const py::object& progress,
                          const std::vector<int>& only = {}) {
  ExpertNaming naming{std::get<0>(n), std::get<1>(n), std::get<2>(n)};
  Progress p = py_progress(progress);
  py::gil_scoped_release nogil;
  if constexpr (std::is_same_v<E, Engine>) engine.load(c, naming, p, only);
  else engine.load(c, naming, p);
}

StoreSpec store_spec(const NamingTuple& n, int experts, int hidden, int inter, std::vector<int> layers,
                     const std::string& format, int group, bool zero_point) {
  return {{experts, hidden, inter}, std::move(layers), pack_options(format, group, zero_point),
          ExpertNaming{std::get<0>(n), std::get<1>(n), std::get<2>(n)}};
}

Config config_from(const std::string& path, const std::string& text) {
  TANDEM_CHECK(path.empty() != text.empty(), Errc::invalid_argument, "engine: give a config file or config text (one)");
  return path.empty() ? parse_config(text) : load_config(path);
}

// A LoraWeights from six (data pointer, size, expert_stride, ld, transposed) tuples in the
// order a_gate, b_gate, a_up, b_up, a_down, b_down; a pointer 0 means "not given".
using MatrixSpec = std::tuple<uintptr_t, size_t, int64_t, int64_t, bool>;
LoraWeights lora_weights(const std::vector<MatrixSpec>& specs, const char* what) {
  TANDEM_CHECK(specs.empty() || specs.size() == 6, Errc::invalid_argument, "lora: ", what,
               " needs 6 matrices (a_gate, b_gate, a_up, b_up, a_down, b_down) or none, got ", specs.size());
  LoraWeights w;
  LoraMatrix* m[6] = {&w.a_gate, &w.b_gate, &w.a_up, &w.b_up, &w.a_down, &w.b_down};
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& [ptr, size, es, ld, t] = specs[i];
    *m[i] = LoraMatrix{reinterpret_cast<float*>(ptr), size, es, ld, t};
  }
  return w;
}

// A LoRA layer, keeping alive what it runs on: its pool (a layer built on its own, pools
// shared between the layers of a model) or the LoraEngine it belongs to (an aliasing pointer).
struct PyLoraLayer {
  std::shared_ptr<LoraMoe> layer;
};

// A LoraEngine and its layers' wrappers, made once (so engine.layers[i] is one object).
struct PyLoraEngine {
  std::shared_ptr<LoraEngine> engine;
  py::list layers;
};

// Expert sources from per-expert data pointers: row-major [inter x hidden] gate / up and
// [hidden x inter] down of dtype `dtype`. Errors name `what` when the counts do not fit.
// Biases (shape.bias): per expert fp32 [inter] gate / up and [hidden] down pointers.
std::function<ExpertSource(int)> pointer_sources(const MoeShape& sh, const std::vector<uintptr_t>& gate,
                                                 const std::vector<uintptr_t>& up, const std::vector<uintptr_t>& down,
                                                 const std::string& dtype, const char* what,
                                                 const std::vector<uintptr_t>& gate_bias = {},
                                                 const std::vector<uintptr_t>& up_bias = {},
                                                 const std::vector<uintptr_t>& down_bias = {}) {
  TANDEM_CHECK(gate.size() == size_t(sh.experts) && up.size() == gate.size() && down.size() == gate.size(),
               Errc::invalid_argument, what, " needs ", sh.experts, " gate/up/down pointers, got ", gate.size(), "/",
               up.size(), "/", down.size());
  const size_t nb = sh.bias ? gate.size() : 0;
  TANDEM_CHECK(gate_bias.size() == nb && up_bias.size() == nb && down_bias.size() == nb, Errc::invalid_argument, what,
               sh.bias ? " needs the experts' gate/up/down biases (" : " got biases for experts without them (", nb,
               " each), got ", gate_bias.size(), "/", up_bias.size(), "/", down_bias.size());
  const SourceType t = source_type(dtype);
  auto view = [](uintptr_t p, SourceType type, int n, int k) { return WeightView{reinterpret_cast<const void*>(p), type, n, k}; };
  return [=](int x) {
    ExpertSource src{view(gate[x], t, sh.inter, sh.hidden), view(up[x], t, sh.inter, sh.hidden),
                     view(down[x], t, sh.hidden, sh.inter)};
    if (nb) {
      src.gate_bias = view(gate_bias[x], SourceType::f32, 1, sh.inter);
      src.up_bias = view(up_bias[x], SourceType::f32, 1, sh.inter);
      src.down_bias = view(down_bias[x], SourceType::f32, 1, sh.hidden);
    }
    return src;
  };
}

// The experts' math from the Python arguments: "silu" or "clamped_swiglu", biases.
MoeShape moe_shape(int experts, int hidden, int inter, const std::string& activation, float alpha, float limit,
                   float up_offset, bool bias) {
  MoeShape sh{experts, hidden, inter};
  TANDEM_CHECK(activation == "silu" || activation == "clamped_swiglu", Errc::invalid_argument, "engine: activation '",
               activation, "' is not one of: silu, clamped_swiglu");
  if (activation == "clamped_swiglu") sh.act = {GateAct::Kind::clamped, alpha, limit, up_offset};
  sh.bias = bias;
  return sh;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "tandem C++ runtime";
  m.attr("__version__") = version();

  py::register_exception_translator([](std::exception_ptr p) {
    // A message may quote bytes of the user's file that are not UTF-8 (a config key, a
    // header): they become \xNN escapes, so the error still names the file, instead of
    // PyErr_SetString's bare UnicodeDecodeError.
    auto raise = [](PyObject* type, const char* what) {
      PyObject* msg = PyUnicode_DecodeUTF8(what, static_cast<Py_ssize_t>(std::strlen(what)), "backslashreplace");
      if (!msg) return;  // the decoder's own error (out of memory) stays set
      PyErr_SetObject(type, msg);
      Py_DECREF(msg);
    };
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      switch (e.code()) {
        case Errc::invalid_argument:
        case Errc::bad_format:
        case Errc::unsupported: return raise(PyExc_ValueError, e.what());
        case Errc::io: return raise(PyExc_OSError, e.what());
        case Errc::internal: return raise(PyExc_RuntimeError, e.what());
      }
      raise(PyExc_RuntimeError, e.what());
    }
  });

  // ---- errors (for tests of the mapping) ----
  m.def("_raise", [](const std::string& code, const std::string& msg) {
    for (Errc c : {Errc::invalid_argument, Errc::bad_format, Errc::io, Errc::unsupported, Errc::internal})
      if (errc_name(c) == code) TANDEM_FAIL(c, msg);
    TANDEM_FAIL(Errc::invalid_argument, "unknown error code '", code, "'");
  });

  // ---- CPU features ----
  m.def("cpu_features", [] {
    const CpuFeatures& f = cpu_features();
    py::dict d;
    d["vendor"] = f.vendor;
    d["brand"] = f.brand;
#define TANDEM_FEATURE(x) d[#x] = f.x;
    TANDEM_FEATURE(avx) TANDEM_FEATURE(avx2) TANDEM_FEATURE(fma) TANDEM_FEATURE(f16c)
    TANDEM_FEATURE(avx512f) TANDEM_FEATURE(avx512dq) TANDEM_FEATURE(avx512bw) TANDEM_FEATURE(avx512vl)
    TANDEM_FEATURE(avx512_vnni) TANDEM_FEATURE(avx512_bf16) TANDEM_FEATURE(avx512_fp16)
    TANDEM_FEATURE(avx_vnni) TANDEM_FEATURE(amx_tile) TANDEM_FEATURE(amx_bf16) TANDEM_FEATURE(amx_int8)
#undef TANDEM_FEATURE
    return d;
  }, "Instruction-set features usable by this process (CPU and OS both enable them).");
  m.def("hardware_isa", [] { return std::string(isa_name(hardware_isa())); });
  m.def("effective_isa", [] { return std::string(isa_name(effective_isa())); },
        "The kernel level in use: the hardware's, or TANDEM_ISA (capped; ValueError above the hardware).");
  m.def("resolve_isa", [](const std::string& req) { return std::string(isa_name(resolve_isa(req, "isa"))); });
  m.def("select_isa", [](const std::string& req) { return std::string(isa_name(select_isa(req, "cpu.isa"))); },
        py::arg("requested") = "auto",
        "The level kernels run for a config's cpu.isa: lowered by TANDEM_ISA, capped by the hardware (ValueError above).");

  // ---- config ----
  m.def("rms_norm_bf16", [](uintptr_t x, uintptr_t w, float eps, int64_t rows, int n, uintptr_t y) {
        py::gil_scoped_release nogil;
        rms_norm_bf16(reinterpret_cast<const uint16_t*>(x), reinterpret_cast<const uint16_t*>(w), eps, rows, n,
                      reinterpret_cast<uint16_t*>(y));
      }, py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("rows"), py::arg("n"), py::arg("out"),
      "transformers' Llama-family RMSNorm on bf16 rows (tandem/dense.h): out = bf16(w * bf16(x / rms(x)))");
  m.def("gated_mlp_bf16", [](std::shared_ptr<DenseLinear> gate_up, std::shared_ptr<DenseLinear> down, uintptr_t x,
                             int64_t rows, uintptr_t y) {
        GatedMlp mlp{std::move(gate_up), std::move(down)};
        check_gated_mlp(mlp, "gated MLP");
        py::gil_scoped_release nogil;
        gated_mlp_bf16(mlp, reinterpret_cast<const bf16_t*>(x), rows, reinterpret_cast<bf16_t*>(y));
      }, py::arg("gate_up"), py::arg("down"), py::arg("x"), py::arg("rows"), py::arg("y"),
      "down(bf16(bf16(silu(g)) * u)), g|u = gate_up(x), on bf16 rows [rows x hidden] (tandem/decode_layer.h)");
  m.def("hot_auto_reserve", &hot_auto_reserve, py::arg("device_total_bytes"),
        "device bytes gpu.hot_experts count: auto leaves free for the KV cache and activations (placement.h)");
  m.def("load_config_json", [](const std::filesystem::path& p) { return load_config(p).to_json(); },
        "Parse and validate a placement YAML file; returns the validated config as JSON text.");
  m.def("parse_config_json",
        [](const std::string& text, const std::string& origin, const std::filesystem::path& base) {
          return parse_config(text, origin, base).to_json();
        },
        py::arg("text"), py::arg("origin") = "<string>", py::arg("base_dir") = std::filesystem::path());

  // ---- doctor ----
  m.def("doctor", [](const std::string& config, bool gpu_kernel_check) {
    DoctorReport r;
    {
      py::gil_scoped_release nogil;
      r = run_doctor(config, gpu_kernel_check);
    }
    return py::make_tuple(r.ok, r.text, r.json);
  }, py::arg("config") = "", py::arg("gpu_kernel_check") = true);

  // ---- safetensors ----
  py::class_<Checkpoint>(m, "Checkpoint", "A validated, memory-mapped safetensors checkpoint.")
      .def(py::init([](const std::filesystem::path& p) {
             py::gil_scoped_release nogil;
             return Checkpoint::open(p);
           }),
           py::arg("path"))
      .def_static("from_tables",
                  [](const std::filesystem::path& root, const std::vector<std::filesystem::path>& files,
                     const std::vector<std::vector<py::tuple>>& tables, const std::string& format) {
                    std::vector<std::vector<TensorInfo>> infos(tables.size());
                    for (size_t i = 0; i < tables.size(); ++i)
                      for (const py::tuple& e : tables[i]) {
                        TensorInfo t;
                        t.name = e[0].cast<std::string>();
                        t.dtype = parse_gguf_dtype(e[1].cast<std::string>());
                        t.shape = e[2].cast<std::vector<int64_t>>();
                        t.begin = e[3].cast<uint64_t>();
                        t.end = e[4].cast<uint64_t>();
                        infos[i].push_back(std::move(t));
                      }
                    py::gil_scoped_release nogil;
                    return std::make_unique<Checkpoint>(Checkpoint::from_tables(root, files, std::move(infos), format));
                  },
                  py::arg("root"), py::arg("files"), py::arg("tables"), py::arg("format"),
                  "A checkpoint of files in another format (GGUF) from the tables its reader made: per file, "
                  "(name, dtype, shape, begin, end) with byte offsets from the file's start; dtype F32, F16, BF16, "
                  "Q4_0, Q4_1, Q8_0 or GGML (bytes tandem's C++ side never decodes).")
      .def("names", &Checkpoint::names)
      .def("__contains__", [](const Checkpoint& c, const std::string& n) { return c.contains(n); })
      .def("__len__", [](const Checkpoint& c) { return c.names().size(); })
      .def_property_readonly("num_files", &Checkpoint::num_files)
      .def("info", [](const Checkpoint& c, const std::string& n) {
        const TensorInfo& t = c.info(n);
        return py::make_tuple(std::string(dtype_name(t.dtype)), t.shape, c.file_of(n).path().string());
      }, "(dtype name, shape, file) of a tensor")
      .def("nbytes", [](const Checkpoint& c, const std::string& n) { return c.info(n).nbytes(); },
           "Bytes a tensor holds in its file")
      .def("read_bytes", [](const Checkpoint& c, const std::string& n) {
        TensorView v = c.tensor(n);
        return py::bytes(reinterpret_cast<const char*>(v.data), v.nbytes);
      }, "A copy of a tensor's raw bytes (tests and small tensors; the engine reads in place).");

  // ---- trace ----
  m.def("trace_enable", &trace::enable, py::arg("on") = true);
  m.def("trace_enabled", &trace::enabled);
  m.def("trace_write", [](const std::filesystem::path& p) { trace::write(p); }, py::arg("path"));
  m.def("trace_span_count", &trace::span_count);

  // ---- expert naming ----
  m.def("expert_naming", [](const Checkpoint& c, int layer) {
    const ExpertNaming n = ExpertNaming::detect(c, layer);
    return py::make_tuple(n.gate, n.up, n.down);
  }, "(gate, up, down) key patterns ({L} layer, {E} expert) of the checkpoint's routed experts");
  m.def("expert_tensor_names", &expert_tensor_names, py::arg("checkpoint"), py::arg("name"),
        "The checkpoint tensors holding weight `name`: itself and its FP8 block scales, or its GPTQ tensors.");
  m.def("expert_key", &ExpertNaming::name, py::arg("pattern"), py::arg("layer"), py::arg("expert"));
  m.def("config_size_bounds", [] {
          py::dict d;
          for (const ConfigSizeBound& b : config_size_bounds()) d[b.key] = py::make_tuple(b.min, b.max);
          return d;
        }, "{config.json key: (min, max)}: the sane bounds on a model's sizes (tandem/memory_plan.h)");
  m.def("moe_layer_cpu_bytes", [](int experts, int hidden, int inter, const std::string& format, int group_size,
                                  bool zero_point, int subpools) {
          const PackOptions o = pack_options(format, group_size, zero_point);
          return moe_layer_cpu_bytes(MoeShape{experts, hidden, inter}, o, subpools, experts);
        }, py::arg("experts"), py::arg("hidden"), py::arg("inter"), py::arg("format"), py::arg("group_size") = 128,
        py::arg("zero_point") = false, py::arg("subpools") = 1,
        "Bytes of one MoE layer's packed experts (gate/up and down) in `format`, as the pools pack them.");

  // ---- expert store ----
  m.def("store_dir_name", [](const std::string& format, int group, bool zero_point) {
        return store_dir_name(pack_options(format, group, zero_point));
      }, py::arg("format"), py::arg("group_size") = 128, py::arg("zero_point") = false,
      "The directory name tandem convert gives a store of this format (tandem-int4-g128, ...).");
  m.def("convert_experts", [](const Checkpoint& c, const NamingTuple& n, int experts, int hidden, int inter,
                              std::vector<int> layers, const std::string& format, int group, bool zero_point,
                              const std::filesystem::path& out, const py::object& progress) {
        const StoreSpec spec = store_spec(n, experts, hidden, inter, std::move(layers), format, group, zero_point);
        Progress p = py_progress(progress);
        ConvertReport r;
        {
          py::gil_scoped_release nogil;
          r = convert_experts(c, spec, out, p);
        }
        py::dict d;
        d["layers_written"] = r.layers_written;
        d["layers_kept"] = r.layers_kept;
        d["bytes"] = r.bytes;
        d["up_to_date"] = r.up_to_date;
        d["replaced"] = r.replaced;
        return d;
      }, py::arg("checkpoint"), py::arg("naming"), py::arg("experts"), py::arg("hidden"), py::arg("inter"),
      py::arg("layers"), py::arg("format"), py::arg("group_size") = 128, py::arg("zero_point") = false,
      py::arg("out"), py::arg("progress") = py::none(),
      "Writes the experts of `layers` packed in `format` into the store directory `out` (tandem/expert_store.h): "
      "resumable, the manifest written last.");
  py::class_<ExpertStore>(m, "ExpertStore", "A store of packed experts written by convert_experts.")
      .def(py::init([](const std::filesystem::path& p) {
             py::gil_scoped_release nogil;
             return ExpertStore::open(p);
           }), py::arg("path"))
      .def_property_readonly("path", [](const ExpertStore& s) { return s.dir().string(); })
      .def_property_readonly("bytes", &ExpertStore::bytes)
      .def_property_readonly("spec", [](const ExpertStore& s) {
             const StoreSpec& sp = s.spec();
             py::dict d;
             d["experts"] = sp.shape.experts;
             d["hidden"] = sp.shape.hidden;
             d["inter"] = sp.shape.inter;
             d["layers"] = sp.layers;
             d["format"] = std::string(format_name(sp.format));
             d["group_size"] = sp.format.group;
             d["zero_point"] = !sp.format.symmetric;
             d["naming"] = NamingTuple{sp.naming.gate, sp.naming.up, sp.naming.down};
             return d;
           })
      .def("check", [](const ExpertStore& s, const Checkpoint& c, const NamingTuple& n, int experts, int hidden,
                       int inter, std::vector<int> layers, const std::string& format, int group, bool zero_point,
                       const py::object& progress) {
             const StoreSpec spec = store_spec(n, experts, hidden, inter, std::move(layers), format, group, zero_point);
             Progress p = py_progress(progress);
             py::gil_scoped_release nogil;
             s.check(spec, c, p);
           }, py::arg("checkpoint"), py::arg("naming"), py::arg("experts"), py::arg("hidden"), py::arg("inter"),
           py::arg("layers"), py::arg("format"), py::arg("group_size") = 128, py::arg("zero_point") = false,
           py::arg("progress") = py::none(),
           "Refuses (ValueError naming the field) a store that does not hold these experts of this checkpoint.")
      .def("verify", [](const ExpertStore& s, const py::object& progress) {
             Progress p = py_progress(progress);
             py::gil_scoped_release nogil;
             s.verify(p);
           }, py::arg("progress") = py::none(), "Reads every layer file and compares it with its hash.");

  // ---- engine ----
  // Tensors cross as (data pointer, ...) from tandem/modules.py, which checks dtype,
  // shape, device and contiguity with errors naming the argument.
  py::class_<Engine>(m, "Engine", "The routed experts of a model's MoE layers (tandem/engine.h).")
      .def(py::init([](const std::string& config_path, const std::string& config_text, int experts, int hidden,
                       int inter, std::vector<int> layers, const std::string& stream, int cuda_device,
                       uintptr_t cuda_stream, std::optional<uint64_t> hot_budget, const std::string& activation,
                       float swiglu_alpha, float swiglu_limit, float swiglu_up_offset, bool bias) {
             Config c = config_from(config_path, config_text);
             const MoeShape shape =
                 moe_shape(experts, hidden, inter, activation, swiglu_alpha, swiglu_limit, swiglu_up_offset, bias);
             TANDEM_CHECK(stream == "config" || stream == "host" || stream == "cuda", Errc::invalid_argument,
                          "engine: stream '", stream, "' is not one of: config, host, cuda");
             py::gil_scoped_release nogil;
             std::unique_ptr<Stream> s;
             if (stream == "host") s = make_host_stream(c.isa());
             // torch's handle 0 is the legacy default stream (cudaStreamLegacy is handle 1).
             if (stream == "cuda") s = make_cuda_stream(cuda_device, reinterpret_cast<void*>(cuda_stream ? cuda_stream : 1));
             return std::make_unique<Engine>(c, EngineSpec{shape, std::move(layers)}, std::move(s), hot_budget);
           }),
           py::arg("config_path") = "", py::arg("config_text") = "", py::arg("experts"), py::arg("hidden"),
           py::arg("inter"), py::arg("layers"), py::arg("stream") = "config", py::arg("cuda_device") = 0,
           py::arg("cuda_stream") = 0, py::arg("hot_budget") = py::none(), py::arg("activation") = "silu",
           py::arg("swiglu_alpha") = 1.0f, py::arg("swiglu_limit") = 7.0f, py::arg("swiglu_up_offset") = 0.0f,
           py::arg("bias") = false,
           "stream: 'config' (gpu.device decides), 'host', or 'cuda' (enqueue on the CUDA stream handle cuda_stream "
           "of device cuda_device, e.g. torch's current stream). hot_budget: device bytes gpu.hot_experts count: auto "
           "may fill (default: the device's free memory less a reserve; 0 on the host stream). activation: 'silu' "
           "(silu(gate) * up) or 'clamped_swiglu' (min(g, L) sigmoid(alpha min(g, L)) (clamp(u, -L, L) + offset): "
           "swiglu_alpha, swiglu_limit, swiglu_up_offset; gpt-oss, DeepSeek-V4); bias: the "
           "experts have gate/up/down biases (load_layer's *_bias)")
      .def("load_checkpoint", [](Engine& e, const Checkpoint& c, const NamingTuple& n, const py::object& progress,
                                 const std::vector<int>& layers) {
             load_from_checkpoint(e, c, n, progress, layers);
           }, py::arg("checkpoint"), py::arg("naming"), py::arg("progress") = py::none(),
           py::arg("layers") = std::vector<int>{},
           "layers: the MoE indices to load (empty: all); the others are left for load_layer")
      .def("load_store", [](Engine& e, const ExpertStore& s, const Checkpoint& c, const NamingTuple& n,
                            const py::object& progress) {
             ExpertNaming naming{std::get<0>(n), std::get<1>(n), std::get<2>(n)};
             Progress p = py_progress(progress);
             py::gil_scoped_release nogil;
             e.load_store(s, c, naming, p);
           }, py::arg("store"), py::arg("checkpoint"), py::arg("naming"), py::arg("progress") = py::none(),
           "Every MoE layer's CPU experts from a checked store, the hot experts from the checkpoint.")
      .def("unload_layer", [](Engine& e, int i) {
             py::gil_scoped_release nogil;
             e.unload_layer(i);
           }, py::arg("index"), "Gives back MoE layer `index`'s weights so that load_layer can load it again.")
      .def("layer_loaded", [](const Engine& e, int i) { return e.loaded(i); }, py::arg("index"))
      .def("load_layer", [](Engine& e, int i, const std::vector<uintptr_t>& gate, const std::vector<uintptr_t>& up,
                            const std::vector<uintptr_t>& down, const std::string& dtype, const py::object& progress,
                            const std::vector<uintptr_t>& gate_bias, const std::vector<uintptr_t>& up_bias,
                            const std::vector<uintptr_t>& down_bias) {
             const auto source = pointer_sources(e.spec().shape, gate, up, down, dtype, "engine: load_layer", gate_bias,
                                                 up_bias, down_bias);
             Progress p = py_progress(progress);
             py::gil_scoped_release nogil;
             e.load_layer(i, source, p);
           }, py::arg("index"), py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("dtype"),
           py::arg("progress") = py::none(), py::arg("gate_bias") = std::vector<uintptr_t>{},
           py::arg("up_bias") = std::vector<uintptr_t>{}, py::arg("down_bias") = std::vector<uintptr_t>{},
           "Packs MoE layer `index` from row-major [inter x hidden] gate/up and [hidden x inter] down per expert "
           "(with biases: fp32 [inter] gate/up and [hidden] down per expert).")
      .def_property_readonly("activation", [](const Engine& e) { return describe_experts(e.spec().shape); })
      .def_property_readonly("loaded", [](const Engine& e) { return e.loaded(); })
      .def("forward", [](Engine& e, int i, uintptr_t x, bool x_bf16, int tokens, uintptr_t ids, uintptr_t weights,
                         int top_k, uintptr_t out, bool sync, std::optional<uintptr_t> cuda_stream) {
             LayerIO io;
             io.x = reinterpret_cast<const void*>(x);
             io.x_type = x_bf16 ? XType::bf16 : XType::f32;
             io.tokens = tokens;
             io.ids = reinterpret_cast<const void*>(ids);
             io.ids_i64 = true;
             io.weights = reinterpret_cast<const float*>(weights);
             io.top_k = top_k;
             io.out = reinterpret_cast<float*>(out);
             py::gil_scoped_release nogil;
             if (cuda_stream) e.stream().follow(reinterpret_cast<void*>(*cuda_stream));
             if (sync)
               e.run(i, io);
             else
               e.forward(i, io);
           }, py::arg("index"), py::arg("x"), py::arg("x_bf16"), py::arg("tokens"), py::arg("ids"), py::arg("weights"),
           py::arg("top_k"), py::arg("out"), py::arg("synchronize"), py::arg("cuda_stream") = py::none(),
           "cuda_stream: enqueue this call (and later ones) on that cudaStream_t handle of the engine's device, "
           "0 for the legacy default stream (torch's current stream); the engine's earlier work is ordered before it")
      .def("synchronize", [](Engine& e) {
             py::gil_scoped_release nogil;
             e.synchronize();
           })
      .def_property_readonly("moe_layers", &Engine::moe_layers)
      .def_property_readonly("layers", [](const Engine& e) { return e.spec().layers; })
      .def_property_readonly("experts", [](const Engine& e) { return e.spec().shape.experts; })
      .def_property_readonly("hidden", [](const Engine& e) { return e.spec().shape.hidden; })
      .def_property_readonly("inter", [](const Engine& e) { return e.spec().shape.inter; })
      .def("index_of", &Engine::index_of)
      .def("hot", &Engine::hot)
      .def_property_readonly("dynamic_hot", [](Engine& e) { return e.config().gpu.hot_experts.dynamic; },
                             "whether the hot sets move while running (gpu.hot_experts.dynamic)")
      .def_property_readonly("hot_budget", &Engine::hot_budget,
                             "gpu.hot_experts count: auto: the device bytes the hot count was sized from (0 otherwise)")
      .def_property_readonly("rebalances", &Engine::rebalances,
                             "dynamic hot experts (gpu.hot_experts.dynamic): rebalances that moved experts so far")
      .def_property_readonly("hot_moves", &Engine::hot_moves,
                             "dynamic hot experts: experts promoted to the device so far, all layers")
      .def_property_readonly("stream", [](Engine& e) { return e.stream().name(); })
      .def_property_readonly("is_cuda", [](Engine& e) { return e.stream().is_cuda(); })
      .def_property_readonly("format", [](Engine& e) { return e.config().cpu.format; })
      .def_property_readonly("deferred", [](Engine& e) { return e.config().gpu.deferred_experts; })
      .def_property_readonly("subpools", [](Engine& e) { return e.pool().subpools(); })
      .def_property_readonly("threads", [](Engine& e) { return e.pool().total_threads(); })
      .def_property_readonly("isa", [](Engine& e) { return std::string(isa_name(e.isa())); },
                             "the kernel level every CPU part of this engine runs (config cpu.isa, lowered by TANDEM_ISA)")
      .def_property_readonly("cpu_bytes", &Engine::cpu_bytes)
      .def_property_readonly("device_bytes", &Engine::device_bytes)
      .def("counts", [](Engine& e, int i) {
             const PlacementCounts c = e.hybrid().counts(i);
             py::dict d;
             d["hot"] = c.hot;
             d["cold"] = c.cold;
             d["deferred"] = c.deferred;
             d["tokens"] = c.tokens;
             return d;
           }, "Routed (token, expert) pairs of MoE layer i by where they ran (after synchronize).")
      .def("expert_weights", [](Engine& e, int layer, int expert) {
             TANDEM_CHECK(0 <= layer && layer < e.moe_layers(), Errc::invalid_argument, "expert_weights: layer ", layer,
                          " is not one of the engine's ", e.moe_layers());
             const MoeLayer& l = e.layer(layer);
             TANDEM_CHECK(0 <= expert && expert < l.shape().experts, Errc::invalid_argument, "expert_weights: expert ",
                          expert, " is not one of ", l.shape().experts);
             ExpertWeights w;
             {
               py::gil_scoped_release nogil;
               w = l.dequantized(expert);
             }
             const int H = l.shape().hidden, I = l.shape().inter;
             auto arr = [](const std::vector<float>& v, int r, int c) {
               py::array_t<float> a({r, c});
               std::copy(v.begin(), v.end(), a.mutable_data());
               return a;
             };
             return py::make_tuple(arr(w.gate, I, H), arr(w.up, I, H), arr(w.down, H, I));
           }, py::arg("layer"), py::arg("expert"),
           "(gate [inter x hidden], up, down [hidden x inter]) fp32: expert `expert` of MoE layer `layer` as its "
           "packs compute it (the quantized values for int8 / int4 / mxfp4).")
      .def("decode_attention", [](Engine& e, int batch, int q_heads, int kv_heads, int head_dim, int value_dim, int keys,
                                  float scale, uintptr_t q, int64_t q_b, int64_t q_h, uintptr_t k, int64_t k_b, int64_t k_h,
                                  int64_t k_l, uintptr_t v, int64_t v_b, int64_t v_h, int64_t v_l, uintptr_t mask,
                                  int64_t mask_b, uintptr_t out, int64_t out_b, int64_t out_h, uintptr_t k2, int64_t k2_b,
                                  int64_t k2_h, int64_t k2_l, int k2_dim) {
             DecodeAttention a;
             a.batch = batch, a.q_heads = q_heads, a.kv_heads = kv_heads, a.head_dim = head_dim;
             a.value_dim = value_dim, a.keys = keys, a.scale = scale;
             a.q = reinterpret_cast<const bf16_t*>(q), a.q_b = q_b, a.q_h = q_h;
             a.k = reinterpret_cast<const bf16_t*>(k), a.k_b = k_b, a.k_h = k_h, a.k_l = k_l;
             a.k2 = reinterpret_cast<const bf16_t*>(k2), a.k2_b = k2_b, a.k2_h = k2_h, a.k2_l = k2_l, a.k2_dim = k2_dim;
             a.v = reinterpret_cast<const bf16_t*>(v), a.v_b = v_b, a.v_h = v_h, a.v_l = v_l;
             a.mask = reinterpret_cast<const uint8_t*>(mask), a.mask_b = mask_b;
             a.out = reinterpret_cast<bf16_t*>(out), a.out_b = out_b, a.out_h = out_h;
             py::gil_scoped_release nogil;
             decode_attention(e.pool(), e.isa(), a);
           }, py::arg("batch"), py::arg("q_heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("value_dim"),
           py::arg("keys"), py::arg("scale"), py::arg("q"), py::arg("q_b"), py::arg("q_h"), py::arg("k"), py::arg("k_b"),
           py::arg("k_h"), py::arg("k_l"), py::arg("v"), py::arg("v_b"), py::arg("v_h"), py::arg("v_l"), py::arg("mask"),
           py::arg("mask_b"), py::arg("out"), py::arg("out_b"), py::arg("out_h"), py::arg("k2") = 0,
           py::arg("k2_b") = 0, py::arg("k2_h") = 0, py::arg("k2_l") = 0, py::arg("k2_dim") = 0,
           "One query row per sequence and head against a KV cache, on the engine's pool (tandem/attention.h): bf16 "
           "q [batch, q_heads, head_dim], k / v [batch, kv_heads, keys, dim], optional uint8 mask [batch, keys] "
           "(0: no pointer), out bf16 [batch, q_heads, value_dim]; element strides; optional k2 [batch, kv_heads, "
           "keys, k2_dim]: the keys' last k2_dim values held apart (k then holds head_dim - k2_dim)")
      .def("prefill_attention", [](Engine& e, int batch, int q_heads, int kv_heads, int queries, int keys,
                                   int head_dim, int value_dim, float scale, bool causal, uintptr_t q, int64_t q_b,
                                   int64_t q_h, int64_t q_l, uintptr_t k, int64_t k_b, int64_t k_h, int64_t k_l,
                                   uintptr_t v, int64_t v_b, int64_t v_h, int64_t v_l, uintptr_t mask, int64_t mask_b,
                                   int64_t mask_l, uintptr_t out, int64_t out_b, int64_t out_l, int64_t out_h) {
             PrefillAttention a;
             a.batch = batch, a.q_heads = q_heads, a.kv_heads = kv_heads, a.queries = queries, a.keys = keys;
             a.head_dim = head_dim, a.value_dim = value_dim, a.scale = scale, a.causal = causal;
             a.q = reinterpret_cast<const bf16_t*>(q), a.q_b = q_b, a.q_h = q_h, a.q_l = q_l;
             a.k = reinterpret_cast<const bf16_t*>(k), a.k_b = k_b, a.k_h = k_h, a.k_l = k_l;
             a.v = reinterpret_cast<const bf16_t*>(v), a.v_b = v_b, a.v_h = v_h, a.v_l = v_l;
             a.mask = reinterpret_cast<const uint8_t*>(mask), a.mask_b = mask_b, a.mask_l = mask_l;
             a.out = reinterpret_cast<bf16_t*>(out), a.out_b = out_b, a.out_l = out_l, a.out_h = out_h;
             py::gil_scoped_release nogil;
             prefill_attention(e.pool(), e.isa(), a);
           }, py::arg("batch"), py::arg("q_heads"), py::arg("kv_heads"), py::arg("queries"), py::arg("keys"),
           py::arg("head_dim"), py::arg("value_dim"), py::arg("scale"), py::arg("causal"), py::arg("q"), py::arg("q_b"),
           py::arg("q_h"), py::arg("q_l"), py::arg("k"), py::arg("k_b"), py::arg("k_h"), py::arg("k_l"), py::arg("v"),
           py::arg("v_b"), py::arg("v_h"), py::arg("v_l"), py::arg("mask"), py::arg("mask_b"), py::arg("mask_l"),
           py::arg("out"), py::arg("out_b"), py::arg("out_l"), py::arg("out_h"),
           "Flash attention of `queries` rows per sequence and head against `keys` keys on the engine's pool, its "
           "products on tandem's BF16 kernels (tandem/attention.h): bf16 q [batch, q_heads, queries, head_dim], k / v "
           "[batch, kv_heads, keys, dim], optional uint8 mask [batch, queries, keys] (0: no pointer; nonzero: attend), "
           "causal: query i at position keys - queries + i sees keys up to it; out bf16 [batch, queries, q_heads, "
           "value_dim]; element strides")
      .def("mla_decode", [](Engine& e, DenseLinear& w_uk, DenseLinear& w_uv, int batch, int heads, int nope, int rope,
                            int rank, int v_dim, int keys, float scale, uintptr_t q, int64_t q_b, int64_t q_h,
                            uintptr_t latent, int64_t latent_b, int64_t latent_l, uintptr_t k_rope, int64_t k_rope_b,
                            int64_t k_rope_l, uintptr_t mask, int64_t mask_b, uintptr_t out, int64_t out_b,
                            int64_t out_h) {
             MlaDecode a;
             a.batch = batch, a.heads = heads, a.nope = nope, a.rope = rope, a.rank = rank, a.v_dim = v_dim;
             a.keys = keys, a.scale = scale;
             a.q = reinterpret_cast<const bf16_t*>(q), a.q_b = q_b, a.q_h = q_h;
             a.latent = reinterpret_cast<const bf16_t*>(latent), a.latent_b = latent_b, a.latent_l = latent_l;
             a.k_rope = reinterpret_cast<const bf16_t*>(k_rope), a.k_rope_b = k_rope_b, a.k_rope_l = k_rope_l;
             a.mask = reinterpret_cast<const uint8_t*>(mask), a.mask_b = mask_b;
             a.out = reinterpret_cast<bf16_t*>(out), a.out_b = out_b, a.out_h = out_h;
             py::gil_scoped_release nogil;
             mla_decode(e.pool(), e.isa(), w_uk, w_uv, a);
           }, py::arg("w_uk"), py::arg("w_uv"), py::arg("batch"), py::arg("heads"), py::arg("nope"), py::arg("rope"),
           py::arg("rank"), py::arg("v_dim"), py::arg("keys"), py::arg("scale"), py::arg("q"), py::arg("q_b"),
           py::arg("q_h"), py::arg("latent"), py::arg("latent_b"), py::arg("latent_l"), py::arg("k_rope"),
           py::arg("k_rope_b"), py::arg("k_rope_l"), py::arg("mask"), py::arg("mask_b"), py::arg("out"),
           py::arg("out_b"), py::arg("out_h"),
           "One-token MLA attention from the cached latents, weight-absorbed (tandem/attention.h): bf16 q [batch, "
           "heads, nope + rope], latent [batch, keys, rank], k_rope [batch, keys, rope], optional uint8 mask "
           "[batch, keys], out bf16 [batch, heads, v_dim]; w_uk / w_uv grouped layers (dense_linear groups=heads); "
           "element strides")
      .def("dense_linear", [](Engine& e, uintptr_t w, int n, int k, const std::string& dtype, const std::string& format,
                              int group_size, bool zero_point, const std::string& name, int groups) {
             const PackOptions o = pack_options(format, group_size, zero_point);
             WeightView v{reinterpret_cast<const void*>(w), source_type(dtype), n, k};
             py::gil_scoped_release nogil;
             return std::make_shared<DenseLinear>(e.pool(), kernel_table(e.isa()), v, o, name, groups);
           }, py::arg("weight"), py::arg("n"), py::arg("k"), py::arg("dtype"), py::arg("format"),
           py::arg("group_size") = 128, py::arg("zero_point") = false, py::arg("name") = "dense", py::arg("groups") = 1,
           py::keep_alive<0, 1>(),
           "Packs a row-major [n x k] weight (nn.Linear layout) for forward on this engine's pool (tandem/dense.h); "
           "groups > 1: n / groups rows per group, each applied to its own k inputs of a row (bf16 only).")
      .def("decoder_layer_step",
           [](Engine& e, int hidden, int q_heads, int kv_heads, int head_dim, float scale, uintptr_t input_norm,
              uintptr_t post_norm, float eps, std::shared_ptr<DenseLinear> qkv, std::shared_ptr<DenseLinear> o,
              const std::string& name, uintptr_t q_norm, uintptr_t k_norm, float qk_eps,
              std::shared_ptr<DenseLinear> router, int top_k, bool renorm, bool scores_f32, bool sorted,
              bool logits_f32, float route_scale, int groups, int top_groups, int moe_index,
              std::shared_ptr<DenseLinear> mlp_gate_up, std::shared_ptr<DenseLinear> mlp_down, int mla_rank, int rope,
              int v_dim, uintptr_t kv_norm, float kv_eps, std::shared_ptr<DenseLinear> q_b, uintptr_t q_a_norm,
              float q_a_eps, std::shared_ptr<DenseLinear> w_uk, std::shared_ptr<DenseLinear> w_uv) {
             auto bf = [](uintptr_t p) { return reinterpret_cast<const bf16_t*>(p); };
             DecoderLayerSpec s;
             s.hidden = hidden, s.q_heads = q_heads, s.kv_heads = kv_heads, s.head_dim = head_dim, s.scale = scale;
             s.input_norm = bf(input_norm), s.post_norm = bf(post_norm), s.eps = eps;
             s.q_norm = bf(q_norm), s.k_norm = bf(k_norm), s.qk_eps = qk_eps;
             s.qkv = std::move(qkv), s.o = std::move(o), s.router = std::move(router);
             s.top_k = top_k, s.renorm = renorm, s.scores_f32 = scores_f32, s.moe_index = moe_index;
             s.route.sorted = sorted, s.route.logits_f32 = logits_f32, s.route.scale = route_scale;
             s.route.groups = groups, s.route.top_groups = top_groups;
             s.mlp.gate_up = std::move(mlp_gate_up), s.mlp.down = std::move(mlp_down);
             s.mla_rank = mla_rank, s.rope = rope, s.v_dim = v_dim, s.kv_norm = bf(kv_norm), s.kv_eps = kv_eps;
             s.q_b = std::move(q_b), s.q_a_norm = bf(q_a_norm), s.q_a_eps = q_a_eps;
             s.w_uk = std::move(w_uk), s.w_uv = std::move(w_uv);
             return std::make_shared<DecoderLayerStep>(e, std::move(s), name);
           }, py::arg("hidden"), py::arg("q_heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("scale"),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("eps"), py::arg("qkv"), py::arg("o"), py::arg("name"),
           py::kw_only(), py::arg("q_norm") = 0, py::arg("k_norm") = 0, py::arg("qk_eps") = 0.f,
           py::arg("router") = nullptr, py::arg("top_k") = 0, py::arg("renorm") = true, py::arg("scores_f32") = false,
           py::arg("sorted") = true, py::arg("logits_f32") = false, py::arg("route_scale") = 1.f,
           py::arg("groups") = 1, py::arg("top_groups") = 1, py::arg("moe_index") = -1,
           py::arg("mlp_gate_up") = nullptr, py::arg("mlp_down") = nullptr, py::arg("mla_rank") = 0,
           py::arg("rope") = 0, py::arg("v_dim") = 0, py::arg("kv_norm") = 0, py::arg("kv_eps") = 0.f,
           py::arg("q_b") = nullptr, py::arg("q_a_norm") = 0, py::arg("q_a_eps") = 0.f, py::arg("w_uk") = nullptr,
           py::arg("w_uv") = nullptr, py::keep_alive<0, 1>(),
           "A decoder layer's one-token step on this engine (tandem/decode_layer.h); the norm weights are bf16 "
           "pointers the caller keeps alive (0: none). Routed experts: moe_index >= 0 with the router's settings, "
           "plus mlp_gate_up / mlp_down as shared experts when given; a dense layer: moe_index -1 and the MLP. "
           "MLA: mla_rank > 0 with rope, v_dim, kv_norm, w_uk / w_uv (and q_b with q_a_norm for a low-rank query).")
      .def_property("caller_runs", [](Engine& e) { return e.pool().caller_runs(); },
                    [](Engine& e, bool on) { e.pool().set_caller_runs(on); },
                    "whether a call into the pool on an idle pool runs worker 0's part on the calling thread "
                    "(tandem/pool.h; default True)")
      .def("reset_counts", [](Engine& e) { e.hybrid().reset_counts(); })
      .def("write_statistics", [](Engine& e, const std::filesystem::path& p) { e.hybrid().write_statistics(p); });

  py::class_<DecoderLayerStep, std::shared_ptr<DecoderLayerStep>>(m, "DecoderLayerStep",
      "One token through a decoder layer in two calls (tandem/decode_layer.h).")
      .def("qkv", [](DecoderLayerStep& d, uintptr_t x, uintptr_t cos, uintptr_t sin, uintptr_t q, uintptr_t k,
                     uintptr_t v) {
             py::gil_scoped_release nogil;
             d.qkv(reinterpret_cast<const bf16_t*>(x), reinterpret_cast<const bf16_t*>(cos),
                   reinterpret_cast<const bf16_t*>(sin), reinterpret_cast<bf16_t*>(q), reinterpret_cast<bf16_t*>(k),
                   reinterpret_cast<bf16_t*>(v));
           }, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("q"), py::arg("k"), py::arg("v"),
           "x [hidden], cos / sin [head_dim] -> q [q_heads x head_dim], k / v [kv_heads x head_dim] (bf16 pointers)")
      .def("rest", [](DecoderLayerStep& d, uintptr_t x, uintptr_t q, uintptr_t k, int64_t k_h, int64_t k_l,
                      uintptr_t v, int64_t v_h, int64_t v_l, int keys, uintptr_t y) {
             py::gil_scoped_release nogil;
             d.rest(reinterpret_cast<const bf16_t*>(x), reinterpret_cast<const bf16_t*>(q),
                    reinterpret_cast<const bf16_t*>(k), k_h, k_l, reinterpret_cast<const bf16_t*>(v), v_h, v_l, keys,
                    reinterpret_cast<bf16_t*>(y));
           }, py::arg("x"), py::arg("q"), py::arg("k"), py::arg("k_h"), py::arg("k_l"), py::arg("v"), py::arg("v_h"),
           py::arg("v_l"), py::arg("keys"), py::arg("y"),
           "attention over the cache (its last key this step's), o_proj, residual, norm, router, experts, residual "
           "-> y [hidden] (bf16 pointers, element strides)")
      .def("qkv_mla", [](DecoderLayerStep& d, uintptr_t x, uintptr_t freqs, uintptr_t q, uintptr_t latent,
                         uintptr_t k_rope) {
             py::gil_scoped_release nogil;
             d.qkv_mla(reinterpret_cast<const bf16_t*>(x), reinterpret_cast<const float*>(freqs),
                       reinterpret_cast<bf16_t*>(q), reinterpret_cast<bf16_t*>(latent), reinterpret_cast<bf16_t*>(k_rope));
           }, py::arg("x"), py::arg("freqs"), py::arg("q"), py::arg("latent"), py::arg("k_rope"),
           "MLA: x [hidden], freqs [rope] fp32 (complex, interleaved) -> q [heads x head_dim], latent [rank], "
           "k_rope [rope] (bf16 pointers)")
      .def("rest_mla", [](DecoderLayerStep& d, uintptr_t x, uintptr_t q, uintptr_t latent, int64_t latent_l,
                          uintptr_t k_rope, int64_t k_rope_l, int keys, uintptr_t y) {
             py::gil_scoped_release nogil;
             d.rest_mla(reinterpret_cast<const bf16_t*>(x), reinterpret_cast<const bf16_t*>(q),
                        reinterpret_cast<const bf16_t*>(latent), latent_l, reinterpret_cast<const bf16_t*>(k_rope),
                        k_rope_l, keys, reinterpret_cast<bf16_t*>(y));
           }, py::arg("x"), py::arg("q"), py::arg("latent"), py::arg("latent_l"), py::arg("k_rope"),
           py::arg("k_rope_l"), py::arg("keys"), py::arg("y"),
           "MLA: attention over the cached latents and rope keys (the last this step's), o_proj, residual, norm, "
           "feed-forward, residual -> y [hidden] (bf16 pointers, element strides per key)")
      .def_property_readonly("mla", &DecoderLayerStep::mla)
      .def_property_readonly("name", &DecoderLayerStep::name);

  static_assert(sizeof(LayerCache) == 6 * sizeof(int64_t) && std::is_standard_layout_v<LayerCache>,
                "DecoderStack.run reads each layer's cache as six int64");
  py::class_<DecoderStack, std::shared_ptr<DecoderStack>>(m, "DecoderStack",
      "One token through consecutive decoder layers in one call (tandem/decode_layer.h).")
      .def(py::init<std::vector<std::shared_ptr<DecoderLayerStep>>>(), py::arg("layers"))
      .def("run", [](DecoderStack& d, uintptr_t x, uintptr_t cos, uintptr_t sin, uintptr_t freqs, uintptr_t caches,
                     int pos) {
             py::gil_scoped_release nogil;
             d.run(reinterpret_cast<bf16_t*>(x), reinterpret_cast<const bf16_t*>(cos),
                   reinterpret_cast<const bf16_t*>(sin), reinterpret_cast<const float*>(freqs),
                   reinterpret_cast<const LayerCache*>(caches), pos);
           }, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("freqs"), py::arg("caches"), py::arg("pos"),
           "x [hidden] bf16 in place through every layer; cos / sin [head_dim] bf16 (GQA) or freqs [rope] fp32 "
           "(MLA), 0 where unused; caches: per layer six int64 (k pointer, k per-head and per-position strides, "
           "v pointer, v strides; elements), each layer writing position `pos` and attending over [0, pos]")
      .def("__len__", &DecoderStack::size);

  py::class_<DenseLinear, std::shared_ptr<DenseLinear>>(m, "DenseLinear",
                                                        "A dense layer's weight on tandem's kernels (tandem/dense.h).")
      .def("forward", [](DenseLinear& d, uintptr_t x, bool x_bf16, int m, int ldx, uintptr_t y, int ldy) {
             py::gil_scoped_release nogil;
             d.forward(reinterpret_cast<const void*>(x), x_bf16, m, ldx, reinterpret_cast<float*>(y), ldy);
           }, py::arg("x"), py::arg("x_bf16"), py::arg("m"), py::arg("ldx"), py::arg("y"), py::arg("ldy"),
           "y [m x n] fp32 (row stride ldy) = x [m x k] (bf16 or fp32, row stride ldx) . W^T; waits for the pool.")
      .def("forward_bf16", [](DenseLinear& d, uintptr_t x, bool x_bf16, int m, int ldx, uintptr_t y, int ldy) {
             py::gil_scoped_release nogil;
             d.forward_bf16(reinterpret_cast<const void*>(x), x_bf16, m, ldx, reinterpret_cast<uint16_t*>(y), ldy);
           }, py::arg("x"), py::arg("x_bf16"), py::arg("m"), py::arg("ldx"), py::arg("y"), py::arg("ldy"),
           "forward, y [m x n] rounded to bf16 (as torch's .to(bfloat16)) on the pool's threads.")
      .def("route", [](DenseLinear& d, uintptr_t x, bool x_bf16, int m, int ldx, int top_k, bool renorm, uintptr_t logits,
                       uintptr_t scores, bool scores_f32, uintptr_t index, bool sorted, bool logits_f32, float scale,
                       int groups, int top_groups) {
             DenseLinear::RouteOptions o;
             o.sorted = sorted, o.logits_f32 = logits_f32, o.scale = scale, o.groups = groups, o.top_groups = top_groups;
             py::gil_scoped_release nogil;
             d.route(reinterpret_cast<const void*>(x), x_bf16, m, ldx, top_k, renorm, reinterpret_cast<void*>(logits),
                     reinterpret_cast<void*>(scores), scores_f32, reinterpret_cast<int64_t*>(index), o);
           }, py::arg("x"), py::arg("x_bf16"), py::arg("m"), py::arg("ldx"), py::arg("top_k"), py::arg("renorm"),
           py::arg("logits"), py::arg("scores"), py::arg("scores_f32"), py::arg("index"), py::arg("sorted") = true,
           py::arg("logits_f32") = false, py::arg("scale") = 1.0f, py::arg("groups") = 1, py::arg("top_groups") = 1,
           "A softmax-then-top-k MoE router on this (bf16) weight: logits [m x n] bf16 (fp32 with logits_f32), "
           "scores [m x top_k] (fp32 or bf16), index [m x top_k] int64; optionally unsorted (torch.topk's "
           "sorted=False order), scaled, group-limited (tandem/dense.h).")
      .def("dequantized", [](const DenseLinear& d) {
             std::vector<float> v = d.dequantized();
             py::array_t<float> a({d.n(), d.k()});
             std::copy(v.begin(), v.end(), a.mutable_data());
             return a;
           }, "The packed weight as fp32 [n x k]: what forward multiplies by.")
      .def_property_readonly("n", &DenseLinear::n)
      .def_property_readonly("k", &DenseLinear::k)
      .def_property_readonly("groups", &DenseLinear::groups)
      .def_property_readonly("bytes", &DenseLinear::bytes)
      .def_property_readonly("name", &DenseLinear::name)
      .def_property_readonly("format", [](const DenseLinear& d) { return std::string(format_name(d.format())); });

  // ---- LoRA fine-tuning (tandem/lora.h) ----
  py::class_<Pool, std::shared_ptr<Pool>>(m, "Pool", "CPU worker pools (one per NUMA node) from a config's cpu section.")
      .def(py::init([](const std::string& config_path, const std::string& config_text) {
             Config c = config_from(config_path, config_text);
             return std::make_shared<Pool>(pool_options(c.cpu));
           }), py::arg("config_path") = "", py::arg("config_text") = "")
      .def_property_readonly("subpools", &Pool::subpools)
      .def_property_readonly("threads", &Pool::total_threads);
  py::class_<LoraContext>(m, "LoraContext", "What one training forward saved for its backward.")
      .def_property_readonly("valid", &LoraContext::valid)
      .def_property_readonly("tokens", &LoraContext::tokens)
      .def_property_readonly("bytes", &LoraContext::bytes);
  py::class_<PyLoraLayer>(m, "LoraLayer", "LoRA on the routed experts of one MoE layer (tandem/lora.h).")
      .def(py::init([](std::shared_ptr<Pool> pool, int experts, int hidden, int inter, const std::string& format, int group,
                       int rank, float alpha, bool rslora, const std::string& backward_format, int layer,
                       bool zero_point, const std::string& isa) {
             SftOptions o;
             o.format = pack_options(format, group, zero_point);
             o.backward_format = parse_format(backward_format);
             o.lora = {rank, alpha, rslora};
             struct Owned {  // the layer is destroyed before its pool
               std::shared_ptr<Pool> pool;
               std::unique_ptr<LoraMoe> layer;
             };
             auto own = std::make_shared<Owned>();
             own->layer = std::make_unique<LoraMoe>(*pool, MoeShape{experts, hidden, inter}, o, layer);
             own->layer->use_isa(select_isa(isa, "cpu.isa"));
             own->pool = std::move(pool);
             return PyLoraLayer{std::shared_ptr<LoraMoe>(own, own->layer.get())};
           }), py::arg("pool"), py::arg("experts"), py::arg("hidden"), py::arg("inter"), py::arg("format") = "bf16",
           py::arg("group") = 128, py::arg("rank") = 8, py::arg("alpha") = 16.0f, py::arg("rslora") = false,
           py::arg("backward_format") = "bf16", py::arg("layer") = 0, py::arg("zero_point") = false,
           py::arg("isa") = "auto")
      .def("load", [](PyLoraLayer& l, const std::vector<uintptr_t>& gate, const std::vector<uintptr_t>& up,
                      const std::vector<uintptr_t>& down, const std::string& dtype, const py::object& progress) {
             const auto source = pointer_sources(l.layer->shape(), gate, up, down, dtype, "lora: load");
             Progress p = py_progress(progress);
             py::gil_scoped_release nogil;
             l.layer->load(source, p);
           }, py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("dtype"), py::arg("progress") = py::none())
      .def("load_checkpoint", [](PyLoraLayer& l, const Checkpoint& c, int layer,
                                 const NamingTuple& n, const py::object& progress) {
             ExpertNaming naming{std::get<0>(n), std::get<1>(n), std::get<2>(n)};
             Progress p = py_progress(progress);
             py::gil_scoped_release nogil;
             l.layer->load(c, layer, naming, p);
           }, py::arg("checkpoint"), py::arg("layer"), py::arg("naming"), py::arg("progress") = py::none(),
           "Packs model layer `layer`'s experts from a checkpoint, read in place.")
      .def("set_lora", [](PyLoraLayer& l, int rank, float alpha, bool rslora) { l.layer->set_lora({rank, alpha, rslora}); },
           py::arg("rank"), py::arg("alpha"), py::arg("rslora") = false)
      .def_property_readonly("layer_index", [](PyLoraLayer& l) { return l.layer->layer_index(); })
      .def_property_readonly("rank", [](PyLoraLayer& l) { return l.layer->options().lora.rank; })
      .def_property_readonly("experts", [](PyLoraLayer& l) { return l.layer->shape().experts; })
      .def_property_readonly("hidden", [](PyLoraLayer& l) { return l.layer->shape().hidden; })
      .def_property_readonly("inter", [](PyLoraLayer& l) { return l.layer->shape().inter; })
      .def_property_readonly("threads", [](PyLoraLayer& l) { return l.layer->pool().total_threads(); })
      .def_property_readonly("isa", [](PyLoraLayer& l) { return std::string(isa_name(l.layer->isa())); })
      .def("prepare_backward", [](PyLoraLayer& l, const py::object& progress) {
             Progress p = py_progress(progress);
             py::gil_scoped_release nogil;
             l.layer->prepare_backward(p);
           }, py::arg("progress") = py::none())
      .def("forward", [](PyLoraLayer& l, uintptr_t x, bool x_bf16, int tokens, uintptr_t ids, uintptr_t weights, int top_k,
                         uintptr_t out, const std::vector<MatrixSpec>& lora, bool train) {
             MoeInput in;
             if (x_bf16) in.x = reinterpret_cast<const bf16_t*>(x);
             else in.x_f32 = reinterpret_cast<const float*>(x);
             in.tokens = tokens;
             in.ids_i64 = reinterpret_cast<const int64_t*>(ids);
             in.top_k = top_k;
             in.weights = reinterpret_cast<const float*>(weights);
             in.out = reinterpret_cast<float*>(out);
             const LoraWeights w = lora_weights(lora, "forward weights");
             py::gil_scoped_release nogil;
             return l.layer->forward(in, w, train);
           }, py::arg("x"), py::arg("x_bf16"), py::arg("tokens"), py::arg("ids"), py::arg("weights"), py::arg("top_k"),
           py::arg("out"), py::arg("lora"), py::arg("train") = true,
           "out[tokens x hidden] fp32 = the layer; ids int64, weights fp32 [tokens x top_k]")
      .def("backward", [](PyLoraLayer& l, LoraContext& ctx, const std::vector<MatrixSpec>& lora, uintptr_t d_out,
                          bool d_out_bf16, uintptr_t d_x, bool accumulate_x, uintptr_t d_weights,
                          const std::vector<MatrixSpec>& grads) {
             SftGrad g;
             if (d_out_bf16) g.d_out_bf16 = reinterpret_cast<const bf16_t*>(d_out);
             else g.d_out = reinterpret_cast<const float*>(d_out);
             g.d_x = reinterpret_cast<float*>(d_x);
             g.accumulate_x = accumulate_x;
             g.d_weights = reinterpret_cast<float*>(d_weights);
             g.grads = lora_weights(grads, "gradients");
             const LoraWeights w = lora_weights(lora, "backward weights");
             py::gil_scoped_release nogil;
             l.layer->backward(ctx, w, g);
           }, py::arg("ctx"), py::arg("lora"), py::arg("d_out"), py::arg("d_out_bf16"), py::arg("d_x"),
           py::arg("accumulate_x"), py::arg("d_weights"), py::arg("grads"))
      .def_property_readonly("packed_bytes", [](PyLoraLayer& l) { return l.layer->packed_bytes(); })
      .def_property_readonly("backward_bytes", [](PyLoraLayer& l) { return l.layer->backward_bytes(); })
      .def_property_readonly("lora_shapes", [](PyLoraLayer& l) { return l.layer->lora_shapes(); })
      .def_property_readonly("activation", [](PyLoraLayer& l) { return describe_experts(l.layer->shape()); })
      .def_property_readonly("scaling", [](PyLoraLayer& l) { return l.layer->options().lora.scaling(); });

  py::class_<PyLoraEngine, std::shared_ptr<PyLoraEngine>>(
      m, "LoraEngine",
      "The training side of a model's MoE layers (tandem/lora_engine.h): the CPU pool from the config and one "
      "LoraLayer per MoE layer on it, in the config's cpu.format at cpu.isa.")
      .def(py::init([](const std::string& config_path, const std::string& config_text, int experts, int hidden,
                       int inter, std::vector<int> layers, const std::string& backward_format, int rank, float alpha,
                       bool rslora, const std::string& activation, float swiglu_alpha, float swiglu_limit,
                       float swiglu_up_offset, bool bias) {
             Config c = config_from(config_path, config_text);
             const MoeShape shape =
                 moe_shape(experts, hidden, inter, activation, swiglu_alpha, swiglu_limit, swiglu_up_offset, bias);
             LoraEngineOptions o;
             o.backward_format = parse_format(backward_format);
             o.lora = {rank, alpha, rslora};
             auto r = std::make_shared<PyLoraEngine>();
             {
               py::gil_scoped_release nogil;
               r->engine = std::make_shared<LoraEngine>(c, EngineSpec{shape, std::move(layers)}, o);
             }
             for (int i = 0; i < r->engine->moe_layers(); ++i)
               r->layers.append(py::cast(PyLoraLayer{std::shared_ptr<LoraMoe>(r->engine, &r->engine->layer(i))}));
             return r;
           }),
           py::arg("config_path") = "", py::arg("config_text") = "", py::arg("experts"), py::arg("hidden"),
           py::arg("inter"), py::arg("layers"), py::arg("backward_format") = "bf16", py::arg("rank") = 8,
           py::arg("alpha") = 16.0f, py::arg("rslora") = false, py::arg("activation") = "silu",
           py::arg("swiglu_alpha") = 1.0f, py::arg("swiglu_limit") = 7.0f, py::arg("swiglu_up_offset") = 0.0f,
           py::arg("bias") = false,
           "layers: the model layer of each MoE layer (distinct, ascending); rank / alpha / rslora: every layer's "
           "initial LoRA config (LoraLayer.set_lora changes one layer's); activation / swiglu_* / bias: the experts' "
           "math (as Engine's; the biases are frozen like the weights)")
      .def("load_checkpoint", [](PyLoraEngine& e, const Checkpoint& c, const NamingTuple& n, const py::object& progress) {
             load_from_checkpoint(*e.engine, c, n, progress);
           }, py::arg("checkpoint"), py::arg("naming"), py::arg("progress") = py::none(),
           "Packs every MoE layer from a checkpoint, read in place, giving the source pages back after each layer; "
           "errors name the tensor before any layer is half loaded. progress(done, total) counts experts.")
      .def("load_layer", [](PyLoraEngine& e, int i, const std::vector<uintptr_t>& gate, const std::vector<uintptr_t>& up,
                            const std::vector<uintptr_t>& down, const std::string& dtype, const py::object& progress,
                            const std::vector<uintptr_t>& gate_bias, const std::vector<uintptr_t>& up_bias,
                            const std::vector<uintptr_t>& down_bias) {
             const auto source = pointer_sources(e.engine->spec().shape, gate, up, down, dtype, "lora engine: load_layer",
                                                 gate_bias, up_bias, down_bias);
             Progress p = py_progress(progress);
             py::gil_scoped_release nogil;
             e.engine->load_layer(i, source, p);
           }, py::arg("index"), py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("dtype"),
           py::arg("progress") = py::none(), py::arg("gate_bias") = std::vector<uintptr_t>{},
           py::arg("up_bias") = std::vector<uintptr_t>{}, py::arg("down_bias") = std::vector<uintptr_t>{},
           "Packs MoE layer `index` from row-major [inter x hidden] gate/up and [hidden x inter] down per expert "
           "(with biases: fp32 [inter] gate/up and [hidden] down per expert).")
      .def("prepare_backward", [](PyLoraEngine& e, const py::object& progress) {
             Progress p = py_progress(progress);
             py::gil_scoped_release nogil;
             e.engine->prepare_backward(p);
           }, py::arg("progress") = py::none(),
           "Builds every layer's backward packs now (otherwise each layer's first backward does).")
      .def_property_readonly("layers", [](PyLoraEngine& e) { return e.layers; },
                             "the LoraLayer of each MoE layer (index i, not the model layer)")
      .def_property_readonly("model_layers", [](PyLoraEngine& e) { return e.engine->spec().layers; })
      .def_property_readonly("moe_layers", [](PyLoraEngine& e) { return e.engine->moe_layers(); })
      .def("index_of", [](PyLoraEngine& e, int model_layer) { return e.engine->index_of(model_layer); })
      .def_property_readonly("loaded", [](PyLoraEngine& e) { return e.engine->loaded(); })
      .def_property_readonly("experts", [](PyLoraEngine& e) { return e.engine->spec().shape.experts; })
      .def_property_readonly("hidden", [](PyLoraEngine& e) { return e.engine->spec().shape.hidden; })
      .def_property_readonly("inter", [](PyLoraEngine& e) { return e.engine->spec().shape.inter; })
      .def_property_readonly("format", [](PyLoraEngine& e) { return e.engine->config().cpu.format; })
      .def_property_readonly("backward_format",
                             [](PyLoraEngine& e) { return std::string(format_name(e.engine->options().backward_format)); })
      .def_property_readonly("pool", [](PyLoraEngine& e) { return std::shared_ptr<Pool>(e.engine, &e.engine->pool()); })
      .def_property_readonly("subpools", [](PyLoraEngine& e) { return e.engine->pool().subpools(); })
      .def_property_readonly("threads", [](PyLoraEngine& e) { return e.engine->pool().total_threads(); })
      .def_property_readonly("isa", [](PyLoraEngine& e) { return std::string(isa_name(e.engine->isa())); },
                             "the kernel level every layer runs (config cpu.isa, lowered by TANDEM_ISA)")
      .def_property_readonly("is_cuda", [](PyLoraEngine&) { return false; },
                             "always False: training runs every routed expert on the CPU pools")
      .def_property_readonly("packed_bytes", [](PyLoraEngine& e) { return e.engine->packed_bytes(); })
      .def_property_readonly("backward_bytes", [](PyLoraEngine& e) { return e.engine->backward_bytes(); });
}
