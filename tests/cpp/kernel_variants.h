// Parameters for the per-variant kernel tests: the lines of cpu_kernels/kernel_list.inc
// (kernel_list()), so a new line is tested without touching a test.
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>
#include <ostream>
#include <string>
#include <vector>

#include "tandem/kernels.h"

namespace tandem {

inline void PrintTo(FeatureSet s, std::ostream* os) { *os << feature_list(s); }

// gtest prints a parameter when a test fails; the line's family and name say which.
inline void PrintTo(const KernelListEntry* e, std::ostream* os) {
  *os << family_name(e->family) << " " << e->name() << " (" << e->isa << ")";
}

namespace test {

// Every line of the given families, in list order.
inline std::vector<const KernelListEntry*> list_entries(std::initializer_list<KernelFamily> families) {
  std::vector<const KernelListEntry*> out;
  for (const KernelListEntry& e : kernel_list())
    for (KernelFamily f : families)
      if (e.family == f) out.push_back(&e);
  return out;
}

// "avx_vnni" for an instantiation of one family, "int8_avx_vnni" for several.
inline std::string variant_name(const KernelListEntry& e, bool with_family) {
  return with_family ? std::string(family_name(e.family)) + "_" + e.name() : e.name();
}

}  // namespace test
}  // namespace tandem

// Skips the test (naming the first missing feature) unless this CPU can run line e.
#define TANDEM_SKIP_UNLESS_CPU_RUNS(e)                                                          \
  do {                                                                                          \
    const auto missing_ = ::tandem::missing_features((e).needs);                                \
    if (!missing_.empty()) GTEST_SKIP() << (e).name() << ": this CPU lacks " << missing_.front(); \
  } while (0)
