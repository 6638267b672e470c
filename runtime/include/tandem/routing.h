// tandem/routing.h: the hot / cold / deferred split of each token's routed experts.
//
// The routing itself (which experts, with which weights) is the model's own router, run
// by transformers in torch; tandem receives its top-k ids and weights. The per-token split
// is written once and compiled twice: as plain C++ for the CPU (and the host stream) and
// as __device__ code for the CUDA kernel in gpu/, so both place every slot the same way.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TANDEM_HD __host__ __device__
#else
#define TANDEM_HD
#endif

namespace tandem {

inline constexpr int kRouterMaxTopK = 32;  // the largest top_k a layer accepts

// Where each of a token's experts runs. A slot holds its id in exactly one of hot /
// cold / deferred (-1 in the other two); an empty slot (id -1) is -1 in all three.
// `deferred` of the token's cold experts, the lowest-weighted (ties: the later slot),
// move to the deferred list.
struct SplitSpec {
  int32_t experts = 0, top_k = 0;
  int32_t deferred = 0;
};

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

// Throws naming the field when the spec cannot be split (top_k, deferred out of range).
void validate_split(const SplitSpec& s);
// tokens x top_k -> hot, cold, deferred, each tokens x top_k.
template <typename Id>  // int32_t or int64_t
void split(const Id* ids, const float* weights, int tokens, const uint8_t* hot_mask, const SplitSpec& s, int32_t* hot,
           int32_t* cold, int32_t* deferred);

}  // namespace tandem
