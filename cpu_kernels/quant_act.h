// Internal: activation quantization for the integer kernels (see quantize_activations
// in kernels.h). Internal linkage so each kernel file vectorizes it under its own ISA
// flags; every step is an exactly rounded IEEE operation (max, one multiply, round to
// nearest even), so all copies give bit-identical results.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "tandem/kernels.h"

namespace tandem {
namespace {

inline float act_value(const bf16_t* a, size_t i) {
  const uint32_t u = static_cast<uint32_t>(a[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float act_value(const float* a, size_t i) { return a[i]; }

// max |a[c]| over the row, and whether every element is finite, on the bit patterns:
// non-negative IEEE values order as their bits do, so an integer max of the magnitude bits
// is the float max (a loop GCC vectorizes; the float compare-and-select it kept scalar
// took 85% of a quantization). Exponent bits all ones: Inf or NaN.
inline float row_amax(const bf16_t* row, int k, bool& finite) {
  uint16_t mx = 0, bad = 0;
  for (int c = 0; c < k; ++c) {
    const uint16_t m = static_cast<uint16_t>(row[c] & 0x7fff);
    mx = m > mx ? m : mx;
    bad |= static_cast<uint16_t>((m & 0x7f80) == 0x7f80);
  }
  finite = !bad;
  return act_value(&mx, 0);
}
inline float row_amax(const float* row, int k, bool& finite) {
  uint32_t mx = 0, bad = 0;
  for (int c = 0; c < k; ++c) {
    uint32_t u;
    std::memcpy(&u, row + c, 4);
    const uint32_t m = u & 0x7fffffffu;
    mx = m > mx ? m : mx;
    bad |= static_cast<uint32_t>((m & 0x7f800000u) == 0x7f800000u);
  }
  finite = !bad;
  float f;
  std::memcpy(&f, &mx, 4);
  return f;
}

template <typename T>
void quantize_rows(const T* a, int m, int k, int lda, int k_pad, int group, int8_t* q, float* scale, int32_t* sums) {
  const int groups = k_pad / group;
  for (int r = 0; r < m; ++r) {
    const T* row = a + static_cast<size_t>(r) * lda;
    int8_t* qr = q + static_cast<size_t>(r) * k_pad;
    bool finite = true;
    const float amax = row_amax(row, k, finite);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    scale[r] = finite ? amax / 127.0f : NAN;
    if (!finite) {
      std::memset(qr, 0, k_pad);
    } else {
      for (int c = 0; c < k; ++c) {
        float x = std::nearbyint(act_value(row, c) * inv);
        x = x > 127.0f ? 127.0f : (x < -127.0f ? -127.0f : x);
        qr[c] = static_cast<int8_t>(x);
      }
      for (int c = k; c < k_pad; ++c) qr[c] = 0;
    }
    for (int g = 0; g < groups; ++g) {
      int32_t s = 0;
      for (int c = g * group; c < (g + 1) * group; ++c) s += qr[c];
      sums[static_cast<size_t>(r) * groups + g] = s;
    }
  }
}

}  // namespace
}  // namespace tandem
