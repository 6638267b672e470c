// Weight packing for every format, unpacking (dequantization), source decoding and
// the scalar conversions. No ISA flags: runs anywhere; packing is bulk work, parallel
// over panels with OpenMP, and each panel is a pure function of its own rows, so the
// result does not depend on the thread count.
#include <omp.h>
#include <sys/mman.h>
#include <xmmintrin.h>

#include <algorithm>
#include <array>
#include <exception>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "bf16_round.h"
#include "quant_act.h"
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

uint16_t fp32_to_fp16(float x) noexcept {
  const _Float16 h = static_cast<_Float16>(x);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}

float fp16_to_fp32(uint16_t x) noexcept {
  _Float16 h;
  std::memcpy(&h, &x, 2);
  return static_cast<float>(h);
}

float fp8_e4m3_to_fp32(uint8_t x) noexcept {
  const int sign = x >> 7, exp = (x >> 3) & 0xf, man = x & 7;
  float v;
  if (exp == 0xf && man == 7) {
    v = NAN;
  } else if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -9);  // subnormal: man/8 * 2^-6
  } else {
    v = std::ldexp(static_cast<float>(8 + man), exp - 10);  // (1 + man/8) * 2^(exp-7)
  }
  return sign ? -v : v;
}

std::string_view format_name(WeightFormat f) noexcept {
  switch (f) {
    case WeightFormat::bf16: return "bf16";
    case WeightFormat::int8: return "int8";
    case WeightFormat::int4: return "int4";
  }
  return "?";
}

WeightFormat parse_format(std::string_view name) {
  for (auto f : {WeightFormat::bf16, WeightFormat::int8, WeightFormat::int4})
    if (name == format_name(f)) return f;
  TANDEM_FAIL(Errc::invalid_argument, "unknown weight format '", name, "' (expected bf16, int8 or int4",
              name == "mxfp4" ? "; mxfp4 is int4 with MXFP4 codes: pack_options" : "", ")");
}

PackOptions pack_options(std::string_view format, int group, bool zero_point) {
  if (format == "mxfp4") return {WeightFormat::int4, 32, true, true};
  return {parse_format(format), group, !zero_point, false};
}

bool same_packing(const PackOptions& a, const PackOptions& b) noexcept {
  return a.format == b.format && (a.format != WeightFormat::int4 ||
                                  (a.group == b.group && a.symmetric == b.symmetric && a.e2m1 == b.e2m1));
}

std::string_view format_name(const PackOptions& o) noexcept { return o.e2m1 ? "mxfp4" : format_name(o.format); }

std::string_view source_type_name(SourceType t) noexcept {
  switch (t) {
    case SourceType::f32: return "f32";
    case SourceType::bf16: return "bf16";
    case SourceType::f16: return "f16";
    case SourceType::f8_e4m3: return "f8_e4m3";
    case SourceType::q4_gptq: return "q4_gptq";
    case SourceType::ggml_q8_0: return "ggml_q8_0";
    case SourceType::ggml_q4_1: return "ggml_q4_1";
  }
  return "?";
}

void AlignedBufferFree::operator()(std::byte* p) const noexcept {
  if (borrowed) return;
  if (mapped)
    ::munmap(p, mapped);
  else
    std::free(p);
}

AlignedBuffer AlignedBuffer::borrow(std::byte* p, size_t bytes) {
  TANDEM_CHECK(reinterpret_cast<uintptr_t>(p) % 64 == 0, Errc::invalid_argument, "a borrowed buffer at ",
               static_cast<const void*>(p), " is not 64-byte aligned");
  AlignedBuffer b;
  b.ptr = std::unique_ptr<std::byte[], Free>(p, Free{0, true});
  b.size = bytes;
  return b;
}

AlignedBuffer AlignedBuffer::allocate(size_t bytes) {
  AlignedBuffer b;
  constexpr size_t kHuge = size_t{2} << 20;
  if (bytes >= kHuge) {
    const size_t size = (bytes + kHuge - 1) / kHuge * kHuge;
    void* m = ::mmap(nullptr, size + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    TANDEM_CHECK(m != MAP_FAILED, Errc::io, "out of memory mapping ", bytes, " bytes of packed weights");
    // Keep the 2 MiB-aligned part only.
    const auto base = reinterpret_cast<uintptr_t>(m);
    const uintptr_t start = (base + kHuge - 1) / kHuge * kHuge;
    if (start > base) ::munmap(m, start - base);
    if (base + kHuge > start) ::munmap(reinterpret_cast<void*>(start + size), base + kHuge - start);
    ::madvise(reinterpret_cast<void*>(start), size, MADV_HUGEPAGE);  // advice: failure changes nothing
    b.ptr = std::unique_ptr<std::byte[], Free>(reinterpret_cast<std::byte*>(start), Free{size});
    b.size = bytes;
    return b;
  }
  const size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded ? rounded : 64);
  TANDEM_CHECK(p != nullptr, Errc::io, "out of memory allocating ", bytes, " bytes of packed weights");
  b.ptr.reset(static_cast<std::byte*>(p));
  b.size = bytes;
  return b;
}

void quantize_activations(const bf16_t* a, int m, int k, int lda, int k_pad, int group, int8_t* q, float* scale,
                          int32_t* sums) {
  quantize_rows(a, m, k, lda, k_pad, group, q, scale, sums);
}
void quantize_activations(const float* a, int m, int k, int lda, int k_pad, int group, int8_t* q, float* scale,
                          int32_t* sums) {
  quantize_rows(a, m, k, lda, k_pad, group, q, scale, sums);
}

namespace {
int64_t row_stride(const WeightView& w) { return w.ld ? w.ld : w.k; }
}  // namespace

const std::byte* Q4Source::scale_at(int g, int r) const {
  if (layout == Layout::ggml_q4_0) return q40_block(r, g * 32);  // the fp16 d at the start of the block
  const size_t i = layout == Layout::packed_rows ? static_cast<size_t>(r) * (k / group) + g : static_cast<size_t>(g) * n + r;
  return scales + i * (scale_type == Scale::f32 ? 4 : 2);
}

float Q4Source::scale(int g, int r) const {
  const std::byte* at = scale_at(g, r);
  switch (scale_type) {
    case Scale::f16: {
      uint16_t b;
      std::memcpy(&b, at, 2);
      return fp16_to_fp32(b);
    }
    case Scale::bf16: {
      uint16_t b;
      std::memcpy(&b, at, 2);
      return bf16_to_fp32(b);
    }
    case Scale::f32: {
      float f;
      std::memcpy(&f, at, 4);
      return f;
    }
  }
  return 0;
}

bool Q4Source::scale_fp16(int g, int r, uint16_t& bits) const {
  if (scale_type == Scale::f16) {  // the bits as they are (no conversion round trip)
    std::memcpy(&bits, scale_at(g, r), 2);
    return true;
  }
  const float s = scale(g, r);
  bits = fp32_to_fp16(s);
  return fp16_to_fp32(bits) == s || (std::isnan(s) && std::isnan(fp16_to_fp32(bits)));
}

float Q4Source::value(int r, int c) const {
  return scale(c / group, r) * static_cast<float>(static_cast<int>(q(r, c)) - zero(c / group, r));
}

std::string_view q4_layout_name(Q4Source::Layout l) noexcept {
  switch (l) {
    case Q4Source::Layout::gptq: return "GPTQ";
    case Q4Source::Layout::awq: return "AWQ";
    case Q4Source::Layout::packed_rows: return "compressed-tensors";
    case Q4Source::Layout::ggml_q4_0: return "GGUF Q4_0";
  }
  return "?";
}

int ggml_block_bytes(SourceType t) noexcept {
  switch (t) {
    case SourceType::ggml_q8_0: return 34;
    case SourceType::ggml_q4_1: return 20;
    default: return 0;
  }
}

void decode_rows(const WeightView& w, int r0, int rows, float* out) {
  const int64_t ld = row_stride(w);
  for (int r = 0; r < rows; ++r) {
    const size_t src = static_cast<size_t>(r0 + r) * ld;
    float* o = out + static_cast<size_t>(r) * w.k;
    switch (w.type) {
      case SourceType::ggml_q8_0:  // per block: fp16 d, 32 x int8
        for (int b = 0; b < w.k / kGgmlBlock; ++b) {
          const std::byte* blk = static_cast<const std::byte*>(w.data) + (src / kGgmlBlock + b) * 34;
          uint16_t d16;
          std::memcpy(&d16, blk, 2);
          const float d = fp16_to_fp32(d16);
          for (int j = 0; j < kGgmlBlock; ++j)
            o[b * kGgmlBlock + j] = d * static_cast<float>(static_cast<int8_t>(blk[2 + j]));
        }
        break;
      case SourceType::ggml_q4_1:  // per block: fp16 d, fp16 m, 16 bytes of nibbles
        for (int b = 0; b < w.k / kGgmlBlock; ++b) {
          const std::byte* blk = static_cast<const std::byte*>(w.data) + (src / kGgmlBlock + b) * 20;
          uint16_t d16, m16;
          std::memcpy(&d16, blk, 2);
          std::memcpy(&m16, blk + 2, 2);
          const float d = fp16_to_fp32(d16), m = fp16_to_fp32(m16);
          for (int j = 0; j < kGgmlBlock; ++j) {
            const auto byte = static_cast<uint8_t>(blk[4 + j % 16]);
            const int q = j < 16 ? (byte & 15) : (byte >> 4);
            o[b * kGgmlBlock + j] = std::fma(d, static_cast<float>(q), m);
          }
        }
        break;
      case SourceType::f32:
        std::memcpy(o, static_cast<const float*>(w.data) + src, sizeof(float) * w.k);
        break;
      case SourceType::bf16: {
        const bf16_t* s = static_cast<const bf16_t*>(w.data) + src;
        for (int c = 0; c < w.k; ++c) o[c] = bf16_to_fp32(s[c]);
        break;
      }
      case SourceType::f16: {
        const uint16_t* s = static_cast<const uint16_t*>(w.data) + src;
        for (int c = 0; c < w.k; ++c) o[c] = fp16_to_fp32(s[c]);
        break;
      }
      case SourceType::f8_e4m3: {
        static const auto table = [] {
          std::array<float, 256> t{};
          for (int i = 0; i < 256; ++i) t[i] = fp8_e4m3_to_fp32(static_cast<uint8_t>(i));
          return t;
        }();
        const uint8_t* s = static_cast<const uint8_t*>(w.data) + src;
        for (int c = 0; c < w.k; ++c) o[c] = table[s[c]];
        if (w.block_scale) {
          const int kb = w.scale_ld ? w.scale_ld : (w.k + w.block_k - 1) / w.block_k;
          const float* bs = w.block_scale + static_cast<size_t>((w.row0 + r0 + r) / w.block_n) * kb;
          for (int c = 0; c < w.k; ++c) o[c] *= bs[(w.col0 + c) / w.block_k];
        }
        break;
      }
      case SourceType::q4_gptq:  // the whole quantized matrix, at the view's offset
        for (int c = 0; c < w.k; ++c) o[c] = w.q4->value(w.row0 + r0 + r, w.col0 + c);
        break;
    }
  }
}

namespace {

void check_view(const char* what, const WeightView& w) {
  if (w.type == SourceType::q4_gptq) {
    TANDEM_CHECK(w.q4 && w.q4->qweight && w.q4->scales &&
                     (w.q4->qzeros || w.q4->layout == Q4Source::Layout::packed_rows ||
                      (w.q4->layout == Q4Source::Layout::ggml_q4_0 && w.q4->group == kGgmlBlock)),
                 Errc::invalid_argument, "pack: ", what, " is a 4-bit quantized weight without its tensors");
    const Q4Source& q = *w.q4;
    TANDEM_CHECK(q.n % 8 == 0 && q.k % 8 == 0 && q.group > 0 && q.k % q.group == 0, Errc::invalid_argument, "pack: ",
                 what, " is a 4-bit quantized matrix of [", q.n, " x ", q.k, "] in groups of ", q.group,
                 ": both sizes must be multiples of 8 and k a multiple of the group");
    TANDEM_CHECK(w.n > 0 && w.k > 0 && w.row0 >= 0 && w.col0 >= 0 && w.row0 + w.n <= w.q4->n && w.col0 + w.k <= w.q4->k,
                 Errc::invalid_argument, "pack: ", what, " rows [", w.row0, ", ", w.row0 + w.n, ") x columns [",
                 w.col0, ", ", w.col0 + w.k, ") are outside its [", w.q4->n, " x ", w.q4->k, "] quantized matrix");
    return;
  }
  TANDEM_CHECK(w.data != nullptr, Errc::invalid_argument, "pack: ", what, " pointer is null");
  if (ggml_block_bytes(w.type)) {
    TANDEM_CHECK(w.k % kGgmlBlock == 0 && row_stride(w) % kGgmlBlock == 0, Errc::invalid_argument, "pack: ", what,
                 " is a ", source_type_name(w.type), " weight of [", w.n, " x ", w.k, "] (row stride ", row_stride(w),
                 "): its rows must be whole blocks of ", kGgmlBlock);
  }
  TANDEM_CHECK(w.n > 0 && w.k > 0, Errc::invalid_argument, "pack: ", what, " shape [", w.n, " x ", w.k,
               "] must be positive");
  TANDEM_CHECK(row_stride(w) >= w.k, Errc::invalid_argument, "pack: ", what, " leading dimension ", w.ld,
               " is smaller than k = ", w.k);
  if (w.block_scale) {
    TANDEM_CHECK(w.type == SourceType::f8_e4m3, Errc::invalid_argument, "pack: block scales are only for f8_e4m3 weights, not ",
                 source_type_name(w.type));
    TANDEM_CHECK(w.block_n > 0 && w.block_k > 0, Errc::invalid_argument, "pack: block scale shape [", w.block_n, " x ",
                 w.block_k, "] must be positive");
  }
}

void check_options(const PackOptions& o, int k) {
  if (o.format == WeightFormat::int4) {
    TANDEM_CHECK(o.group == 32 || o.group == 64 || o.group == 128, Errc::invalid_argument, "pack: int4 group size ",
                 o.group, " is not one of 32, 64, 128");
    TANDEM_CHECK(k % o.group == 0, Errc::invalid_argument, "pack: k = ", k, " is not a multiple of the int4 group size ",
                 o.group, "; int4 cannot represent a partial group (choose a group that divides k, or int8 / bf16)");
  }
  if (o.format == WeightFormat::int8)
    // vpdpbusd accumulates (q + 128) * a in int32: 255 * 127 * k must stay below 2^31.
    TANDEM_CHECK(k <= 65536, Errc::invalid_argument, "pack: k = ", k, " is above int8's limit of 65536");
}

// Layout for a format (shape, padding, strides; no data).
PackedWeight layout(const PackOptions& o, int n, int k) {
  PackedWeight p;
  p.format = o.format;
  p.n = n;
  p.k = k;
  p.panels = (n + kPanel - 1) / kPanel;
  switch (o.format) {
    case WeightFormat::bf16:
      p.k_pad = (k + 1) / 2 * 2;
      p.k_pairs = p.k_pad / 2;
      p.group = p.k_pad;
      p.panel_stride = static_cast<size_t>(p.k_pad) * kPanel * sizeof(bf16_t);
      break;
    case WeightFormat::int8:
      p.k_pad = (k + 63) / 64 * 64;
      p.group = p.k_pad;
      p.panel_stride = static_cast<size_t>(p.k_pad) * kPanel + kPanel * sizeof(float);
      break;
    case WeightFormat::int4:
      p.k_pad = k;
      p.group = o.group;
      p.symmetric = o.symmetric;
      p.e2m1 = o.e2m1;
      TANDEM_CHECK(!o.e2m1 || (o.group == 32 && o.symmetric), Errc::invalid_argument,
                   "pack: mxfp4 needs groups of 32 and no zero points (group ", o.group, ")");
      p.group_stride = static_cast<size_t>(o.group) * kPanel / 2 + kPanel * sizeof(uint16_t) + (o.symmetric ? 0 : kPanel);
      p.panel_stride = p.group_stride * (k / o.group);
      break;
  }
  return p;
}

// Layout for a format, data allocated for `stored_per_panel` stored panels per panel.
PackedWeight layout(const PackOptions& o, int n, int k, int stored_per_panel) {
  PackedWeight p = layout(o, n, k);
  p.data = AlignedBuffer::allocate(p.panel_stride * p.panels * stored_per_panel);
  return p;
}

// Rounds to nearest, ties to even (the current rounding mode, as std::nearbyint does), inline:
// cvtss2si is baseline SSE, where nearbyintf is a libm call per value. For |x| < 2^31.
inline float round_even(float x) { return static_cast<float>(_mm_cvtss_si32(_mm_set_ss(x))); }

[[noreturn]] void non_finite(const WeightView& w, const char* what, int r, const float* row) {
  int c = 0;
  while (c < w.k && std::isfinite(row[c])) ++c;
  if (w.name)
    TANDEM_FAIL(Errc::bad_format, "tensor ", w.name, w.file ? " of " : "", w.file ? w.file : "", ": element [",
                w.row0 + r, ", ", w.col0 + c, "] is ", row[c], "; non-finite weights are refused (fix the checkpoint)");
  TANDEM_FAIL(Errc::bad_format, "pack: ", what, " [", r, ", ", c, "] is ", row[c],
              "; integer formats cannot hold NaN or Inf (pack it as bf16, or fix the checkpoint)");
}

// Panel writers: `rows` holds the panel's 64 source rows as fp32 (row stride k; rows
// past n are absent and written as zeros).
void write_bf16(const PackedWeight& p, std::byte* dst, const float* rows, int valid) {
  bf16_t* d = reinterpret_cast<bf16_t*>(dst);
  for (int pr = 0; pr < p.k_pairs; ++pr)
    for (int j = 0; j < kPanel; ++j)
      for (int e = 0; e < 2; ++e) {
        const int c = 2 * pr + e;
        d[(static_cast<size_t>(pr) * kPanel + j) * 2 + e] =
            (j < valid && c < p.k) ? fp32_to_bf16(rows[static_cast<size_t>(j) * p.k + c]) : 0;
      }
}

// amax (optional): each row's max |w| over a wider range than these columns (pack_cols).
void write_int8(const PackedWeight& p, std::byte* dst, const float* rows, int valid, const WeightView& w,
                const char* what, int r0, const float* amax_of = nullptr) {
  uint8_t* d = reinterpret_cast<uint8_t*>(dst);
  float* scale = reinterpret_cast<float*>(dst + static_cast<size_t>(p.k_pad) * kPanel);
  std::memset(d, 128, static_cast<size_t>(p.k_pad) * kPanel);  // q = 0
  for (int j = 0; j < kPanel; ++j) {
    scale[j] = 0.0f;
    if (j >= valid) continue;
    const float* row = rows + static_cast<size_t>(j) * p.k;
    float amax = 0.0f;
    for (int c = 0; c < p.k; ++c) {
      if (!std::isfinite(row[c])) non_finite(w, what, r0 + j, row);
      amax = std::max(amax, std::fabs(row[c]));
    }
    if (amax_of) amax = amax_of[r0 + j];
    scale[j] = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int c = 0; c < p.k; ++c) {
      const float q = std::clamp(round_even(row[c] * inv), -127.0f, 127.0f);
      d[(static_cast<size_t>(c / 4) * kPanel + j) * 4 + c % 4] = static_cast<uint8_t>(static_cast<int>(q) + 128);
    }
  }
}

// The int4 layout's writer: row(gi, j, q, scale, zero) fills valid row j's `group` values of
// group gi, its fp16 scale and zero point; padding rows hold value 0 (q = zero point, scale 0).
template <class Row>
void write_int4_rows(const PackedWeight& p, std::byte* dst, int valid, Row&& row) {
  const int g = p.group;
  for (int gi = 0; gi < p.k / g; ++gi) {
    std::byte* base = dst + gi * p.group_stride;
    uint8_t* nib = reinterpret_cast<uint8_t*>(base);
    uint16_t* scale = reinterpret_cast<uint16_t*>(base + static_cast<size_t>(g) * kPanel / 2);
    uint8_t* zero = reinterpret_cast<uint8_t*>(base + static_cast<size_t>(g) * kPanel / 2 + kPanel * 2);
    for (int j = 0; j < kPanel; ++j) {
      uint8_t q[128] = {};
      uint16_t s16 = 0;
      int z = p.symmetric ? 8 : 0;
      if (j < valid)
        row(gi, j, q, s16, z);
      else if (p.symmetric)
        std::fill_n(q, g, uint8_t{8});
      scale[j] = s16;
      if (!p.symmetric) zero[j] = static_cast<uint8_t>(z);
      for (int o = 0; o < g / 8; ++o) {  // byte i of k-octet o: q[8o + i] low, q[8o + 4 + i] high
        uint32_t word = 0;
        for (int i = 0; i < 4; ++i) word |= uint32_t(q[8 * o + i] | q[8 * o + 4 + i] << 4) << (8 * i);
        std::memcpy(nib + (static_cast<size_t>(o) * kPanel + j) * 4, &word, 4);
      }
    }
  }
}

// One MXFP4 block: the shared exponent e is the smallest with max|v| <= 6 * 2^e (no value
// saturates; a block that already is MXFP4 gets its own codes back, as its values are
// multiples of its smallest step), each value the nearest E2M1 code (ties to the even
// code), the fp16 scale 2^(e - 1) (the codes' table holds twice their values). e stays in
// [-23, 16] (fp16's powers of two): below, a block's values (all under 2^-21) round on
// the coarser step 2^-23; above, the block is refused.
void mxfp4_block(const float* v, int g, uint8_t* q, uint16_t& s16, const char* what, int r, int gi) {
  float amax = 0.0f;
  for (int c = 0; c < g; ++c) amax = std::max(amax, std::fabs(v[c]));
  int e = -23;
  if (amax > 0.0f) {
    int ex;  // amax / 6 = m * 2^ex, m in [0.5, 1): the smallest e with amax <= 6 * 2^e
    const float m = std::frexp(amax / 6.0f, &ex);
    e = std::max(-23, m == 0.5f ? ex - 1 : ex);
    while (amax > std::ldexp(6.0f, e)) ++e;  // amax / 6 rounded down in the division
  }
  TANDEM_CHECK(e <= 16, Errc::bad_format, "pack: ", what, " row ", r, ", group ", gi, ": max |w| ", amax,
               " is beyond mxfp4 (6 * 2^16)");
  s16 = fp32_to_fp16(std::ldexp(1.0f, e - 1));
  const float inv = std::ldexp(1.0f, -e);  // exact: a power of two
  for (int c = 0; c < g; ++c) {
    // The code of |v| / 2^e in [0, 6] counts the midpoints between the levels 0, 0.5, 1,
    // 1.5, 2, 3, 4, 6 that it passes; on a midpoint it goes to the even code (a midpoint
    // above an even code is not passed, one above an odd code is).
    const float x = std::fabs(v[c]) * inv;
    const int code = (x > 0.25f) + (x >= 0.75f) + (x > 1.25f) + (x >= 1.75f) + (x > 2.5f) + (x >= 3.5f) + (x > 5.0f);
    q[c] = static_cast<uint8_t>(code | (v[c] < 0.0f && code ? 8 : 0));
  }
}

void write_int4(const PackedWeight& p, std::byte* dst, const float* rows, int valid, const WeightView& w,
                const char* what, int r0) {
  const int g = p.group;
  write_int4_rows(p, dst, valid, [&](int gi, int j, uint8_t* q, uint16_t& s16, int& z) {
    const float* v = rows + static_cast<size_t>(j) * p.k + static_cast<size_t>(gi) * g;
    float lo = 0.0f, hi = 0.0f;  // the range always includes 0
    for (int c = 0; c < g; ++c) {
      if (!std::isfinite(v[c])) non_finite(w, what, r0 + j, rows + static_cast<size_t>(j) * p.k);
      lo = std::min(lo, v[c]);
      hi = std::max(hi, v[c]);
    }
    if (p.e2m1) return mxfp4_block(v, g, q, s16, what, r0 + j, gi);
    const float want = p.symmetric ? std::max(-lo, hi) / 7.0f : (hi - lo) / 15.0f;
    s16 = fp32_to_fp16(want);
    const float s = fp16_to_fp32(s16);
    TANDEM_CHECK(std::isfinite(s), Errc::bad_format, "pack: ", what, " row ", r0 + j, ", group ", gi, ": scale ", want,
                 " overflows fp16 (int4 needs |w| < 458,000)");
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
    if (!p.symmetric) z = static_cast<int>(std::clamp(round_even(-lo * inv), 0.0f, 15.0f));
    for (int c = 0; c < g; ++c)
      q[c] = static_cast<uint8_t>(std::clamp(round_even(v[c] * inv) + static_cast<float>(z), 0.0f, 15.0f));
  });
}

// int4 from a GPTQ source with the same group size: its nibbles, scales and zero points as
// they are (write_int4's layout, padding rows alike).
bool direct_q4(const PackedWeight& p, const WeightView& w) {
  return w.type == SourceType::q4_gptq && p.format == WeightFormat::int4 && !p.e2m1 && w.q4->group == p.group &&
         w.col0 % p.group == 0;
}

void write_int4_q4(const PackedWeight& p, std::byte* dst, int valid, const WeightView& w, int r0) {
  const int g = p.group;
  const Q4Source& s = *w.q4;
  const char* name = w.name ? w.name : "weight";
  const char* of = w.file ? " of " : "";
  const char* file = w.file ? w.file : "";
  write_int4_rows(p, dst, valid, [&](int gi, int j, uint8_t* q, uint16_t& s16, int& z) {
    const int R = w.row0 + r0 + j, G = (w.col0 + gi * g) / g;
    const bool exact = s.scale_fp16(G, R, s16);
    if (!exact || (s16 & 0x7c00) == 0x7c00) {  // inexact, or fp16 Inf / NaN: the value named
      const float sv = s.scale(G, R);
      TANDEM_CHECK(std::isfinite(sv), Errc::bad_format, "tensor ", name, of, file, ": row ", R, ", group ", G,
                   " has scale ", sv, "; non-finite weights are refused");
      TANDEM_FAIL(Errc::unsupported, "tensor ", name, of, file, ": row ", R, ", group ", G, " has scale ", sv,
                  ", which int4's fp16 scales cannot hold exactly; load it as int8 or bf16 (cpu.format)");
    }
    z = s.zero(G, R);
    TANDEM_CHECK(!p.symmetric || z == 8, Errc::unsupported, "tensor ", name, of, file, ": row ", R, ", group ", G,
                 " has zero point ", z, "; symmetric int4 holds zero point 8 only: pack this ",
                 q4_layout_name(s.layout), " checkpoint with zero points (cpu.zero_point: true)");
    for (int c = 0; c < g; c += 8) s.octet(R, w.col0 + gi * g + c, q + c);
  });
}

// OpenMP regions cannot throw across their boundary: run the region, keep the first
// error, rethrow it afterwards.
template <size_t N>
void pack_panels_checked(PackedWeight& p, const WeightView* (&views)[N], const char* const (&what)[N],
                         const float* amax = nullptr) {
  std::exception_ptr err;
  const int stored = static_cast<int>(N) * p.panels;
  std::byte* base = p.data.data();
#pragma omp parallel
  {
    std::vector<float> rows(static_cast<size_t>(kPanel) * p.k);
#pragma omp for schedule(static)
    for (int i = 0; i < stored; ++i) {
      try {
        const WeightView& w = *views[i % N];
        const int panel = i / static_cast<int>(N);
        const int r0 = panel * kPanel, valid = std::min(kPanel, w.n - r0);
        std::byte* dst = base + static_cast<size_t>(i) * p.panel_stride;
        if (direct_q4(p, w)) {
          write_int4_q4(p, dst, valid, w, r0);
          continue;
        }
        decode_rows(w, r0, valid, rows.data());
        switch (p.format) {
          case WeightFormat::bf16: write_bf16(p, dst, rows.data(), valid); break;
          case WeightFormat::int8: write_int8(p, dst, rows.data(), valid, w, what[i % N], r0, amax); break;
          case WeightFormat::int4: write_int4(p, dst, rows.data(), valid, w, what[i % N], r0); break;
        }
      } catch (...) {
#pragma omp critical(tandem_pack_error)
        if (!err) err = std::current_exception();
      }
    }
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace

size_t packed_bytes(const PackOptions& opt, int n, int k, bool gate_up) {
  TANDEM_CHECK(n > 0 && k > 0, Errc::invalid_argument, "packed_bytes: shape [", n, " x ", k, "] must be positive");
  check_options(opt, k);
  const PackedWeight p = layout(opt, n, k);
  return p.panel_stride * p.panels * (gate_up ? 2 : 1);
}

PackedWeight pack(const WeightView& w, const PackOptions& opt) {
  check_view("weight", w);
  check_options(opt, w.k);
  PackedWeight p = layout(opt, w.n, w.k, 1);
  const WeightView* views[1] = {&w};
  const char* const what[1] = {"weight"};
  pack_panels_checked(p, views, what);
  return p;
}

PackedWeight pack_gate_up(const WeightView& gate, const WeightView& up, const PackOptions& opt) {
  check_view("gate weight", gate);
  check_view("up weight", up);
  TANDEM_CHECK(gate.n == up.n && gate.k == up.k, Errc::invalid_argument, "pack_gate_up: gate [", gate.n, " x ", gate.k,
               "] and up [", up.n, " x ", up.k, "] differ in shape");
  check_options(opt, gate.k);
  PackedWeight p = layout(opt, gate.n, gate.k, 2);
  p.gate_up = true;
  const WeightView* views[2] = {&gate, &up};
  const char* const what[2] = {"gate weight", "up weight"};
  pack_panels_checked(p, views, what);
  return p;
}

int column_unit(const PackOptions& opt) {
  switch (opt.format) {
    case WeightFormat::bf16: return 2;
    case WeightFormat::int8: return 64;  // k_pad's step: a slice's padding is the whole's
    case WeightFormat::int4: return opt.group;
  }
  return 1;
}

namespace {
void check_cols(const PackOptions& opt, int k, int c0, int cols) {
  TANDEM_CHECK(c0 >= 0 && cols > 0 && c0 + cols <= k, Errc::invalid_argument, "pack: columns [", c0, ", ", c0 + cols,
               ") are outside [0, ", k, ")");
  const int unit = column_unit(opt);
  TANDEM_CHECK(c0 % unit == 0 && (c0 + cols == k || cols % unit == 0), Errc::invalid_argument, "pack: columns [", c0,
               ", ", c0 + cols, ") of ", k, " do not fall on ", format_name(opt.format), "'s column unit ", unit);
}
}  // namespace

PackedWeight pack_cols(const WeightView& w, int c0, int cols, const PackOptions& opt) {
  check_view("weight", w);
  check_options(opt, cols);
  check_cols(opt, w.k, c0, cols);
  const WeightView v = sub_view(w, 0, w.n, c0, cols);
  if (opt.format != WeightFormat::int8 || (c0 == 0 && cols == w.k)) return pack(v, opt);
  // int8: each row's scale from the whole row, the values from these columns.
  std::vector<float> amax(w.n, 0.0f);
  std::exception_ptr err;
#pragma omp parallel
  {
    std::vector<float> row(w.k);
#pragma omp for schedule(static)
    for (int r = 0; r < w.n; ++r) {
      try {
        decode_rows(w, r, 1, row.data());
        float a = 0.0f;
        for (int c = 0; c < w.k; ++c) {
          if (!std::isfinite(row[c])) non_finite(w, "weight", r, row.data());
          a = std::max(a, std::fabs(row[c]));
        }
        amax[r] = a;
      } catch (...) {
#pragma omp critical(tandem_pack_error)
        if (!err) err = std::current_exception();
      }
    }
  }
  if (err) std::rethrow_exception(err);
  PackedWeight p = layout(opt, v.n, v.k, 1);
  const WeightView* views[1] = {&v};
  const char* const what[1] = {"weight"};
  pack_panels_checked(p, views, what, amax.data());
  return p;
}

PackedWeight pack_layout(const PackOptions& opt, int n, int k, bool gate_up) {
  TANDEM_CHECK(n > 0 && k > 0, Errc::invalid_argument, "pack: shape [", n, " x ", k, "] must be positive");
  check_options(opt, k);
  PackedWeight p = layout(opt, n, k);
  p.gate_up = gate_up;
  return p;
}

PackedWeight empty_pack(const PackOptions& opt, int n, int k, bool gate_up) {
  PackedWeight p = pack_layout(opt, n, k, gate_up);
  p.data = AlignedBuffer::allocate(p.panel_stride * p.panels * (gate_up ? 2 : 1));
  return p;
}

ColumnBytes column_bytes(const PackedWeight& full, int c0, int cols) {
  const PackOptions opt = full.options();
  check_cols(opt, full.k, c0, cols);
  const PackedWeight part = layout(opt, full.n, cols);
  ColumnBytes b;
  switch (full.format) {
    case WeightFormat::bf16:  // [k_pad / 2][64][2] bf16
      b.offset = static_cast<size_t>(c0 / 2) * kPanel * 2 * sizeof(bf16_t);
      b.bytes = part.panel_stride;
      break;
    case WeightFormat::int8:  // [k_pad / 4][64][4] bytes, then the row scales
      b.offset = static_cast<size_t>(c0 / 4) * kPanel * 4;
      b.bytes = static_cast<size_t>(part.k_pad) * kPanel;
      b.tail_offset = static_cast<size_t>(full.k_pad) * kPanel;
      b.tail_bytes = kPanel * sizeof(float);
      break;
    case WeightFormat::int4:  // whole groups
      b.offset = static_cast<size_t>(c0 / full.group) * full.group_stride;
      b.bytes = part.panel_stride;
      break;
  }
  return b;
}

PackedWeight slice_cols(const PackedWeight& full, int c0, int cols) {
  TANDEM_CHECK(!full.gate_up, Errc::invalid_argument, "slice_cols: a gate_up pack is cut by panels, not columns");
  const ColumnBytes b = column_bytes(full, c0, cols);
  PackedWeight p = empty_pack(full.options(), full.n, cols);
  for (int i = 0; i < full.panels; ++i) {
    std::byte* dst = p.data.data() + static_cast<size_t>(i) * p.panel_stride;
    const std::byte* src = full.panel_data(i);
    std::memcpy(dst, src + b.offset, b.bytes);
    if (b.tail_bytes) std::memcpy(dst + b.bytes, src + b.tail_offset, b.tail_bytes);
  }
  return p;
}

PackedWeight pack_bf16(const bf16_t* w, int n, int k, int ld) {
  return pack({w, SourceType::bf16, n, k, ld});
}
PackedWeight pack_bf16_from_fp32(const float* w, int n, int k, int ld) {
  return pack({w, SourceType::f32, n, k, ld});
}
PackedWeight pack_gate_up_bf16(const bf16_t* gate, const bf16_t* up, int n, int k, int ld) {
  return pack_gate_up({gate, SourceType::bf16, n, k, ld}, {up, SourceType::bf16, n, k, ld});
}

WeightView sub_view(const WeightView& w, int r0, int rows, int c0, int cols) {
  TANDEM_CHECK(r0 >= 0 && rows >= 0 && r0 + rows <= w.n && c0 >= 0 && cols >= 0 && c0 + cols <= w.k,
               Errc::invalid_argument, "sub_view: [", r0, ", ", r0 + rows, ") x [", c0, ", ", c0 + cols,
               ") is outside the weight's [", w.n, " x ", w.k, "]");
  if (w.type == SourceType::q4_gptq) {  // the quantized matrix stays whole; the view moves
    WeightView v = w;
    v.n = rows;
    v.k = cols;
    v.row0 = w.row0 + r0;
    v.col0 = w.col0 + c0;
    return v;
  }
  WeightView v = w;
  const size_t first = static_cast<size_t>(r0) * row_stride(w) + c0;  // in weights
  if (const int bb = ggml_block_bytes(w.type)) {
    TANDEM_CHECK(c0 % kGgmlBlock == 0 && cols % kGgmlBlock == 0, Errc::invalid_argument, "sub_view: columns [", c0,
                 ", ", c0 + cols, ") of a ", source_type_name(w.type), " weight must be whole blocks of ", kGgmlBlock);
    v.data = static_cast<const std::byte*>(w.data) + first / kGgmlBlock * bb;
  } else {
    size_t elem = 4;
    if (w.type == SourceType::bf16 || w.type == SourceType::f16) elem = 2;
    if (w.type == SourceType::f8_e4m3) elem = 1;
    v.data = static_cast<const std::byte*>(w.data) + first * elem;
  }
  v.ld = row_stride(w);
  v.n = rows;
  v.k = cols;
  v.row0 = w.row0 + r0;
  v.col0 = w.col0 + c0;
  v.scale_ld = w.scale_ld ? w.scale_ld : (w.k + w.block_k - 1) / w.block_k;
  return v;
}

float source_value(const WeightView& w, int r, int c) {
  std::vector<float> row(w.k);
  decode_rows(w, r, 1, row.data());
  return row[c];
}

namespace {

// Dequantized value of output row j (0..63), column c, of one stored panel.
float panel_value(const PackedWeight& w, const std::byte* panel, int j, int c) {
  switch (w.format) {
    case WeightFormat::bf16:
      return bf16_to_fp32(reinterpret_cast<const bf16_t*>(panel)[(static_cast<size_t>(c / 2) * kPanel + j) * 2 + c % 2]);
    case WeightFormat::int8: {
      const auto* d = reinterpret_cast<const uint8_t*>(panel);
      const float* scale = reinterpret_cast<const float*>(panel + static_cast<size_t>(w.k_pad) * kPanel);
      return scale[j] * static_cast<float>(static_cast<int>(d[(static_cast<size_t>(c / 4) * kPanel + j) * 4 + c % 4]) - 128);
    }
    case WeightFormat::int4: {
      const std::byte* base = panel + (c / w.group) * w.group_stride;
      const int cc = c % w.group, o = cc / 8, e = cc % 8;
      const uint8_t b = reinterpret_cast<const uint8_t*>(base)[(static_cast<size_t>(o) * kPanel + j) * 4 + e % 4];
      const int q = e < 4 ? (b & 15) : (b >> 4);
      const float s = fp16_to_fp32(reinterpret_cast<const uint16_t*>(base + static_cast<size_t>(w.group) * kPanel / 2)[j]);
      const int z = w.symmetric ? w.fixed_zero() : reinterpret_cast<const uint8_t*>(base + static_cast<size_t>(w.group) * kPanel / 2 + kPanel * 2)[j];
      return s * static_cast<float>(w.nibble_value(q) - z);
    }
  }
  return 0;
}

}  // namespace

std::vector<float> unpack(const PackedWeight& w) {
  const int parts = w.gate_up ? 2 : 1;
  std::vector<float> out(static_cast<size_t>(parts) * w.n * w.k);
  for (int part = 0; part < parts; ++part)
    for (int panel = 0; panel < w.panels; ++panel) {
      const std::byte* src = w.panel_data(w.gate_up ? 2 * panel + part : panel);
      for (int j = 0; j < kPanel && panel * kPanel + j < w.n; ++j)
        for (int c = 0; c < w.k; ++c)
          out[(static_cast<size_t>(part) * w.n + panel * kPanel + j) * w.k + c] = panel_value(w, src, j, c);
    }
  return out;
}

}  // namespace tandem
