"""One dense layer at decode and prefill sizes: tandem.dense (bf16 / int8 / int4 on the
engine's pool) against torch's nn.Linear (bf16, 1 thread and all threads), same process,
alternated, best of --reps; bytes/s over the packed (tandem) or bf16 (torch) weight,
against the machine's read bandwidth (build/bench/bench_ceilings).

    .venv/bin/python bench/bench_dense.py                 # Qwen3-30B-A3B's layers
    .venv/bin/python bench/bench_dense.py --rows 1,32 --reps 20
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import tandem
from tandem import demo
from tandem.dense import TandemLinear

from bench_hf import ceilings  # the machine line and read bandwidth of build/bench/bench_ceilings

# (name, n, k): Qwen3-30B-A3B's q_proj, o_proj, k_proj and lm_head
SHAPES = [("q_proj", 4096, 2048), ("o_proj", 2048, 4096), ("k_proj", 512, 2048), ("lm_head", 151936, 2048)]


def best_time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,128", help="input rows (tokens), comma-separated")
    p.add_argument("--formats", default="bf16,int8,int4")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    ceil = ceilings()
    print(ceil.get("machine", ""))
    bw = ceil.get("read_gbs")
    model = tandem.load_model(demo.ensure_demo_model(), {"version": 1, "gpu": {"device": "none"}}, progress=False)
    engine = model.tandem_engine
    cores = torch.get_num_threads()
    print(f"engine: {engine.threads} threads, kernel level {engine.isa}; read bandwidth {bw} GB/s; best of {args.reps}")
    print(f"{'layer':10}{'n x k':>14}{'rows':>6} {'variant':14}{'ms':>9}{'GB/s':>8}{'%bw':>6}{'vs torch-all':>14}")
    torch.manual_seed(0)
    for name, n, k in SHAPES:
        lin = nn.Linear(k, n, bias=False).to(torch.bfloat16)
        layers = {f: TandemLinear(engine, lin, f, name=name) for f in args.formats.split(",")}
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k).to(torch.bfloat16)
            rows = []
            with torch.no_grad():
                for threads in (1, max(cores, engine.threads)):
                    torch.set_num_threads(threads)
                    rows.append((f"torch-{threads}t", best_time(lambda: lin(x), args.reps), n * k * 2))
                torch.set_num_threads(cores)
                for f, layer in layers.items():
                    rows.append((f"tandem-{f}", best_time(lambda: layer(x), args.reps), layer.packed_bytes))
            torch_all = rows[1][1]
            for label, t, nbytes in rows:
                gbs = nbytes / t / 1e9
                pct = f"{gbs / bw:.0%}" if bw else "n/a"
                print(f"{name:10}{f'{n} x {k}':>14}{m:>6} {label:14}{t * 1e3:>9.3f}{gbs:>8.1f}{pct:>6}{torch_all / t:>13.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
