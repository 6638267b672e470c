"""Start-up time of a GGUF model's routed experts (issue 19): llama.cpp's own GGUF files of
bench_hf's random Qwen3-30B-A3B-shaped checkpoint (4 layers, vocabulary 32768), packed by
tandem in place, against packing the same checkpoint's bf16 safetensors into the same format
and against reading the GGUF file, all in one run.

    LLAMA_CPP_PATH=... LLAMA_CPP_SRC=... .venv/bin/python bench/bench_gguf_load.py [--reps 2]

The GGUF files are bench_llama.py's (converted by llama.cpp's convert_hf_to_gguf.py, q4_0
quantized by its quantizer), made once under its --work directory; LLAMA_CPP_PATH /
LLAMA_CPP_SRC as bench_llama.py's docstring says (needed only to make them). Each pairing:
Q4_0 -> int4 groups of 32 (nibbles and scales copied), Q8_0 -> int8 (decoded and quantized
per row), BF16 -> bf16. Times are the experts only (engine.load_checkpoint, the page cache
warm, best of --reps); "file read" reads the whole GGUF file with 8 MiB preads into fresh
memory (bench_store.read_speed), and the expert bytes' share of it is the fair floor.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

PAIRS = (("q4_0", "int4", 32), ("q8_0", "int8", 128), ("bf16", "bf16", 128))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--work", default=str(Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem")) / "gguf"))
    args = ap.parse_args()

    import gguf
    import torch

    from bench_hf import model_dir
    from bench_llama import gguf_file
    from bench_store import read_speed
    from tandem import _C
    from tandem.loader import open_model_experts

    ckpt = model_dir("qwen3-30b-a3b", 4, 32768)
    largs = types.SimpleNamespace(work=args.work, llama_src=os.environ.get("LLAMA_CPP_SRC"),
                                  llama=os.environ.get("LLAMA_CPP_PATH"))
    st = open_model_experts(ckpt)
    E, H, I = st.shape
    print("machine: " + next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
          + f", {os.cpu_count()} CPUs; torch threads {torch.get_num_threads()}")
    print(f"checkpoint: {ckpt} ({len(st.layers)} MoE layers x {E} experts, hidden {H}, intermediate {I})\n")
    print(f"{'source -> format':24} {'experts GB':>10} {'GGUF s':>8} {'safetensors s':>13} {'file read s':>11} "
          f"{'expert share s':>14} {'vs read':>8} {'vs safetensors':>14}")
    for gtype, fmt, group in PAIRS:
        path = gguf_file(largs, ckpt, gtype)
        g = open_model_experts(path)
        expert_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors if "_exps" in t.name)
        extra = f", group_size: {group}" if fmt == "int4" else ""
        config = f"version: 1\ncpu: {{format: {fmt}{extra}}}\ngpu: {{device: none}}\n"

        def load(me) -> float:
            best = float("inf")
            for _ in range(args.reps):
                engine = _C.Engine(config_text=config, experts=E, hidden=H, inter=I, layers=me.layers)
                t = time.perf_counter()
                engine.load_checkpoint(me.ckpt, me.naming)
                best = min(best, time.perf_counter() - t)
                del engine
            return best

        from_gguf = load(g)
        from_st = load(st)
        read = min(read_speed([path], False, "fresh") for _ in range(args.reps))
        share = read * expert_bytes / path.stat().st_size
        print(f"{gtype.upper() + ' -> ' + fmt + (f' g{group}' if fmt == 'int4' else ''):24} {expert_bytes / 1e9:10.2f} "
              f"{from_gguf:8.2f} {from_st:13.2f} {read:11.2f} {share:14.2f} {share / from_gguf:8.0%} "
              f"{from_st / from_gguf:13.1f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
