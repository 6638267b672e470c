// Read bandwidth and the portable parts of the ceilings; the wide loops are in
// ceilings_avx512.cpp (compiled with AVX-512 flags, called only after the check).
#include "ceilings.h"

#include <cstdlib>
#include <sstream>

#include <omp.h>
#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>

#include "tandem/cpu_features.h"
#include "tandem/error.h"
#include "tandem/topology.h"

namespace tandem::bench {

// In ceilings_avx512.cpp.
uint64_t read_slice_avx512(const void* p, size_t bytes);
double fma_f32_loop(long iters);
double dpbf16_loop(long iters);
double dpbusd_loop(long iters);
double maddubs_zmm_loop(long iters);
// In ceilings_avx2.cpp.
double fma_f32_ymm_loop(long iters);
double maddubs_ymm_loop(long iters);
double dpbusd_ymm_loop(long iters);

namespace {

uint64_t read_slice_scalar(const void* p, size_t bytes) {
  const uint64_t* q = static_cast<const uint64_t*>(p);
  uint64_t a = 0, b = 0, c = 0, d = 0;
  for (size_t i = 0; i + 4 <= bytes / 8; i += 4) a ^= q[i], b ^= q[i + 1], c ^= q[i + 2], d ^= q[i + 3];
  return a ^ b ^ c ^ d;
}

using Clock = std::chrono::steady_clock;

// Runs f(iters) on every thread at once; returns total operations per second / 1e9.
template <typename F>
double peak(int threads, double ops_per_iter, F f) {
  long iters = 1 << 16;
  // Grow until one run takes >= 50 ms, so timer and start-up noise are small.
  for (;;) {
    auto t0 = Clock::now();
#pragma omp parallel num_threads(threads)
    f(iters);
    double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (s >= 0.05) return ops_per_iter * static_cast<double>(iters) * threads / s / 1e9;
    iters *= s > 0.005 ? static_cast<long>(0.06 / s) + 1 : 16;
  }
}

}  // namespace

ReadBandwidth::ReadBandwidth(size_t bytes, int threads) : bytes_(bytes & ~size_t(4095)), threads_(threads) {
  buf_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TANDEM_CHECK(buf_ != MAP_FAILED, Errc::io, "cannot allocate ", bytes_, " bytes for the bandwidth buffer");
  madvise(buf_, bytes_, MADV_HUGEPAGE);
  // First touch by the threads that will read, so pages land on their node.
  const size_t slice = bytes_ / threads_;
#pragma omp parallel num_threads(threads_)
  {
    const int t = omp_get_thread_num();
    auto* p = static_cast<uint8_t*>(buf_) + t * slice;
    for (size_t i = 0; i < slice; i += 64) p[i] = static_cast<uint8_t>(i * 131 + t);
  }
}

ReadBandwidth::~ReadBandwidth() { munmap(buf_, bytes_); }

double ReadBandwidth::measure(int passes) {
  const bool wide = cpu_features().avx512f;
  const size_t slice = (bytes_ / threads_) & ~size_t(255);
  volatile uint64_t sink = 0;
  auto t0 = Clock::now();
  for (int p = 0; p < passes; ++p) {
#pragma omp parallel num_threads(threads_)
    {
      const auto* s = static_cast<const uint8_t*>(buf_) + omp_get_thread_num() * slice;
      sink = sink ^ (wide ? read_slice_avx512(s, slice) : read_slice_scalar(s, slice));
    }
  }
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  return static_cast<double>(slice) * threads_ * passes / secs / 1e9;
}

double peak_fma_f32(int threads) {
  if (!cpu_features().avx512f) return 0;
  return peak(threads, 32.0 * 16, [](long n) { fma_f32_loop(n); });
}

double peak_dpbf16(int threads) {
  if (!cpu_features().avx512_bf16) return 0;
  return peak(threads, 64.0 * 16, [](long n) { dpbf16_loop(n); });
}

double peak_dpbusd(int threads) {
  if (!cpu_features().avx512_vnni) return 0;
  return peak(threads, 128.0 * 16, [](long n) { dpbusd_loop(n); });
}

double peak_fma_f32_ymm(int threads) {
  const CpuFeatures& f = cpu_features();
  if (!(f.avx2 && f.fma && f.os_avx)) return 0;
  return peak(threads, 16.0 * 10, [](long n) { fma_f32_ymm_loop(n); });
}

double peak_maddubs(int threads) {
  if (!cpu_features().avx512bw || !cpu_features().os_avx512) return 0;
  return peak(threads, 128.0 * 8, [](long n) { maddubs_zmm_loop(n); });
}

double peak_maddubs_ymm(int threads) {
  if (!cpu_features().avx2 || !cpu_features().os_avx) return 0;
  return peak(threads, 64.0 * 8, [](long n) { maddubs_ymm_loop(n); });
}

double peak_dpbusd_ymm(int threads) {
  if (!cpu_features().avx_vnni) return 0;
  return peak(threads, 64.0 * 10, [](long n) { dpbusd_ymm_loop(n); });
}

void tdpbf16ps_loop(long iters);
void tdpbsud_loop(long iters);

double peak_tdpbf16ps(int threads) {
  if (!cpu_features().amx_bf16) return 0;
  return peak(threads, 4.0 * 16 * 16 * 32 * 2, [](long n) { tdpbf16ps_loop(n); });
}

void tdpbf16ps_data_loop(long iters);

double peak_tdpbf16ps_data(int threads) {
  if (!cpu_features().amx_bf16) return 0;
  return peak(threads, 4.0 * 16 * 16 * 32 * 2, [](long n) { tdpbf16ps_data_loop(n); });
}

double peak_tdpbf16ps_loaded(int threads, size_t bytes) {
  if (!cpu_features().amx_bf16) return 0;
  return peak(threads, 4.0 * 16 * 16 * 32 * 2, [bytes](long n) { tdpbf16ps_loaded_loop(n, bytes); });
}

double peak_tdpbf16ps_streaming(int threads, bool b_from_l2, const ReadBandwidth& stream, int lines, double* gbps) {
  *gbps = 0;
  if (!cpu_features().amx_bf16) return 0;
  const size_t slice = (stream.bytes() / threads) & ~size_t(4095);
  const double flop_per_step = 4.0 * 16 * 16 * 32 * 2;
  const double gflops = peak(threads, flop_per_step, [&](long n) {
    tdpbf16ps_stream_loop(n, b_from_l2, stream.data() + omp_get_thread_num() * slice, slice, lines);
  });
  *gbps = gflops / flop_per_step * lines * 64;
  return gflops;
}

std::vector<int> core_cpus(int limit) {
  std::vector<int> cpus;
  for (const NumaNodeInfo& node : topology().nodes)
    for (const CoreInfo& core : node.cores)
      if (static_cast<int>(cpus.size()) < limit && !core.pus.empty()) cpus.push_back(core.pus.front());
  return cpus;
}

double peak_tdpbf16ps_loaded_on(int cpu, size_t bytes) {
  if (!cpu_features().amx_bf16) return 0;
  cpu_set_t old, one;
  if (sched_getaffinity(0, sizeof(old), &old) != 0) return 0;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  if (sched_setaffinity(0, sizeof(one), &one) != 0) return 0;
  const double r = peak(1, 4.0 * 16 * 16 * 32 * 2, [bytes](long n) { tdpbf16ps_loaded_loop(n, bytes); });
  sched_setaffinity(0, sizeof(old), &old);
  return r;
}

double peak_tdpbsud(int threads) {
  if (!cpu_features().amx_int8) return 0;
  return peak(threads, 4.0 * 16 * 16 * 64 * 2, [](long n) { tdpbsud_loop(n); });
}

double measure_peak(PeakInsn insn, int threads) {
  switch (insn) {
    case PeakInsn::none: return 0;
    case PeakInsn::fma_f32_ymm: return peak_fma_f32_ymm(threads);
    case PeakInsn::fma_f32_zmm: return peak_fma_f32(threads);
    case PeakInsn::dpbf16_zmm: return peak_dpbf16(threads);
    case PeakInsn::maddubs_ymm: return peak_maddubs_ymm(threads);
    case PeakInsn::maddubs_zmm: return peak_maddubs(threads);
    case PeakInsn::dpbusd_zmm: return peak_dpbusd(threads);
    case PeakInsn::dpbusd_ymm: return peak_dpbusd_ymm(threads);
    case PeakInsn::amx_bf16: return peak_tdpbf16ps(threads);
    case PeakInsn::amx_int8: return peak_tdpbsud(threads);
  }
  return 0;
}

double median(std::vector<double> v) {
  TANDEM_CHECK(!v.empty(), Errc::invalid_argument, "median of nothing");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int default_threads() { return std::max(1, topology().cores); }

std::string machine_line() {
  return str_cat(cpu_features().brand, ", ", topology().cores, " cores, ", topology().nodes.size(),
                 " NUMA node(s), hardware kernel level ", isa_name(hardware_isa()), ", in effect ",
                 isa_name(effective_isa()));
}

std::vector<int> parse_int_list(const char* s) {
  std::vector<int> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) v.push_back(std::atoi(x.c_str()));
  return v;
}

}  // namespace tandem::bench
