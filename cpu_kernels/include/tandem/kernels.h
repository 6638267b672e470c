// tandem/kernels.h: expert projection kernels on packed weights.
//
// One expert projection is W [n x k] (gate/up: n = intermediate, k = hidden; down:
// n = hidden, k = intermediate). The kernels compute, for m token rows,
//
//   C[m x n] (+)= A[m x k] . W^T        A bf16, accumulation fp32
//
// plus two fused forms used by the MoE layer:
//   gate_up:  H[m x n] = silu(A . Wg^T) * (A . Wu^T)       (fp32 or bf16 out)
//             (or, per GateAct, a clamped SwiGLU; optional biases on g and u)
//   down:     C[m x n] += w[m] * (A . Wd^T)               (per-token routing weight)
//
// Weights are packed once into the layout the kernels read (PackedWeight, formats
// below). For each k-pair (bf16) or k-quad (int8), a panel row is 64 outputs x 4 bytes
// = 256 bytes = four zmm vectors: the operand of vdpbf16ps / vpdpbusd, and 16 such
// rows at stride 256 are an AMX B tile.
//
// Kernels are single-threaded over a range of output panels [panel_begin, panel_end);
// the MoE engine splits panels across its worker threads. Every ISA variant is one line
// of cpu_kernels/kernel_list.inc (kernel_list() below). Which one runs is chosen by
// feature set under the level select_isa() returns (cpu_features.h: a config's
// cpu.isa, lowered by TANDEM_ISA, capped by the hardware): the engine's layers hold
// kernel_table(level) of their own; the free functions gemm() / gate_up() below use
// the process table kernels().
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/cpu_features.h"

namespace tandem {

using bf16_t = uint16_t;  // raw bfloat16 bits

// fp32 <-> bf16, round to nearest even; NaN stays NaN (quiet), Inf stays Inf.
bf16_t fp32_to_bf16(float x) noexcept;
float bf16_to_fp32(bf16_t x) noexcept;
void fp32_to_bf16(const float* src, bf16_t* dst, size_t n) noexcept;

// Weight formats, each with the packed layout its kernels read (all in panels of 64
// output rows, padded rows are zero):
//   bf16  [k_pad/2][64][2] bf16 per panel, k_pad = k rounded up to 2.
//   int8  [k_pad/4][64][4] bytes q + 128 (q in [-127, 127]), then fp32 scale[64];
//         w = scale[row] * q. Symmetric, one scale per output row. k_pad = k rounded
//         up to 64 (an AMX tile's depth); the padding holds q = 0.
//   int4  per group of `group` k (32, 64 or 128; k must be a multiple): [group/8][64][4]
//         bytes whose low nibble holds q for k = 8o + e and high nibble for k = 8o + 4 + e,
//         then fp16 scale[64], then (asymmetric only) u8 zero[64]; w = scale * (q - zero),
//         q in [0, 15], zero = 8 for symmetric.
//         MXFP4 ("mxfp4": an int4 pack with e2m1 set, groups of 32, no zero bytes): each
//         nibble is an E2M1 code (sign, two exponent bits, one mantissa bit) whose value
//         times two is kE2m1Lut[q] - 12 (-12..12), and the group's fp16 scale holds
//         2^(e - 1) for the block's shared exponent e; w = scale * (kE2m1Lut[q] - 12).
// The integer kernels quantize each activation row on the fly (quantize_activations)
// and use integer dot products (vpdpbusd / AMX tdpbsud) with fp32 scaling.
enum class WeightFormat { bf16, int8, int4 };
std::string_view format_name(WeightFormat f) noexcept;
WeightFormat parse_format(std::string_view name);  // "bf16", "int8", "int4"
// E2M1 code -> 12 + twice its value: 0, 0.5, 1, 1.5, 2, 3, 4, 6, then the same negated.
inline constexpr uint8_t kE2m1Lut[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// Element types a source weight can have. q4_gptq: 4-bit weights quantized in groups along
// k, as GPTQ checkpoints store them (WeightView::q4). ggml_q8_0 / ggml_q4_1: GGUF's block
// types, each row k / 32 blocks of 32 weights (k and the view's column offset multiples of
// 32; ld, in weights, too): q8_0 = fp16 d, 32 x int8 q, w = d * q (34 bytes); q4_1 = fp16 d,
// fp16 m, 16 bytes of nibbles (weight j of the block: low nibble of byte j for j < 16, else
// the high nibble of byte j - 16), w = d * q + m (20 bytes). (GGUF's Q4_0 is a Q4Source.)
enum class SourceType { f32, bf16, f16, f8_e4m3, q4_gptq, ggml_q8_0, ggml_q4_1 };
std::string_view source_type_name(SourceType t) noexcept;
// ggml block types: weights per block (32) and bytes per block (34, 20); 0 for other types.
inline constexpr int kGgmlBlock = 32;
int ggml_block_bytes(SourceType t) noexcept;

// A 4-bit weight W [n x k] quantized in groups of `group` along k, as the common formats store
// it (element (r, c); g = c / group; "nibble i of a word" is bits 4i..4i+3):
//   gptq (AutoGPTQ / GPTQModel, "gptq" format): qweight int32 [k / 8, n], q = nibble c % 8 of
//        qweight[c / 8][r]; qzeros int32 [k / group, n / 8], zero = (nibble r % 8 of
//        qzeros[g][r / 8] + 1) & 15 (it stores zero - 1); scales [k / group, n]
//   awq  (AutoAWQ GEMM): qweight int32 [k, n / 8], q = nibble kAwqSlot[r % 8] of
//        qweight[c][r / 8] (AWQ's interleaved order); qzeros the same way, no offset; scales
//        [k / group, n]
//   packed_rows (compressed-tensors pack-quantized): weight_packed int32 [n, k / 8], q = nibble
//        c % 8 of word [r][c / 8] (the signed value + 8); zero = 8 when symmetric, else nibble
//        r % 8 of weight_zero_point int32 [n / 8, k / group] at [r / 8][g]; scales [n, k / group]
//   ggml_q4_0 (GGUF's Q4_0): qweight holds each row's k / 32 blocks of 18 bytes: fp16 scale
//        d, then 16 bytes of nibbles (weight j of the block: low nibble of byte j for j < 16,
//        else the high nibble of byte j - 16); group 32, zero 8, scales read from the blocks
//        (`scales` points at qweight)
//   w(r, c) = scale(g, r) * (q(r, c) - zero(g, r)), scales fp16, bf16 or fp32.
// Groups run along k in order (no act-order permutation: the loaders refuse one). The tensors
// may sit unaligned in their file: they are read bytewise.
struct Q4Source {
  enum class Layout { gptq, awq, packed_rows, ggml_q4_0 };
  static constexpr int kQ40Bytes = 18;  // ggml_q4_0: bytes per block of 32
  enum class Scale { f16, bf16, f32 };
  Layout layout = Layout::gptq;
  Scale scale_type = Scale::f16;
  const std::byte* qweight = nullptr;
  const std::byte* scales = nullptr;
  const std::byte* qzeros = nullptr;  // null: symmetric (packed_rows only)
  int n = 0, k = 0, group = 128;
  static constexpr int kAwqSlot[8] = {0, 4, 1, 5, 2, 6, 3, 7};  // nibble holding row r % 8
  // The weight's element (r, c) of the full matrix, exactly, in fp32.
  float value(int r, int c) const;
  uint8_t q(int r, int c) const {
    switch (layout) {
      case Layout::awq: return nibble(qweight, static_cast<size_t>(c) * (n / 8) + r / 8, kAwqSlot[r % 8]);
      case Layout::ggml_q4_0: {
        const int j = c % 32;
        const auto b = static_cast<uint8_t>(q40_block(r, c)[2 + j % 16]);
        return j < 16 ? (b & 15) : (b >> 4);
      }
      default: return nibble(qweight, row_word(r, c), c % 8);
    }
  }
  // gptq and packed_rows: the word holding k = c / 8 * 8 .. + 7 of row r.
  size_t row_word(int r, int c) const {
    return layout == Layout::gptq ? static_cast<size_t>(c / 8) * n + r : static_cast<size_t>(r) * (k / 8) + c / 8;
  }
  int zero(int g, int r) const {
    switch (layout) {
      case Layout::gptq: return (nibble(qzeros, static_cast<size_t>(g) * (n / 8) + r / 8, r % 8) + 1) & 15;
      case Layout::awq: return nibble(qzeros, static_cast<size_t>(g) * (n / 8) + r / 8, kAwqSlot[r % 8]);
      case Layout::packed_rows:
        return qzeros ? nibble(qzeros, static_cast<size_t>(r / 8) * (k / group) + g, r % 8) : 8;
      case Layout::ggml_q4_0: return 8;
    }
    return 8;
  }
  // ggml_q4_0: the block holding (r, c).
  const std::byte* q40_block(int r, int c) const {
    return qweight + (static_cast<size_t>(r) * (k / 32) + c / 32) * kQ40Bytes;
  }
  // q(r, c + i) for i < 8 into out (c a multiple of 8): one word for gptq and packed_rows,
  // which hold 8 consecutive k of a row per word.
  void octet(int r, int c, uint8_t* out) const {
    if (layout == Layout::ggml_q4_0) {  // bytes j % 16 .. + 7 of the block, low or high nibbles
      const std::byte* qs = q40_block(r, c) + 2 + c % 16;
      const int shift = c % 32 < 16 ? 0 : 4;
      for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>((static_cast<uint8_t>(qs[i]) >> shift) & 15);
      return;
    }
    if (layout == Layout::awq) {
      for (int i = 0; i < 8; ++i) out[i] = q(r, c + i);
      return;
    }
    uint32_t v;
    std::memcpy(&v, qweight + 4 * row_word(r, c), 4);
    for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>((v >> (4 * i)) & 15);
  }
  float scale(int g, int r) const;
  const std::byte* scale_at(int g, int r) const;  // where scale(g, r) is stored
  // The scale as fp16 bits; false when fp16 cannot hold it exactly.
  bool scale_fp16(int g, int r, uint16_t& bits) const;
  static uint8_t nibble(const std::byte* p, size_t word, int i) {
    uint32_t v;
    std::memcpy(&v, p + 4 * word, 4);
    return static_cast<uint8_t>((v >> (4 * i)) & 15);
  }
};
std::string_view q4_layout_name(Q4Source::Layout l) noexcept;  // "GPTQ", "AWQ", "compressed-tensors", "GGUF Q4_0"

// A weight matrix W [n x k] as it sits in a checkpoint. FP8 E4M3 weights may carry
// block scales the way DeepSeek-V3 ships them (weight_scale_inv): element (r, c) is
// fp8(r, c) * block_scale[(r / block_n) * ceil(k / block_k) + c / block_k].
struct WeightView {
  const void* data = nullptr;
  SourceType type = SourceType::f32;
  int n = 0, k = 0;
  int64_t ld = 0;  // row stride in elements; 0 means k
  const float* block_scale = nullptr;
  int block_n = 128, block_k = 128;
  // A view into part of a block-scaled weight starts at (row0, col0) of the full matrix,
  // whose block-scale rows hold scale_ld entries (0: ceil(k / block_k)).
  int row0 = 0, col0 = 0, scale_ld = 0;
  // Where the weight comes from, for error messages (null: unknown): a checkpoint
  // tensor's name and file. Errors about an element give its (row0 + r, col0 + c).
  const char* name = nullptr;
  const char* file = nullptr;
  // q4_gptq: the whole quantized matrix (data unused); this view is its rows [row0, row0 + n)
  // x columns [col0, col0 + k).
  const Q4Source* q4 = nullptr;
};
// Rows [r0, r0 + rows) x columns [c0, c0 + cols) of w, as a view of its own.
WeightView sub_view(const WeightView& w, int r0, int rows, int c0, int cols);

// Packing a q4_gptq source into int4 with the source's own group size keeps its numbers:
// the nibbles, the fp16 scales and the zero points are copied, not quantized again (a
// zero point other than 8 needs symmetric = false, or the packing is refused naming the
// element). Other formats and group sizes quantize its exact values again.
struct PackOptions {
  WeightFormat format = WeightFormat::bf16;
  int group = 128;         // int4: k values per scale (32, 64 or 128)
  bool symmetric = true;   // int4: zero point fixed at 8, or one zero point per group
  bool e2m1 = false;       // int4 as MXFP4 (format "mxfp4"): group 32, symmetric, E2M1 codes
};
// The pack options of a format name ("bf16", "int8", "int4", "mxfp4") and int4's keys:
// "mxfp4" is int4 with e2m1, groups of 32 and no zero points whatever group and
// zero_point say (as they say nothing for bf16 and int8: the config refuses them there).
PackOptions pack_options(std::string_view format, int group, bool zero_point);
// "bf16", "int8", "int4" or "mxfp4".
std::string_view format_name(const PackOptions& o) noexcept;
// Whether packs made with a and b are the same: format, and for int4 its group, zero
// points and MXFP4 codes.
bool same_packing(const PackOptions& a, const PackOptions& b) noexcept;

inline constexpr int kPanel = 64;  // output rows per packed panel

// Packed weights and scratch, 64-byte aligned. Buffers of 2 MiB and more are mapped
// on their own, 2 MiB aligned, and marked for transparent huge pages (MADV_HUGEPAGE:
// where the kernel's THP mode is "madvise", the default of many distributions, plain
// allocations get 4 KiB pages, and a kernel streaming weights then misses the TLB
// every 4 KiB). The pages are still placed by first touch. A borrowed buffer is a view
// of memory another owner frees (a PackedWeight over part of a larger pack: the prefill
// attention's key blocks).
struct AlignedBufferFree {
  size_t mapped = 0;  // bytes mapped with mmap; 0: from aligned_alloc
  bool borrowed = false;  // not freed here
  void operator()(std::byte* p) const noexcept;
};
struct AlignedBuffer {
  using Free = AlignedBufferFree;
  std::unique_ptr<std::byte[], Free> ptr;
  size_t size = 0;
  static AlignedBuffer allocate(size_t bytes);
  // A view of `bytes` at p (64-byte aligned, as the kernels' aligned loads need), which
  // must outlive it.
  static AlignedBuffer borrow(std::byte* p, size_t bytes);
  std::byte* data() const { return ptr.get(); }
};

struct PackedWeight {
  WeightFormat format = WeightFormat::bf16;
  int n = 0, k = 0;        // logical shape of W (of gate, for a gate_up pack)
  int panels = 0;          // ceil(n / 64): output panels
  int k_pad = 0;           // k padded as the format's layout needs (see above)
  int k_pairs = 0;         // bf16: k_pad / 2
  int group = 0;           // int4: k per group; int8: k_pad (one group)
  bool symmetric = true;   // int4
  bool e2m1 = false;       // int4: MXFP4 (nibbles are E2M1 codes; see the layouts above)
  bool gate_up = false;    // panels stored as gate 0, up 0, gate 1, up 1, ...
  size_t panel_stride = 0;  // bytes per stored panel, scales included
  size_t group_stride = 0;  // int4: bytes per group inside a panel
  AlignedBuffer data;
  int groups() const { return format == WeightFormat::int4 ? k / group : 1; }
  size_t panel_bytes() const { return panel_stride; }
  // Stored panel i (for a gate_up pack, gate panel p is 2p and up panel p is 2p + 1).
  const std::byte* panel_data(int p) const { return data.data() + static_cast<size_t>(p) * panel_stride; }
  const bf16_t* panel(int p) const { return reinterpret_cast<const bf16_t*>(panel_data(p)); }
  size_t bytes() const { return data.size; }
  PackOptions options() const { return {format, group, symmetric, e2m1}; }
  // int4: the zero point of a pack without zero bytes (8, or 12 for MXFP4: its code
  // table's 0), and the value a nibble stands for before it (the code table's for MXFP4).
  int fixed_zero() const { return e2m1 ? 12 : 8; }
  int nibble_value(int q) const { return e2m1 ? kE2m1Lut[q] : q; }
};

// Packs W into opt.format. Parallel over panels (OpenMP) and deterministic: every
// scale and quantized value depends only on its own row (and group). Throws
// tandem::Error naming the problem for bad shapes, NaN/Inf weights in an integer
// format, k not a multiple of the int4 group, or scales fp16 cannot hold.
PackedWeight pack(const WeightView& w, const PackOptions& opt = {});
// Gate and up of one expert in one weight: panels alternate gate, up, gate, up, ...
PackedWeight pack_gate_up(const WeightView& gate, const WeightView& up, const PackOptions& opt = {});
// The pack of columns [c0, c0 + cols) of w: pack(sub_view(w, 0, w.n, c0, cols)), except
// that int8's row scales are taken over each whole row of w, so the result equals the
// same columns cut from pack(w) (slice_cols): a weight split along k (a down projection
// over several subpools) holds the same numbers however it is split. c0 must be a
// multiple of the format's column unit (column_unit: 2, 64, or the int4 group).
PackedWeight pack_cols(const WeightView& w, int c0, int cols, const PackOptions& opt = {});
// The smallest column step at which a pack in opt's format can be cut along k.
int column_unit(const PackOptions& opt);
// The layout of a pack of W [n x k] (gate_up: gate and up panels) in opt's format: shape,
// padding and strides, no data (where a stored pack's bytes sit).
PackedWeight pack_layout(const PackOptions& opt, int n, int k, bool gate_up = false);
// pack_layout with its data allocated and uninitialized: what pack() / pack_gate_up() fill
// (readers of stored packs).
PackedWeight empty_pack(const PackOptions& opt, int n, int k, bool gate_up = false);
// Where columns [c0, c0 + cols) of one stored panel of `full` sit inside it: `bytes` at
// `offset` (the panel's products), then, for int8, `tail_bytes` at `tail_offset` (its row
// scales). Copied in that order, they make the stored panel of a pack of those columns
// (empty_pack(opt, full.n, cols)). c0 as for pack_cols.
struct ColumnBytes {
  size_t offset = 0, bytes = 0, tail_offset = 0, tail_bytes = 0;
};
ColumnBytes column_bytes(const PackedWeight& full, int c0, int cols);
// Columns [c0, c0 + cols) of a (non-gate_up) pack, cut byte for byte (column_bytes).
PackedWeight slice_cols(const PackedWeight& full, int c0, int cols);
// Bytes pack(W [n x k], opt) (gate_up = false) or pack_gate_up(gate, up [n x k], opt)
// (gate_up = true) will hold, from the shape alone (memory planning: tandem doctor).
// Throws tandem::Error for shapes pack() refuses.
size_t packed_bytes(const PackOptions& opt, int n, int k, bool gate_up = false);
// Shorthands for BF16 packs of row-major bf16 / fp32 weights (leading dimension ld).
PackedWeight pack_bf16(const bf16_t* w, int n, int k, int ld);
PackedWeight pack_bf16_from_fp32(const float* w, int n, int k, int ld);
PackedWeight pack_gate_up_bf16(const bf16_t* gate, const bf16_t* up, int n, int k, int ld);
// The dense fp32 matrix a packed weight represents, i.e. the dequantized weights:
// [n x k], or [2n x k] (gate rows, then up rows) for a gate_up pack.
std::vector<float> unpack(const PackedWeight& w);
// Rows [r0, r0 + rows) of a source decoded to fp32 (block scales applied), row stride k.
void decode_rows(const WeightView& w, int r0, int rows, float* out);
// One element of a source weight as fp32 (references, tests).
float source_value(const WeightView& w, int r, int c);

// fp16 <-> fp32 (round to nearest even).
uint16_t fp32_to_fp16(float x) noexcept;
float fp16_to_fp32(uint16_t x) noexcept;
// FP8 E4M3 (OCP "e4m3fn": no Inf, 0x7f / 0xff are NaN) to fp32; exact.
float fp8_e4m3_to_fp32(uint8_t x) noexcept;

// How the integer kernels quantize activations, exposed for references: per row,
// scale = max|a| / 127 and q = round_nearest_even(a * (127 / max|a|)) in [-127, 127]
// (a zero row has scale 0); q is padded with zeros to k_pad columns; sums[r * groups
// + g] = sum of q over group g (`group` columns each). A row holding NaN or Inf gets
// scale NaN, so its outputs are NaN rather than silently finite.
void quantize_activations(const bf16_t* a, int m, int k, int lda, int k_pad, int group, int8_t* q, float* scale,
                          int32_t* sums);
void quantize_activations(const float* a, int m, int k, int lda, int k_pad, int group, int8_t* q, float* scale,
                          int32_t* sums);

// Activations quantized once for several integer-kernel calls on weights with the same
// k and layout (the panel ranges of a thread pool, gate_up then a second expert, ...):
// without it every call quantizes its input again.
struct QuantizedActs {
  int m = 0, k = 0, k_pad = 0, group = 0;
  std::vector<int8_t> q;        // [m x k_pad]
  std::vector<float> scale;     // [m]
  std::vector<int32_t> sums;    // [m x k_pad / group]
  // Sizes the buffers for m rows of input to w (an int8 or int4 pack).
  void prepare(const PackedWeight& w, int rows);
  bool matches(const PackedWeight& w) const { return k == w.k && k_pad == w.k_pad && group == w.group; }
};
struct KernelTable;
// Quantizes rows [r0, r1) of A (bf16 or fp32, row stride lda) into qa with kt's
// quantizer (default: the process table, kernels()); disjoint row ranges may run on
// different threads.
void quantize_activations(QuantizedActs& qa, const bf16_t* a, int lda, int r0, int r1, const KernelTable* kt = nullptr);
void quantize_activations(QuantizedActs& qa, const float* a, int lda, int r0, int r1, const KernelTable* kt = nullptr);

// ---- kernels ------------------------------------------------------------------------
// Exactly one of a (bf16) and a_f32 (fp32) is the input, or, for the integer formats,
// qa (already quantized). The BF16 kernels round fp32 input to bf16.
struct GemmArgs {
  const bf16_t* a = nullptr;  // [m x k], row stride lda (elements)
  const float* a_f32 = nullptr;
  const QuantizedActs* qa = nullptr;
  int m = 0, lda = 0;
  float* c = nullptr;         // [m x n] fp32, row stride ldc
  int ldc = 0;
  bool accumulate = false;    // C += instead of C =
  const float* row_scale = nullptr;  // optional [m]: C (+)= row_scale[r] * (A.W^T)[r]
  int panel_begin = 0, panel_end = -1;  // -1: all panels
  // Optional: the same input (a, or qa's q) in the tile order of pack_row_tiles, for the
  // variants with KernelVariant::row_tiles (others ignore it; a / qa stay required).
  const std::byte* a_tiles = nullptr;
};

// The gate_up epilogue's activation of g = A . Wg^T (+ gate_bias) and u = A . Wu^T (+ up_bias):
//   silu      h = silu(g) * u
//   clamped   a clamped SwiGLU: g' = min(g, limit), u' = clamp(u, -limit, limit),
//             h = g' * sigmoid(alpha * g') * (u' + up_offset)
//             gpt-oss (and MiniMax-M3): alpha 1.702, limit 7, up_offset 1; DeepSeek-V4 and
//             HY-V4: alpha 1 (silu of the clamped gate), up_offset 0.
// NaN in g or u gives NaN in h in both.
struct GateAct {
  enum class Kind : uint8_t { silu, clamped };
  Kind kind = Kind::silu;
  float alpha = 1.0f, limit = 7.0f, up_offset = 0.0f;  // clamped only
  bool plain() const { return kind == Kind::silu; }
  bool operator==(const GateAct&) const = default;
};

struct GateUpArgs {
  const bf16_t* a = nullptr;  // [m x k]
  const float* a_f32 = nullptr;
  const QuantizedActs* qa = nullptr;
  int m = 0, lda = 0;
  float* h = nullptr;         // [m x n] fp32 out, or
  bf16_t* h_bf16 = nullptr;   // [m x n] bf16 out (exactly one of the two)
  int ldh = 0;
  int panel_begin = 0, panel_end = -1;  // in units of gate (= up) panels
  GateAct act;
  // Optional [n] fp32 biases added to g and u before the activation (output j of the
  // pack: gate_bias[j]); both or neither.
  const float* gate_bias = nullptr;
  const float* up_bias = nullptr;
  const std::byte* a_tiles = nullptr;  // optional, as in GemmArgs
};

using GemmFn = void (*)(const PackedWeight& w, const GemmArgs& args);
// quantize_activations of one ISA: a or a_f32 (one is null) into q, scale, sums.
using QuantizeFn = void (*)(const bf16_t* a, const float* a_f32, int m, int k, int lda, int k_pad, int group, int8_t* q,
                            float* scale, int32_t* sums);
using GateUpFn = void (*)(const PackedWeight& w, const GateUpArgs& args);
// h[j] = silu(g[j]) * u[j] for j < n: the very arithmetic of the gate_up kernels'
// epilogue (the same inline code, compiled with the level's flags), so a layer that
// adds to the pre-activations first (LoRA) activates them bit for bit like gate_up.
using SiluMulFn = void (*)(const float* g, const float* u, float* h, int n);
// out[j] = 1 / (1 + exp(-x[j])) with the same exponential as silu_mul (the LoRA backward's
// SiLU derivative); a companion of silu_mul in that family, from the same ISA file.
using SigmoidFn = void (*)(const float* x, float* out, int n);
// h[j] = the clamped SwiGLU of GateAct (alpha, limit, up_offset) for j < n: the gate_up
// epilogue's arithmetic for GateAct::Kind::clamped, from the silu_mul family's line.
using ClampedSwigluFn = void (*)(const float* g, const float* u, float* h, int n, float alpha, float limit,
                                 float up_offset);

struct KernelVariant {
  const char* name = nullptr;  // "avx512_bf16", "avx512_vnni", "amx_bf16", ...
  GemmFn gemm = nullptr;
  GateUpFn gate_up = nullptr;
  bool row_tiles = false;  // reads GemmArgs::a_tiles when given (the AMX kernels)
};

// ---- inputs in the AMX kernels' tile order ------------------------------------------
// The AMX kernels load their input A as tiles of 16 rows x 64 bytes. From plain rows
// they copy each call's rows into that order first, per call (rows a power of two apart
// would evict each other from L1 as tile rows). A caller that makes several calls on the
// same rows (the MoE engine: every work item of one expert) packs them once instead and
// passes the result as a_tiles (on an AMX Xeon the engine's calls ran 1.04-1.14x faster
// that way at 64-128 rows per expert: bench/RESULTS.md).
// Layout: [block of 16 rows][64-byte step along the row][16 rows][64 bytes]; rows from m
// up to the next multiple of 16 are zero.
// The bytes of one input row as the kernels for w read it (bf16: 2k; int8 / int4: the
// quantized row, k_pad).
size_t row_tile_row_bytes(const PackedWeight& w);
size_t row_tiles_bytes(int m, size_t row_bytes);
// Packs m rows of row_bytes (a multiple of 64) each, lda_bytes apart, into out
// (row_tiles_bytes(m, row_bytes) bytes, 64-byte aligned).
void pack_row_tiles(const void* a, size_t lda_bytes, int m, size_t row_bytes, std::byte* out);
// Whether v uses a_tiles for w (the AMX kernels, except BF16 with k % 32 != 0 and INT4 with
// groups of 32, whose steps are not 64 bytes of a row).
bool takes_row_tiles(const KernelVariant& v, const PackedWeight& w);

// The kernels for one format at one ISA level: `small` below large_from_m token rows
// (decode, bandwidth-bound), `large` from there on (prefill, compute-bound).
struct FormatKernels {
  KernelVariant small, large;
  int large_from_m = 1 << 30;
  const KernelVariant& pick(int m) const { return m >= large_from_m ? large : small; }
};

struct KernelTable {
  IsaLevel level;
  const char* name;  // the level's name
  FormatKernels bf16, int8, int4;
  QuantizeFn quantize;
  SiluMulFn silu_mul;
  SigmoidFn sigmoid;  // from the silu_mul family's line
  ClampedSwigluFn clamped_swiglu;  // from the silu_mul family's line
  const FormatKernels& of(WeightFormat f) const {
    return f == WeightFormat::int8 ? int8 : f == WeightFormat::int4 ? int4 : bf16;
  }
};

// The table for a level: select_kernels(level, cpu_features()), built once. A level
// without its own variant for a format runs the best one it allows (the variant's name
// says which code runs). Throws tandem::Error when the level is above the hardware.
const KernelTable& kernel_table(IsaLevel level);
// The process-wide table for effective_isa(), resolved on first use (for the free
// functions below; engines and layers hold the table of their own config's level).
const KernelTable& kernels();

// ---- the kernel list ----------------------------------------------------------------
// Families of kernel_list.inc: the three weight formats (gemm + gate_up), and the two
// helpers that each ISA file compiles with its own flags.
enum class KernelFamily { bf16, int8, int4, quantize, silu_mul };
std::string_view family_name(KernelFamily f) noexcept;
constexpr KernelFamily family_of(WeightFormat f) {
  return f == WeightFormat::int8 ? KernelFamily::int8 : f == WeightFormat::int4 ? KernelFamily::int4 : KernelFamily::bf16;
}

// One line of the list.
struct KernelListEntry {
  KernelFamily family;
  const char* isa;       // its source file's suffix ("avxvnni": gemm_q_avxvnni.cpp), which sets its flags
  FeatureSet needs;      // what those flags let the compiler emit: the CPU must have all of it
  int from_m;            // preferred from this many token rows on (1: at every m)
  KernelVariant kernel;  // kernel.name is the line's name; gemm / gate_up for bf16, int8, int4
  QuantizeFn quantize;   // family quantize
  SiluMulFn silu_mul;    // family silu_mul
  SigmoidFn sigmoid;     // family silu_mul
  ClampedSwigluFn clamped_swiglu = nullptr;  // family silu_mul
  const char* name() const { return kernel.name; }
};
// Every line, in list order (within a family, later lines are preferred).
std::span<const KernelListEntry> kernel_list();
// The line of `family` called `name`, or nullptr.
const KernelListEntry* find_kernel(KernelFamily family, std::string_view name);
// The table kernel_table(cap) holds on a CPU with features f: per family, the last line
// whose features f has and level_allows(cap) admits; a line with from_m > 1 becomes the
// format's `large` from that m on, over the best line with from_m = 1. The table's
// level and name are cap's. A pure function of its arguments (tests pass made-up CPUs).
KernelTable select_kernels(IsaLevel cap, const CpuFeatures& f);
// `table` with `e` run for its family at every m: one variant whatever the preference
// (tests, bench_kernels --variant). Throws tandem::Error (unsupported) naming the first
// feature e needs that this CPU lacks.
KernelTable with_kernel(KernelTable table, const KernelListEntry& e);

// Validated entry points through kernels() (TANDEM_CHECK on every argument).
void gemm(const PackedWeight& w, const GemmArgs& args);
void gate_up(const PackedWeight& w, const GateUpArgs& args);
// Refuses (naming `what`) one bias without the other, or a clamped SwiGLU with a non-finite
// alpha / limit / up_offset or a limit <= 0 (the second overload: that part alone, which
// the layers check when they are built).
void check_gate_act(const char* what, const GateUpArgs& args);
void check_gate_act(const std::string& what, const GateAct& act);

}  // namespace tandem
