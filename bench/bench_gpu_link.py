"""The GPU numbers a layerwise-prefill cost model needs, measured with torch alone:

  - host -> device and device -> host copy bandwidth, pinned vs pageable host memory
    (the rate at which a layer's cold experts could stream to the GPU);
  - the GPU's bf16 GEMM rate at one expert's shapes (gate/up [2I x H], down [H x I]) for a
    range of tokens per expert (the rate the streamed experts would run at there).

    python bench/bench_gpu_link.py                 # qwen3-30b, qwen3-235b, deepseek-v3 shapes
    python bench/bench_gpu_link.py --sizes-mib 16,256 --reps 10

Then, per shape, the prompt length above which streaming a layer's experts (bf16) over the
measured pinned link and running them on the GPU beats running them on the CPU at a given
rate (--cpu-tflops, the CPU engine's measured bf16 prefill rate on the machine in question:
bench_moe prints it). Prints a table; needs a CUDA device (exits 2 without one).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

SHAPES = {  # name: (experts, hidden, intermediate, top_k)
    "qwen3-30b": (128, 2048, 768, 8),
    "qwen3-235b": (128, 4096, 1536, 8),
    "deepseek-v3": (256, 7168, 2048, 8),
}


def copy_rate(nbytes: int, pinned: bool, to_device: bool, reps: int) -> float:
    """GB/s of one copy of nbytes, best of reps, timed with CUDA events around the copy."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    host.fill_(1)  # touch every page before timing (a fresh pageable buffer faults on first use)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        if to_device:
            dev.copy_(host, non_blocking=pinned)
        else:
            host.copy_(dev, non_blocking=pinned)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return nbytes / best / 1e9


def gemm_rate(m: int, n: int, k: int, reps: int) -> float:
    """TFLOP/s of [m x k] @ [k x n] in bf16 (fp32 accumulate), median of reps."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        a @ b
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    times.sort()
    return 2.0 * m * n * k / times[len(times) // 2] / 1e12


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", default="4,64,256", help="copy sizes in MiB (comma-separated)")
    ap.add_argument("--tokens", default="8,64,512,4096", help="tokens per expert for the GEMM rates")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="MoE shapes: " + ", ".join(SHAPES))
    ap.add_argument("--cpu-tflops", type=float, default=1.0,
                    help="the CPU engine's bf16 prefill rate (TFLOP/s) the break-even is computed against")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu_link: torch sees no CUDA device; nothing measured", file=sys.stderr)
        return 2
    shapes = [s for s in a.shapes.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"--shapes: unknown shape {s!r} (known: {', '.join(SHAPES)})")
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print("\ncopy bandwidth, GB/s (best of reps; CUDA events)")
    print(f"{'MiB':>6} {'H2D pinned':>11} {'H2D pageable':>13} {'D2H pinned':>11} {'D2H pageable':>13}")
    h2d_pinned = 0.0
    for mib in (int(x) for x in a.sizes_mib.split(",")):
        n = mib << 20
        r = [copy_rate(n, p, d, a.reps) for d, p in ((True, True), (True, False), (False, True), (False, False))]
        h2d_pinned = max(h2d_pinned, r[0])
        print(f"{mib:>6} {r[0]:>11.1f} {r[1]:>13.1f} {r[2]:>11.1f} {r[3]:>13.1f}")
    tokens = [int(x) for x in a.tokens.split(",")]
    print("\nbf16 GEMM rate per expert, TFLOP/s (torch.matmul, median of reps)")
    print(f"{'shape':>12} {'tokens':>7} {'gate_up':>8} {'down':>8}")
    rates = {}
    for s in shapes:
        E, H, I, K = SHAPES[s]
        for t in tokens:
            gu, dn = gemm_rate(t, 2 * I, H, a.reps), gemm_rate(t, H, I, a.reps)
            rates[(s, t)] = 2 / (1 / gu + 1 / dn)
            print(f"{s:>12} {t:>7} {gu:>8.1f} {dn:>8.1f}")
    print(f"\nlayerwise prefill, modelled: stream every expert of a layer in bf16 at {h2d_pinned:.1f} GB/s "
          f"(pinned H2D) vs the CPU at {a.cpu_tflops:.2f} TFLOP/s")
    print(f"{'shape':>12} {'layer GB':>9} {'upload ms':>10} {'break-even tokens':>18}")
    for s in shapes:
        E, H, I, K = SHAPES[s]
        nbytes = E * 3 * H * I * 2
        upload_s = nbytes / (h2d_pinned * 1e9)
        flops_per_token = K * 3 * 2 * H * I
        # The CPU's time for T tokens equals the upload at T = upload_s * cpu_rate / flops_per_token
        # (the GPU's own compute is small next to either at these sizes: the table above).
        t_even = upload_s * a.cpu_tflops * 1e12 / flops_per_token
        print(f"{s:>12} {nbytes / 1e9:>9.2f} {upload_s * 1e3:>10.1f} {t_even:>18.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
