// tandem/kernels.h: expert projection kernels on packed weights.
//
// One expert projection is W [n x k] (gate/up: n = intermediate, k = hidden; down:
// n = hidden, k = intermediate). The kernels compute, for m token rows,
//
//   C[m x n] (+)= A[m x k] . W^T        A bf16, accumulation fp32
//
// plus two fused forms used by the MoE layer:
//   gate_up:  H[m x n] = silu(A . Wg^T) * (A . Wu^T)       (fp32 or bf16 out)
//   down:     C[m x n] += w[m] * (A . Wd^T)               (per-token routing weight)
//
// Weights are packed once into the layout the kernels read (PackedWeight). The BF16
// layout is panels of 64 output rows: [n/64][k/2][64][2] bf16, i.e. for each pair of
// k, 64 outputs x 2 values = 256 bytes = four zmm vectors of VNNI pairs. The same
// bytes serve AVX-512-BF16 (vdpbf16ps), AVX-512/AVX2 (bf16 -> fp32 + FMA) and AMX
// (a B tile is 16 pair-rows of 64 bytes). n is padded to 64 and k to 2 with zeros.
//
// Kernels are single-threaded over a range of output panels [panel_begin, panel_end);
// the MoE engine splits panels across its worker threads. Which ISA variant runs is
// chosen once per process from effective_isa() (TANDEM_ISA can lower it), or
// explicitly for tests and benchmarks through kernel_table(level).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "tandem/cpu_features.h"

namespace tandem {

using bf16_t = uint16_t;  // raw bfloat16 bits

// fp32 <-> bf16, round to nearest even; NaN stays NaN (quiet), Inf stays Inf.
bf16_t fp32_to_bf16(float x) noexcept;
float bf16_to_fp32(bf16_t x) noexcept;
void fp32_to_bf16(const float* src, bf16_t* dst, size_t n) noexcept;

enum class WeightFormat { bf16 };
std::string_view format_name(WeightFormat f) noexcept;

inline constexpr int kPanel = 64;  // output rows per packed panel

// 64-byte aligned, owned bytes.
struct AlignedBuffer {
  struct Free {
    void operator()(std::byte* p) const noexcept;
  };
  std::unique_ptr<std::byte[], Free> ptr;
  size_t size = 0;
  static AlignedBuffer allocate(size_t bytes);
  std::byte* data() const { return ptr.get(); }
};

struct PackedWeight {
  WeightFormat format = WeightFormat::bf16;
  int n = 0, k = 0;        // logical shape of W (of gate, for a gate_up pack)
  int panels = 0;          // ceil(n / 64): output panels
  int k_pairs = 0;         // ceil(k / 2)
  bool gate_up = false;    // panels stored as gate 0, up 0, gate 1, up 1, ...
  AlignedBuffer data;
  size_t panel_bytes() const { return static_cast<size_t>(k_pairs) * kPanel * 2 * sizeof(bf16_t); }
  // Stored panel i (for a gate_up pack, gate panel p is 2p and up panel p is 2p + 1).
  const bf16_t* panel(int p) const {
    return reinterpret_cast<const bf16_t*>(data.data() + static_cast<size_t>(p) * panel_bytes());
  }
  size_t bytes() const { return data.size; }
};

// Packs W [n x k] row-major (leading dimension ld >= k), from bf16, fp16 or fp32.
// Parallel over panels (OpenMP); deterministic.
PackedWeight pack_bf16(const bf16_t* w, int n, int k, int ld);
PackedWeight pack_bf16_from_fp32(const float* w, int n, int k, int ld);
// Gate and up of one expert in one weight: panels alternate gate, up, gate, up, ...
PackedWeight pack_gate_up_bf16(const bf16_t* gate, const bf16_t* up, int n, int k, int ld);
// The dense [n x k] fp32 matrix a packed weight represents (tests, references).
std::vector<float> unpack(const PackedWeight& w);

// ---- kernels: one table per ISA level -------------------------------------------
struct GemmArgs {
  const bf16_t* a = nullptr;  // [m x k], row stride lda (elements)
  int m = 0, lda = 0;
  float* c = nullptr;         // [m x n] fp32, row stride ldc
  int ldc = 0;
  bool accumulate = false;    // C += instead of C =
  const float* row_scale = nullptr;  // optional [m]: C (+)= row_scale[r] * (A.W^T)[r]
  int panel_begin = 0, panel_end = -1;  // -1: all panels
};

struct GateUpArgs {
  const bf16_t* a = nullptr;  // [m x k]
  int m = 0, lda = 0;
  float* h = nullptr;         // [m x n] fp32 out, or
  bf16_t* h_bf16 = nullptr;   // [m x n] bf16 out (exactly one of the two)
  int ldh = 0;
  int panel_begin = 0, panel_end = -1;  // in units of gate (= up) panels
};

struct KernelTable {
  IsaLevel level;
  const char* name;  // "avx512_bf16", ...
  void (*gemm_bf16)(const PackedWeight& w, const GemmArgs& args);
  void (*gate_up_bf16)(const PackedWeight& w, const GateUpArgs& args);
};

// The table for a level; levels without their own variant fall back to the next
// lower one (e.g. amx -> avx512_bf16 until the AMX kernels land). Throws
// tandem::Error when the level is above the hardware.
const KernelTable& kernel_table(IsaLevel level);
// The process-wide table for effective_isa(), resolved on first use.
const KernelTable& kernels();

// Convenience entry points through kernels(); validate arguments (TANDEM_CHECK).
void gemm(const PackedWeight& w, const GemmArgs& args);
void gate_up(const PackedWeight& w, const GateUpArgs& args);

}  // namespace tandem
