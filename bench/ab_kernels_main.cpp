// The harness of bench/ab_kernels.sh: one GEMM kernel of one ISA file, compiled from a
// given copy of cpu_kernels/ (AB_DIR, put first on the quote include path by the script)
// into namespace tandem_ab, timed on one thread with the weights packed once and resident
// in the caches (the in-core rate; bench_kernels measures the DRAM-fed one). Prints
// GOP/s (best of 7) and a checksum of the output, so two builds can be compared for speed
// and for bits. Packing uses the current tree's library (libtandem_kernels.a), so both
// copies must share its packed layouts.
#include "tandem/kernels.h"
namespace tandem_ab { using namespace ::tandem; }
#define tandem tandem_ab
#include AB_ISA_FILES
#undef tandem

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define AB_CAT2(a, b) a##b
#define AB_CAT(a, b) AB_CAT2(a, b)

int main(int argc, char** argv) {
  using namespace ::tandem;
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s bf16|int8|int4 N K M [GROUP]\n", argv[0]);
    return 2;
  }
  const std::string fmt = argv[1];
  const int n = std::atoi(argv[2]), k = std::atoi(argv[3]), m = std::atoi(argv[4]);
  PackOptions opt;
  opt.format = fmt == "bf16" ? WeightFormat::bf16 : fmt == "int8" ? WeightFormat::int8 : WeightFormat::int4;
  if (argc > 5) opt.group = std::atoi(argv[5]);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> wf(static_cast<size_t>(n) * k);
  for (float& x : wf) x = nd(rng) * 0.02f;
  WeightView v;
  v.data = wf.data();
  v.type = SourceType::f32;
  v.n = n;
  v.k = k;
  const PackedWeight pw = pack(v, opt);
  std::vector<bf16_t> a(static_cast<size_t>(m) * k);
  for (bf16_t& x : a) {
    const float f = nd(rng);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    x = static_cast<bf16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  }
  std::vector<float> c(static_cast<size_t>(m) * n);
  GemmArgs g;
  g.a = a.data();
  g.m = m;
  g.lda = k;
  g.c = c.data();
  g.ldc = n;
  auto call = [&] {
    if (opt.format == WeightFormat::bf16) {
#ifdef AB_HAS_BF16
      AB_CAT(tandem_ab::gemm_bf16_, AB_SUFFIX)(pw, g);
#else
      std::fprintf(stderr, "no BF16 kernel for this suffix\n");
      std::exit(2);
#endif
    }
#ifdef AB_HAS_Q
    else if (opt.format == WeightFormat::int8) AB_CAT(tandem_ab::gemm_int8_, AB_SUFFIX)(pw, g);
    else AB_CAT(tandem_ab::gemm_int4_, AB_SUFFIX)(pw, g);
#else
    else {
      std::fprintf(stderr, "no integer kernels for this suffix\n");
      std::exit(2);
    }
#endif
  };
  call();
  const int iters = std::max(1, static_cast<int>(4e9 / (2.0 * m * n * k)));
  double best = 1e30;
  for (int rep = 0; rep < 7; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) call();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  double sum = 0;
  uint64_t bits = 1469598103934665603ull;  // FNV-1a over the output's bytes
  for (float x : c) {
    sum += x;
    uint32_t u;
    std::memcpy(&u, &x, 4);
    bits = (bits ^ u) * 1099511628211ull;
  }
  std::printf("%.2f GOP/s checksum %016llx (sum %.6g)\n", 2.0 * m * n * k * iters / best / 1e9,
              static_cast<unsigned long long>(bits), sum);
  return 0;
}
