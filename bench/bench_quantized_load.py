"""Packing int4 experts from a 4-bit GPTQ checkpoint (nibbles, scales and zero points copied)
against quantizing them from a bf16 checkpoint, same shapes, same engine.

    .venv/bin/python bench/bench_quantized_load.py [--layers 4] [--reps 2]

Shapes: Qwen3-30B-A3B's experts (128 per layer, hidden 2048, intermediate 768), int4 groups of
128, symmetric. The GPTQ checkpoint holds random nibbles, zero points 8 and fp16 scales (only
the expert tensors: timing needs nothing else); it is written once next to bench_hf's bf16
checkpoint. Both loads start with the source in the page cache.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

E, H, I, GROUP = 128, 2048, 768, 128


def gptq_checkpoint(out: Path, layers: int) -> Path:
    import torch
    from safetensors.torch import save_file

    file = out / "model.safetensors"
    if file.exists():
        return file
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for L in range(layers):
        for e in range(E):
            for proj, (n, k) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
                base = f"model.layers.{L}.mlp.experts.{e}.{proj}_proj"
                tensors[base + ".qweight"] = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=g, dtype=torch.int32)
                tensors[base + ".qzeros"] = torch.full((k // GROUP, n // 8), 0x77777777, dtype=torch.int32)
                tensors[base + ".scales"] = (torch.rand((k // GROUP, n), generator=g) * 0.01 + 1e-3).half()
    tmp = file.with_suffix(".tmp")
    save_file(tensors, tmp)
    tmp.rename(file)
    return file


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()

    from bench_hf import model_dir
    from tandem import _C

    bf16_dir = model_dir("qwen3-30b-a3b", args.layers, 32768)
    gptq = gptq_checkpoint(Path(str(bf16_dir) + "-gptq"), args.layers)
    naming = ("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
              "model.layers.{L}.mlp.experts.{E}.down_proj.weight")
    config = f"version: 1\ncpu: {{format: int4, group_size: {GROUP}}}\ngpu: {{device: none}}\n"
    layers = list(range(args.layers))
    print("machine: " + next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
                             "?"))
    for name, path in (("bf16 checkpoint, quantized", bf16_dir), ("GPTQ checkpoint, copied", gptq)):
        ckpt = _C.Checkpoint(str(path))
        best = float("inf")
        for _ in range(args.reps + 1):
            engine = _C.Engine(config_text=config, experts=E, hidden=H, inter=I, layers=layers)
            t = time.perf_counter()
            engine.load_checkpoint(ckpt, naming)
            best = min(best, time.perf_counter() - t)  # the first round also warms the page cache
            packed = engine.cpu_bytes
            del engine
        print(f"{name:28} {best:7.2f} s   {packed / 1e9 / best:6.2f} GB/s of int4 packs ({packed / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
