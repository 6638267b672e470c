#include "tandem/routing.h"

#include <cmath>

#include "tandem/error.h"

namespace tandem {

void validate_router(const RouterSpec& s) {
  TANDEM_CHECK(s.experts >= 1 && s.experts <= kRouterMaxExperts, Errc::invalid_argument, "router: experts = ", s.experts,
               " is outside [1, ", kRouterMaxExperts, "]");
  TANDEM_CHECK(s.top_k >= 1 && s.top_k <= s.experts && s.top_k <= kRouterMaxTopK, Errc::invalid_argument,
               "router: top_k = ", s.top_k, " is outside [1, min(experts = ", s.experts, ", ", kRouterMaxTopK, ")]");
  TANDEM_CHECK(s.scoring == Scoring::softmax || s.scoring == Scoring::sigmoid, Errc::invalid_argument,
               "router: unknown scoring ", static_cast<int>(s.scoring));
  if (s.scoring == Scoring::sigmoid) {
    TANDEM_CHECK(s.groups >= 1 && s.experts % s.groups == 0, Errc::invalid_argument, "router: n_group = ", s.groups,
                 " does not divide experts = ", s.experts);
    TANDEM_CHECK(s.groups == 1 || s.experts / s.groups >= 2, Errc::invalid_argument,
                 "router: grouped routing scores a group by its two best experts; groups of ", s.experts / s.groups,
                 " are too small");
    TANDEM_CHECK(s.topk_groups >= 1 && s.topk_groups <= s.groups, Errc::invalid_argument, "router: topk_group = ",
                 s.topk_groups, " is outside [1, n_group = ", s.groups, "]");
    TANDEM_CHECK(s.topk_groups * (s.experts / s.groups) >= s.top_k, Errc::invalid_argument, "router: the ",
                 s.topk_groups, " kept groups hold ", s.topk_groups * (s.experts / s.groups), " experts, fewer than top_k = ",
                 s.top_k);
    TANDEM_CHECK(std::isfinite(s.scaling), Errc::invalid_argument, "router: routed_scaling_factor = ", s.scaling,
                 " is not finite");
  }
}

void validate_split(const SplitSpec& s) {
  TANDEM_CHECK(s.experts >= 1, Errc::invalid_argument, "split: experts = ", s.experts, " must be positive");
  TANDEM_CHECK(s.top_k >= 1 && s.top_k <= kRouterMaxTopK, Errc::invalid_argument, "split: top_k = ", s.top_k,
               " is outside [1, ", kRouterMaxTopK, "]");
  TANDEM_CHECK(s.deferred >= 0 && s.deferred <= s.top_k, Errc::invalid_argument, "split: deferred_experts = ", s.deferred,
               " is outside [0, top_k = ", s.top_k, "]");
}

void route(const float* logits, int tokens, const float* bias, const RouterSpec& s, int32_t* ids, float* weights) {
  validate_router(s);
  TANDEM_CHECK(tokens >= 0, Errc::invalid_argument, "router: tokens = ", tokens, " is negative");
  for (int t = 0; t < tokens; ++t) {
    const float* l = logits + static_cast<size_t>(t) * s.experts;
    for (int e = 0; e < s.experts; ++e)
      TANDEM_CHECK(std::isfinite(l[e]), Errc::invalid_argument, "router: logits[", t, ", ", e, "] = ", l[e],
                   " is not finite");
    route_token(l, bias, s, ids + static_cast<size_t>(t) * s.top_k, weights + static_cast<size_t>(t) * s.top_k);
  }
}

template <typename Id>
void split(const Id* ids, const float* weights, int tokens, const uint8_t* hot_mask, const SplitSpec& s, int32_t* hot,
           int32_t* cold, int32_t* deferred) {
  validate_split(s);
  for (int t = 0; t < tokens; ++t) {
    const size_t o = static_cast<size_t>(t) * s.top_k;
    for (int k = 0; k < s.top_k; ++k)
      TANDEM_CHECK(ids[o + k] >= -1 && ids[o + k] < s.experts, Errc::invalid_argument, "split: ids[", t, ", ", k,
                   "] = ", ids[o + k], " is outside [-1, ", s.experts, ")");
    split_token(ids + o, weights + o, hot_mask, s, hot + o, cold + o, deferred + o);
  }
}
template void split(const int32_t*, const float*, int, const uint8_t*, const SplitSpec&, int32_t*, int32_t*, int32_t*);
template void split(const int64_t*, const float*, int, const uint8_t*, const SplitSpec&, int32_t*, int32_t*, int32_t*);

}  // namespace tandem
