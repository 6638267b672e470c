// tandem._C: the C++ runtime as seen from Python. Thin: validation and logic live
// in C++; this file converts types, releases the GIL around long work, and maps
// tandem::Error to Python exceptions with the same message:
//   invalid_argument, bad_format, unsupported -> ValueError
//   io -> OSError;  internal -> RuntimeError
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include "tandem/config.h"
#include "tandem/cpu_features.h"
#include "tandem/doctor.h"
#include "tandem/error.h"
#include "tandem/safetensors.h"

namespace py = pybind11;
using namespace tandem;

PYBIND11_MODULE(_C, m) {
  m.doc() = "tandem C++ runtime";
  m.attr("__version__") = version();

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      switch (e.code()) {
        case Errc::invalid_argument:
        case Errc::bad_format:
        case Errc::unsupported: PyErr_SetString(PyExc_ValueError, e.what()); return;
        case Errc::io: PyErr_SetString(PyExc_OSError, e.what()); return;
        case Errc::internal: PyErr_SetString(PyExc_RuntimeError, e.what()); return;
      }
      PyErr_SetString(PyExc_RuntimeError, e.what());
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

  // ---- config ----
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
      .def("names", &Checkpoint::names)
      .def("__contains__", [](const Checkpoint& c, const std::string& n) { return c.contains(n); })
      .def("__len__", [](const Checkpoint& c) { return c.names().size(); })
      .def_property_readonly("num_files", &Checkpoint::num_files)
      .def("info", [](const Checkpoint& c, const std::string& n) {
        const TensorInfo& t = c.info(n);
        return py::make_tuple(std::string(dtype_name(t.dtype)), t.shape, c.file_of(n).path().string());
      }, "(dtype name, shape, file) of a tensor")
      .def("read_bytes", [](const Checkpoint& c, const std::string& n) {
        TensorView v = c.tensor(n);
        return py::bytes(reinterpret_cast<const char*>(v.data), v.nbytes);
      }, "A copy of a tensor's raw bytes (tests and small tensors; the engine reads in place).");
}
