// bench/ceilings.h: the machine's measured ceilings, which every benchmark prints
// beside its own figures (a kernel's GB/s means little without the machine's GB/s).
//
// Each function runs one short measurement and returns its rate, so a benchmark can
// interleave ceiling and kernel runs (A B A B) on a noisy shared machine and report
// medians of the pairs.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "peak.h"

namespace tandem::bench {

// Sustained read bandwidth in GB/s (1e9 bytes/s): `threads` threads stream their
// slices of a buffer of `bytes` (use several times the last-level cache) with
// 512-bit loads (256-bit without AVX-512), `passes` times.
class ReadBandwidth {
 public:
  ReadBandwidth(size_t bytes, int threads);
  ~ReadBandwidth();
  double measure(int passes = 3);
  size_t bytes() const { return bytes_; }
  const char* data() const { return static_cast<const char*>(buf_); }

 private:
  size_t bytes_;
  int threads_;
  void* buf_;
};

// Peak instruction throughput on all `threads`, with enough independent
// accumulators that latency does not bound it. Returns GFLOP/s (GOP/s for int8),
// counting a multiply-add as 2 operations, or 0 when the CPU lacks the instruction.
double peak_fma_f32(int threads);     // vfmadd231ps zmm: 32 FLOP/instruction
double peak_fma_f32_ymm(int threads); // vfmadd231ps ymm: 16 FLOP/instruction
double peak_dpbf16(int threads);      // vdpbf16ps zmm: 64 FLOP/instruction
double peak_dpbusd(int threads);      // vpdpbusd zmm: 128 OP/instruction
double peak_maddubs(int threads);     // vpmaddubsw + vpmaddwd + vpaddd zmm: 128 OP/sequence
double peak_maddubs_ymm(int threads); // the same on ymm: 64 OP/sequence
double peak_dpbusd_ymm(int threads);  // {vex} vpdpbusd ymm (AVX-VNNI): 64 OP/instruction
double peak_tdpbf16ps(int threads);   // AMX tdpbf16ps, 16x16x32: 16384 FLOP/instruction
double peak_tdpbf16ps_data(int threads);  // the same, random bf16 operands instead of zeros
double peak_tdpbf16ps_loaded(int threads, size_t bytes);  // the same 2 x 2 step, its 4 tiles loaded
                                                          // from a footprint of `bytes` per thread
double peak_tdpbsud(int threads);     // AMX tdpbsud, 16x16x64: 32768 OP/instruction
// The 2 x 2 step while each thread also prefetches `lines` cache lines per step of its
// slice of `stream` into L2: a prefill kernel's ceiling when its weights come from memory
// once (8 lines per step is what bf16 weights need at 128 token rows per expert, and int8
// ones at 256). b_from_l2 false: all tiles from L1 (an idealization); true: A from L1, B
// from L2 at the packed weights' row stride (the AMX kernels' case). Returns GFLOP/s;
// *gbps gets the stream's GB/s at that rate.
double peak_tdpbf16ps_streaming(int threads, bool b_from_l2, const ReadBandwidth& stream, int lines, double* gbps);
// peak_tdpbf16ps_loaded on one thread pinned to `cpu`: a per-core figure, for hosts whose
// cores differ (a virtual machine's cores may share their tile unit or caches with other
// guests, and then run their tile loads several times slower than their neighbour).
// Returns 0 when the thread cannot be pinned there.
double peak_tdpbf16ps_loaded_on(int cpu, size_t bytes);
// One logical CPU per physical core this process may run on (topology(): hardware
// threads of one core share its tile unit), at most `limit`.
std::vector<int> core_cpus(int limit);

// The AMX loops behind the figures above, on the calling thread, for benchmarks that time
// short bursts themselves (bench_amx_gated): `iters` 2 x 2 steps (65536 FLOP each) with the
// tiles from a footprint of `bytes`; and the same while streaming `lines` lines per step
// of [stream, stream + stream_bytes) (b_from_l2 as in peak_tdpbf16ps_streaming).
void tdpbf16ps_loaded_loop(long iters, size_t bytes);
void tdpbf16ps_stream_loop(long iters, bool b_from_l2, const char* stream, size_t stream_bytes, int lines);
// The peak of `insn` (bench/peak.h: the one a kernel variant runs); 0 for
// PeakInsn::none or an instruction this CPU lacks.
double measure_peak(PeakInsn insn, int threads);

double median(std::vector<double> v);
int default_threads();  // physical cores usable by this process
std::string machine_line();
std::vector<int> parse_int_list(const char* s);  // "1,8,32" -> {1, 8, 32}  // "AMD EPYC ..., 2 cores, avx512_bf16"

}  // namespace tandem::bench
