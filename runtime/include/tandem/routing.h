// tandem/routing.h: top-k expert routing and the hot / cold / deferred split of each
// token's experts.
//
// The per-token functions are written once and compiled twice: as plain C++ for the
// CPU (and the host stream) and as __device__ code for the CUDA kernels in gpu/, so
// both sides choose the same experts (up to the last bit of expf) and break ties the
// same way: equal scores go to the lower expert index.
//
// Scoring, as the Hugging Face models do it:
//   softmax   p = softmax(logits); the top_k largest p; with renormalize, p / sum(top-k p)
//             (Qwen3-MoE norm_topk_prob, Mixtral: softmax over the top-k logits is the same)
//   sigmoid   s = sigmoid(logits); choice = s + bias (e_score_correction_bias); groups of
//             experts/groups experts scored by the sum of their two best choices; experts
//             outside the best topk_groups groups are excluded; the top_k best choices win,
//             weighted by s (renormalized with +1e-20 when asked), times `scaling`
//             (DeepSeek-V3 routed_scaling_factor)
// Ids come out in descending score order.
#pragma once

#include <math.h>

#include <cstdint>

#if defined(__CUDACC__)
#define TANDEM_HD __host__ __device__
#else
#define TANDEM_HD
#endif

namespace tandem {

inline constexpr int kRouterMaxExperts = 512;
inline constexpr int kRouterMaxTopK = 32;

enum class Scoring : int32_t { softmax = 0, sigmoid = 1 };

struct RouterSpec {
  int32_t experts = 0, top_k = 0;
  Scoring scoring = Scoring::softmax;
  bool renormalize = true;
  int32_t groups = 1, topk_groups = 1;  // sigmoid only
  float scaling = 1.0f;                 // sigmoid only
};

// Where each of a token's experts runs. A slot holds its id in exactly one of hot /
// cold / deferred (-1 in the other two); an empty slot (id -1) is -1 in all three.
// `deferred` of the token's cold experts, the lowest-weighted (ties: the later slot),
// move to the deferred list.
struct SplitSpec {
  int32_t experts = 0, top_k = 0;
  int32_t deferred = 0;
};

namespace detail {

TANDEM_HD inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Index of the largest v[i] over i in [0, n) with allowed(i); ties: the lower index.
template <typename Allowed>
TANDEM_HD inline int argmax(const float* v, int n, Allowed allowed) {
  int best = -1;
  for (int i = 0; i < n; ++i)
    if (allowed(i) && (best < 0 || v[i] > v[best])) best = i;
  return best;
}

}  // namespace detail

// One token: logits [experts] (fp32), bias [experts] or nullptr -> ids, weights [top_k].
// The spec must have been validated (validate_router on the host).
TANDEM_HD inline void route_token(const float* logits, const float* bias, const RouterSpec& s, int32_t* ids,
                                  float* weights) {
  const int E = s.experts, K = s.top_k;
  float score[kRouterMaxExperts];  // what selection ranks
  bool taken[kRouterMaxExperts];
  for (int e = 0; e < E; ++e) taken[e] = false;
  if (s.scoring == Scoring::softmax) {
    float mx = logits[0];
    for (int e = 1; e < E; ++e) mx = logits[e] > mx ? logits[e] : mx;
    float sum = 0.0f;
    for (int e = 0; e < E; ++e) sum += expf(logits[e] - mx);
    float top = 0.0f;
    for (int k = 0; k < K; ++k) {
      const int e = detail::argmax(logits, E, [&](int i) { return !taken[i]; });
      taken[e] = true;
      ids[k] = e;
      weights[k] = expf(logits[e] - mx) / sum;
      top += weights[k];
    }
    if (s.renormalize)
      for (int k = 0; k < K; ++k) weights[k] /= top;
    return;
  }
  for (int e = 0; e < E; ++e) score[e] = detail::sigmoid(logits[e]) + (bias ? bias[e] : 0.0f);
  const int G = s.groups, per = E / G;
  bool group_on[kRouterMaxExperts];
  if (G > 1) {
    float gscore[kRouterMaxExperts];
    for (int g = 0; g < G; ++g) {
      const float* v = score + g * per;
      int a = 0;
      for (int i = 1; i < per; ++i) a = v[i] > v[a] ? i : a;
      int b = -1;
      for (int i = 0; i < per; ++i)
        if (i != a && (b < 0 || v[i] > v[b])) b = i;
      gscore[g] = v[a] + (b >= 0 ? v[b] : 0.0f);
      group_on[g] = false;
    }
    for (int j = 0; j < s.topk_groups; ++j) {
      const int g = detail::argmax(gscore, G, [&](int i) { return !group_on[i]; });
      group_on[g] = true;
    }
  } else {
    group_on[0] = true;
  }
  float top = 0.0f;
  for (int k = 0; k < K; ++k) {
    const int e = detail::argmax(score, E, [&](int i) { return !taken[i] && group_on[i / per]; });
    taken[e] = true;
    ids[k] = e;
    weights[k] = detail::sigmoid(logits[e]);
    top += weights[k];
  }
  for (int k = 0; k < K; ++k) weights[k] = (s.renormalize ? weights[k] / (top + 1e-20f) : weights[k]) * s.scaling;
}

// One token: ids, weights [top_k]; hot_mask [experts] (nonzero: on the device) ->
// hot, cold, deferred [top_k].
// An id outside [-1, experts) is never hot or deferred: it goes to the cold list as it
// is (clamped to int32), where the CPU engine refuses it naming its [token, slot]. (The
// host entry point below refuses it first.)
template <typename Id>
TANDEM_HD inline void split_token(const Id* ids, const float* weights, const uint8_t* hot_mask, const SplitSpec& s,
                                  int32_t* hot, int32_t* cold, int32_t* deferred) {
  int n_cold = 0;
  for (int k = 0; k < s.top_k; ++k) {
    const bool valid = ids[k] >= 0 && ids[k] < s.experts;
    const int32_t id = valid ? static_cast<int32_t>(ids[k]) : -1;
    const bool on_device = valid && hot_mask && hot_mask[id];
    hot[k] = on_device ? id : -1;
    cold[k] = valid && !on_device ? id : -1;
    if (!valid && ids[k] != -1) {
      const int64_t v = static_cast<int64_t>(ids[k]);
      cold[k] = static_cast<int32_t>(v > 2147483647 ? 2147483647 : v < -2147483647 ? -2147483647 : v);
    }
    deferred[k] = -1;
    n_cold += valid && cold[k] >= 0;
  }
  const int n_def = s.deferred < n_cold ? s.deferred : n_cold;
  for (int j = 0; j < n_def; ++j) {
    int pick = -1;
    for (int k = 0; k < s.top_k; ++k)
      if (cold[k] >= 0 && cold[k] < s.experts && (pick < 0 || weights[k] <= weights[pick])) pick = k;
    deferred[pick] = cold[pick];
    cold[pick] = -1;
  }
}

// ---- host entry points (runtime/routing.cpp) ----

// Throws naming the field when the spec cannot be routed (experts beyond the limits,
// top_k > experts, groups not dividing experts, too few experts in the kept groups).
void validate_router(const RouterSpec& s);
void validate_split(const SplitSpec& s);
// tokens x experts logits -> tokens x top_k ids / weights. Non-finite logits are refused.
void route(const float* logits, int tokens, const float* bias, const RouterSpec& s, int32_t* ids, float* weights);
// tokens x top_k -> hot, cold, deferred, each tokens x top_k.
template <typename Id>  // int32_t or int64_t
void split(const Id* ids, const float* weights, int tokens, const uint8_t* hot_mask, const SplitSpec& s, int32_t* hot,
           int32_t* cold, int32_t* deferred);

}  // namespace tandem
