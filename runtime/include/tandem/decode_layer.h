// tandem/decode_layer.h: one token of one sequence through a decoder layer in two C++
// calls on the engine's pool, instead of transformers' dozens of torch operations and
// module calls per layer. Between the two calls the caller appends the step's key and
// value (or MLA's latent and rope key) to its KV cache (the cache stays the framework's).
//
// Two attention forms:
//   - GQA (Qwen3-MoE, Mixtral): RMSNorm, q/k/v, per-head q/k RMSNorms, rotary embedding,
//     attention over the cache;
//   - MLA (DeepSeek-V2): RMSNorm, the query (q_proj, or q_a_proj, RMSNorm, q_b_proj) and
//     kv_a_proj_with_mqa, the latent's RMSNorm, the complex rotary embedding of the rope
//     parts, then the weight-absorbed attention over the cached latents (mla_decode);
// then o_proj, residual, RMSNorm and a feed-forward: routed experts (softmax-then-top-k
// router), plus the shared experts' gated MLP if the layer has them, or a dense gated
// MLP; residual.
//
// Every step rounds to bf16 where transformers' bf16 forward rounds, with the same
// operations as tandem's module-by-module path (TandemRMSNorm, fused TandemLinears,
// decode_attention / mla_decode, TandemRouter, TandemExperts, gated_mlp_bf16), so the
// layer's output is bit-identical to that path's (tests/python/test_decode_layer.py):
//   x_n   = rms_norm(x)                                   (rms_norm_bf16)
//   GQA:  q|k|v = bf16(x_n . W_qkv^T)                     (one DenseLinear, bf16 out)
//         q, k  = rms_norm per head (when the layer has q_norm / k_norm)
//         q, k  = bf16(bf16(t * cos) + bf16(rotate_half(t) * sin))   (apply_rotary_pos_emb)
//         a     = decode_attention(q, the cache's keys and values)
//   MLA:  q|c   = bf16(x_n . W^T)   (q_proj's rows and kv_a's; or q_a's and kv_a's, then
//                 q = bf16(rms_norm(q_a) . W_qb^T))
//         latent = rms_norm(c[:rank]); the rope parts of q and c[rank:] times the position's
//                 complex frequencies in fp32 (re = ac - bd, im = ad + bc), rounded to bf16
//                 (DeepSeek-V2's apply_rotary_emb)
//         a     = mla_decode(q, the cached latents and rope keys)
//   h     = bf16(x + bf16(a . W_o^T))
//   MoE:  r = router(rms_norm(h)): logits, top-k scores (bf16 or fp32), expert ids
//         f = bf16(experts(rms_norm(h), ids, float(scores))), then bf16(f + mlp(rms_norm(h)))
//             with shared experts
//   dense: f = mlp(rms_norm(h))
//   y     = bf16(h + f)
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tandem/dense.h"
#include "tandem/kernels.h"

namespace tandem {

class Engine;

// The gated MLP of a dense layer or of a MoE block's shared experts (transformers'
// `down_proj(act_fn(gate_proj(x)) * up_proj(x))` with SiLU), rounding where its bf16
// forward rounds:
//   g|u = bf16(x . W_gu^T)          (one DenseLinear: the gate's rows, then the up's)
//   h   = bf16(bf16(silu(g)) * u)   (silu in fp32 with the kernel table's exponential, so
//                                    within an fp32 rounding of torch's before the bf16 one)
//   y   = bf16(h . W_down^T)
struct GatedMlp {
  std::shared_ptr<DenseLinear> gate_up;  // [2 * intermediate x hidden]
  std::shared_ptr<DenseLinear> down;     // [hidden x intermediate]
  bool empty() const { return !gate_up && !down; }
};
// Checks the two layers' shapes (errors name `name`).
void check_gated_mlp(const GatedMlp& mlp, const std::string& name);
// x [rows x hidden] -> y [rows x hidden], bf16 (y may be x). Two pool tasks; the
// activation on the calling thread.
void gated_mlp_bf16(const GatedMlp& mlp, const bf16_t* x, int64_t rows, bf16_t* y);

struct DecoderLayerSpec {
  int hidden = 0, q_heads = 0, kv_heads = 0, head_dim = 0;  // MLA: kv_heads 1, head_dim nope + rope
  float scale = 0.f;                   // attention's score scale
  const bf16_t* input_norm = nullptr;  // [hidden]
  const bf16_t* post_norm = nullptr;   // [hidden]
  float eps = 0.f;
  const bf16_t* q_norm = nullptr;  // GQA: [head_dim], with k_norm, or both null
  const bf16_t* k_norm = nullptr;
  float qk_eps = 0.f;
  std::shared_ptr<DenseLinear> qkv;  // GQA: [(q_heads + 2 kv_heads) * head_dim x hidden]; MLA: see below
  std::shared_ptr<DenseLinear> o;    // [hidden x q_heads * value width]

  // MLA (mla_rank > 0). qkv's rows: the query's (q_heads * head_dim; or q_lora_rank rows
  // when q_b is set), then kv_a's (mla_rank + rope).
  int mla_rank = 0, rope = 0, v_dim = 0;
  const bf16_t* kv_norm = nullptr;  // [mla_rank]
  float kv_eps = 0.f;
  std::shared_ptr<DenseLinear> q_b;  // [q_heads * head_dim x q_lora_rank], or null
  const bf16_t* q_a_norm = nullptr;  // [q_lora_rank], with q_b
  float q_a_eps = 0.f;
  std::shared_ptr<DenseLinear> w_uk, w_uv;  // kv_b_proj's halves as grouped layers (mla_decode)

  // Feed-forward: routed experts (moe_index >= 0: router and the engine's MoE layer), plus
  // `mlp` as shared experts when set; or the dense gated MLP `mlp` alone (moe_index < 0).
  std::shared_ptr<DenseLinear> router;  // [experts x hidden], bf16
  int top_k = 0;
  bool renorm = true, scores_f32 = false;
  DenseLinear::RouteOptions route;
  int moe_index = -1;
  GatedMlp mlp;
};

// A layer's cache buffers, with room for the position a step writes. GQA: keys and values
// [kv_heads x positions x head_dim] (k_h / v_h, k_l / v_l: element strides per head and per
// position). MLA: k the latents [positions x mla_rank], v the rope keys [positions x rope]
// (k_l, v_l per position; k_h, v_h unused).
struct LayerCache {
  bf16_t* k = nullptr;
  int64_t k_h = 0, k_l = 0;
  bf16_t* v = nullptr;
  int64_t v_h = 0, v_l = 0;
};

class DecoderLayerStep {
 public:
  // Checks the shapes (errors name the layer); keeps the dense layers alive.
  DecoderLayerStep(Engine& engine, DecoderLayerSpec spec, std::string name);

  bool mla() const { return s_.mla_rank > 0; }

  // GQA. x [hidden] (the layer's input), cos / sin [head_dim] (the position's rotary
  // embedding, bf16) -> q [q_heads x head_dim], k and v [kv_heads x head_dim], bf16.
  void qkv(const bf16_t* x, const bf16_t* cos, const bf16_t* sin, bf16_t* q, bf16_t* k, bf16_t* v);
  // GQA. x [hidden] (the layer's input again), q from qkv(), the cache [kv_heads x keys x
  // head_dim] (element strides per head and per key; the last key is this step's) ->
  // y [hidden], the layer's output (y may be x).
  void rest(const bf16_t* x, const bf16_t* q, const bf16_t* k, int64_t k_h, int64_t k_l, const bf16_t* v, int64_t v_h,
            int64_t v_l, int keys, bf16_t* y);

  // MLA. x [hidden], freqs [rope] (the position's rope / 2 complex frequencies, fp32 real
  // and imaginary parts interleaved) -> q [q_heads x head_dim], latent [mla_rank],
  // k_rope [rope], bf16.
  void qkv_mla(const bf16_t* x, const float* freqs, bf16_t* q, bf16_t* latent, bf16_t* k_rope);
  // MLA. x, q as above, the cache's latents [keys x mla_rank] and rope keys [keys x rope]
  // (element strides per key; the last is this step's) -> y [hidden] (y may be x).
  void rest_mla(const bf16_t* x, const bf16_t* q, const bf16_t* latent, int64_t latent_l, const bf16_t* k_rope,
                int64_t k_rope_l, int keys, bf16_t* y);

  // Both calls with the cache in between: the token's key and value (MLA: its latent and
  // rope key) written into `cache` at position `pos`, attention over positions [0, pos];
  // x [hidden] becomes the layer's output. GQA takes cos / sin, MLA freqs (as above).
  void step(bf16_t* x, const bf16_t* cos, const bf16_t* sin, const float* freqs, const LayerCache& cache,
            int pos);

  const DecoderLayerSpec& spec() const { return s_; }
  const std::string& name() const { return name_; }

 private:
  // a [q_heads x value width] (the attention's output) -> y: o_proj, residual, norm,
  // feed-forward, residual.
  void tail(const bf16_t* x, const bf16_t* a, bf16_t* y);

  Engine& e_;
  DecoderLayerSpec s_;
  std::string name_;
  int experts_ = 0;
};

// One token through consecutive decoder layers in one call: x [hidden] in place, layer i
// writing its key and value into caches[i] at `pos` (DecoderLayerStep::step). The layers
// are kept alive; their shapes must chain (each one's hidden size the same).
class DecoderStack {
 public:
  explicit DecoderStack(std::vector<std::shared_ptr<DecoderLayerStep>> layers);
  void run(bf16_t* x, const bf16_t* cos, const bf16_t* sin, const float* freqs, const LayerCache* caches, int pos);
  size_t size() const { return layers_.size(); }

 private:
  std::vector<std::shared_ptr<DecoderLayerStep>> layers_;
};

}  // namespace tandem
