"""LoRA forward + backward of one MoE layer: tandem's CPU path (sft/, tandem._C.LoraLayer)
vs PyTorch CPU autograd doing the same computation, each in its own process.

    .venv/bin/python bench/bench_sft.py                                   # everything below
    .venv/bin/python bench/bench_sft.py --shapes 30b --ranks 8 --tokens 512 --reps 2

Shapes (random bf16 base weights, random uniform top-k routing, seed 0):
  30b   Qwen3-30B-A3B:   128 experts, hidden 2048, expert intermediate 768,  top-8
  235b  Qwen3-235B-A22B: 128 experts, hidden 4096, expert intermediate 1536, top-8
One step = forward (training: context saved) + backward from a random dL/dout giving dL/dx,
dL/dw (routing weights) and dL/dA, dL/dB of every expert's gate/up/down LoRA.

Base FLOPs per step = 12 * rows * hidden * inter (forward: gate, up, down; backward: dOut Wd
and [dg du][Wg; Wu]; LoRA needs no weight gradient of the base), rows = tokens * top_k.
The ceiling is the peak of the instruction tandem's bf16 kernels run at the level in effect
(AMX tdpbf16ps on an AMX CPU, where the AMX kernel serves every m; vdpbf16ps otherwise),
measured by build/bench/bench_ceilings right before and after each shape (the higher of the
two: an instruction peak is a ceiling; the machine is shared: the ratio uses the peak
measured next to it).

The PyTorch peer: the experts' base weights in bf16, LoRA A/B fp32 leaf tensors (one per
expert and matrix, as PEFT's per-expert modules hold them), x bf16 with
requires_grad, routing weights fp32 with requires_grad; per expert (tokens grouped by a
sort, as transformers' eager MoE does) g = (x Wg^T) + s (x Ag^T) Bg^T with the base product
in bf16 (oneDNN) and the LoRA products in fp32, the same for up and down; out.index_add_;
out.backward(dout). torch uses the same number of threads as tandem's pool.

Memory: "step" is the peak resident memory during a configuration's steps (VmHWM, cleared
through /proc/self/clear_refs before them) above the resident memory right after the
weights and adapters were set up, i.e. saved activations, scratch and gradients (the
allocators' caches from earlier configurations of the same process count against it);
"weights" is the resident memory after loading.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"30b": dict(experts=128, hidden=2048, inter=768, top_k=8),
          "235b": dict(experts=128, hidden=4096, inter=1536, top_k=8)}


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def bf16_peak() -> tuple[str, float | None]:
    """(instruction, GFLOP/s): the peak of what the bf16 kernels in effect run."""
    import tandem
    amx = tandem.effective_isa() == "amx"
    name = "AMX tdpbf16ps" if amx else "vdpbf16ps"
    exe = ROOT / "build" / "bench" / "bench_ceilings"
    if not exe.exists():
        return name, None
    out = subprocess.run([str(exe), "--reps", "3"], capture_output=True, text=True).stdout
    # The highest repetition: an instruction peak is a ceiling, and on a shared machine the
    # median can catch a neighbour's load (a run that saw more than the median is proof).
    row = r"peak AMX tdpbf16ps \(bf16\)" if amx else r"peak vdpbf16ps zmm \(bf16\)"
    m = re.search(row + r"\s+[\d.]+ GFLOP/s\s+\(([\d.]+)\.\.([\d.]+)\)", out)
    return name, (float(m.group(2)) if m else None)


def make_inputs(torch, shape: dict, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    E, H, K = shape["experts"], shape["hidden"], shape["top_k"]
    x = torch.randn(tokens, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    w = torch.rand(tokens, K, generator=g)
    dout = torch.randn(tokens, H, generator=g)
    return x, ids, w, dout


def lora_params(torch, shape: dict, r: int):
    g = torch.Generator().manual_seed(1)
    E, H, I = shape["experts"], shape["hidden"], shape["inter"]
    dims = [(r, H), (I, r), (r, H), (I, r), (r, I), (H, r)]
    return [torch.randn(E, a, b, generator=g) * 0.02 for a, b in dims]


def random_weights(torch, shape: dict):
    """bf16 gate, up [experts x inter x hidden] and down [experts x hidden x inter], filled
    expert by expert (no full-size fp32 temporary)."""
    g = torch.Generator().manual_seed(0)
    E, H, I = shape["experts"], shape["hidden"], shape["inter"]
    W = [torch.empty(E, I, H, dtype=torch.bfloat16), torch.empty(E, I, H, dtype=torch.bfloat16),
         torch.empty(E, H, I, dtype=torch.bfloat16)]
    for w in W:
        for e in range(E):
            w[e] = torch.randn(w.shape[1], w.shape[2], generator=g) / w.shape[2] ** 0.5
    return W


def run_tandem(args, shape: dict, r: int, T: int) -> dict:
    import torch

    from tandem import _C

    pool = _C.Pool(config_text=f"cpu:\n  format: {args.format}\n")
    torch.set_num_threads(pool.threads)
    layer = _C.LoraLayer(pool, shape["experts"], shape["hidden"], shape["inter"], format=args.format, group=128, rank=r,
                         alpha=2.0 * r)
    W = random_weights(torch, shape)
    t0 = time.perf_counter()
    layer.load([t.data_ptr() for t in W[0]], [t.data_ptr() for t in W[1]], [t.data_ptr() for t in W[2]], "bfloat16")
    t_load = time.perf_counter() - t0
    del W
    t0 = time.perf_counter()
    layer.prepare_backward()
    t_bwpack = time.perf_counter() - t0
    params = lora_params(torch, shape, r)
    grads = [torch.zeros_like(p) for p in params]
    spec = lambda t: (t.data_ptr(), t.numel(), 0, 0, False)
    P, G = [spec(p) for p in params], [spec(g) for g in grads]
    x, ids, w, dout = make_inputs(torch, shape, T, seed=T)
    out = torch.empty(T, shape["hidden"])
    dx = torch.empty(T, shape["hidden"])
    dw = torch.empty(T, shape["top_k"])
    base_rss = status_kib("VmRSS")
    reset_peak()

    def step():
        ctx = layer.forward(x.data_ptr(), True, T, ids.data_ptr(), w.data_ptr(), shape["top_k"], out.data_ptr(), P, True)
        saved = ctx.bytes
        layer.backward(ctx, P, dout.data_ptr(), False, dx.data_ptr(), False, dw.data_ptr(), G)
        return saved

    step()  # warm-up: scratch buffers grow to this size once
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        saved = step()
        times.append(time.perf_counter() - t0)
    return dict(variant="tandem", r=r, tokens=T, seconds=statistics.median(times), times=times,
                step_mib=(status_kib("VmHWM") - base_rss) / 1024, weights_mib=base_rss / 1024,
                saved_bytes_per_token=saved / T, load_s=t_load, backward_pack_s=t_bwpack,
                packed_bytes=layer.packed_bytes, backward_bytes=layer.backward_bytes)


def torch_step(torch, shape, W, params, x, ids, w, dout, s):
    """The same computation in PyTorch autograd; returns the tensors holding the grads."""
    Wg, Wu, Wd = W
    ag, bg, au, bu, ad, bd = params
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    T, K = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=shape["experts"]).tolist()
    out = torch.zeros(T, shape["hidden"])
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start:start + n]
        start += n
        tok, slot = sel // K, sel % K
        xe = x[tok]
        xf = xe.float()
        g = (xe @ Wg[e].T).float() + s * ((xf @ ag[e].T) @ bg[e].T)
        u = (xe @ Wu[e].T).float() + s * ((xf @ au[e].T) @ bu[e].T)
        h = torch.nn.functional.silu(g) * u
        y = (h.bfloat16() @ Wd[e].T).float() + s * ((h @ ad[e].T) @ bd[e].T)
        out = out.index_add(0, tok, w[tok, slot, None] * y)
    out.backward(dout)
    return x, w


def run_torch(args, shape: dict, r: int, T: int) -> dict:
    import torch

    torch.set_num_threads(args.threads or os.cpu_count())
    W = random_weights(torch, shape)
    # One leaf tensor per expert and matrix, as PEFT's per-expert LoRA modules hold them
    # (indexing one [experts x ...] Parameter would make autograd write a full-size zero
    # gradient per expert: the peer would then lose by E^2 work, not by its arithmetic).
    params = [[m.clone().requires_grad_() for m in p] for p in lora_params(torch, shape, r)]
    x, ids, w, dout = make_inputs(torch, shape, T, seed=T)
    base_rss = status_kib("VmRSS")
    reset_peak()
    torch_step(torch, shape, W, params, x, ids, w, dout, 2.0)  # warm-up
    times = []
    for _ in range(args.reps):
        for p in params:
            for m in p:
                m.grad = None
        t0 = time.perf_counter()
        torch_step(torch, shape, W, params, x, ids, w, dout, 2.0)
        times.append(time.perf_counter() - t0)
    return dict(variant="torch", r=r, tokens=T, seconds=statistics.median(times), times=times,
                step_mib=(status_kib("VmHWM") - base_rss) / 1024, weights_mib=base_rss / 1024)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="30b,235b")
    ap.add_argument("--ranks", default="8,64")
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--format", default="bf16", choices=["bf16", "int8", "int4"])
    ap.add_argument("--variants", default="tandem,torch")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: the pool's)")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant in this process
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--r", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--T", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.ranks = [int(v) for v in str(args.ranks).split(",")]
    args.tokens = [int(v) for v in str(args.tokens).split(",")]

    if args.variant:  # child process
        fn = run_tandem if args.variant == "tandem" else run_torch
        print(json.dumps(fn(args, SHAPES[args.shape], args.r, args.T)))
        return 0

    all_results = {}
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        peak_name, peak = bf16_peak()
        print(f"\n== {name}: experts {shape['experts']}, hidden {shape['hidden']}, inter {shape['inter']}, "
              f"top-{shape['top_k']}; base format {args.format}; {peak_name} peak {peak} GFLOP/s", flush=True)
        res = {}
        for r in args.ranks:
            for T in args.tokens:
                for v in args.variants.split(","):  # each configuration in a fresh process
                    cmd = [sys.executable, __file__, "--variant", v, "--shape", name, "--r", str(r), "--T", str(T),
                           "--reps", str(args.reps), "--format", args.format, "--threads", str(args.threads)]
                    p = subprocess.run(cmd, capture_output=True, text=True)
                    if p.returncode != 0:
                        print(f"{v} r={r} tokens={T} failed:\n{p.stderr[-3000:]}", flush=True)
                        continue
                    res.setdefault(v, []).append(json.loads(p.stdout.strip().splitlines()[-1]))
                    print(f"  ({v} r={r} tokens={T}: {res[v][-1]['seconds']:.3f} s)", flush=True)
        peak_after = bf16_peak()[1]
        if peak and peak_after:
            peak = max(peak, peak_after)
        rows = []
        print(f"{'r':>3} {'tokens':>6} | {'tandem s':>8} {'GFLOP/s':>8} {'%peak':>6} {'saved B/tok':>11} {'step MiB':>8} |"
              f" {'torch s':>8} {'step MiB':>8} | {'speedup':>7} {'mem':>5}")
        for t in res.get("tandem", []):
            rows_ = t["tokens"] * shape["top_k"]
            flops = 12.0 * rows_ * shape["hidden"] * shape["inter"]
            gf = flops / t["seconds"] / 1e9
            pt = next((x for x in res.get("torch", []) if x["r"] == t["r"] and x["tokens"] == t["tokens"]), None)
            sp = pt["seconds"] / t["seconds"] if pt else float("nan")
            mem = t["step_mib"] / pt["step_mib"] if pt and pt["step_mib"] > 0 else float("nan")
            print(f"{t['r']:>3} {t['tokens']:>6} | {t['seconds']:>8.3f} {gf:>8.1f} {100 * gf / peak if peak else 0:>5.1f}%"
                  f" {t['saved_bytes_per_token']:>11.0f} {t['step_mib']:>8.0f} |"
                  f" {pt['seconds'] if pt else float('nan'):>8.3f} {pt['step_mib'] if pt else float('nan'):>8.0f} |"
                  f" {sp:>6.2f}x {mem:>5.2f}")
            rows.append(dict(tandem=t, torch=pt, gflops=gf, peak=peak))
        if "tandem" in res and res["tandem"]:
            t = res["tandem"][0]
            print(f"tandem weights: forward packs {t['packed_bytes'] / 2**30:.2f} GiB, backward packs "
                  f"{t['backward_bytes'] / 2**30:.2f} GiB (built in {t['backward_pack_s']:.1f} s), load {t['load_s']:.1f} s; "
                  f"resident after load {t['weights_mib'] / 1024:.2f} GiB"
                  + (f"; torch weights resident {res['torch'][0]['weights_mib'] / 1024:.2f} GiB" if res.get("torch") else ""))
        all_results[name] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(all_results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
