"""One-token (decode) attention: tandem's pool (tandem.attention, _C.Engine.decode_attention)
against torch's SDPA on the same bf16 tensors, over KV-cache lengths, with the bytes of
cache each call reads and their rate over the machine's measured read bandwidth
(build/bench/bench_ceilings). SDPA runs with 1 thread (what torch keeps beside tandem's
pool in a tandem model) and with one per core.

    .venv/bin/python bench/bench_attention.py                       # Qwen3-30B-A3B heads
    .venv/bin/python bench/bench_attention.py --heads 64,4 --dim 128 --keys 256,4096

With --prefill: a causal prompt's attention (queries = keys = each --keys value) on the
pool (_C.Engine.prefill_attention: flash attention on tandem's BF16 GEMM kernels) against
SDPA split by heads over the pool's threads (what tandem ran before, tandem.attention._sdpa),
SDPA on torch's one thread, and SDPA with one thread per core (PyTorch's own parallelism),
with GFLOP/s (4 x dim x heads x L (L + 1) / 2 per call) over the peak of the instruction
tandem's BF16 kernel at this level uses (bench_ceilings):

    .venv/bin/python bench/bench_attention.py --prefill --keys 128,512,2048,4096 --reps 2 --rounds 3
    .venv/bin/python bench/bench_attention.py --prefill --heads 16,16 --dim 192 --value-dim 128   # DeepSeek-V2-Lite

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


def best_times(variants, rounds: int, reps: int) -> dict[str, float]:
    """Seconds per call of each (name, fn, torch threads) variant: the best of `rounds` rounds
    of `reps` calls (after one untimed), the variants alternated within each round; torch is
    left at one thread."""
    import torch

    best = {name: float("inf") for name, _, _ in variants}
    for _ in range(rounds):
        for name, fn, threads in variants:
            torch.set_num_threads(threads)
            fn()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / reps)
    torch.set_num_threads(1)
    return best


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
    p.add_argument("--prefill", action="store_true", help="a causal prompt's attention instead of one token's")
    p.add_argument("--value-dim", type=int, default=0, help="--prefill: the values' dim (default --dim)")
    args = p.parse_args()
    hq, hkv = (int(x) for x in args.heads.split(","))
    D = args.dim
    cores = os.cpu_count() or 1
    ceil = ceilings()
    bw = ceil.get("read_gbs")
    print(ceil.get("machine", ""))
    if args.prefill:
        return prefill(args, hq, hkv, D, args.value_dim or D, ceil)
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
        best = best_times((("ours", ours, 1), ("sdpa1", sdpa, 1), ("sdpaN", sdpa, cores)), args.rounds, args.reps)
        nbytes = 2 * hkv * L * D * 2
        rate = nbytes / best["ours"] / 1e9
        pct = f"{rate / bw:5.0%}" if bw else "    -"
        print(f"{L:>7} {nbytes / 2**20:>8.2f} | {best['ours'] * 1e6:>10.1f} {rate:>6.1f} {pct} | "
              f"{best['sdpa1'] * 1e6:>10.1f} {best['sdpaN'] * 1e6:>10.1f} | {best['sdpa1'] / best['ours']:>9.2f}x "
              f"{best['sdpaN'] / best['ours']:>9.2f}x")
    return 0


# The peak a BF16 kernel at an engine's level is measured against (bench_ceilings' keys).
PEAK_OF_LEVEL = {"amx": ("amx_bf16", "tdpbf16ps"), "avx512_bf16": ("dpbf16", "vdpbf16ps"),
                 "avx512_vnni": ("fma_zmm", "vfmadd231ps zmm"), "avx512": ("fma_zmm", "vfmadd231ps zmm"),
                 "avx2": ("fma_ymm", "vfmadd231ps ymm")}


def prefill(args, hq: int, hkv: int, D: int, Dv: int, ceil: dict) -> int:
    import torch
    from torch import nn

    from tandem import attention
    from tandem.engine import make_engine

    cores = os.cpu_count() or 1
    eng = make_engine({"version": 1, "cpu": {}}, (8, 64, 32), [0])
    key, instr = PEAK_OF_LEVEL.get(eng.isa, (None, "-"))
    peak = ceil.get(key) if key else None
    print(f"prefill attention, causal, heads {hq} / {hkv} kv, dims {D} / {Dv}, bf16; tandem: {eng.threads} pool "
          f"threads, level {eng.isa}, peak {instr} {peak} GFLOP/s; best of {args.rounds} rounds of {args.reps} calls")
    print(f"{'L':>6} | {'tandem ms':>9} {'GFLOP/s':>8} {'%peak':>6} | {'split ms':>9} {'sdpa 1t':>9} "
          f"{'sdpa {}t'.format(cores):>9} | {'vs split':>8} {'vs 1t':>7} {'vs {}t'.format(cores):>7} | {'rel L2':>7}")
    mod = nn.Module()  # what tandem.attention needs of an attention module
    mod.num_key_value_groups, mod.is_causal = hq // hkv, True
    mod.__dict__["tandem_attention_engine"] = eng
    g = torch.Generator().manual_seed(0)
    for L in (int(x) for x in args.keys.split(",")):
        # q as transformers' projections leave it: [B, L, H, D] memory seen as [B, H, L, D]
        q = torch.randn(1, L, hq, D, generator=g).bfloat16().transpose(1, 2)
        k = torch.randn(1, hkv, L, D, generator=g).bfloat16()
        v = torch.randn(1, hkv, L, Dv, generator=g).bfloat16()
        scale = D ** -0.5

        def ours():
            return attention._prefill(eng, mod, q, k, v, None, scale, True)

        def split():
            return attention._sdpa(mod, q, k, v, None, dropout=0.0, scaling=scale, is_causal=True)[0]

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                                    enable_gqa=True).transpose(1, 2)

        torch.set_num_threads(1)
        want = sdpa().float()
        got = ours()
        assert got is not None, "tandem.attention._prefill refused the call"
        err = ((got.float() - want).norm() / want.norm()).item()
        assert err < 1e-2, f"L {L}: tandem's output differs from SDPA's by {err:.3g} (relative L2)"
        best = best_times((("ours", ours, 1), ("split", split, 1), ("sdpa1", sdpa, 1), ("sdpaN", sdpa, cores)),
                          args.rounds, args.reps)
        flops = 2 * (D + Dv) * hq * L * (L + 1) / 2
        rate = flops / best["ours"] / 1e9
        pct = f"{rate / peak:6.0%}" if peak else "     -"
        print(f"{L:>6} | {best['ours'] * 1e3:>9.2f} {rate:>8.1f} {pct} | {best['split'] * 1e3:>9.2f} "
              f"{best['sdpa1'] * 1e3:>9.2f} {best['sdpaN'] * 1e3:>9.2f} | {best['split'] / best['ours']:>7.2f}x "
              f"{best['sdpa1'] / best['ours']:>6.2f}x {best['sdpaN'] / best['ours']:>6.2f}x | {err:>7.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
