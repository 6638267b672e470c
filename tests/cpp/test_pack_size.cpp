// packed_bytes (tandem/kernels.h) against the packs themselves: the doctor's memory
// estimate relies on it, so every format, int4 group and zero-point choice and shapes
// that need padding (n not a multiple of 64, odd k, k not a multiple of 64) are compared
// with PackedWeight::bytes() of real pack() / pack_gate_up() results.
#include <gtest/gtest.h>

#include <vector>

#include "tandem/kernels.h"
#include "test_util.h"

namespace tandem {
namespace {

TEST(PackSize, EqualsPackedBytesForEveryFormat) {
  struct Case {
    PackOptions opt;
    std::vector<int> ks;
  };
  const std::vector<Case> cases = {
      {{WeightFormat::bf16}, {1, 2, 3, 63, 64, 65, 130}},
      {{WeightFormat::int8}, {1, 3, 63, 64, 65, 130}},
      {{WeightFormat::int4, 32, true}, {32, 96, 160}},
      {{WeightFormat::int4, 64, true}, {64, 192}},
      {{WeightFormat::int4, 128, true}, {128, 256}},
      {{WeightFormat::int4, 32, false}, {32, 96}},
      {{WeightFormat::int4, 128, false}, {128, 384}},
  };
  for (const Case& c : cases)
    for (int n : {1, 63, 64, 65, 130})
      for (int k : c.ks) {
        std::vector<float> w(size_t(n) * k, 0.5f);
        const WeightView v{w.data(), SourceType::f32, n, k};
        SCOPED_TRACE(::testing::Message() << format_name(c.opt.format) << " group " << c.opt.group
                                          << (c.opt.symmetric ? " sym" : " asym") << " n " << n << " k " << k);
        EXPECT_EQ(packed_bytes(c.opt, n, k), pack(v, c.opt).bytes());
        EXPECT_EQ(packed_bytes(c.opt, n, k, true), pack_gate_up(v, v, c.opt).bytes());
      }
}

TEST(PackSize, RefusesWhatPackRefuses) {
  EXPECT_NE(test::error_of([] { packed_bytes({WeightFormat::int4, 64, true}, 64, 96); }).find("not a multiple"),
            std::string::npos);
  EXPECT_NE(test::error_of([] { packed_bytes({WeightFormat::int4, 48, true}, 64, 96); }).find("32, 64, 128"),
            std::string::npos);
  EXPECT_NE(test::error_of([] { packed_bytes({WeightFormat::bf16}, 0, 96); }).find("must be positive"),
            std::string::npos);
}

}  // namespace
}  // namespace tandem
