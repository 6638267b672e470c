// Shared by the benchmarks: timing, and the "bare kernels" expert step that
// bench_kernels measures and bench_moe compares the engine against.
#pragma once

#include <chrono>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/kernels.h"

namespace tandem::bench {

using Clock = std::chrono::steady_clock;

// Routed-expert shapes of real models (random weights stand in for them), and "tiny"
// for smoke runs.
struct ModelShape {
  const char* name;
  int experts, hidden, inter, top_k;
};
inline constexpr ModelShape kModelShapes[] = {{"qwen3-30b", 128, 2048, 768, 8},
                                              {"qwen3-235b", 128, 4096, 1536, 8},
                                              {"deepseek-v3", 256, 7168, 2048, 8},
                                              {"gpt-oss-120b", 128, 2880, 2880, 4},
                                              {"tiny", 16, 256, 128, 4}};
// The shape called `name`, or nullptr.
inline const ModelShape* find_model_shape(std::string_view name) {
  for (const ModelShape& s : kModelShapes)
    if (name == s.name) return &s;
  return nullptr;
}

inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Runs f() once to warm up (page faults, primitive caches), then repeatedly for at
// least min_s seconds; returns seconds per call.
template <typename F>
double time_per_call(F f, double min_s = 0.25) {
  f();
  long n = 0;
  const auto t0 = Clock::now();
  do {
    f();
    ++n;
  } while (seconds_since(t0) < min_s);
  return seconds_since(t0) / n;
}

// One routed step on the bare kernels: for each expert in turn, gate_up (bf16 out into
// h) then down (accumulated into out with row weights rw), m rows, with `threads`
// OpenMP threads splitting each product's panels and meeting at a barrier after each.
// Integer packs get their input quantized once per product, rows split over threads.
// Kernels and quantizer come from kt (default: the process table, kernels()).
void expert_step(int threads, const std::vector<const PackedWeight*>& gate_up, const std::vector<const PackedWeight*>& down,
                 int m, const bf16_t* a, bf16_t* h, float* out, const float* rw, QuantizedActs& q_in, QuantizedActs& q_mid,
                 const KernelTable* kt = nullptr);

// Puts the kernel variant `name` (a line of cpu_kernels/kernel_list.inc) into `table` for
// `format`'s family at every m, with that line's quantizer where the list has one of the
// same name (bench_kernels and bench_moe --variant). When there is no such line, or this
// CPU lacks what it needs, prints why (naming the known variants) and returns false.
bool use_variant(KernelTable& table, WeightFormat format, std::string_view name);
// "small (m < N), large", or "name at every m" when one variant runs at every row count.
std::string kernels_line(const FormatKernels& fk);

}  // namespace tandem::bench
