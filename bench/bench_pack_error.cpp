// What packing an FP8 checkpoint costs in accuracy: one expert-sized weight [1536 x 4096]
// quantized to FP8 E4M3 with 128 x 128 block scales (amax / 448, as DeepSeek-V3 and the
// Qwen3 FP8 releases store them), then packed into each tandem format from those FP8
// values; printed: each pack's relative RMS error against the FP8 values themselves (the
// checkpoint's numbers), next to FP8's own error against the weights it was made from.
// Weights: Student t with 4 degrees of freedom (heavy tails, as trained weights have), or
// Gaussian with --gaussian. Usage: bench_pack_error [--gaussian] [--seed N]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "tandem/kernels.h"

using namespace tandem;

namespace {

// The nearest E4M3 code (ties to the lower magnitude; the codes are few, so a table).
struct E4m3 {
  std::vector<float> mag;  // the 127 finite non-negative values, ascending (code = index)
  E4m3() {
    for (int c = 0; c < 0x7f; ++c) mag.push_back(fp8_e4m3_to_fp32(static_cast<uint8_t>(c)));
  }
  uint8_t operator()(float x) const {
    const float a = std::min(std::fabs(x), mag.back());
    const auto hi = std::lower_bound(mag.begin(), mag.end(), a);
    int c = static_cast<int>(hi - mag.begin());
    if (c > 0 && (c == static_cast<int>(mag.size()) || a - mag[c - 1] <= mag[c] - a)) --c;
    return static_cast<uint8_t>(c | (x < 0 ? 0x80 : 0));
  }
};

}  // namespace

int main(int argc, char** argv) {
  bool gaussian = false;
  uint64_t seed = 7;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--gaussian")) gaussian = true;
    else if (!std::strcmp(argv[i], "--seed") && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
    else { std::fprintf(stderr, "usage: %s [--gaussian] [--seed N]\n", argv[0]); return 2; }
  }
  const int n = 1536, k = 4096, B = 128;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::student_t_distribution<float> student(4.0f);
  std::vector<float> w(static_cast<size_t>(n) * k);
  for (auto& x : w) x = gaussian ? normal(rng) : 0.01f * student(rng);
  const int bn = (n + B - 1) / B, bk = (k + B - 1) / B;
  std::vector<float> scale(static_cast<size_t>(bn) * bk);
  std::vector<uint8_t> q(w.size());
  const E4m3 e4m3;
  for (int i = 0; i < bn; ++i)
    for (int j = 0; j < bk; ++j) {
      const int r1 = std::min(n, (i + 1) * B), c1 = std::min(k, (j + 1) * B);
      float amax = 0.0f;
      for (int r = i * B; r < r1; ++r)
        for (int c = j * B; c < c1; ++c) amax = std::max(amax, std::fabs(w[static_cast<size_t>(r) * k + c]));
      const float s = amax / 448.0f;
      scale[static_cast<size_t>(i) * bk + j] = s;
      for (int r = i * B; r < r1; ++r)
        for (int c = j * B; c < c1; ++c) q[static_cast<size_t>(r) * k + c] = e4m3(w[static_cast<size_t>(r) * k + c] / s);
    }
  WeightView v{q.data(), SourceType::f8_e4m3, n, k};
  v.block_scale = scale.data();
  std::vector<double> fp8(w.size());
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < k; ++c) fp8[static_cast<size_t>(r) * k + c] = source_value(v, r, c);
  auto relative_rms = [](const auto& got, const auto& want) {
    double e2 = 0, x2 = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      const double e = double(got[i]) - double(want[i]);
      e2 += e * e;
      x2 += double(want[i]) * double(want[i]);
    }
    return std::sqrt(e2 / x2);
  };
  std::printf("weights [%d x %d], %s, seed %llu; FP8 E4M3 in %dx%d blocks\n", n, k,
              gaussian ? "Gaussian" : "Student t (4 dof)", static_cast<unsigned long long>(seed), B, B);
  std::printf("%-14s %8s %12s\n", "", "bytes/w", "rel. RMS");
  std::printf("%-14s %8.2f %12.4f   (against the weights it was made from)\n", "fp8 itself", 1.0 + 4.0 / (B * B),
              relative_rms(fp8, w));
  const PackOptions formats[] = {{WeightFormat::bf16},         {WeightFormat::int8},
                                 {WeightFormat::int4, 128, true}, {WeightFormat::int4, 32, true},
                                 {WeightFormat::int4, 32, false}, pack_options("mxfp4", 32, false)};
  for (const PackOptions& o : formats) {
    const PackedWeight p = pack(v, o);
    std::string name(format_name(o));
    if (o.format == WeightFormat::int4 && !o.e2m1) name += " g" + std::to_string(o.group) + (o.symmetric ? "" : " zp");
    std::printf("%-14s %8.2f %12.4f   (against the fp8 values)\n", name.c_str(),
                double(p.bytes()) / (double(n) * k), relative_rms(unpack(p), fp8));
  }
}
