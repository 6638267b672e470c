// Scalar reference twin of the BF16 kernels: the same packed layout and drivers,
// plain loops, fp32 accumulation. Compiled without ISA flags.
#include "gemm_bf16_driver.h"

namespace tandem {
namespace {

struct MicroRef {
  static constexpr int kMaxRows = 4;
  static void run(int mr, const bf16_t* a, int lda, const bf16_t* wp, int k, float* t, const PanelPrefetch&) {
    for (int r = 0; r < mr; ++r) {
      float acc[kPanel] = {};
      for (int c = 0; c < k; ++c) {
        const float av = bf16_to_fp32(a[static_cast<size_t>(r) * lda + c]);
        const bf16_t* row = wp + static_cast<size_t>(c / 2) * kPanel * 2 + (c & 1);
        for (int j = 0; j < kPanel; ++j) acc[j] += av * bf16_to_fp32(row[2 * j]);
      }
      std::memcpy(t + r * kPanel, acc, sizeof(acc));
    }
  }
};

}  // namespace

void gemm_bf16_ref(const PackedWeight& w, const GemmArgs& g) { gemm_driver<MicroRef>(w, g); }
void gate_up_bf16_ref(const PackedWeight& w, const GateUpArgs& g) { gate_up_driver<MicroRef>(w, g); }
void silu_mul_ref(const float* g, const float* u, float* h, int n) { silu_mul(g, u, h, n); }
void sigmoid_ref(const float* x, float* out, int n) { sigmoid(x, out, n); }
void clamped_swiglu_ref(const float* g, const float* u, float* h, int n, float alpha, float limit, float offset) {
  clamped_swiglu(g, u, h, n, alpha, limit, offset);
}

}  // namespace tandem
