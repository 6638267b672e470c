"""One-token (decode) attention: tandem's pool (tandem.attention, _C.Engine.decode_attention)
against torch's SDPA on the same bf16 tensors, over KV-cache lengths, with the bytes of
cache each call reads and their rate over the machine's measured read bandwidth
(build/bench/bench_ceilings). SDPA runs with 1 thread (what torch keeps beside tandem's
pool in a tandem model) and with one per core.

    .venv/bin/python bench/bench_attention.py                       # Qwen3-30B-A3B heads
    .venv/bin/python bench/bench_attention.py --heads 64,4 --dim 128 --keys 256,4096

Each figure is the best of --rounds rounds of --reps calls, the variants alternated per
round (the machine's load moves between rounds; the minimum is the least disturbed).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> int:
    import torch

    from bench_hf import ceilings
    from tandem.engine import make_engine

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="32,4", help="query heads,kv heads (default: Qwen3-30B-A3B's 32,4)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--keys", default="128,512,2048,8192,32768")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    hq, hkv = (int(x) for x in args.heads.split(","))
    D = args.dim
    cores = os.cpu_count() or 1
    ceil = ceilings()
    bw = ceil.get("read_gbs")
    print(ceil.get("machine", ""))
    print(f"read bandwidth (bench_ceilings): {bw} GB/s; heads {hq} / {hkv} kv, dim {D}, bf16; "
          f"best of {args.rounds} rounds of {args.reps} calls")
    eng = make_engine({"version": 1, "cpu": {}}, (8, 64, 32), [0])
    print(f"tandem: {eng.threads} pool threads, kernel level {eng.isa}")
    print(f"{'keys':>7} {'KV MiB':>8} | {'tandem us':>10} {'GB/s':>6} {'%bw':>5} | {'sdpa 1t us':>10} {'sdpa {}t us'.format(cores):>10}"
          f" | {'vs sdpa 1t':>10} {'vs sdpa {}t'.format(cores):>10}")
    g = torch.Generator().manual_seed(0)
    for L in (int(x) for x in args.keys.split(",")):
        q = torch.randn(1, hq, 1, D, generator=g).bfloat16()
        k = torch.randn(1, hkv, L, D, generator=g).bfloat16()
        v = torch.randn(1, hkv, L, D, generator=g).bfloat16()
        out = torch.empty(1, 1, hq, D, dtype=torch.bfloat16)
        scale = D ** -0.5

        def ours():
            eng.decode_attention(1, hq, hkv, D, D, L, scale, q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(),
                                 k.stride(0), k.stride(1), k.stride(2), v.data_ptr(), v.stride(0), v.stride(1),
                                 v.stride(2), 0, 0, out.data_ptr(), hq * D, D)

        def sdpa():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True).transpose(1, 2)
        ours()
        err = ((out.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 1e-2, f"keys {L}: tandem's output differs from SDPA's by {err:.3g} (relative L2)"
        best = {"ours": 1e9, "sdpa1": 1e9, "sdpaN": 1e9}
        for _ in range(args.rounds):
            for name, fn, threads in (("ours", ours, 1), ("sdpa1", sdpa, 1), ("sdpaN", sdpa, cores)):
                torch.set_num_threads(threads)
                fn()
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    fn()
                best[name] = min(best[name], (time.perf_counter() - t0) / args.reps)
        torch.set_num_threads(1)
        nbytes = 2 * hkv * L * D * 2
        rate = nbytes / best["ours"] / 1e9
        pct = f"{rate / bw:5.0%}" if bw else "    -"
        print(f"{L:>7} {nbytes / 2**20:>8.2f} | {best['ours'] * 1e6:>10.1f} {rate:>6.1f} {pct} | "
              f"{best['sdpa1'] * 1e6:>10.1f} {best['sdpaN'] * 1e6:>10.1f} | {best['sdpa1'] / best['ours']:>9.2f}x "
              f"{best['sdpaN'] / best['ours']:>9.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
