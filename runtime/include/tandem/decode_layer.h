// tandem/decode_layer.h: one token of one sequence through a Qwen3-MoE-form decoder layer
// (RMSNorm, q/k/v, per-head q/k RMSNorms, rotary embedding, attention over a KV cache,
// o_proj, residual, RMSNorm, softmax-then-top-k router, routed experts, residual) in two
// C++ calls on the engine's pool, instead of transformers' dozens of torch operations and
// module calls per layer. Between the two calls the caller appends the step's key and
// value to its KV cache (the cache stays the framework's).
//
// Every step rounds to bf16 where transformers' bf16 forward rounds, with the same
// operations as tandem's module-by-module path (TandemRMSNorm, a fused TandemLinear,
// decode_attention, TandemRouter, TandemExperts), so the layer's output is bit-identical
// to that path's (tests/python/test_decode_layer.py):
//   x_n   = rms_norm(x)                                   (rms_norm_bf16)
//   q|k|v = bf16(x_n . W_qkv^T)                          (one DenseLinear, bf16 out)
//   q, k  = rms_norm per head (when the layer has q_norm / k_norm)
//   q, k  = bf16(bf16(t * cos) + bf16(rotate_half(t) * sin))   (apply_rotary_pos_emb)
//   a     = decode_attention(q, the cache's keys and values)
//   h     = bf16(x + bf16(a . W_o^T))
//   r     = router(rms_norm(h)): logits, top-k scores (bf16 or fp32), expert ids
//   y     = bf16(h + bf16(experts(rms_norm(h), ids, float(scores))))
#pragma once

#include <cstdint>
#include <memory>

#include "tandem/dense.h"
#include "tandem/kernels.h"

namespace tandem {

class Engine;

struct DecoderLayerSpec {
  int hidden = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  float scale = 0.f;                   // attention's score scale
  const bf16_t* input_norm = nullptr;  // [hidden]
  const bf16_t* post_norm = nullptr;   // [hidden]
  float eps = 0.f;
  const bf16_t* q_norm = nullptr;  // [head_dim], with k_norm, or both null
  const bf16_t* k_norm = nullptr;
  float qk_eps = 0.f;
  std::shared_ptr<DenseLinear> qkv;     // [(q_heads + 2 kv_heads) * head_dim x hidden]: q, k, v rows
  std::shared_ptr<DenseLinear> o;       // [hidden x q_heads * head_dim]
  std::shared_ptr<DenseLinear> router;  // [experts x hidden], bf16
  int top_k = 0;
  bool renorm = true, sorted = true, scores_f32 = false;
  int moe_index = -1;  // the engine's MoE layer
};

class DecoderLayerStep {
 public:
  // Checks the shapes (errors name the layer); keeps the dense layers alive.
  DecoderLayerStep(Engine& engine, DecoderLayerSpec spec, std::string name);

  // x [hidden] (the layer's input), cos / sin [head_dim] (the position's rotary
  // embedding, bf16) -> q [q_heads x head_dim], k and v [kv_heads x head_dim], bf16.
  void qkv(const bf16_t* x, const bf16_t* cos, const bf16_t* sin, bf16_t* q, bf16_t* k, bf16_t* v);
  // x [hidden] (the layer's input again), q from qkv(), the cache [kv_heads x keys x
  // head_dim] (element strides per head and per key; the last key is this step's) ->
  // y [hidden], the layer's output (y may be x).
  void rest(const bf16_t* x, const bf16_t* q, const bf16_t* k, int64_t k_h, int64_t k_l, const bf16_t* v, int64_t v_h,
            int64_t v_l, int keys, bf16_t* y);

  const DecoderLayerSpec& spec() const { return s_; }
  const std::string& name() const { return name_; }

 private:
  Engine& e_;
  DecoderLayerSpec s_;
  std::string name_;
  int experts_ = 0;
};

}  // namespace tandem
