"""One MoE layer's routed experts on the CPU: tandem (tandem._C.Engine) next to the engines users
would pick instead, in the same process, on the same random bf16 weights, inputs and routing:
KTransformers' kt-kernel 0.7.2 (its MoE operators) and ggml, llama.cpp's tensor library (the
graph llama.cpp builds for a Qwen3-MoE layer, bench/peers_ggml.py).

    .venv/bin/python bench/bench_peers.py --kt-path DIR --llama-path DIR2   # 235b, bf16/int8/int4, 1..2048 tokens
    .venv/bin/python bench/bench_peers.py --shape 30b --experts 16 --tokens 1,32 --reps 1   # a quick check
    KT_KERNEL_PATH=DIR LLAMA_CPP_PATH=DIR2 .venv/bin/python bench/bench_peers.py --formats int4 --tokens 1,512

The peers are installed outside the project and only called, never copied:
    pip install --no-deps --target DIR kt-kernel==0.7.2 gguf typer rich httpx
        (--kt-path DIR, default $KT_KERNEL_PATH; DIR is appended to sys.path, so the project's own
        torch / numpy / yaml win)
    pip install --no-deps --target DIR2 llama-cpp-python==0.3.36
        (builds llama.cpp for this CPU, ~10 minutes on 2 cores; --llama-path DIR2, default
        $LLAMA_CPP_PATH; its llama_cpp/lib/libggml*.so are loaded with ctypes)
A peer that is not found is said so and left out; --peers picks among those found.

Shapes (random bf16 weights N(0, 1/fan_in), seed 0; --experts N allocates the first N experts
only, for quick runs or small machines; routing then draws from those N):
  235b  Qwen3-235B-A22B: 128 experts, hidden 4096, expert intermediate 1536, top-8
  30b   Qwen3-30B-A3B:   128 experts, hidden 2048, expert intermediate 768,  top-8
  v3    DeepSeek-V3:     256 routed experts, hidden 7168, expert intermediate 2048, top-8
        (45 GB of bf16 source for all 256: use --experts on a small machine)
Inputs per token count T (seed T): x ~ N(0, 1) in bf16, routing = 8 different sets of T x top-8
distinct experts (uniform) with weights normalised to sum 1, cycled call after call by every
engine in the same order (so decode does not re-read 8 experts that sit in the cache).

Formats and what each side runs (each quantizes the same bf16 weights while loading):
  bf16  tandem cpu.format bf16            | kt AMXBF16_MOE (what kt's BF16 method runs)
                                          | ggml BF16
  int8  tandem cpu.format int8 (per row)  | kt AMXInt8_MOE (AMXINT8, online-quantized from bf16)
                                          | ggml Q8_0 (blocks of 32, fp16 scale)
  int4  tandem cpu.format int4, symmetric groups of --int4-group along k (default 32)
                                          | kt AMXInt4_MOE (AMXINT4: one scale per row, online from bf16)
                                          | kt AMXInt4_KGroup_MOE (RAWINT4: symmetric groups of
                                            --int4-group, bf16 scales; fed with int4 this script
                                            quantizes itself in the compressed-tensors layout)
                                          | ggml Q4_0 (blocks of 32, fp16 scale; in ggml's CPU
                                            repack buffer, as llama.cpp loads it, where this CPU
                                            has a repacked layout: x86 with AVX2)
  kt-kernel's pip package loads one build per CPU (amx, avx512_bf16, avx512_vnni, ..., avx2:
  printed); its wrappers pick the classes above in every AVX-512 build, whose kernels follow
  the build (tile instructions only in the amx build).
  (kt-kernel 0.7.2's RAWINT4 AMX operator returned NaN for groups of 64 and 128 on the AMX
  machine this was written on, and later crashed the process (SIGSEGV) at groups of 128, so it
  runs only for groups of 32, the default; a peer output with NaN/Inf is flagged in its row.)
All use the same threads: one per physical core (tandem's cpu.threads auto; kt-kernel's
WorkerPool gets the same subpools and thread counts, --kt-threads changes kt's; ggml's
threadpool the same count). kt-kernel's caller also spin-waits in CPUInfer.sync and its task
queue has a thread of its own, so on a machine with few cores kt may do better with fewer
workers than cores: try --kt-threads.

Timing: per engine and T, a warm-up call (its output is the one compared), then --reps samples,
each the mean of enough back-to-back calls to last >= 50 ms and started 0.2 s after the
previous one ended (engines' idle threads spin for a while before they park: kt-kernel's for
~0.1 s); the median sample is reported (ms per layer forward), and "best" is the ratio of the
two engines' fastest samples: where something outside the process slows the machine now and
then (the AMX Xeon this was written on: the tile step of a core drops to about a third for
stretches of milliseconds to seconds, bench/bench_amx_gated.cpp), the fastest samples are the
closest to the engines' own speed. tandem stays loaded and each peer in turn is loaded next to it: when both fit in
memory, their samples alternate (tandem, peer, tandem, peer, ...) so a neighbour's load hits
both alike; otherwise (or with --sequential) tandem runs all token counts first, is freed,
then the peers.
GB/s = distinct experts of the routing (mean over the 8) x nominal bytes per expert of the
format (3 x hidden x inter x 2 / 1 / 0.5 bytes; scales not counted) / time: the same bytes
for all, so the GB/s ratio is the speed ratio. tandem/peer > 1: tandem faster.

Memory: the bf16 source stays resident (3 x E x hidden x inter x 2 bytes: 4.8 GB for 235b) and
each engine packs its own copy (4.8 GB more each in bf16); --sequential never holds two engines'
copies, --experts N shrinks all of them.

Correctness: relative L2 difference ||a - b|| / ||b|| of the whole T x hidden output of tandem
vs the peer (they quantize differently: reported; for bf16 it must be < 0.1, else the run
fails), and of each against an fp32 torch reference (bf16 weights and x as fp32) on the first
--check tokens.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_sft import random_weights  # this script's folder is first on sys.path
import peers_ggml

SHAPES = {"235b": dict(name="Qwen3-235B-A22B", experts=128, hidden=4096, inter=1536, top_k=8),
          "30b": dict(name="Qwen3-30B-A3B", experts=128, hidden=2048, inter=768, top_k=8),
          "v3": dict(name="DeepSeek-V3", experts=256, hidden=7168, inter=2048, top_k=8)}
BYTES_PER_WEIGHT = {"bf16": 2.0, "int8": 1.0, "int4": 0.5}
ROUTINGS = 8          # routings per token count, cycled
MIN_SAMPLE_S = 0.05   # a timed sample lasts at least this long (several calls for small T)
# A pause before each sample, so that the engine sampled before has parked its threads: after
# a call kt-kernel 0.7.2's workers kept spinning for 0.08-0.1 s of CPU time (both cores for the
# first 20 ms, one core until ~0.1 s), ggml's OpenMP workers (libgomp) ~0.01 s, tandem's pool
# <= 0.003 s (measured on a 2-core Zen 4 with getrusage around an idle sleep); without the
# pause a tandem sample that followed a kt one ran on half the machine.
SETTLE_S = 0.2
INSTALL = ("pip install --no-deps --target DIR kt-kernel==0.7.2 gguf typer rich httpx; "
           "then --kt-path DIR or KT_KERNEL_PATH=DIR")
LLAMA_INSTALL = ("pip install --no-deps --target DIR llama-cpp-python==0.3.36; "
                 "then --llama-path DIR or LLAMA_CPP_PATH=DIR")


# ---------------------------------------------------------------------------- machine

def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def physical_cores() -> int:
    cores = set()
    for d in Path("/sys/devices/system/cpu").glob("cpu[0-9]*"):
        try:
            cores.add((d.joinpath("topology/physical_package_id").read_text().strip(),
                       d.joinpath("topology/core_id").read_text().strip()))
        except OSError:
            pass
    return len(cores) or os.cpu_count() or 1


def meminfo_gib(key: str) -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def numa_nodes() -> int:
    return len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1


# ---------------------------------------------------------------------------- data

def make_case(shape: dict, E: int, T: int) -> dict:
    g = torch.Generator().manual_seed(T)
    K = shape["top_k"]
    x = torch.randn(T, shape["hidden"], generator=g).bfloat16()
    ids, ws, distinct = [], [], []
    for _ in range(ROUTINGS):
        i = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].contiguous()  # distinct per token
        w = torch.rand(T, K, generator=g) + 0.1
        ids.append(i)
        ws.append((w / w.sum(dim=1, keepdim=True)).contiguous())
        distinct.append(int(torch.unique(i).numel()))
    return dict(T=T, x=x, ids=ids, w=ws, distinct=statistics.mean(distinct))


def reference(W, case: dict, n: int) -> torch.Tensor:
    """fp32 output of the first n tokens under routing 0."""
    Wg, Wu, Wd = W
    x = case["x"][:n].float()
    ids, w = case["ids"][0][:n], case["w"][0][:n]
    out = torch.zeros(n, Wd.shape[1])
    for t in range(n):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = torch.nn.functional.silu(Wg[e].float() @ x[t]) * (Wu[e].float() @ x[t])
            out[t] += w[t, k] * (Wd[e].float() @ h)
    return out


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@contextlib.contextmanager
def c_stdout(verbose: bool):
    """kt-kernel's C++ code prints to the process's stdout (pool and layer banners): keep it
    out of the tables unless --verbose."""
    if verbose:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def quantize_int4_groups(w: torch.Tensor, group: int):
    """[E x N x K] bf16 -> (packed uint8 [E x N x K/2], bf16 scales [E x N x K/group]):
    symmetric int4 per group of `group` along k, q = round(w / s) in [-8, 7] with
    s = max|w| / 7 (rounded to bf16 first); stored as q + 8, element 2j in the low nibble of
    byte j and 2j+1 in the high one (the compressed-tensors "pack-quantized" byte order)."""
    E, N, K = w.shape
    packed = torch.empty(E, N, K // 2, dtype=torch.uint8)
    scales = torch.empty(E, N, K // group, dtype=torch.bfloat16)
    for e in range(E):
        f = w[e].float().view(N, K // group, group)
        s = (f.abs().amax(dim=-1) / 7.0).clamp_min(1e-8).bfloat16()
        q = torch.round(f / s.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int16).view(N, K) + 8
        packed[e] = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
        scales[e] = s
    return packed, scales


# ---------------------------------------------------------------------------- runners

class TandemRunner:
    def __init__(self, _C, shape: dict, E: int, fmt: str, group: int, max_tokens: int, W):
        text = f"version: 1\ncpu:\n  format: {fmt}\n"
        if fmt == "int4":
            text += f"  group_size: {group}\n  zero_point: false\n"
        text += "  threads: auto\n  isa: auto\ngpu:\n  device: none\n"
        if max_tokens > 4096:
            text += f"buffers:\n  max_tokens: {max_tokens}\n"
        self.name = "tandem"
        self.K = shape["top_k"]
        self.engine = _C.Engine(config_text=text, experts=E, hidden=shape["hidden"], inter=shape["inter"], layers=[0],
                                stream="host")
        t0 = time.perf_counter()
        self.engine.load_layer(0, [t.data_ptr() for t in W[0]], [t.data_ptr() for t in W[1]],
                               [t.data_ptr() for t in W[2]], "bfloat16")
        self.load_s = time.perf_counter() - t0
        self.bytes = self.engine.cpu_bytes
        self.desc = (f"cpu.format {fmt}" + (f" (groups of {group})" if fmt == "int4" else "")
                     + f", isa {self.engine.isa}, {self.engine.threads} threads in {self.engine.subpools} subpool(s)")
        self.out = {}

    def call(self, case: dict, r: int) -> None:
        T = case["T"]
        out = self.out.get(T)
        if out is None:
            out = self.out[T] = torch.empty(T, case["x"].shape[1])
        self.engine.forward(0, case["x"].data_ptr(), True, T, case["ids"][r].data_ptr(), case["w"][r].data_ptr(),
                            self.K, out.data_ptr(), synchronize=True)

    def output(self, T: int) -> torch.Tensor:
        return self.out[T]

    def free(self) -> None:
        del self.engine
        self.out.clear()


class KtRunner:
    """One kt-kernel MoE operator (kt_kernel_ext.moe.*), set up as its wrappers in
    kt_kernel/utils/amx.py do, minus their checkpoint loaders and pinned CUDA buffers: a
    MOEConfig on the shared CPUInfer's pool with the bf16 [E x N x K] tensors (AMXMoEWrapper.
    load_weights_from_tensors, without its save-to-disk) or per-expert int4 + scale pointers
    (NativeMoEWrapper, RAWINT4), load_weights_task; then per call forward_task(bsz, top_k, ids,
    weights, x, out, incremental=False), submit, sync."""

    def __init__(self, kt, cpu_infer, cls_name: str, label: str, shape: dict, E: int, max_tokens: int, W,
                 q4=None, group: int = 0):
        ext = kt.kt_kernel_ext
        cls = getattr(ext.moe, cls_name, None)
        if cls is None:
            raise RuntimeError(f"{cls_name} is not in this kt-kernel build (variant {kt.__cpu_variant__})")
        self.name = label
        self.K = shape["top_k"]
        self.cpu_infer = cpu_infer
        self.mask = torch.zeros(E, dtype=torch.bool)  # no expert on a GPU
        self.p2l = torch.arange(E, dtype=torch.int64)
        cfg = ext.moe.MOEConfig(E, shape["top_k"], shape["hidden"], shape["inter"], self.mask.data_ptr())
        cfg.layer_idx = 0
        cfg.pool = cpu_infer.backend_
        cfg.max_len = -(-max_tokens // 64) * 64  # its AMX buffers want a multiple of their M step
        self.keep = []  # whatever the operator may point into stays alive with it
        if q4 is not None:  # RAWINT4 (NativeMoEWrapper's path): per-expert packed int4 + bf16 group scales
            (gq, gs), (uq, us), (dq, ds) = q4
            cfg.quant_config.bits = 4
            cfg.quant_config.group_size = group
            cfg.quant_config.zero_point = False
            cfg.gate_projs = [[t.data_ptr() for t in gq]]
            cfg.up_projs = [[t.data_ptr() for t in uq]]
            cfg.down_projs = [[t.data_ptr() for t in dq]]
            cfg.gate_scales = [[t.data_ptr() for t in gs]]
            cfg.up_scales = [[t.data_ptr() for t in us]]
            cfg.down_scales = [[t.data_ptr() for t in ds]]
            self.keep += [q4]
        else:  # bf16 source, packed (bf16) or quantized (int8 / int4 per row) by load_weights
            cfg.gate_proj = W[0].data_ptr()
            cfg.up_proj = W[1].data_ptr()
            cfg.down_proj = W[2].data_ptr()
            self.keep += [W]
        self.moe = cls(cfg)
        self.cfg = cfg
        t0 = time.perf_counter()
        cpu_infer.submit(self.moe.load_weights_task(self.p2l.data_ptr()))
        cpu_infer.sync()
        self.load_s = time.perf_counter() - t0
        self.desc = f"{cls_name}, kt-kernel {kt.__version__} ({kt.__cpu_variant__} build)"
        self.out, self.bsz = {}, {}

    def call(self, case: dict, r: int) -> None:
        T = case["T"]
        out = self.out.get(T)
        if out is None:
            out = self.out[T] = torch.empty(T, case["x"].shape[1], dtype=torch.bfloat16)
            self.bsz[T] = torch.tensor([T], dtype=torch.int32)
        self.cpu_infer.submit(self.moe.forward_task(self.bsz[T].data_ptr(), self.K, case["ids"][r].data_ptr(),
                                                    case["w"][r].data_ptr(), case["x"].data_ptr(), out.data_ptr(),
                                                    False))
        self.cpu_infer.sync()

    def output(self, T: int) -> torch.Tensor:
        return self.out[T].float()

    def free(self) -> None:
        del self.moe, self.cfg
        self.keep.clear()
        self.out.clear()


def measure(runners: list, cases: list, reps: int) -> dict:
    """{(runner name, T): (median seconds per call, output of the warm-up call on routing 0,
    fastest sample's seconds per call)}; samples of the runners alternate."""
    res = {}
    for case in cases:
        counter = {r.name: 0 for r in runners}
        calls, samples, outs = {}, {r.name: [] for r in runners}, {}

        def run(r, n):
            t0 = time.perf_counter()
            for _ in range(n):
                r.call(case, counter[r.name] % ROUTINGS)
                counter[r.name] += 1
            return (time.perf_counter() - t0) / n

        for r in runners:
            run(r, 1)  # warm-up on routing 0: the output compared
            outs[r.name] = r.output(case["T"]).clone()
            t = run(r, 1)
            calls[r.name] = max(1, math.ceil(MIN_SAMPLE_S / max(t, 1e-6)))
        for _ in range(reps):
            for r in runners:
                time.sleep(SETTLE_S)
                samples[r.name].append(run(r, calls[r.name]))
        for r in runners:
            res[(r.name, case["T"])] = (statistics.median(samples[r.name]), outs[r.name], min(samples[r.name]))
    return res


# ---------------------------------------------------------------------------- kt-kernel

def import_kt(path: str | None):
    """kt_kernel from DIR (appended to sys.path), or (None, reason)."""
    if not path:
        return None, "no --kt-path and KT_KERNEL_PATH is not set"
    if not Path(path, "kt_kernel").is_dir():
        return None, f"no kt_kernel package in {path}"
    if path not in sys.path:
        sys.path.append(path)
    try:
        import kt_kernel
        return kt_kernel, None
    except Exception as e:  # an ImportError, or an ISA check of its loader
        return None, f"import failed: {type(e).__name__}: {e}"


def kt_variants(fmt: str, group: int) -> list[tuple[str, str, bool]]:
    """(operator class, label, needs pre-quantized int4) per format."""
    if fmt == "bf16":
        return [("AMXBF16_MOE", "kt AMXBF16", False)]
    if fmt == "int8":
        return [("AMXInt8_MOE", "kt AMXINT8", False)]
    if group != 32:  # kt-kernel 0.7.2's RAWINT4 returned NaN (g64, g128), then crashed the process (g128)
        print(f"   kt RAWINT4/g{group}: skipped (kt-kernel 0.7.2's RAWINT4 AMX operator computes only groups of 32 "
              f"correctly on the machine this was written on, and crashed the process at groups of 128)")
        return [("AMXInt4_MOE", "kt AMXINT4/row", False)]
    return [("AMXInt4_MOE", "kt AMXINT4/row", False), ("AMXInt4_KGroup_MOE", f"kt RAWINT4/g{group}", True)]


# ---------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="235b", choices=sorted(SHAPES))
    ap.add_argument("--formats", default="bf16,int8,int4")
    ap.add_argument("--tokens", default="1,32,512,2048")
    ap.add_argument("--reps", type=int, default=5, help="timed samples per engine and token count (median)")
    ap.add_argument("--experts", type=int, default=0, help="allocate only this many experts (default: the model's)")
    ap.add_argument("--int4-group", type=int, default=32, choices=[32, 64, 128],
                    help="int4 group length along k (tandem's cpu.group_size and kt's RAWINT4; default 32, the "
                         "only one kt-kernel 0.7.2's RAWINT4 AMX operator computed correctly here)")
    ap.add_argument("--check", type=int, default=4, help="tokens compared with the fp32 torch reference")
    ap.add_argument("--kt-path", default=os.environ.get("KT_KERNEL_PATH"),
                    help="directory holding kt_kernel (pip --target DIR); default $KT_KERNEL_PATH")
    ap.add_argument("--llama-path", default=os.environ.get("LLAMA_CPP_PATH"),
                    help="directory holding llama_cpp (pip --target DIR) for ggml; default $LLAMA_CPP_PATH")
    ap.add_argument("--peers", default="kt,ggml", help="peers to run among those found (default: kt,ggml)")
    ap.add_argument("--kt-threads", type=int, default=0,
                    help="kt-kernel's worker threads (default: tandem's, one per physical core)")
    ap.add_argument("--verbose", action="store_true", help="let kt-kernel's C++ banners through")
    ap.add_argument("--sequential", action="store_true",
                    help="never hold two engines' weights at once (tandem first, then the peers)")
    args = ap.parse_args()
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    wanted = {p.strip() for p in args.peers.split(",") if p.strip()}
    if not wanted <= {"kt", "ggml"}:
        ap.error(f"--peers: {sorted(wanted - {'kt', 'ggml'})} not among: kt, ggml")
    for f in formats:
        if f not in BYTES_PER_WEIGHT:
            ap.error(f"--formats: {f!r} is not one of: bf16, int8, int4")
    tokens = [int(v) for v in args.tokens.split(",")]
    if min(tokens) < 1:
        ap.error("--tokens must be >= 1")
    shape = SHAPES[args.shape]
    E = args.experts or shape["experts"]
    if not shape["top_k"] <= E <= shape["experts"]:
        ap.error(f"--experts must be in {shape['top_k']}..{shape['experts']}")
    H, I, K = shape["hidden"], shape["inter"], shape["top_k"]

    from tandem import _C

    probe = _C.Pool(config_text="cpu:\n  threads: auto\n")
    threads, subpools = probe.threads, probe.subpools
    del probe
    flags = cpu_flags()
    print(f"machine: {cpu_model()}; {physical_cores()} physical cores, {os.cpu_count()} logical CPUs, "
          f"{numa_nodes()} NUMA node(s); AMX: {'yes' if {'amx_tile', 'amx_bf16', 'amx_int8'} <= flags else 'no'}; "
          f"memory {meminfo_gib('MemTotal'):.1f} GiB ({meminfo_gib('MemAvailable'):.1f} available)")
    print(f"software: tandem {_C.__version__}, torch {torch.__version__}, python {platform.python_version()}; "
          f"threads: {threads} in {subpools} subpool(s) for both engines")
    kt, why = import_kt(args.kt_path) if "kt" in wanted else (None, "not asked for (--peers)")
    cpu_infer = None
    if kt is None:
        print(f"kt-kernel: not found ({why}) (install with: {INSTALL}); measuring tandem alone")
    else:
        ext = kt.kt_kernel_ext
        print(f"kt-kernel: {kt.__version__}, {kt.__cpu_variant__} build, int8 kernel {kt.__int8_kernel__}, "
              f"from {Path(kt.__file__).parent}")
        kt_threads = args.kt_threads or threads
        wpc = ext.WorkerPoolConfig()
        wpc.subpool_count = subpools
        wpc.subpool_numa_map = list(range(subpools))
        wpc.subpool_thread_count = [kt_threads // subpools + (1 if i < kt_threads % subpools else 0)
                                    for i in range(subpools)]
        with c_stdout(args.verbose):
            cpu_infer = ext.CPUInfer(wpc)
        if kt_threads != threads:
            print(f"kt-kernel threads: {kt_threads} (--kt-threads), tandem: {threads}")
    ggml = None
    if "ggml" in wanted:
        libdir, why = peers_ggml.find_libdir(args.llama_path)
        if libdir is not None:
            try:
                ggml = peers_ggml.Ggml(libdir)
            except (OSError, AttributeError) as e:
                why = f"{type(e).__name__}: {e}"
        if ggml is None:
            print(f"ggml: not found ({why}) (install with: {LLAMA_INSTALL})")
        else:
            print(f"ggml: llama-cpp-python's libraries in {libdir}; CPU features {ggml.cpu_features()}; "
                  f"extra buffer types: {', '.join(ggml.extra_bufts()) or 'none'}")

    expert_b = 3 * H * I
    print(f"\n== {args.shape} ({shape['name']}): {E} of {shape['experts']} experts allocated, hidden {H}, inter {I}, "
          f"top-{K}; bf16 source {E * expert_b * 2 / 1e9:.2f} GB; tokens {tokens}, {args.reps} samples each", flush=True)
    torch.set_num_threads(max(1, physical_cores()))
    t0 = time.perf_counter()
    W = random_weights(torch, {**shape, "experts": E})  # bench_sft's: N(0, 1/fan_in), seed 0
    cases = [make_case(shape, E, T) for T in tokens]
    refs = {c["T"]: reference(W, c, min(args.check, c["T"])) for c in cases}
    print(f"weights, inputs and references made in {time.perf_counter() - t0:.1f} s", flush=True)

    failures = []
    q4 = None
    for fmt in formats:
        nominal = expert_b * BYTES_PER_WEIGHT[fmt]
        tandem = TandemRunner(_C, shape, E, fmt, args.int4_group, max(tokens), W)
        print(f"\n-- {fmt}: tandem {tandem.desc}; packed {tandem.bytes / 1e9:.2f} GB "
              f"({tandem.bytes / E / 1e6:.1f} MB/expert), loaded in {tandem.load_s:.1f} s", flush=True)
        variants = kt_variants(fmt, args.int4_group) if kt is not None else []
        if ggml is not None:
            variants.append(("ggml", peers_ggml.label(fmt), False))
        # Both resident if a peer's copy (~ nominal bytes, + half for slack) fits what is left.
        both = not args.sequential and E * nominal * 1.5 / 2**30 < meminfo_gib("MemAvailable") - 1.0
        results, tandem_alone = {}, None
        if not both or not variants:
            tandem_alone = measure([tandem], cases, args.reps)
            tandem.free()
            tandem = None
            gc.collect()
        for cls_name, label, needs_q4 in variants:
            try:
                if needs_q4 and q4 is None:
                    t0 = time.perf_counter()
                    q4 = tuple(quantize_int4_groups(w, args.int4_group) for w in W)
                    print(f"   (int4 groups of {args.int4_group} for RAWINT4 quantized in {time.perf_counter() - t0:.1f} s)")
                if cls_name == "ggml":
                    peer = peers_ggml.GgmlRunner(ggml, fmt, shape, E, W, threads, cases)
                else:
                    with c_stdout(args.verbose):
                        peer = KtRunner(kt, cpu_infer, cls_name, label, shape, E, max(tokens), W,
                                        q4=q4 if needs_q4 else None, group=args.int4_group)
            except Exception as e:
                print(f"   {label}: could not load: {type(e).__name__}: {e}", flush=True)
                continue
            print(f"   {label}: {peer.desc}; loaded in {peer.load_s:.1f} s", flush=True)
            try:
                results[label] = measure([tandem, peer] if tandem is not None else [peer], cases, args.reps)
            except Exception as e:
                print(f"   {label}: forward failed: {type(e).__name__}: {e}", flush=True)
            with c_stdout(args.verbose):
                peer.free()
                del peer
                gc.collect()
        if tandem is not None:
            tandem.free()
            tandem = None
        if fmt == "int4":
            q4 = None
        gc.collect()

        print(f"{'tokens':>6} {'exp':>5} | {'tandem ms':>10} {'GB/s':>6} | {'peer':<15} {'ms':>10} {'GB/s':>6} | "
              f"{'tandem/pr':>9} {'best':>7} | {'L2 t~pr':>8} {'t~ref':>8} {'pr~ref':>8}")
        for c in cases:
            T, n = c["T"], min(args.check, c["T"])
            gb = c["distinct"] * nominal / 1e9
            peers = list(results.items()) or [(None, None)]
            for label, res in peers:
                t_s, t_out, t_best = res[("tandem", T)] if tandem_alone is None else tandem_alone[("tandem", T)]
                line = f"{T:>6} {c['distinct']:>5.0f} | {t_s * 1e3:>10.3f} {gb / t_s:>6.1f} | "
                t_ref = rel_l2(t_out[:n], refs[T])
                if label is None:
                    line += f"{'(no peer)':<15} {'':>10} {'':>6} | {'':>9} {'':>7} | {'':>8} {t_ref:>8.4f} {'':>8}"
                else:
                    k_s, k_out, k_best = res[(label, T)]
                    d = rel_l2(t_out, k_out)
                    line += (f"{label:<15} {k_s * 1e3:>10.3f} {gb / k_s:>6.1f} | {k_s / t_s:>8.2f}x {k_best / t_best:>6.2f}x | "
                             f"{d:>8.4f} {t_ref:>8.4f} {rel_l2(k_out[:n], refs[T]):>8.4f}")
                    if not torch.isfinite(k_out).all():
                        line += "  (peer output has NaN/Inf: its time means nothing)"
                    if fmt == "bf16" and not d < 0.1:
                        failures.append(f"bf16 tokens {T}: tandem vs {label} relative L2 {d:.4f} >= 0.1")
                        line += "  FAIL"
                if not torch.isfinite(t_out).all():
                    line += "  (tandem output has NaN/Inf)"
                    failures.append(f"{fmt} tokens {T}: tandem output has NaN/Inf")
                print(line, flush=True)
    if cpu_infer is not None:
        with c_stdout(args.verbose):
            del cpu_infer
            gc.collect()
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
