// Internal: fp32 -> bf16 rounding (nearest even; NaN stays a quiet NaN) and bf16 -> fp32
// (exact), inline with
// internal linkage so the kernel files can vectorize it under their own ISA flags
// while pack_bf16.cpp exports the same rule as tandem::fp32_to_bf16.
#pragma once

#include <cstdint>
#include <cstring>

namespace tandem {
namespace {

inline uint16_t round_to_bf16(float x) {
  uint32_t v;
  std::memcpy(&v, &x, 4);
  if ((v & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((v >> 16) | 0x40);
  v += 0x7fffu + ((v >> 16) & 1u);
  return static_cast<uint16_t>(v >> 16);
}

inline float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace
}  // namespace tandem
