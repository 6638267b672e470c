// Prints this machine's ceilings: read bandwidth of a cold buffer and the peak
// rates of the dot-product instructions the expert kernels use, plus oneDNN's
// large bf16 matmul as a peer, so the ceilings themselves can be sanity-checked.
//
//   build/bench/bench_ceilings [--bytes GiB] [--threads N] [--reps R]
#include <dnnl.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ceilings.h"
#include "tandem/cpu_features.h"

using namespace tandem::bench;

namespace {

// oneDNN bf16 x bf16 -> f32 matmul, M=N=K=n; returns GFLOP/s of one timed run.
struct DnnlMatmul {
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  dnnl::memory a, b, c;
  dnnl::matmul mm;
  int n;
  explicit DnnlMatmul(int n_) : n(n_) {
    using dt = dnnl::memory::data_type;
    using tag = dnnl::memory::format_tag;
    dnnl::memory::desc ad({n, n}, dt::bf16, tag::ab), bd({n, n}, dt::bf16, tag::ab), cd({n, n}, dt::f32, tag::ab);
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(ad, bd, cd), eng);  // oneDNN 2.x API
    mm = dnnl::matmul(pd);
    a = dnnl::memory(pd.src_desc(), eng);
    b = dnnl::memory(pd.weights_desc(), eng);
    c = dnnl::memory(pd.dst_desc(), eng);
    std::memset(a.get_data_handle(), 0x3f, pd.src_desc().get_size());
    std::memset(b.get_data_handle(), 0x3f, pd.weights_desc().get_size());
  }
  double run() {
    auto t0 = std::chrono::steady_clock::now();
    mm.execute(strm, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    strm.wait();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return 2.0 * n * n * n / s / 1e9;
  }
};

}  // namespace

int main(int argc, char** argv) {
  double gib = 1.0;
  int threads = default_threads(), reps = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--bytes")) gib = std::atof(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    else { std::fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
  }
  std::printf("machine: %s\nthreads: %d, buffer %.2f GiB, %d repetitions (medians; min..max)\n",
              machine_line().c_str(), threads, gib, reps);
  ReadBandwidth bw(static_cast<size_t>(gib * (1ull << 30)), threads);
  DnnlMatmul peer(1024);
  peer.run();  // warm-up: primitive creation, page faults
  std::vector<double> r_bw, r_fma, r_fma_ymm, r_bf16, r_vnni, r_madd, r_madd_ymm, r_amx_bf16, r_amx_data, r_amx_l1, r_amx_l2, r_amx_stream, r_amx_stream_bw, r_amx_stream1, r_amx_stream1_bw, r_amx_int8, r_dnnl;
  const std::vector<int> cpus = core_cpus(threads);
  std::vector<std::vector<double>> r_amx_core(cpus.size());
  for (int r = 0; r < reps; ++r) {  // interleaved, so drift hits every figure alike
    r_bw.push_back(bw.measure(2));
    r_fma.push_back(peak_fma_f32(threads));
    r_fma_ymm.push_back(peak_fma_f32_ymm(threads));
    r_bf16.push_back(peak_dpbf16(threads));
    r_vnni.push_back(peak_dpbusd(threads));
    r_madd.push_back(peak_maddubs(threads));
    r_madd_ymm.push_back(peak_maddubs_ymm(threads));
    r_amx_bf16.push_back(peak_tdpbf16ps(threads));
    r_amx_data.push_back(peak_tdpbf16ps_data(threads));
    r_amx_l1.push_back(peak_tdpbf16ps_loaded(threads, 16 << 10));
    r_amx_l2.push_back(peak_tdpbf16ps_loaded(threads, 256 << 10));
    double stream_gbps = 0;
    r_amx_stream1.push_back(peak_tdpbf16ps_streaming(threads, false, bw, 8, &stream_gbps));
    r_amx_stream1_bw.push_back(stream_gbps);
    r_amx_stream.push_back(peak_tdpbf16ps_streaming(threads, true, bw, 8, &stream_gbps));
    r_amx_stream_bw.push_back(stream_gbps);
    for (size_t c = 0; c < cpus.size(); ++c) r_amx_core[c].push_back(peak_tdpbf16ps_loaded_on(cpus[c], 16 << 10));
    r_amx_int8.push_back(peak_tdpbsud(threads));
    r_dnnl.push_back(peer.run());
  }
  auto row = [](const char* name, const char* unit, std::vector<double> v) {
    auto [lo, hi] = std::minmax_element(v.begin(), v.end());
    if (*hi == 0) { std::printf("%-36s %10s\n", name, "n/a (no such instruction)"); return; }
    std::printf("%-36s %10.1f %-8s (%.1f..%.1f)\n", name, median(v), unit, *lo, *hi);
  };
  row("read bandwidth", "GB/s", r_bw);
  row("peak vfmadd231ps zmm (fp32)", "GFLOP/s", r_fma);
  row("peak vfmadd231ps ymm (fp32)", "GFLOP/s", r_fma_ymm);
  row("peak vdpbf16ps zmm (bf16)", "GFLOP/s", r_bf16);
  row("peak vpdpbusd zmm (int8)", "GOP/s", r_vnni);
  row("peak vpmaddubsw+vpmaddwd zmm (int8)", "GOP/s", r_madd);
  row("peak vpmaddubsw+vpmaddwd ymm (int8)", "GOP/s", r_madd_ymm);
  row("peak AMX tdpbf16ps (bf16)", "GFLOP/s", r_amx_bf16);
  row("AMX tdpbf16ps, random operands", "GFLOP/s", r_amx_data);
  row("AMX tdpbf16ps, tiles from 16 KB (L1)", "GFLOP/s", r_amx_l1);
  row("AMX tdpbf16ps, tiles from 256 KB (L2)", "GFLOP/s", r_amx_l2);
  // A prefill kernel's ceilings: every weight byte read from memory once (8 lines per
  // step: bf16 weights at 128 token rows per expert) while the tiles work from L1 (an
  // idealization), or A from L1 and B from L2 (what the AMX kernels do).
  row("AMX tdpbf16ps, L1 + 8 lines/step of DRAM", "GFLOP/s", r_amx_stream1);
  row("  ... its weight stream", "GB/s", r_amx_stream1_bw);
  row("AMX tdpbf16ps, B from L2 + 8 lines/step", "GFLOP/s", r_amx_stream);
  row("  ... its weight stream", "GB/s", r_amx_stream_bw);
  for (size_t c = 0; c < cpus.size(); ++c) {
    const std::string name = "AMX tiles from L1, 1 thread on cpu " + std::to_string(cpus[c]);
    row(name.c_str(), "GFLOP/s", r_amx_core[c]);
  }
  row("peak AMX tdpbsud (int8)", "GOP/s", r_amx_int8);
  row("peer: oneDNN bf16 matmul 1024^3", "GFLOP/s", r_dnnl);
  // oneDNN picks AMX where the CPU has it: compare it with the best bf16 instruction.
  const double best_bf16 = std::max(median(r_bf16), median(r_amx_bf16));
  if (best_bf16 > 0)
    std::printf("oneDNN bf16 matmul / %s peak: %.0f%%\n", median(r_amx_bf16) > 0 ? "tdpbf16ps" : "vdpbf16ps",
                100.0 * median(r_dnnl) / best_bf16);
  return 0;
}
