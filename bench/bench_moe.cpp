// A whole routed-expert MoE layer on the CPU engine (runtime/moe.h), cold weights,
// next to the machine's ceilings and the bare kernels on the same packs.
//
// Per token count: time per layer forward, effective weight GB/s (packed bytes of the
// distinct experts the batch touches), GFLOP/s, the read bandwidth and compute peak
// measured interleaved (A B A B, medians of the pairs), and, for decode, the ratio to
// the bare kernels: the same 8 experts' gate_up + down called directly with OpenMP
// threads splitting the panels (bench_kernels' harness), i.e. what scheduling costs.
// The compute peak is that of the instruction the layer's kernel variant runs for the
// batch's average rows per expert (bench/peak.h; AMX: tdpbf16ps / tdpbsud), and %roof
// compares the time with the roofline max(weight bytes / bandwidth, ops / that peak).
// TANDEM_BENCH_TRACE=PREFIX writes one traced forward per token count to PREFIX.T.json.
//
// --math gpt-oss runs the layer as gpt-oss's experts (clamped SwiGLU, alpha 1.702, limit 7,
// up + 1, biases on gate, up and down): what that costs over plain SiLU at the same shape.
//
//   build/bench/bench_moe [--shape qwen3-30b|qwen3-235b|deepseek-v3|gpt-oss-120b|all] [--format bf16|int8|int4]
//                         [--tokens 1,4,16,64,256,1024] [--reps R] [--budget-gb G] [--math plain|gpt-oss]
//                         [--variant NAME]
// --variant NAME runs that line of cpu_kernels/kernel_list.inc for the format at every row
// count (and its quantizer, where the list has one of that name), in the layer and in the
// bare kernels it is compared with.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "ceilings.h"
#include "harness.h"
#include "tandem/moe.h"
#include "tandem/pool_config.h"
#include "tandem/trace.h"

using namespace tandem;
using namespace tandem::bench;

namespace {


// A "Key: N kB" line of /proc/self/status in bytes: VmRSS (resident now), VmHWM (its
// high-water mark, which reset_peak_rss() restarts).
double proc_status_bytes(const char* key) {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  double kb = 0;
  const size_t n = std::strlen(key);
  while (std::fgets(line, sizeof line, f))
    if (!std::strncmp(line, key, n) && line[n] == ':' && std::sscanf(line + n + 1, "%lf", &kb) == 1) break;
  std::fclose(f);
  return kb * 1024;
}
void reset_peak_rss() {
  if (std::FILE* f = std::fopen("/proc/self/clear_refs", "w")) {
    std::fputs("5", f);
    std::fclose(f);
  }
}



}  // namespace

int main(int argc, char** argv) {
  std::string which = "all";
  std::vector<int> token_counts = {1, 4, 16, 64, 256, 1024};
  int reps = 5;
  double budget_gb = 6;
  PackOptions opt;
  bool oai = false;  // --math gpt-oss
  std::string variant;
  for (int i = 1; i < argc; ++i) {
    auto next = [&] { return i + 1 < argc ? argv[++i] : ""; };
    if (!std::strcmp(argv[i], "--shape")) which = next();
    else if (!std::strcmp(argv[i], "--format")) { const char* f = next(); opt = pack_options(f, opt.group, !opt.symmetric); }
    else if (!std::strcmp(argv[i], "--group")) opt.group = std::atoi(next());
    else if (!std::strcmp(argv[i], "--tokens")) token_counts = parse_int_list(next());
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(next());
    else if (!std::strcmp(argv[i], "--budget-gb")) budget_gb = std::atof(next());
    else if (!std::strcmp(argv[i], "--math")) {
      const std::string m = next();
      if (m != "plain" && m != "gpt-oss") { std::fprintf(stderr, "--math: plain or gpt-oss, not '%s'\n", m.c_str()); return 2; }
      oai = m == "gpt-oss";
    }
    else if (!std::strcmp(argv[i], "--variant")) variant = next();
    else { std::fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
  }
  KernelTable forced = kernels();
  if (!variant.empty() && !use_variant(forced, opt.format, variant)) return 2;
  Pool pool(pool_options(Config::Cpu{}));
  const int threads = pool.total_threads();
  std::printf("machine: %s; format: %s; engine: %d subpool(s), %d threads; %d repetitions, medians\n",
              machine_line().c_str(), std::string(format_name(opt)).c_str(), pool.subpools(), threads, reps);
  {  // What a span costs: the engine records one per work item.
    auto span_ns = [](bool on) {
      trace::enable(on);
      const int n = 2'000'000;
      const auto t0 = Clock::now();
      for (int i = 0; i < n; ++i) trace::Span sp("probe");
      trace::enable(false);
      return seconds_since(t0) / n * 1e9;
    };
    const double off = span_ns(false), on = span_ns(true);
    std::printf("trace: a span costs %.1f ns disabled, %.1f ns recording\n", off, on);
  }
  ReadBandwidth bw(size_t(1) << 30, threads);
  std::printf("%-12s %6s %5s | %10s %8s %8s | %6s %6s %6s | %s\n", "shape", "tokens", "exp", "us/layer", "GB/s",
              "GFLOP/s", "%bw", "%peak", "%roof", "vs bare kernels (decode)");
  for (const char* name : {"qwen3-30b", "qwen3-235b", "deepseek-v3", "gpt-oss-120b"}) {
    if (which != "all" && which != name) continue;
    const ModelShape& s = *find_model_shape(name);
    std::mt19937_64 rng(42);
    std::normal_distribution<float> nd(0.f, 0.05f);
    std::vector<bf16_t> g(size_t(s.inter) * s.hidden), d(size_t(s.hidden) * s.inter);
    for (auto& x : g) x = fp32_to_bf16(nd(rng));
    for (auto& x : d) x = fp32_to_bf16(nd(rng));
    std::vector<float> bias(std::max(s.inter, s.hidden));
    for (auto& x : bias) x = nd(rng);
    MoeShape math{1, s.hidden, s.inter};
    if (oai) {
      math.act = {GateAct::Kind::clamped, 1.702f, 7.0f, 1.0f};
      math.bias = true;
    }
    auto source = [&](int) {
      ExpertSource src{{g.data(), SourceType::bf16, s.inter, s.hidden}, {g.data(), SourceType::bf16, s.inter, s.hidden},
                       {d.data(), SourceType::bf16, s.hidden, s.inter}};
      if (oai) {
        src.gate_bias = {bias.data(), SourceType::f32, 1, s.inter};
        src.up_bias = {bias.data(), SourceType::f32, 1, s.inter};
        src.down_bias = {bias.data(), SourceType::f32, 1, s.hidden};
      }
      return src;
    };
    // Experts to allocate: the real count if it fits the memory budget, else fewer (still
    // gigabytes, far beyond the LLC, so every forward streams from DRAM).
    double per_expert;
    {
      MoeLayer probe(pool, math, opt);
      probe.load(source);
      per_expert = double(probe.packed_bytes());
    }
    const int E = std::max(s.top_k, std::min(s.experts, int(budget_gb * 1e9 / per_expert)));
    MoeShape shape = math;
    shape.experts = E;
    MoeLayer layer(pool, shape, opt);
    if (!variant.empty()) layer.use_kernels(forced);
    if (oai) std::printf("# experts: %s\n", describe_experts(shape).c_str());
    const FormatKernels& fk = layer.kernel_set().of(opt.format);
    std::printf("# kernels: %s; compute ceiling: %s / %s\n", kernels_line(fk).c_str(),
                peak_for_variant(fk.small.name, opt.format).name.c_str(),
                peak_for_variant(fk.large.name, opt.format).name.c_str());
    const double rss0 = proc_status_bytes("VmRSS");
    reset_peak_rss();
    const auto t_load = Clock::now();
    layer.load(source);
    std::printf("# %s: %d of %d experts allocated (%.2f GB packed, %.1f MB each), loaded in %.1f s; "
                "peak RSS while loading: +%.2f GB over the %.2f GB before\n",
                s.name, E, s.experts, layer.packed_bytes() / 1e9, per_expert / 1e6, seconds_since(t_load),
                (proc_status_bytes("VmHWM") - rss0) / 1e9, rss0 / 1e9);
    double bare_gbs = 0;
    for (int T : token_counts) {
      // 32 random routings (top-k distinct experts per token), cycled.
      const int R = 32;
      std::vector<std::vector<int32_t>> ids(R, std::vector<int32_t>(size_t(T) * s.top_k));
      double distinct = 0;
      for (auto& v : ids) {
        std::set<int> used;
        for (int t = 0; t < T; ++t) {
          std::set<int> mine;
          while (int(mine.size()) < s.top_k) mine.insert(std::uniform_int_distribution<int>(0, E - 1)(rng));
          int k = 0;
          for (int e : mine) v[size_t(t) * s.top_k + k++] = e, used.insert(e);
        }
        distinct += used.size();
      }
      distinct /= R;
      std::vector<bf16_t> x(size_t(T) * s.hidden);
      for (auto& v : x) v = fp32_to_bf16(nd(rng) * 20);
      std::vector<float> w(size_t(T) * s.top_k, 1.0f / s.top_k), out(size_t(T) * s.hidden);
      MoeInput in;
      in.x = x.data();
      in.tokens = T;
      in.top_k = s.top_k;
      in.weights = w.data();
      in.out = out.data();
      int r = 0;
      auto forward = [&] {
        in.ids = ids[r++ % R].data();
        layer.forward(in);
      };
      auto timed = [](auto f) { return time_per_call(f, 0.3); };
      // The roofline: the layer cannot take less than reading its distinct experts' packed
      // weights once at the measured bandwidth, nor less than its products at the
      // measured peak of the instruction its kernel runs; %roof = that bound / the time.
      std::vector<double> ts, rb, rp, rr;
      const double ops = 2.0 * 3 * s.hidden * s.inter * T * s.top_k;
      const int rows_per_expert = static_cast<int>(std::lround(double(T) * s.top_k / std::max(1.0, distinct)));
      const PeakChoice pc = peak_for_variant(fk.pick(rows_per_expert).name, opt.format);
      for (int rep = 0; rep < reps; ++rep) {
        const double c_bw = bw.measure(1);
        const double t = timed(forward);
        const double c_peak = measure_peak(pc.insn, threads);  // 0: none measured
        ts.push_back(t);
        rb.push_back(distinct * per_expert / t / 1e9 / c_bw);
        if (c_peak > 0) {
          rp.push_back(ops / t / 1e9 / c_peak);
          rr.push_back(std::max(distinct * per_expert / (c_bw * 1e9), ops / (c_peak * 1e9)) / t);
        }
      }
      const double t = median(ts);
      const double gbs = distinct * per_expert / t / 1e9;
      std::printf("%-12s %6d %5.0f | %10.1f %8.1f %8.1f | %6s %6s %6s", s.name, T, distinct, t * 1e6, gbs, ops / t / 1e9,
                  percent_of(median(rb), 1).c_str(), rp.empty() ? "n/a" : percent_of(median(rp), 1).c_str(),
                  rr.empty() ? "n/a" : percent_of(median(rr), 1).c_str());
      if (T == 1 && pool.subpools() == 1) {
        // The bare kernels on the same packs: 8 experts, panels split over OpenMP threads.
        QuantizedActs q_in, q_mid;
        std::vector<bf16_t> h(s.inter);
        std::vector<float> acc(s.hidden);
        auto bare = [&] {
          const int32_t* route = ids[r++ % R].data();
          std::vector<const PackedWeight*> gu, dn;
          for (int k = 0; k < s.top_k; ++k) {
            gu.push_back(&layer.gate_up_pack(0, route[k]));
            dn.push_back(&layer.down_pack(0, route[k]));
          }
          expert_step(threads, gu, dn, 1, x.data(), h.data(), acc.data(), w.data(), q_in, q_mid, &layer.kernel_set());
        };
        std::vector<double> ratio;
        for (int rep = 0; rep < reps; ++rep) {
          const double te = timed(forward), tb = timed(bare);
          ratio.push_back(tb / te);
          bare_gbs = s.top_k * per_expert / tb / 1e9;
        }
        std::printf(" | engine / bare: %.0f%% (bare %.1f GB/s)", 100 * median(ratio), bare_gbs);
      }
      std::printf("\n");
      std::fflush(stdout);
      if (const char* tp = std::getenv("TANDEM_BENCH_TRACE")) {  // one traced forward per token count
        trace::enable(true);
        forward();
        trace::enable(false);
        trace::write(std::string(tp) + "." + std::to_string(T) + ".json");
      }
    }
  }
  return 0;
}
