// tandem/dense.h: a dense linear layer (nn.Linear without its bias) on tandem's expert
// kernels and worker pool, for the layers of a model that run on the CPU besides its
// routed experts (attention projections, shared experts and dense MLPs, lm_head).
//
// The weight [n x k] is packed once in the chosen format (the experts' formats: bf16,
// int8 per output row, int4 with groups) and split by output panels over the pool's
// subpools, each subpool's slice in one piece per thread, packed (and first touched) by
// its own threads in parallel. forward()
// runs one task on the pool and waits for it (and so for every task queued before it:
// an engine's MoE layers share the pool, FIFO): the input is rounded to bf16 (or
// quantized) once, then every subpool's threads run runs of its panels through the
// kernel table's gemm for the row count (AMX / VNNI / AVX-512 as for the experts).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tandem/kernels.h"
#include "tandem/pool.h"

namespace tandem {

// The RMSNorm of transformers' Llama-family models (Qwen3, Qwen3-MoE, Mixtral, DeepSeek,
// ...) on bf16 rows: for each of `rows` rows of n values, h = x * 1 / sqrt(mean(x^2) + eps)
// in fp32, rounded to bf16, then y = bf16(w * h) (torch's `weight * h.to(bf16)`). One
// pass per row on the calling thread (no pool task: a decode step's norm is microseconds).
// x, w, y: bf16 bits; y may alias x. The sum of squares is accumulated in double, so it
// can differ from torch's fp32 sum in the last bit of the mean.
void rms_norm_bf16(const uint16_t* x, const uint16_t* w, float eps, int64_t rows, int n, uint16_t* y);

class DenseLinear {
 public:
  // Packs w; errors name `name` (and the element, for a NaN or Inf weight: refused in
  // every format).
  DenseLinear(Pool& pool, const KernelTable& kernels, const WeightView& w, const PackOptions& format, std::string name);
  // A grouped layer: `groups` weights of [n / groups x k] stacked in w, group g's rows
  // applied to its own input (the g-th k values of each input row, see forward): the
  // per-head products of MLA's weight-absorbed decode in one pool task. bf16 only;
  // n / groups must be a multiple of the panel width (kPanel outputs).
  DenseLinear(Pool& pool, const KernelTable& kernels, const WeightView& w, const PackOptions& format, std::string name,
              int groups);
  ~DenseLinear();
  DenseLinear(const DenseLinear&) = delete;
  DenseLinear& operator=(const DenseLinear&) = delete;

  // y [m x n] (fp32, row stride ldy >= n) = x [m x k] . W^T, x bf16 (x_bf16) or fp32 with
  // row stride ldx >= k. Grouped: x [m x groups * k] (ldx >= groups * k), and output
  // columns [g * n / groups, (g + 1) * n / groups) of row r are x[r, g * k : (g + 1) * k]
  // times group g's weight. Blocks until done; rethrows a task's error.
  void forward(const void* x, bool x_bf16, int m, int ldx, float* y, int ldy);
  // The same, y rounded to bf16 (round to nearest even, as torch's .to(bfloat16)) by the
  // pool's threads, each on the columns it computed: y_bf16 [m x n] bf16 bits, row stride ldy.
  void forward_bf16(const void* x, bool x_bf16, int m, int ldx, uint16_t* y_bf16, int ldy);

  // A MoE router of the softmax-then-top-k form (Qwen2/3-MoE, Mixtral, OLMoE, MiniMax:
  // transformers' `F.linear` logits, softmax in fp32, top_k, optionally divided by their
  // sum; DeepSeek-V2's fp32 logits, greedy or group-limited, scaled) for m rows: logits
  // [m x n] (bf16 bits, the kernel's fp32 sums rounded once as torch rounds its bf16
  // linear; or those fp32 sums, as DeepSeek-V2's fp32 linear of the same bf16 values),
  // scores [m x top_k] (fp32, or bf16 bits if !scores_f32) and index [m x top_k], selected
  // as torch.topk selects on the CPU (the same std algorithms, comparator and ranges: equal
  // probabilities resolve alike, NaN first; largest first unless !sorted, which keeps
  // std::nth_element's order as torch.topk(sorted=False) does). The products run as
  // forward() does (bf16 weights only); the rest on the calling thread.
  struct RouteOptions {
    bool sorted = true;
    bool logits_f32 = false;
    float scale = 1.0f;  // every score times this (DeepSeek's routed_scaling_factor), after renorm
    // group-limited greedy (DeepSeek-V2): experts in `groups` equal groups; only the
    // top_groups groups by their largest probability compete, the others' probabilities
    // set to 0 before the top k. groups = 1: all compete.
    int groups = 1, top_groups = 1;
  };
  void route(const void* x, bool x_bf16, int m, int ldx, int top_k, bool renorm, void* logits, void* scores,
             bool scores_f32, int64_t* index, const RouteOptions& options);
  void route(const void* x, bool x_bf16, int m, int ldx, int top_k, bool renorm, void* logits, void* scores,
             bool scores_f32, int64_t* index) {
    route(x, x_bf16, m, ldx, top_k, renorm, logits, scores, scores_f32, index, RouteOptions{});
  }

  int n() const { return n_; }
  int k() const { return k_; }
  int groups() const { return groups_; }
  const PackOptions& format() const { return format_; }
  const std::string& name() const { return name_; }
  const KernelTable& kernels() const { return kt_; }
  size_t bytes() const;  // packed bytes, all slices
  // The packed weight as fp32 [n x k] (nn.Linear layout): what forward multiplies by.
  std::vector<float> dequantized() const;

 private:
  struct Piece {
    int n0 = 0, n = 0;  // output columns [n0, n0 + n)
    PackedWeight w;
  };
  class Forward;
  Pool& pool_;
  const KernelTable& kt_;
  PackOptions format_;
  std::string name_;
  int n_ = 0, k_ = 0, groups_ = 1;
  std::vector<std::vector<Piece>> pieces_;  // per subpool: its slice of output panels, in pieces
};

}  // namespace tandem
