// packed_bytes (tandem/kernels.h) against the packs themselves: the doctor's memory
// estimate relies on it, so every format, int4 group and zero-point choice and shapes
// that need padding (n not a multiple of 64, odd k, k not a multiple of 64) are compared
// with PackedWeight::bytes() of real pack() / pack_gate_up() results.
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
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

// The VmFlags line of the mapping that holds p in /proc/self/smaps ("" if none is found).
std::string vm_flags_of(const void* p) {
  std::ifstream in("/proc/self/smaps");
  const auto addr = reinterpret_cast<uintptr_t>(p);
  std::string line;
  bool inside = false;
  while (std::getline(in, line)) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-') {
      inside = lo <= addr && addr < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

// Buffers from 2 MiB on are mapped 2 MiB aligned and advised for transparent huge pages;
// smaller ones come from the heap. Every byte of each is writable and reads back, and
// freeing them (munmap or free, by the deleter) leaves nothing for ASan to report.
TEST(AlignedBuffer, LargeBuffersAreHugePageAlignedAndAdvised) {
  constexpr size_t kHuge = size_t{2} << 20;
  std::ifstream thp("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string mode((std::istreambuf_iterator<char>(thp)), std::istreambuf_iterator<char>());
  const bool thp_available = !mode.empty() && mode.find("[never]") == std::string::npos;
  for (size_t bytes : {size_t{1}, size_t{100}, kHuge - 1, kHuge, kHuge + 1, 5 * kHuge + 4096}) {
    SCOPED_TRACE(::testing::Message() << bytes << " bytes");
    AlignedBuffer b = AlignedBuffer::allocate(bytes);
    ASSERT_NE(b.data(), nullptr);
    EXPECT_EQ(b.size, bytes);
    const auto addr = reinterpret_cast<uintptr_t>(b.data());
    EXPECT_EQ(addr % 64, 0u);
    for (size_t i = 0; i < bytes; i += 4096) b.data()[i] = std::byte{static_cast<unsigned char>(i / 4096)};
    b.data()[bytes - 1] = std::byte{0x5a};
    for (size_t i = 0; i + 1 < bytes; i += 4096) EXPECT_EQ(b.data()[i], std::byte{static_cast<unsigned char>(i / 4096)});
    EXPECT_EQ(b.data()[bytes - 1], std::byte{0x5a});
    if (bytes >= kHuge) {
      EXPECT_EQ(addr % kHuge, 0u);
      const std::string flags = vm_flags_of(b.data());
      ASSERT_FALSE(flags.empty()) << "no mapping holds the buffer in /proc/self/smaps";
      // "hg": MADV_HUGEPAGE was applied (the kernel refuses it only without THP support).
      if (thp_available) EXPECT_NE(flags.find(" hg"), std::string::npos) << flags;
    }
  }
}

}  // namespace
}  // namespace tandem
