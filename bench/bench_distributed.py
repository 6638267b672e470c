"""Several ranks on one machine: one shared copy of the CPU experts against a copy per rank
and against one process with the combined batch (issue 28).

    .venv/bin/python bench/bench_distributed.py [--model qwen3-30b] [--layers 4] [--format int8]
        [--ranks 2] [--tokens 1,16,128] [--reps 5] [--comm auto]

The checkpoint is bench_hf.py's random Qwen3-30B-A3B-shaped one (built once into tandem's
cache). Three runs, each in fresh processes (gloo over loopback, torch on 1 thread):

- one:      one process, the experts of every MoE layer called on the ranks' combined batch
            (ranks x T tokens), the pool on every core;
- shared:   `--ranks` processes, `distributed.cpu_experts: shared`: rank 0 holds the experts
            and a pool on every core, each rank calls the same layers on its T tokens;
- per_rank: `--ranks` processes with a copy each, each pool on cores / ranks threads.

Each call is one MoE layer's routed experts (random hidden states and top-k routing, the same
rows in every run: rank r's batch is rows [r T, (r + 1) T) of the combined one). Printed per
run: resident memory after loading (VmRSS of each process and their sum) and, per T, the
median over `--reps` of the time of one pass over the layers (the slowest rank's, after a
barrier), as tokens per second over all ranks, and the ratio to `one`.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def batch(tokens: int, hidden: int, experts: int, top_k: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=g) * 0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    return x, ids, w


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import tandem
    from bench_hf import status_kib

    torch.set_num_threads(1)
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if ranks > 1 else 0
    cpus = os.cpu_count() or 1
    threads = max(1, cpus // ranks) if args.mode == "per_rank" else cpus
    cfg = {"version": 1, "cpu": {"format": args.format, "threads": threads, "dense_format": "torch"},
           "gpu": {"device": "none"},
           "distributed": {"cpu_experts": "per_rank" if args.mode == "per_rank" else "auto", "comm": args.comm}}
    model = tandem.load_model(args.ckpt, cfg, progress=False)
    rss = status_kib("VmRSS") * 1024
    experts = [m for m in model.modules() if type(m).__name__ == "TandemExperts"]
    hf = model.config
    E, H, K = hf.num_experts, hf.hidden_size, hf.num_experts_per_tok
    share = args.share  # ranks whose rows form the combined batch
    times = {}
    for T in args.tokens:
        if args.mode == "one":
            xs = [batch(T, H, E, K, 1000 * T + r) for r in range(share)]
            x, ids, w = (torch.cat([b[i] for b in xs]) for i in range(3))
        else:
            x, ids, w = batch(T, H, E, K, 1000 * T + rank)
        samples = []
        with torch.no_grad():
            for rep in range(args.reps + 1):
                if ranks > 1:
                    dist.barrier()
                t0 = time.perf_counter()
                for m in experts:
                    m(x, ids, w)
                dt = torch.tensor([time.perf_counter() - t0])
                if ranks > 1:
                    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if rep:
                    samples.append(float(dt))
        times[T] = statistics.median(samples)
    out = {"rank": rank, "rss": rss, "times": times, "threads": threads,
           "packed": model.tandem_engine.cpu_bytes if model.tandem_engine is not None else 0}
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(out))
    if ranks > 1:
        dist.barrier()
        dist.destroy_process_group()


def launch(args, mode: str, world: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(f"/tmp/bench_distributed_{os.getpid()}_{mode}")
    procs = []
    for r in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1", TANDEM_TORCH_THREADS="1")
        if world > 1:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world),
                       LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world))
        cmd = [sys.executable, __file__, "--worker", "--mode", mode, "--ckpt", str(args.ckpt), "--out", str(out),
               "--format", args.format, "--tokens", ",".join(map(str, args.tokens)), "--reps", str(args.reps),
               "--comm", args.comm, "--share", str(args.ranks)]
        procs.append(subprocess.Popen(cmd, env=env))
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"{mode}: a worker failed (exit {p.returncode})")
    res = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]
    for r in range(world):
        Path(f"{out}.rank{r}").unlink()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--format", default="int8")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", default="1,16,128")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--comm", default="auto")
    ap.add_argument("--modes", default="one,shared,per_rank")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--mode")
    ap.add_argument("--ckpt")
    ap.add_argument("--out")
    ap.add_argument("--share", type=int, default=1)
    args = ap.parse_args()
    args.tokens = [int(t) for t in str(args.tokens).split(",")]
    if args.worker:
        return worker(args)
    sys.path.insert(0, str(HERE))
    from bench_hf import model_dir

    args.ckpt = model_dir(args.model, args.layers, 32768)
    import platform

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    print(f"# {cpu}, {os.cpu_count()} CPUs; {args.ckpt.name}, cpu.format {args.format}, {args.ranks} ranks, "
          f"comm {args.comm}, median of {args.reps}")
    results = {}
    for mode in args.modes.split(","):
        results[mode] = launch(args, mode, 1 if mode == "one" else args.ranks)
    base = results.get("one")
    print(f"\n| run | threads per pool | VmRSS per process (GB) | sum (GB) | packed experts held (GB) |")
    print("|---|---|---|---|---|")
    for mode, res in results.items():
        rss = [r["rss"] / 1e9 for r in res]
        print(f"| {mode} | {res[0]['threads']} | {' / '.join(f'{v:.2f}' for v in rss)} | {sum(rss):.2f} | "
              f"{sum(r['packed'] for r in res) / 1e9:.2f} |")
    print(f"\n| tokens per rank | " + " | ".join(f"{m} tok/s" for m in results) + " | " +
          " | ".join(f"{m} / one" for m in results if m != "one" and base) + " |")
    print("|---|" + "---|" * (len(results) + (len(results) - 1 if base else 0)))
    for T in args.tokens:
        tps = {m: args.ranks * T / res[0]["times"][str(T)] for m, res in results.items()}
        ratios = [f"{tps[m] / tps['one']:.2f}" for m in results if m != "one" and base]
        print(f"| {T} | " + " | ".join(f"{tps[m]:.0f}" for m in results) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
