// The hybrid scheduler (runtime/hybrid.h): per-layer time of an MoE layer split between
// the stream's device (hot experts) and the CPU pools (cold experts), next to each part
// timed alone, to show how much of the shorter part the overlap hides.
//
// Per batch size and fraction of experts on the device:
//   hybrid   HybridMoe::enqueue of every layer, then one synchronize; per layer
//   device   the device part alone: split + the hot experts on the stream
//   cpu      the CPU part alone: the engine on the cold experts only
//   ideal    max(device, cpu): perfect overlap, and the ratio ideal / hybrid
//   hidden   (device + cpu - hybrid) / min(device, cpu): the share of the shorter part
//            that ran under the longer one (1 = fully overlapped, 0 = serialized);
//            "-" when the shorter part is under 10% of the longer
//   peer     the CPU engine with every expert (no device), and its ratio to hybrid
// On the host stream the "device" is a thread running the CPU BF16 kernels. On either
// stream the pool leaves one core (unless --threads says otherwise) to the thread that
// drives the stream, as the engine does. cuda-legacy enqueues on CUDA's legacy default
// stream (the one torch uses unless told otherwise) instead of a non-blocking stream of its own.
//
//   build/bench/bench_hybrid [--stream host|cuda|cuda-legacy] [--shape qwen3-30b] [--layers 2]
//                            [--tokens 1,64,512] [--hot 0,10,25,50] [--threads N] [--format bf16]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ceilings.h"
#include "harness.h"
#include "tandem/hybrid.h"
#include "tandem/pool_config.h"
#include "tandem/streams.h"
#include "tandem/topology.h"

using namespace tandem;
using namespace tandem::bench;

int main(int argc, char** argv) {
  std::string stream_kind = "host", shape_name = "qwen3-30b";
  int n_layers = 2, threads = -1;
  std::vector<int> token_counts = {1, 64, 512}, hot_pcts = {0, 10, 25, 50};
  PackOptions opt;
  for (int i = 1; i < argc; ++i) {
    auto next = [&] { return i + 1 < argc ? argv[++i] : ""; };
    if (!std::strcmp(argv[i], "--stream")) stream_kind = next();
    else if (!std::strcmp(argv[i], "--shape")) shape_name = next();
    else if (!std::strcmp(argv[i], "--layers")) n_layers = std::atoi(next());
    else if (!std::strcmp(argv[i], "--tokens")) token_counts = parse_int_list(next());
    else if (!std::strcmp(argv[i], "--hot")) hot_pcts = parse_int_list(next());
    else if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(next());
    else if (!std::strcmp(argv[i], "--format")) opt.format = parse_format(next());
    else { std::fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
  }
  const ModelShape* sh = find_model_shape(shape_name);
  if (!sh) {
    std::fprintf(stderr, "unknown shape %s (qwen3-30b, qwen3-235b, deepseek-v3, tiny)\n", shape_name.c_str());
    return 2;
  }
  if (stream_kind != "host" && stream_kind != "cuda" && stream_kind != "cuda-legacy") {
    std::fprintf(stderr, "--stream %s: not one of host, cuda, cuda-legacy\n", stream_kind.c_str());
    return 2;
  }
  // cudaStreamLegacy is the handle ((cudaStream_t)1).
  std::unique_ptr<Stream> stream = stream_kind == "cuda"          ? make_cuda_stream(0)
                                   : stream_kind == "cuda-legacy" ? make_cuda_stream(0, reinterpret_cast<void*>(1))
                                                                  : make_host_stream();
  Config::Cpu cpu_cfg;
  cpu_cfg.threads = threads > 0 ? threads : 0;
  Pool pool(pool_options(cpu_cfg, 1));  // as the engine: a core for the thread driving the stream
  const int E = sh->experts, H = sh->hidden, I = sh->inter, K = sh->top_k;
  std::printf("machine: %s\nstream: %s; shape %s (experts %d, hidden %d, inter %d, top-%d); %d layers; CPU format %s, "
              "%d pool threads\n",
              machine_line().c_str(), stream->name().c_str(), sh->name, E, H, I, K, n_layers,
              std::string(format_name(opt.format)).c_str(), pool.total_threads());

  // One random expert's weights serve every expert (speed does not depend on values).
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd(0.f, 0.02f);
  std::vector<bf16_t> g(size_t(I) * H), u(g.size()), d(size_t(H) * I);
  for (auto* v : {&g, &u, &d})
    for (auto& x : *v) x = fp32_to_bf16(nd(rng));
  auto source = [&](int) {
    return ExpertSource{{g.data(), SourceType::bf16, I, H}, {u.data(), SourceType::bf16, I, H}, {d.data(), SourceType::bf16, H, I}};
  };
  std::vector<std::unique_ptr<MoeLayer>> layers;
  std::vector<MoeLayer*> ptrs;
  for (int l = 0; l < n_layers; ++l) {
    layers.push_back(std::make_unique<MoeLayer>(pool, MoeShape{E, H, I}, opt, l));
    layers.back()->load(source);
    ptrs.push_back(layers.back().get());
  }
  const int max_t = *std::max_element(token_counts.begin(), token_counts.end());
  HybridMoe hy(*stream, ptrs, {2, max_t, 0});

  std::printf("\n%6s %5s %10s %10s %10s %10s %8s %8s %10s %8s\n", "tokens", "hot%", "hybrid ms", "device ms", "cpu ms",
              "ideal ms", "ideal/hy", "hidden", "peer ms", "peer/hy");
  for (int T : token_counts) {
    // Routing: top-k distinct experts per token, uniform; weights positive.
    std::vector<int32_t> ids(size_t(T) * K);
    std::vector<float> w(ids.size());
    std::uniform_int_distribution<int> pick(0, E - 1);
    for (int t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k) {
        int e;
        do e = pick(rng);
        while (std::find(&ids[size_t(t) * K], &ids[size_t(t) * K + k], e) != &ids[size_t(t) * K + k]);
        ids[size_t(t) * K + k] = e;
        w[size_t(t) * K + k] = 1.0f / K;
      }
    std::vector<bf16_t> x(size_t(T) * H);
    for (auto& v : x) v = fp32_to_bf16(nd(rng) * 50);
    auto dev = [&](size_t bytes) { return stream->alloc_device(bytes); };
    void* dx = dev(x.size() * 2);
    void* dids = dev(ids.size() * 4);
    void* dw = dev(w.size() * 4);
    void* dout = dev(size_t(T) * H * 4);
    void* d3 = dev(3 * ids.size() * 4);
    void* dmask = dev(E);
    stream->upload(dx, x.data(), x.size() * 2);
    stream->upload(dids, ids.data(), ids.size() * 4);
    stream->upload(dw, w.data(), w.size() * 4);
    std::vector<float> out(size_t(T) * H);

    // The peer: every expert on the CPU.
    MoeInput all;
    all.x = x.data();
    all.tokens = T;
    all.ids = ids.data();
    all.top_k = K;
    all.weights = w.data();
    all.out = out.data();
    const double t_peer = time_per_call([&] {
      for (auto* l : ptrs) l->forward(all);
    }) / n_layers;

    for (int pct : hot_pcts) {
      const int nh = std::min(E, static_cast<int>(std::lround(E * pct / 100.0)));
      std::vector<int> hot;
      for (int j = 0; j < nh; ++j) hot.push_back(j * E / std::max(nh, 1));
      for (int l = 0; l < n_layers; ++l) hy.set_hot(l, hot, source);
      std::vector<uint8_t> mask(E, 0);
      for (int e : hot) mask[e] = 1;
      stream->upload(dmask, mask.data(), E);
      const LayerIO io{dx, XType::bf16, T, dids, false, static_cast<float*>(dw), K, static_cast<float*>(dout)};
      const double t_hy = time_per_call([&] {
        for (int l = 0; l < n_layers; ++l) hy.enqueue(l, io);
        stream->synchronize();
      }) / n_layers;
      const double t_dev = time_per_call([&] {
        for (int l = 0; l < n_layers; ++l) {
          stream->split(dids, false, static_cast<float*>(dw), T, static_cast<uint8_t*>(dmask), {E, K, 0},
                        static_cast<int32_t*>(d3));
          if (DeviceExperts* de = hy.device_experts(l))
            de->forward(dx, XType::bf16, T, static_cast<int32_t*>(d3), static_cast<float*>(dw), K, static_cast<float*>(dout));
        }
        stream->synchronize();
      }) / n_layers;
      std::vector<int32_t> hot_ids(ids.size()), cold(ids.size()), def(ids.size());
      split(ids.data(), w.data(), T, mask.data(), {E, K, 0}, hot_ids.data(), cold.data(), def.data());
      MoeInput cin = all;
      cin.ids = cold.data();
      const double t_cpu = time_per_call([&] {
        for (auto* l : ptrs) l->forward(cin);
      }) / n_layers;
      const double ideal = std::max(t_dev, t_cpu), shorter = std::min(t_dev, t_cpu);
      // "hidden" means little when one part is negligible: printed from 10% of the other.
      char hidden[16] = "-";
      if (shorter >= 0.1 * ideal) std::snprintf(hidden, sizeof hidden, "%.2f", (t_dev + t_cpu - t_hy) / shorter);
      std::printf("%6d %5d %10.3f %10.3f %10.3f %10.3f %8.2f %8s %10.3f %8.2f\n", T, pct, t_hy * 1e3, t_dev * 1e3,
                  t_cpu * 1e3, ideal * 1e3, ideal / t_hy, hidden, t_peer * 1e3, t_peer / t_hy);
      std::fflush(stdout);
    }
    for (void* p : {dx, dids, dw, dout, d3, dmask}) stream->free_device(p);
  }
  return 0;
}
