// Scalar reference twin of the integer kernels: the same packed layouts and drivers,
// plain loops, exact integer dot products. Compiled without ISA flags.
#include "gemm_q_driver.h"

namespace tandem {

float fp16_to_fp32(uint16_t) noexcept;

namespace {

struct Int8Ref {
  static constexpr int kMaxRows = 4;
  static void run(int mr, const QuantInput& in, int r0, const PackedWeight& w, const std::byte* panel, float* t) {
    const auto* d = reinterpret_cast<const uint8_t*>(panel);
    const float* scale = int8_scales(w, panel);
    for (int r = 0; r < mr; ++r) {
      const int8_t* a = in.row(r0 + r);
      for (int j = 0; j < kPanel; ++j) {
        int32_t acc = 0;
        for (int c = 0; c < w.k_pad; ++c) acc += (static_cast<int>(d[(static_cast<size_t>(c / 4) * kPanel + j) * 4 + c % 4]) - 128) * a[c];
        t[r * kPanel + j] = static_cast<float>(acc) * scale[j];
      }
    }
  }
};

struct Int4Ref {
  static constexpr int kMaxRows = 4;
  static void run(int mr, const QuantInput& in, int r0, const PackedWeight& w, const std::byte* panel, float* t) {
    for (int r = 0; r < mr; ++r) {
      const int8_t* a = in.row(r0 + r);
      for (int j = 0; j < kPanel; ++j) {
        float f = 0.0f;
        for (int gi = 0; gi < in.groups; ++gi) {
          const std::byte* gb = int4_group(w, panel, gi);
          const auto* nib = reinterpret_cast<const uint8_t*>(gb);
          int32_t acc = 0;
          for (int c = 0; c < w.group; ++c) {
            const uint8_t b = nib[(static_cast<size_t>(c / 8) * kPanel + j) * 4 + c % 4];
            const int q = (c % 8) < 4 ? (b & 15) : (b >> 4);
            acc += w.nibble_value(q) * a[gi * w.group + c];
          }
          const int z = w.symmetric ? w.fixed_zero() : int4_zeros(w, gb)[j];
          acc -= z * in.sums[static_cast<size_t>(r0 + r) * in.groups + gi];
          f += static_cast<float>(acc) * fp16_to_fp32(int4_scales(w, gb)[j]);
        }
        t[r * kPanel + j] = f;
      }
    }
  }
};

}  // namespace

void gemm_int8_ref(const PackedWeight& w, const GemmArgs& g) { gemm_q_driver<Int8Ref>(w, g); }
void gate_up_int8_ref(const PackedWeight& w, const GateUpArgs& g) { gate_up_q_driver<Int8Ref>(w, g); }
void gemm_int4_ref(const PackedWeight& w, const GemmArgs& g) { gemm_q_driver<Int4Ref>(w, g); }
void gate_up_int4_ref(const PackedWeight& w, const GateUpArgs& g) { gate_up_q_driver<Int4Ref>(w, g); }

void quantize_ref(const bf16_t* a, const float* a_f32, int m, int k, int lda, int k_pad, int group, int8_t* q,
                  float* scale, int32_t* sums) {
  quantize_any(a, a_f32, m, k, lda, k_pad, group, q, scale, sums);
}

}  // namespace tandem
