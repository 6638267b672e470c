// tandem/attention.h: decode and prefill attention on the worker pool. One query row per sequence
// and head (a generation step) against a KV cache, for the CPU models whose other layers
// run on tandem's kernels: torch's SDPA runs it on the one thread it keeps beside the
// pool, reading the whole cache at a single core's speed, once per layer and token.
//
// For each sequence b and query head h (kv head g = h / (q_heads / kv_heads), GQA):
//   s_l = scale * q[b,h] . k[b,g,l]          for the keys l with mask[b,l] (all without a mask)
//   out[b,h] = sum_l softmax(s)_l * v[b,g,l]
// in fp32 from bf16 q, k, v, the output rounded to bf16 once (SDPA's CPU kernels also
// accumulate bf16 attention in fp32: the two differ by summation order). The keys are
// split into chunks over the pool's threads (flash-decoding: per chunk a running max,
// sum and weighted value sum, combined per head in a second phase), so one layer's cache
// is read by every core. A row whose mask admits no key gets zeros.
//
// A key may come in two parts held apart (MLA's weight-absorbed decode: the compressed
// latent and the shared rope key, cached as two tensors): with k2 set, q's first
// head_dim - k2_dim values are dotted with k's rows and its last k2_dim with k2's.
#pragma once

#include <cstdint>

#include "tandem/cpu_features.h"
#include "tandem/kernels.h"
#include "tandem/pool.h"

namespace tandem {

struct DecodeAttention {
  int batch = 0, q_heads = 0, kv_heads = 0, keys = 0;
  int head_dim = 0;   // of q and k
  int value_dim = 0;  // of v and out (0: head_dim; MLA's differ)
  float scale = 0.f;
  // Element strides; the elements of a row are contiguous.
  const bf16_t* q = nullptr;  // [batch, q_heads, head_dim]
  int64_t q_b = 0, q_h = 0;
  const bf16_t* k = nullptr;  // [batch, kv_heads, keys, head_dim - k2_dim]
  int64_t k_b = 0, k_h = 0, k_l = 0;
  const bf16_t* k2 = nullptr;  // optional [batch, kv_heads, keys, k2_dim]: the key's second part
  int64_t k2_b = 0, k2_h = 0, k2_l = 0;
  int k2_dim = 0;
  const bf16_t* v = nullptr;  // [batch, kv_heads, keys, value_dim]
  int64_t v_b = 0, v_h = 0, v_l = 0;
  const uint8_t* mask = nullptr;  // optional [batch, keys]: nonzero = attend
  int64_t mask_b = 0;
  bf16_t* out = nullptr;  // [batch, q_heads, value_dim]
  int64_t out_b = 0, out_h = 0;
};

// Validates `a` (errors name the field), runs it as one task on `pool` with the vector
// code `level` allows (AVX-512, AVX2 + FMA, or scalar) and waits.
void decode_attention(Pool& pool, IsaLevel level, const DecodeAttention& a);

// Prefill attention on the pool: `queries` query rows per sequence and head (a prompt, or
// a chunk of one after keys - queries cached keys) against `keys` keys. Query row i sits at
// position keys - queries + i; with `causal` it sees the keys l <= that position, with a
// mask the keys whose byte in its row is nonzero, with both the keys both admit.
//
// Flash attention whose two products run on tandem's BF16 GEMM kernels (kernels.h: the
// level's variant, AVX512_BF16 / AMX / AVX-512 / AVX2 / reference): phase 0 packs each
// (sequence, kv head)'s keys and values into weight panels, once; phase 1 takes blocks of
// query rows of every query head of a kv head (GQA: the group shares each key panel read)
// and, per block of 256 keys,
//   S = scale * Q K^T (fp32), an online softmax per row (running max m and sum l, the
//   output so far scaled by exp(m_old - m_new)), P = bf16(exp(S - m)), O += P V (fp32),
// then out = bf16(O / l). The arithmetic of SDPA's CPU flash attention for bf16 (fp32
// scores and sums, the probabilities rounded to bf16 for the second product), in another
// order. A row whose keys are all masked gets zeros.
struct PrefillAttention {
  int batch = 0, q_heads = 0, kv_heads = 0, queries = 0, keys = 0;
  int head_dim = 0;   // of q and k
  int value_dim = 0;  // of v and out (0: head_dim)
  float scale = 0.f;
  bool causal = false;
  // Element strides; the elements of a row are contiguous.
  const bf16_t* q = nullptr;  // [batch, q_heads, queries, head_dim]
  int64_t q_b = 0, q_h = 0, q_l = 0;
  const bf16_t* k = nullptr;  // [batch, kv_heads, keys, head_dim]
  int64_t k_b = 0, k_h = 0, k_l = 0;
  const bf16_t* v = nullptr;  // [batch, kv_heads, keys, value_dim]
  int64_t v_b = 0, v_h = 0, v_l = 0;
  const uint8_t* mask = nullptr;  // optional [batch, queries, keys]: nonzero = attend (mask_b 0: shared)
  int64_t mask_b = 0, mask_l = 0;
  bf16_t* out = nullptr;  // [batch, queries, q_heads, value_dim]
  int64_t out_b = 0, out_l = 0, out_h = 0;
};

// Validates `a` (errors name the field), runs it on `pool` with kernel_table(level)'s BF16
// kernels and waits.
void prefill_attention(Pool& pool, IsaLevel level, const PrefillAttention& a);

class DenseLinear;

// One-token MLA attention from the cached latents, weight-absorbed (DeepSeek-V2 / V3's
// decode as llama.cpp and vLLM run it), for each sequence b and head h:
//   q_lat = bf16(q_nope[b,h] W_UK[h])                        (w_uk: H groups of [rank x nope])
//   o_lat = bf16(attention of [q_lat, q_rope[b,h]] over keys [latent_l, k_rope_l] and
//                values latent_l, as decode_attention computes it)
//   out[b,h] = bf16(W_UV[h] o_lat)                           (w_uv: H groups of [v_dim x rank])
// Three pool tasks in a row (the two grouped products and the attention), no Python
// between them.
struct MlaDecode {
  int batch = 0, heads = 0, nope = 0, rope = 0, rank = 0, v_dim = 0, keys = 0;
  float scale = 0.f;
  const bf16_t* q = nullptr;  // [batch, heads, nope + rope]
  int64_t q_b = 0, q_h = 0;
  const bf16_t* latent = nullptr;  // [batch, keys, rank]
  int64_t latent_b = 0, latent_l = 0;
  const bf16_t* k_rope = nullptr;  // [batch, keys, rope]
  int64_t k_rope_b = 0, k_rope_l = 0;
  const uint8_t* mask = nullptr;  // optional [batch, keys]: nonzero = attend
  int64_t mask_b = 0;
  bf16_t* out = nullptr;  // [batch, heads, v_dim]
  int64_t out_b = 0, out_h = 0;
};
void mla_decode(Pool& pool, IsaLevel level, DenseLinear& w_uk, DenseLinear& w_uv, const MlaDecode& a);

}  // namespace tandem
