// BF16 packing, unpacking and fp32 <-> bf16 conversion (no ISA flags: runs anywhere;
// the packing loop is bulk work and uses OpenMP).
#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "bf16_round.h"
#include "tandem/error.h"
#include "tandem/kernels.h"

namespace tandem {

bf16_t fp32_to_bf16(float x) noexcept { return round_to_bf16(x); }

float bf16_to_fp32(bf16_t x) noexcept {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void fp32_to_bf16(const float* src, bf16_t* dst, size_t n) noexcept {
  for (size_t i = 0; i < n; ++i) dst[i] = fp32_to_bf16(src[i]);
}

std::string_view format_name(WeightFormat f) noexcept {
  switch (f) {
    case WeightFormat::bf16: return "bf16";
  }
  return "?";
}

void AlignedBuffer::Free::operator()(std::byte* p) const noexcept { std::free(p); }

AlignedBuffer AlignedBuffer::allocate(size_t bytes) {
  AlignedBuffer b;
  const size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded ? rounded : 64);
  TANDEM_CHECK(p != nullptr, Errc::io, "out of memory allocating ", bytes, " bytes of packed weights");
  b.ptr.reset(static_cast<std::byte*>(p));
  b.size = bytes;
  return b;
}

namespace {

void check_shape(int n, int k, int ld, const void* w) {
  TANDEM_CHECK(w != nullptr, Errc::invalid_argument, "pack: weight pointer is null");
  TANDEM_CHECK(n > 0 && k > 0, Errc::invalid_argument, "pack: weight shape [", n, " x ", k, "] must be positive");
  TANDEM_CHECK(ld >= k, Errc::invalid_argument, "pack: leading dimension ", ld, " is smaller than k = ", k);
}

PackedWeight empty_pack(int n, int k, int stored_panels) {
  PackedWeight p;
  p.n = n;
  p.k = k;
  p.panels = (n + kPanel - 1) / kPanel;
  p.k_pairs = (k + 1) / 2;
  p.data = AlignedBuffer::allocate(static_cast<size_t>(stored_panels) * p.panel_bytes());
  return p;
}

// Writes panel `panel` of W (value(row, col) as bf16 bits) into dst: [k_pairs][64][2],
// zero for rows >= n and the odd-k tail.
template <typename Get>
void pack_panel(bf16_t* dst, int panel, int n, int k, int k_pairs, Get get) {
  for (int p = 0; p < k_pairs; ++p) {
    bf16_t* row = dst + static_cast<size_t>(p) * kPanel * 2;
    for (int j = 0; j < kPanel; ++j) {
      const int r = panel * kPanel + j;
      const int c0 = 2 * p, c1 = 2 * p + 1;
      row[2 * j] = r < n ? get(r, c0) : 0;
      row[2 * j + 1] = (r < n && c1 < k) ? get(r, c1) : 0;
    }
  }
}

template <typename Get>
PackedWeight pack_with(int n, int k, Get get) {
  PackedWeight p = empty_pack(n, k, (n + kPanel - 1) / kPanel);
  bf16_t* base = reinterpret_cast<bf16_t*>(p.data.data());
  const size_t stride = p.panel_bytes() / sizeof(bf16_t);
#pragma omp parallel for schedule(static)
  for (int i = 0; i < p.panels; ++i) pack_panel(base + i * stride, i, n, k, p.k_pairs, get);
  return p;
}

}  // namespace

PackedWeight pack_bf16(const bf16_t* w, int n, int k, int ld) {
  check_shape(n, k, ld, w);
  return pack_with(n, k, [&](int r, int c) { return w[static_cast<size_t>(r) * ld + c]; });
}

PackedWeight pack_bf16_from_fp32(const float* w, int n, int k, int ld) {
  check_shape(n, k, ld, w);
  return pack_with(n, k, [&](int r, int c) { return fp32_to_bf16(w[static_cast<size_t>(r) * ld + c]); });
}

PackedWeight pack_gate_up_bf16(const bf16_t* gate, const bf16_t* up, int n, int k, int ld) {
  check_shape(n, k, ld, gate);
  check_shape(n, k, ld, up);
  const int panels = (n + kPanel - 1) / kPanel;
  PackedWeight p = empty_pack(n, k, 2 * panels);
  p.gate_up = true;
  bf16_t* base = reinterpret_cast<bf16_t*>(p.data.data());
  const size_t stride = p.panel_bytes() / sizeof(bf16_t);
#pragma omp parallel for schedule(static)
  for (int i = 0; i < 2 * panels; ++i) {
    const bf16_t* src = (i % 2 == 0) ? gate : up;
    pack_panel(base + i * stride, i / 2, n, k, p.k_pairs,
               [&](int r, int c) { return src[static_cast<size_t>(r) * ld + c]; });
  }
  return p;
}

std::vector<float> unpack(const PackedWeight& w) {
  // A gate_up pack unpacks to [2n x k]: gate rows, then up rows.
  const int parts = w.gate_up ? 2 : 1;
  std::vector<float> out(static_cast<size_t>(parts) * w.n * w.k);
  for (int part = 0; part < parts; ++part)
    for (int panel = 0; panel < w.panels; ++panel) {
      const bf16_t* src = w.panel(w.gate_up ? 2 * panel + part : panel);
      for (int p = 0; p < w.k_pairs; ++p)
        for (int j = 0; j < kPanel; ++j) {
          const int r = panel * kPanel + j;
          if (r >= w.n) continue;
          for (int e = 0; e < 2; ++e) {
            const int c = 2 * p + e;
            if (c < w.k)
              out[(static_cast<size_t>(part) * w.n + r) * w.k + c] = bf16_to_fp32(src[(static_cast<size_t>(p) * kPanel + j) * 2 + e]);
          }
        }
    }
  return out;
}

}  // namespace tandem
