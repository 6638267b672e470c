#include "tandem/routing.h"

#include "tandem/error.h"

namespace tandem {

void validate_split(const SplitSpec& s) {
  TANDEM_CHECK(s.experts >= 1, Errc::invalid_argument, "split: experts = ", s.experts, " must be positive");
  TANDEM_CHECK(s.top_k >= 1 && s.top_k <= kRouterMaxTopK, Errc::invalid_argument, "split: top_k = ", s.top_k,
               " is outside [1, ", kRouterMaxTopK, "]");
  TANDEM_CHECK(s.deferred >= 0 && s.deferred <= s.top_k, Errc::invalid_argument, "split: deferred_experts = ", s.deferred,
               " is outside [0, top_k = ", s.top_k, "]");
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
