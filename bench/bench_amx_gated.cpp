// One core's AMX prefill kernels next to that core's AMX ceilings, counting only the bursts
// during which the core ran its tile loads at full rate.
//
//   build/bench/bench_amx_gated [--formats bf16,int8,int4] [--ops gate_up,down] [--m 32,128]
//                               [--experts E] [--panels P] [--samples N] [--group G] [--cpu C]
//   build/bench/bench_amx_gated --probe     # one line per physical core: its tile step now
//
// Why gated: on a virtual machine the host can throttle a core's tile unit (on the AMX
// Xeon this project is developed on, a 2 x 2 tile step fed from L1 ran at about 2400
// GFLOP/s per core or, for stretches of a millisecond to minutes, at about 700; probes a
// few milliseconds apart often disagree), and single runs of the other benchmarks then
// measure the host. Here a short probe (the step from L1) runs
// before and after every timed burst, on the same pinned thread, and a burst counts only
// when both probes are at least 60% of the best probe seen. The figures are one thread's,
// so they say what the kernels do, not what two cores' shared memory bandwidth allows.
//
// Ceilings (gated, one thread): the tile step from L1 and from L2, the same while
// streaming 8 cache lines per step from memory (what bf16 weights need at 128 rows per
// expert) with all tiles from L1 (an idealization) or A from L1 and B from L2 (the kernels'
// own case), and the thread's plain read stream. Kernels: the AMX variant of each format on
// one qwen3-235b expert's gate_up (k 4096, 2 x 1536 outputs) or down (k 1536, 4096 outputs),
// E experts in rotation (weights from memory), in calls of P panels as the engine cuts
// them, with the input rows packed into tile order once per expert (a_tiles, as the engine
// does) and without (packed by each call), alternated; the ratio is the median of the
// pairs'. GB/s counts the packed weights. %naive and %core: the tiled time against this
// core's roofline, max(weight bytes / the plain read stream, tile steps / a step rate), with
// the step rate of the tile step from L1 (naive) or of the kernels'-case ceiling (core).
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ceilings.h"
#include "tandem/cpu_features.h"
#include "tandem/kernels.h"

using namespace tandem;
using namespace tandem::bench;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// GFLOP/s of this thread's tile step from 16 KB over a short burst.
double probe() {
  const long iters = 4000;
  const auto t0 = Clock::now();
  tdpbf16ps_loaded_loop(iters, 16 << 10);
  return iters * 65536.0 / seconds_since(t0) / 1e9;
}

// A timed burst and the slower of the tile probes around it. Bursts are kept while
// measuring by the best probe seen so far, and judged again at the end by the best probe
// of the whole run, so that a run that began on a throttled core does not keep its
// throttled bursts once the core has shown its full rate.
struct Burst {
  double a = 0, b = 0;  // what was timed (one figure, or a pair's two times)
  double probe = 0;
};

struct Gate {
  double best = 0;
  bool open(double before, double after, double* slower) {
    best = std::max({best, before, after});
    *slower = std::min(before, after);
    return *slower >= 0.6 * best;
  }
  std::vector<Burst> kept(const std::vector<Burst>& v) const {
    std::vector<Burst> out;
    for (const Burst& x : v)
      if (x.probe >= 0.6 * best) out.push_back(x);
    return out;
  }
};

std::vector<std::string> split(const char* s) {
  std::vector<std::string> out;
  std::string cur;
  for (const char* p = s;; ++p) {
    if (*p == ',' || *p == 0) {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
      if (*p == 0) break;
    } else {
      cur += *p;
    }
  }
  return out;
}

bool pin(int cpu) {
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  return sched_setaffinity(0, sizeof(one), &one) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> formats = {"bf16", "int8", "int4"}, ops = {"gate_up", "down"};
  std::vector<int> ms = {32, 128};
  int experts = 16, panels = 8, samples = 12, group = 128, cpu = -1;
  // --probe: each physical core's tile step from L1 right now ("cpu N: GFLOP/s" lines): is
  // the host throttling a core's tile unit at this moment?
  if (argc == 2 && !std::strcmp(argv[1], "--probe")) {
    if (!cpu_features().amx_bf16) {
      std::fprintf(stderr, "bench_amx_gated: this CPU has no AMX-BF16\n");
      return 2;
    }
    (void)kernels();  // requests the tile permission
    for (const int c : core_cpus(1 << 10)) {
      if (!pin(c)) continue;
      probe();
      std::printf("cpu %d: %.0f\n", c, probe());
    }
    return 0;
  }
  for (int i = 1; i + 1 < argc; i += 2) {
    const char* v = argv[i + 1];
    if (!std::strcmp(argv[i], "--formats")) formats = split(v);
    else if (!std::strcmp(argv[i], "--ops")) ops = split(v);
    else if (!std::strcmp(argv[i], "--m")) ms = parse_int_list(v);
    else if (!std::strcmp(argv[i], "--experts")) experts = std::atoi(v);
    else if (!std::strcmp(argv[i], "--panels")) panels = std::atoi(v);
    else if (!std::strcmp(argv[i], "--samples")) samples = std::atoi(v);
    else if (!std::strcmp(argv[i], "--group")) group = std::atoi(v);
    else if (!std::strcmp(argv[i], "--cpu")) cpu = std::atoi(v);
    else { std::fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
  }
  if (!cpu_features().amx_bf16 || !cpu_features().amx_int8) {
    std::printf("bench_amx_gated: this CPU has no AMX-BF16 / AMX-INT8; nothing to measure\n");
    return 0;
  }
  if (experts < 1 || panels < 1 || samples < 1) {
    std::fprintf(stderr, "--experts, --panels and --samples must be positive\n");
    return 2;
  }
  (void)kernels();  // requests the tile permission
  // The core: the given one, else the first allowed core whose probe is at full rate
  // (within 60% of the best any core shows), waiting up to a minute for one.
  const std::vector<int> cpus = core_cpus(1 << 10);
  if (cpu < 0) {
    double best = 0;
    for (int attempt = 0; attempt < 30 && cpu < 0; ++attempt) {
      std::vector<double> rate(cpus.size());
      for (size_t c = 0; c < cpus.size(); ++c) {
        pin(cpus[c]);
        probe();
        rate[c] = probe();
        best = std::max(best, rate[c]);
      }
      for (size_t c = 0; c < cpus.size() && cpu < 0; ++c)
        if (attempt >= 2 && rate[c] >= 0.8 * best) cpu = cpus[c];
      if (cpu < 0) std::this_thread::sleep_for(std::chrono::seconds(2));
    }
    if (cpu < 0) cpu = cpus.empty() ? 0 : cpus.front();
  }
  if (!pin(cpu)) {
    std::fprintf(stderr, "cannot run on cpu %d\n", cpu);
    return 2;
  }
  std::printf("machine: %s\none thread on cpu %d; a burst counts when the tile probe before and after it is >= 60%% of the "
              "best probe seen\n",
              machine_line().c_str(), cpu);

  Gate gate;
  for (int i = 0; i < 20; ++i) gate.best = std::max(gate.best, probe());
  std::printf("measuring (ceilings, kernels, ceilings again)...\n");
  std::fflush(stdout);

  // Ceilings.
  ReadBandwidth stream(size_t(1) << 30, 1);
  struct Ceiling {
    const char* name;
    int kind;  // 0: L1, 1: L2, 2: L1 + stream, 3: A L1 B L2 + stream
  };
  const Ceiling ceilings[] = {{"tile step, tiles from L1", 0},
                              {"tile step, tiles from L2", 1},
                              {"tile step from L1 + 8 lines/step from memory", 2},
                              {"tile step, A L1, B L2 + 8 lines/step (kernels' case)", 3}};
  std::vector<Burst> ceiling_bursts[4];
  auto measure_ceilings = [&] {
    for (const Ceiling& c : ceilings) {
      int n = 0;
      for (int t = 0; t < 400 && n < samples; ++t) {
        const long iters = 20000;
        const double before = probe();
        const auto t0 = Clock::now();
        if (c.kind == 0) tdpbf16ps_loaded_loop(iters, 16 << 10);
        else if (c.kind == 1) tdpbf16ps_loaded_loop(iters, 256 << 10);
        else tdpbf16ps_stream_loop(iters, c.kind == 3, stream.data(), stream.bytes(), 8);
        const double rate = iters * 65536.0 / seconds_since(t0) / 1e9;
        double slower;
        if (gate.open(before, probe(), &slower)) ++n;
        ceiling_bursts[c.kind].push_back({rate, 0, slower});
      }
    }
  };
  measure_ceilings();
  std::vector<double> plain_stream;
  for (int t = 0; t < 5; ++t) plain_stream.push_back(stream.measure(1));

  // Kernels.
  struct KernelCase {
    std::string fmt, op;
    int m;
    bool quant, tiles_ok;
    double ops, bytes;
    std::vector<Burst> bursts;  // a: rows, b: tiles
  };
  std::vector<KernelCase> cases;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 0.02f);
  for (const std::string& fmt : formats) {
    const PackOptions opt = pack_options(fmt, group, false);
    const KernelListEntry* line = find_kernel(family_of(opt.format), fmt == "bf16" ? "amx_bf16" : fmt == "int8" ? "amx_int8" : "amx_int4");
    if (!line) {
      std::printf("%s: no AMX line in kernel_list.inc\n", fmt.c_str());
      continue;
    }
    for (const std::string& op : ops) {
      const bool gu = op == "gate_up";
      const int n = gu ? 1536 : 4096, k = gu ? 4096 : 1536;
      std::vector<bf16_t> w(static_cast<size_t>(n) * k);
      for (auto& x : w) x = fp32_to_bf16(nd(rng));
      const WeightView view{w.data(), SourceType::bf16, n, k};
      std::vector<PackedWeight> packs;
      for (int e = 0; e < experts; ++e) packs.push_back(gu ? pack_gate_up(view, view, opt) : pack(view, opt));
      const PackedWeight& w0 = packs[0];
      for (int m : ms) {
        std::vector<bf16_t> a(static_cast<size_t>(m) * k);
        for (auto& x : a) x = fp32_to_bf16(nd(rng) * 50);
        QuantizedActs qa;
        const bool quant = opt.format != WeightFormat::bf16;
        if (quant) {
          qa.prepare(w0, m);
          quantize_activations(qa, a.data(), k, 0, m);
        }
        const bool tiles_ok = takes_row_tiles(line->kernel, w0);
        const size_t row_bytes = row_tile_row_bytes(w0);
        AlignedBuffer tiles = AlignedBuffer::allocate(row_tiles_bytes(m, row_bytes));
        std::vector<float> out(static_cast<size_t>(m) * n);
        auto run_expert = [&](const PackedWeight& pw, bool with_tiles) {
          if (with_tiles) {
            if (quant) pack_row_tiles(qa.q.data(), qa.k_pad, m, row_bytes, tiles.data());
            else pack_row_tiles(a.data(), sizeof(bf16_t) * k, m, row_bytes, tiles.data());
          }
          // The fields gemm and gate_up share, then each call's own.
          auto input = [&](auto& g, int p, int pe) {
            g.a = quant ? nullptr : a.data();
            g.qa = quant ? &qa : nullptr;
            g.m = m;
            g.lda = k;
            g.panel_begin = p;
            g.panel_end = pe;
            g.a_tiles = with_tiles ? tiles.data() : nullptr;
          };
          for (int p = 0; p < pw.panels; p += panels) {
            const int pe = std::min(pw.panels, p + panels);
            if (gu) {
              GateUpArgs g;
              input(g, p, pe);
              g.h = out.data();
              g.ldh = n;
              line->kernel.gate_up(pw, g);
            } else {
              GemmArgs g;
              input(g, p, pe);
              g.c = out.data();
              g.ldc = n;
              line->kernel.gemm(pw, g);
            }
          }
        };
        KernelCase kc{fmt, op, m, quant, tiles_ok, 2.0 * m * k * (gu ? 2.0 * n : n), static_cast<double>(w0.bytes()), {}};
        int e = 0, n_ok = 0;
        for (int s = 0; s < 60 * samples && n_ok < samples; ++s) {
          double t[2], slower = 1e30;
          bool ok = true;
          for (int o = 0; o < 2; ++o) {
            const int v = (s + o) & 1;
            const double before = probe();
            const auto t0 = Clock::now();
            run_expert(packs[e++ % experts], v == 1 && tiles_ok);
            t[v] = seconds_since(t0);
            double sl;
            ok = gate.open(before, probe(), &sl) && ok;
            slower = std::min(slower, sl);
          }
          n_ok += ok;
          kc.bursts.push_back({t[0], t[1], slower});
        }
        cases.push_back(std::move(kc));
      }
    }
  }
  // A second round of ceilings, now that the run has seen its core's best probe.
  measure_ceilings();

  double ceiling_rate[4] = {};
  for (const Ceiling& c : ceilings) {
    std::vector<double> v;
    for (const Burst& b : gate.kept(ceiling_bursts[c.kind])) v.push_back(b.a);
    ceiling_rate[c.kind] = v.empty() ? 0 : median(v);
    if (c.kind >= 2)
      std::printf("%-56s %7.0f GFLOP/s  stream %5.1f GB/s  (n=%zu)\n", c.name, ceiling_rate[c.kind],
                  ceiling_rate[c.kind] / 65536.0 * 8 * 64, v.size());
    else
      std::printf("%-56s %7.0f GFLOP/s  (n=%zu)\n", c.name, ceiling_rate[c.kind], v.size());
  }
  std::printf("%-56s %7.1f GB/s\n", "plain 512-bit read stream, one thread", median(plain_stream));
  std::printf("best tile probe seen: %.0f GFLOP/s (a throttled core shows about a third of its unthrottled rate)\n", gate.best);
  std::printf("\n%-5s %-7s %4s | %9s %7s %6s | %9s %7s %6s | %6s | %6s %6s\n", "fmt", "op", "m", "rows us", "G(FL)OPs", "GB/s",
              "tiles us", "G(FL)OPs", "GB/s", "tiles/", "%naive", "%core");
  std::printf("(%%naive: tiles us against max(weights / read stream, steps at the L1 tile step); %%core: the same with the "
              "steps at the kernels'-case ceiling)\n");
  for (const KernelCase& kc : cases) {
    const std::vector<Burst> kept = gate.kept(kc.bursts);
    const char* fmt = kc.fmt.c_str();
    const char* op = kc.op.c_str();
    const int m = kc.m;
    const bool quant = kc.quant, tiles_ok = kc.tiles_ok;
    if (kept.empty()) {
      std::printf("%-5s %-7s %4d | no burst at full rate in %zu tries\n", fmt, op, m, kc.bursts.size());
      continue;
    }
    std::vector<double> t_rows, t_tiles, ratio;
    for (const Burst& b : kept) {
      t_rows.push_back(b.a);
      t_tiles.push_back(b.b);
      ratio.push_back(b.a / b.b);
    }
    {
        const double ops_ = kc.ops, bytes = kc.bytes;
        const double tr = median(t_rows), tt = median(t_tiles);
        // Rooflines of this core, in tile steps (bf16: 65536 FLOP, int8 / int4: 131072 OP,
        // each with one 1 KB B tile per product pair): the weights at the plain read stream,
        // or the steps at the L1 tile step's rate (naive) / at the kernels'-case ceiling
        // (the step with B from L2 while streaming weights).
        const double steps = ops_ / (quant ? 131072.0 : 65536.0), read_s = bytes / (median(plain_stream) * 1e9);
        const double naive = std::max(read_s, steps / (ceiling_rate[0] * 1e9 / 65536.0));
        const double core = std::max(read_s, steps / (ceiling_rate[3] * 1e9 / 65536.0));
        std::printf("%-5s %-7s %4d | %9.0f %7.0f %6.1f | %9.0f %7.0f %6.1f | %5.2fx | %5.0f%% %5.0f%%%s (n=%zu)\n", fmt, op,
                    m, tr * 1e6, ops_ / tr / 1e9, bytes / tr / 1e9, tt * 1e6, ops_ / tt / 1e9, bytes / tt / 1e9, median(ratio),
                    100.0 * naive / tt, 100.0 * core / tt, tiles_ok ? "" : " (tiles not taken)", ratio.size());
    }
  }
  return 0;
}
