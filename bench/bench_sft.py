"""LoRA forward + backward of one MoE layer: tandem's CPU path (sft/, tandem._C.LoraLayer)
vs PyTorch CPU autograd doing the same computation vs KTransformers' kt-kernel 0.7.2 SFT
operator (AMXBF16_SFT_MOE), each in its own process.

    KT_KERNEL_PATH=DIR .venv/bin/python bench/bench_sft.py               # everything below
    .venv/bin/python bench/bench_sft.py --shapes 30b --ranks 8 --tokens 512 --reps 2
    .venv/bin/python bench/bench_sft.py --variants tandem,kt --check tandem,kt --shapes 30b --tokens 128 --reps 1

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

kt-kernel (variant kt, in the default --variants) is installed outside the project and only
called, never copied:
    pip install --no-deps --target DIR kt_kernel-0.7.2-cp311-cp311-manylinux_2_35_x86_64.whl gguf typer rich httpx
then KT_KERNEL_PATH=DIR (or --kt-path DIR; DIR is appended to sys.path, so the project's own torch
wins). Without it, on a CPU without AMX (its SFT operator is an AMX one) or with --format other
than bf16, the script prints one line saying why and measures tandem and torch alone.
The kt step is the operator as kt's AMXSFTMoEWrapper (kt_kernel/sft/amx.py) sets it up, minus
its staging copies: a MOESFTConfig with the same bf16 [E x N x K] base weights, lora_alpha =
2 r (kt's scaling alpha / r = 2 = tandem's), backward packs kept per layer (share_backward_bb
false: kt's training default shares them between layers and repacks each layer's before its
backward, overlapped with the previous layer; tandem keeps its backward packs too), then per
step forward_sft_task(save_for_backward) + backward_task into the LoRA gradient buffers
(accumulate, as tandem's backward does), each submitted to kt's CPUInfer and synced. kt's
worker pool gets tandem's pool's subpools and threads (--kt-threads changes it).
What kt computes differs from tandem's step only in precision: the same out, dL/dx, dL/dw and
dL/dA, dL/dB of every expert's gate/up/down LoRA, but with LoRA A/B and their gradients in
bf16 (the script hands it the fp32 adapters rounded to bf16), dL/dout taken in bf16 (converted
once, outside the timing) and out and dL/dx returned in bf16 (tandem: fp32 adapters, gradients,
dL/dout, out and dL/dx). tandem/kt = kt s / tandem s (> 1: tandem faster).

Correctness (--check, default kt): before its timed steps, each checked variant's warm-up step
is compared with the torch variant's computation of the same step (fp32 adapters, bf16 base
products, fp32 LoRA products; run in that child before the variant loads), as relative L2
||a - ref|| / ||ref|| of out, dL/dx, dL/dw and of dL/dA, dL/dB over all experts for gate, up
and down; printed under the table (a NaN/Inf output is flagged there).
"""
from __future__ import annotations

import argparse
import ctypes
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


def release_freed() -> None:
    """Hands the heap freed so far back to the OS (glibc), so that a reference step's
    temporaries do not stay resident under the memory measured for the variant's steps."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reference(torch, shape: dict, W, r: int, x, ids, w, dout) -> dict:
    """The torch variant's step (torch_step, fp32 adapters): out, dL/dx, dL/dw and the six
    dL/dA, dL/dB as [experts x ...] tensors (zero for an expert no token chose)."""
    params = [[m.clone().requires_grad_() for m in p] for p in lora_params(torch, shape, r)]
    out, x, w = torch_step(torch, shape, W, params, x, ids, w, dout, 2.0)
    grads = [torch.stack([m.grad if m.grad is not None else torch.zeros_like(m) for m in p]) for p in params]
    return dict(out=out.detach(), dx=x.grad, dw=w.grad, grads=grads)


LORA_NAMES = ["gate A", "gate B", "up A", "up B", "down A", "down B"]


def check(torch, ref: dict, out, dx, dw, grads) -> dict:
    """Relative L2 error of a variant's step against reference()'s; finite: all outputs are."""
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
    got = [out, dx, dw] + list(grads)
    return dict(out=rel(out, ref["out"]), dx=rel(dx, ref["dx"]), dw=rel(dw, ref["dw"]),
                lora={n: rel(g, gr) for n, g, gr in zip(LORA_NAMES, grads, ref["grads"])},
                finite=all(bool(torch.isfinite(t).all()) for t in got))


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
    x, ids, w, dout = make_inputs(torch, shape, T, seed=T)
    ref = reference(torch, shape, W, r, x, ids, w, dout) if "tandem" in args.check else None
    del W
    release_freed()
    t0 = time.perf_counter()
    layer.prepare_backward()
    t_bwpack = time.perf_counter() - t0
    params = lora_params(torch, shape, r)
    grads = [torch.zeros_like(p) for p in params]
    spec = lambda t: (t.data_ptr(), t.numel(), 0, 0, False)
    P, G = [spec(p) for p in params], [spec(g) for g in grads]
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

    step()  # warm-up: scratch buffers grow to this size once; the step checked
    err = check(torch, ref, out, dx, dw, grads) if ref is not None else None
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        saved = step()
        times.append(time.perf_counter() - t0)
    return dict(variant="tandem", r=r, tokens=T, seconds=statistics.median(times), times=times,
                step_mib=(status_kib("VmHWM") - base_rss) / 1024, weights_mib=base_rss / 1024,
                saved_bytes_per_token=saved / T, load_s=t_load, backward_pack_s=t_bwpack,
                packed_bytes=layer.packed_bytes, backward_bytes=layer.backward_bytes, check=err)


def torch_step(torch, shape, W, params, x, ids, w, dout, s):
    """The same computation in PyTorch autograd; returns out and the tensors holding the
    grads of x and w (the adapters' are in params' .grad)."""
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
    return out, x, w


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


def kt_unavailable(args) -> str | None:
    """Why the kt variant cannot run here (checked without importing kt_kernel), or None."""
    from bench_peers import INSTALL, cpu_flags  # imported here: bench_peers imports this module

    if args.format != "bf16":
        return f"this script runs kt's bf16 operator only, not --format {args.format}"
    if not args.kt_path:
        return f"no --kt-path and KT_KERNEL_PATH is not set; install with: {INSTALL}"
    if not Path(args.kt_path, "kt_kernel").is_dir():
        return f"no kt_kernel package in {args.kt_path}; install with: {INSTALL}"
    if not {"amx_tile", "amx_bf16"} <= cpu_flags():
        return "the CPU has no AMX (kt-kernel's SFT MoE operators are AMX ones)"
    return None


def run_kt(args, shape: dict, r: int, T: int) -> dict:
    """kt-kernel's AMXBF16_SFT_MOE, set up as kt's AMXSFTMoEWrapper does (see the docstring);
    {"skipped": why} where it cannot be."""
    import torch

    from bench_peers import import_kt
    from tandem import _C

    kt, why = import_kt(args.kt_path)
    if kt is None:
        return dict(variant="kt", skipped=why)
    ext = kt.kt_kernel_ext
    cls = getattr(ext.moe, "AMXBF16_SFT_MOE", None)
    if cls is None:
        return dict(variant="kt", skipped=f"kt-kernel {kt.__version__} ({kt.__cpu_variant__} build) has no AMXBF16_SFT_MOE")
    probe = _C.Pool(config_text=f"cpu:\n  format: {args.format}\n")  # tandem's pool: threads and subpools
    threads, subpools = probe.threads, probe.subpools
    del probe
    kt_threads = args.kt_threads or threads
    torch.set_num_threads(args.threads or threads)
    E, H, I, K = shape["experts"], shape["hidden"], shape["inter"], shape["top_k"]
    W = random_weights(torch, shape)
    x, ids, w, dout = make_inputs(torch, shape, T, seed=T)
    # Before kt's pool exists: its workers would compete with torch's threads.
    ref = reference(torch, shape, W, r, x, ids, w, dout) if "kt" in args.check else None
    release_freed()
    # kt's operator takes bf16 adapters and writes bf16 gradients: the same adapters, rounded.
    lora = [p.bfloat16().contiguous() for p in lora_params(torch, shape, r)]
    grads = [torch.zeros_like(p) for p in lora]

    wpc = ext.WorkerPoolConfig()
    wpc.subpool_count = subpools
    wpc.subpool_numa_map = list(range(subpools))
    wpc.subpool_thread_count = [kt_threads // subpools + (1 if i < kt_threads % subpools else 0)
                                for i in range(subpools)]
    cpu_infer = ext.CPUInfer(wpc)
    cfg = ext.moe.MOESFTConfig()
    cfg.expert_num, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size = E, K, H, I
    cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout = r, 2.0 * r, 0.0  # scaling alpha / r = 2, tandem's
    cfg.max_cache_depth = 1  # one forward saved per backward
    cfg.max_len = -(-T // 32) * 32  # the wrapper's: its AMX M step
    cfg.layer_idx = 0
    cfg.share_backward_bb = False  # backward packs kept per layer (see the docstring)
    cfg.share_cache_pool = False
    cfg.full_weight_grad = False
    cfg.authoritative_optimizer_grads = True  # the wrapper's for BF16: backward_task may accumulate
    p2l = torch.arange(E, dtype=torch.int64)
    cfg.physical_to_logical_map = p2l.data_ptr()
    cfg.gate_proj, cfg.up_proj, cfg.down_proj = (t.data_ptr() for t in W)
    (cfg.gate_lora_a, cfg.gate_lora_b, cfg.up_lora_a, cfg.up_lora_b, cfg.down_lora_a,
     cfg.down_lora_b) = (t.data_ptr() for t in lora)
    cfg.pool = cpu_infer.backend_
    moe = cls(cfg)
    t0 = time.perf_counter()
    cpu_infer.submit(moe.load_weights_task())  # packs forward and backward (transposed) copies
    cpu_infer.sync()
    t_load = time.perf_counter() - t0
    del W  # kt packed its own copies
    release_freed()
    dout_bf16 = dout.bfloat16()  # kt takes dL/dout in bf16
    bsz = torch.tensor([T], dtype=torch.int32)
    out = torch.empty(T, H, dtype=torch.bfloat16)
    dx = torch.empty(T, H, dtype=torch.bfloat16)
    dw = torch.empty(T, K)
    G = [g.data_ptr() for g in grads]
    base_rss = status_kib("VmRSS")
    reset_peak()

    def step():
        cpu_infer.submit(moe.forward_sft_task(bsz.data_ptr(), K, ids.data_ptr(), w.data_ptr(), x.data_ptr(),
                                              out.data_ptr(), True))
        cpu_infer.sync()
        cpu_infer.submit(moe.backward_task(dout_bf16.data_ptr(), dx.data_ptr(), *G, dw.data_ptr(), 0, 0, 0,
                                           True, 1.0))  # no base-weight gradients; accumulate LoRA's
        cpu_infer.sync()

    step()  # warm-up; the step checked
    err = check(torch, ref, out, dx, dw, grads) if ref is not None else None
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    res = dict(variant="kt", r=r, tokens=T, seconds=statistics.median(times), times=times,
               step_mib=(status_kib("VmHWM") - base_rss) / 1024, weights_mib=base_rss / 1024, load_s=t_load,
               check=err, desc=f"{cls.__name__}, kt-kernel {kt.__version__} ({kt.__cpu_variant__} build), "
                               f"{kt_threads} worker threads in {subpools} subpool(s)")
    del moe, cfg, cpu_infer
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="30b,235b")
    ap.add_argument("--ranks", default="8,64")
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--format", default="bf16", choices=["bf16", "int8", "int4"])
    ap.add_argument("--variants", default="tandem,torch,kt",
                    help="any of tandem, torch, kt (kt is skipped, with a note, where it cannot run)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: the pool's)")
    ap.add_argument("--check", default="kt",
                    help="variants whose warm-up step is compared with torch's computation (tandem, kt; '' none)")
    ap.add_argument("--kt-path", default=os.environ.get("KT_KERNEL_PATH", ""),
                    help="directory holding kt_kernel (pip --target DIR); default $KT_KERNEL_PATH")
    ap.add_argument("--kt-threads", type=int, default=0, help="kt-kernel's worker threads (default: tandem's pool's)")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant in this process
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--r", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--T", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.ranks = [int(v) for v in str(args.ranks).split(",")]
    args.tokens = [int(v) for v in str(args.tokens).split(",")]
    args.check = [v for v in args.check.split(",") if v]

    if args.variant:  # child process
        fn = {"tandem": run_tandem, "torch": run_torch, "kt": run_kt}[args.variant]
        # The result line alone on stdout: native code's banners (kt-kernel's pool and layer,
        # printed up to the process's exit) go to stderr.
        result_fd = os.dup(1)
        sys.stdout.flush()
        os.dup2(2, 1)
        res = fn(args, SHAPES[args.shape], args.r, args.T)
        sys.stdout.flush()
        os.write(result_fd, (json.dumps(res) + "\n").encode())
        return 0

    variants = [v for v in args.variants.split(",") if v]
    if "kt" in variants and (why := kt_unavailable(args)):
        print(f"kt: skipped ({why})")
        variants.remove("kt")

    all_results = {}
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        peak_name, peak = bf16_peak()
        print(f"\n== {name}: experts {shape['experts']}, hidden {shape['hidden']}, inter {shape['inter']}, "
              f"top-{shape['top_k']}; base format {args.format}; {peak_name} peak {peak} GFLOP/s", flush=True)
        res = {}
        for r in args.ranks:
            for T in args.tokens:
                for v in list(variants):  # each configuration in a fresh process
                    cmd = [sys.executable, __file__, "--variant", v, "--shape", name, "--r", str(r), "--T", str(T),
                           "--reps", str(args.reps), "--format", args.format, "--threads", str(args.threads),
                           "--check", ",".join(args.check), "--kt-path", args.kt_path,
                           "--kt-threads", str(args.kt_threads)]
                    p = subprocess.run(cmd, capture_output=True, text=True)
                    if p.returncode != 0:
                        print(f"{v} r={r} tokens={T} failed:\n{p.stderr[-3000:]}", flush=True)
                        continue
                    out = json.loads(p.stdout.strip().splitlines()[-1])
                    if "skipped" in out:
                        print(f"{v}: skipped ({out['skipped']})", flush=True)
                        variants.remove(v)
                        continue
                    res.setdefault(v, []).append(out)
                    print(f"  ({v} r={r} tokens={T}: {out['seconds']:.3f} s)", flush=True)
        peak_after = bf16_peak()[1]
        if peak and peak_after:
            peak = max(peak, peak_after)
        rows = []
        nan = float("nan")
        # Columns for the peers that ran or were asked for (not kt where it was skipped);
        # tandem/X: X's seconds / tandem's (> 1: tandem faster); mem: tandem's step MiB / X's.
        names = [v for v in ("torch", "kt") if v in variants or res.get(v)]
        print(f"{'r':>3} {'tokens':>6} | {'tandem s':>8} {'GFLOP/s':>8} {'%peak':>6} {'saved B/tok':>11} {'step MiB':>8} |"
              + "".join(f" {v + ' s':>8} {'step MiB':>8} |" for v in names)
              + " |".join(f" {'tandem/' + v:>{len('tandem/' + v)}} {'mem':>5}" for v in names))
        for t in res.get("tandem", []):
            rows_ = t["tokens"] * shape["top_k"]
            flops = 12.0 * rows_ * shape["hidden"] * shape["inter"]
            gf = flops / t["seconds"] / 1e9
            peers = {v: next((x for x in res.get(v, []) if x["r"] == t["r"] and x["tokens"] == t["tokens"]), None)
                     for v in names}
            line = (f"{t['r']:>3} {t['tokens']:>6} | {t['seconds']:>8.3f} {gf:>8.1f} {100 * gf / peak if peak else 0:>5.1f}%"
                    f" {t['saved_bytes_per_token']:>11.0f} {t['step_mib']:>8.0f} |")
            for pt in peers.values():
                line += f" {pt['seconds'] if pt else nan:>8.3f} {pt['step_mib'] if pt else nan:>8.0f} |"
            for v, pt in peers.items():
                sp = pt["seconds"] / t["seconds"] if pt else nan
                mem = t["step_mib"] / pt["step_mib"] if pt and pt["step_mib"] > 0 else nan
                line += f" {sp:>{len('tandem/' + v) - 1}.2f}x {mem:>5.2f} |"
            print(line.rstrip(" |"))
            rows.append(dict(tandem=t, torch=peers.get("torch"), kt=peers.get("kt"), gflops=gf, peak=peak))
        checked = [x for v in ("tandem", "kt") for x in res.get(v, []) if x.get("check")]
        if checked:
            print("relative L2 vs the torch variant's step (fp32 adapters): out, dL/dx, dL/dw; dL/dA, dL/dB of "
                  "all experts: " + ", ".join(LORA_NAMES))
        for x in checked:
            c = x["check"]
            print(f"  {x['variant']:<6} r={x['r']} tokens={x['tokens']}: out {c['out']:.4f}, dx {c['dx']:.4f}, "
                  f"dw {c['dw']:.4f}; " + " ".join(f"{e:.4f}" for e in c["lora"].values())
                  + ("" if c["finite"] else "  (NaN/Inf in its outputs: its time means nothing)"))
        if res.get("kt"):
            k = res["kt"][0]
            print(f"kt: {k['desc']}; resident after load {k['weights_mib'] / 1024:.2f} GiB (forward and backward "
                  f"packs), load {k['load_s']:.1f} s. It computes all tandem's step does (dL/dw included), but keeps "
                  f"LoRA A/B and their gradients in bf16 and takes dL/dout, returns out and dL/dx in bf16 (tandem: fp32)")
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
