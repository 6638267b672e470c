// Expert kernels (BF16, INT8, INT4) on cold weights, next to the machine's ceilings
// and oneDNN.
//
// One step = the routed experts of one token batch: 8 different experts (top-8), each
// running gate_up (SiLU*up) then down (routing-weighted accumulate) on m rows.
// Experts rotate through more memory than the last-level cache, so every step
// streams its weights from DRAM. Both sides use all cores (ours: panels split over
// OpenMP threads; oneDNN: its own OpenMP). Ceilings and kernels are measured
// interleaved (A B A B) and ratios are medians of the per-repetition pairs. The
// compute ceiling is the peak of the instruction the kernel variant picked for m
// really runs (bench/peak.h: vdpbf16ps for "avx512_bf16", fp32 vfmadd231ps for the
// BF16 "avx512" / "avx2" variants, vpdpbusd for "avx512_vnni", ...; "n/a" for AMX);
// the peer is oneDNN's bf16 matmul for BF16 and INT4 (oneDNN 2.6 has no int4) and its
// int8 matmul (u8 activations, s8 weights, per-channel scales) for INT8, which is given
// pre-quantized activations (ours quantizes inside the timed call).
//
// The kernels are those of the process's level (TANDEM_ISA, else the hardware's), or,
// with --variant NAME, exactly that line of cpu_kernels/kernel_list.inc for the format
// at every m (plus the quantizer of the same ISA file, when it has one).
//
//   build/bench/bench_kernels [--shape qwen3-30b|qwen3-235b|deepseek-v3|all] [--m 1,8,32,128,512]
//                             [--experts N] [--reps R] [--no-onednn]
//                             [--format bf16|int8|int4] [--group 32|64|128] [--asym] [--variant NAME]

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dnnl.hpp>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "ceilings.h"
#include "harness.h"
#include "tandem/error.h"
#include "tandem/kernels.h"

using namespace tandem;
using namespace tandem::bench;

namespace {

struct Shape {
  const char* name;
  int hidden, inter, experts;  // experts: how many distinct (cold) experts to rotate through
};
const Shape kShapes[] = {
    {"qwen3-30b", 2048, 768, 128},
    {"qwen3-235b", 4096, 1536, 128},
    {"deepseek-v3", 7168, 2048, 48},  // 48 x 88 MB (x2 with oneDNN's copy) fits 24 GB
};

std::vector<bf16_t> random_bf16(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, 0.05f);
  std::vector<bf16_t> v(n);
  for (auto& x : v) x = fp32_to_bf16(d(rng));
  return v;
}

struct Ours {
  const Shape& s;
  int threads;
  const KernelTable* kt;
  std::vector<PackedWeight> gu, down;
  Ours(const Shape& sh, int t, const PackOptions& opt, const KernelTable* table) : s(sh), threads(t), kt(table) {
    auto g = random_bf16(size_t(s.inter) * s.hidden, 1), u = random_bf16(size_t(s.inter) * s.hidden, 2),
         d = random_bf16(size_t(s.hidden) * s.inter, 3);
    const WeightView gv{g.data(), SourceType::bf16, s.inter, s.hidden}, uv{u.data(), SourceType::bf16, s.inter, s.hidden},
        dv{d.data(), SourceType::bf16, s.hidden, s.inter};
    for (int e = 0; e < s.experts; ++e) {
      gu.push_back(pack_gate_up(gv, uv, opt));
      down.push_back(pack(dv, opt));
    }
  }
  double bytes_per_expert() const { return double(gu[0].bytes() + down[0].bytes()); }
  QuantizedActs q_in, q_mid;
  // One step: experts e0..e0+7 on m rows.
  void step(int e0, int m, const bf16_t* a, bf16_t* h, float* out, const float* rw) {
    std::vector<const PackedWeight*> g8, d8;
    for (int i = 0; i < 8; ++i) {
      g8.push_back(&gu[(e0 + i) % s.experts]);
      d8.push_back(&down[(e0 + i) % s.experts]);
    }
    expert_step(threads, g8, d8, m, a, h, out, rw, q_in, q_mid, kt);
  }
};

// oneDNN: the same two products per expert, weights as nn.Linear stores them
// ([n x k] row-major = oneDNN weights {k, n} in "ba"), bf16 in, f32 out (gate/up)
// and f32 accumulate (down), no fusion (SiLU is not part of its time).
struct OneDnn {
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  const Shape& s;
  bool int8;
  std::vector<dnnl::memory> w1, w2;
  OneDnn(const Shape& sh, bool i8) : s(sh), int8(i8) {
    using dt = dnnl::memory::data_type;
    using tag = dnnl::memory::format_tag;
    auto g = random_bf16(size_t(2 * s.inter) * s.hidden, 4), d = random_bf16(size_t(s.hidden) * s.inter, 5);
    const dt wt = int8 ? dt::s8 : dt::bf16;
    const size_t es = int8 ? 1 : 2;
    for (int e = 0; e < s.experts; ++e) {
      w1.emplace_back(dnnl::memory::desc({s.hidden, 2 * s.inter}, wt, tag::ba), eng);
      std::memcpy(w1.back().get_data_handle(), g.data(), g.size() * es);  // int8: arbitrary bytes, as good as any
      w2.emplace_back(dnnl::memory::desc({s.inter, s.hidden}, wt, tag::ba), eng);
      std::memcpy(w2.back().get_data_handle(), d.data(), d.size() * es);
    }
  }
  struct Prims {
    dnnl::matmul m1, m2;
    dnnl::memory src, mid, midbf, dst;
  };
  Prims make(int m) {
    using dt = dnnl::memory::data_type;
    using tag = dnnl::memory::format_tag;
    Prims p;
    const dt at = int8 ? dt::u8 : dt::bf16;
    dnnl::memory::desc src({m, s.hidden}, at, tag::ab), mid({m, 2 * s.inter}, dt::f32, tag::ab),
        midbf({m, s.inter}, at, tag::ab), dst({m, s.hidden}, dt::f32, tag::ab);
    dnnl::primitive_attr first, acc;
    if (int8) {  // per-output-channel weight scales, as ours
      first.set_output_scales(2, std::vector<float>(2 * s.inter, 0.01f));
      acc.set_output_scales(2, std::vector<float>(s.hidden, 0.01f));
    }
    p.m1 = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, w1[0].get_desc(), mid), first, eng));
    dnnl::post_ops po;
    po.append_sum(1.0f);
    acc.set_post_ops(po);
    p.m2 = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(midbf, w2[0].get_desc(), dst), acc, eng));
    p.src = dnnl::memory(src, eng);
    p.mid = dnnl::memory(mid, eng);
    p.midbf = dnnl::memory(midbf, eng);
    p.dst = dnnl::memory(dst, eng);
    std::memset(p.src.get_data_handle(), 0, src.get_size());
    std::memset(p.midbf.get_data_handle(), 0, midbf.get_size());
    std::memset(p.dst.get_data_handle(), 0, dst.get_size());
    return p;
  }
  void step(Prims& p, int e0) {
    for (int i = 0; i < 8; ++i) {
      const int e = (e0 + i) % s.experts;
      p.m1.execute(strm, {{DNNL_ARG_SRC, p.src}, {DNNL_ARG_WEIGHTS, w1[e]}, {DNNL_ARG_DST, p.mid}});
      p.m2.execute(strm, {{DNNL_ARG_SRC, p.midbf}, {DNNL_ARG_WEIGHTS, w2[e]}, {DNNL_ARG_DST, p.dst}});
    }
    strm.wait();
  }
};


}  // namespace

int main(int argc, char** argv) {
  std::string which = "all";
  std::vector<int> ms = {1, 8, 32, 128, 512};
  int reps = 5, experts = 0;
  bool onednn = true;
  std::string variant;
  PackOptions opt;
  for (int i = 1; i < argc; ++i) {
    auto next = [&] { return i + 1 < argc ? argv[++i] : ""; };
    if (!std::strcmp(argv[i], "--shape")) which = next();
    else if (!std::strcmp(argv[i], "--m")) ms = parse_int_list(next());
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(next());
    else if (!std::strcmp(argv[i], "--experts")) experts = std::atoi(next());
    else if (!std::strcmp(argv[i], "--no-onednn")) onednn = false;
    else if (!std::strcmp(argv[i], "--format")) { const char* f = next(); opt = pack_options(f, opt.group, !opt.symmetric); }
    else if (!std::strcmp(argv[i], "--group")) opt.group = std::atoi(next());
    else if (!std::strcmp(argv[i], "--asym")) opt.symmetric = false;
    else if (!std::strcmp(argv[i], "--variant")) variant = next();
    else { std::fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
  }
  const int threads = default_threads();
  KernelTable table = kernels();
  if (!variant.empty() && !use_variant(table, opt.format, variant)) return 2;
  const FormatKernels& fk = table.of(opt.format);
  std::printf("machine: %s; format: %s%s; kernels: %s; threads: %d; %d repetitions, medians\n",
              machine_line().c_str(), std::string(format_name(opt)).c_str(),
              opt.format == WeightFormat::int4 ? (" group " + std::to_string(opt.group) + (opt.symmetric ? " sym" : " asym")).c_str() : "",
              kernels_line(fk).c_str(), threads, reps);
  const PeakChoice peak_small = peak_for_variant(fk.small.name, opt.format),
                   peak_large = peak_for_variant(fk.large.name, opt.format);
  if (peak_small.name == peak_large.name)
    std::printf("compute ceiling: %s", peak_small.name.c_str());
  else
    std::printf("compute ceiling: %s (m < %d), %s", peak_small.name.c_str(), fk.large_from_m, peak_large.name.c_str());
  std::printf("; peer: oneDNN %s matmul\n", opt.format == WeightFormat::int8 ? "int8" : "bf16");
  ReadBandwidth bw(size_t(1) << 30, threads);
  std::printf("%-12s %5s | %9s %8s %8s | %7s %7s | %9s %8s | %6s\n", "shape", "m", "us/expert", "GB/s", "GFLOP/s",
              "%bw", "%peak", "oneDNN us", "GFLOP/s", "vs 1DNN");
  for (Shape s : kShapes) {
    if (which != "all" && which != s.name) continue;
    if (experts > 0) s.experts = experts;
    Ours ours(s, threads, opt, &table);
    std::unique_ptr<OneDnn> peer = onednn ? std::make_unique<OneDnn>(s, opt.format == WeightFormat::int8) : nullptr;
    const double bytes = ours.bytes_per_expert();  // packed bytes, scales included
    for (int m : ms) {
      auto a = random_bf16(size_t(m) * s.hidden, 7);
      std::vector<bf16_t> h(size_t(m) * s.inter);
      std::vector<float> out(size_t(m) * s.hidden), rw(m, 0.125f);
      const double flops = 2.0 * m * 3.0 * s.hidden * s.inter;
      std::optional<OneDnn::Prims> prims;
      if (peer) prims = peer->make(m);
      std::vector<double> t_ours, t_dnnl, r_bw, r_peak;
      const PeakChoice& pc = m >= fk.large_from_m ? peak_large : peak_small;
      int e0 = 0, d0 = 0;
      for (int r = 0; r < reps; ++r) {
        const double ceil_bw = bw.measure(1);
        const double t = time_per_call([&] { ours.step(e0, m, a.data(), h.data(), out.data(), rw.data()); e0 += 8; }) / 8;
        const double ceil_peak = measure_peak(pc.insn, threads);  // 0: none measured
        t_ours.push_back(t);
        r_bw.push_back(bytes / t / 1e9 / ceil_bw);
        if (ceil_peak > 0) r_peak.push_back(flops / t / 1e9 / ceil_peak);
        if (peer) t_dnnl.push_back(time_per_call([&] { peer->step(*prims, d0); d0 += 8; }) / 8);
      }
      const double t = median(t_ours);
      std::printf("%-12s %5d | %9.1f %8.1f %8.1f | %7s %7s", s.name, m, t * 1e6, bytes / t / 1e9, flops / t / 1e9,
                  percent_of(median(r_bw), 1).c_str(), r_peak.empty() ? "n/a" : percent_of(median(r_peak), 1).c_str());
      if (peer) {
        const double td = median(t_dnnl);
        std::printf(" | %9.1f %8.1f | %5.2fx", td * 1e6, flops / td / 1e9, td / t);
      }
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  return 0;
}
