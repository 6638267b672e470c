"""Decode tokens/s with the model's RMSNorms fused (tandem.dense.TandemRMSNorm) against the
same model with transformers' own RMSNorms, alternated in one process (this machine's load
changes from minute to minute, so only alternated figures compare).

    .venv/bin/python bench/ab_fused_norms.py                  # int4 experts, int4 dense layers
    .venv/bin/python bench/ab_fused_norms.py --format bf16 --dense auto --rounds 8

The checkpoint is bench_hf.py's random Qwen3-30B-A3B-shaped one (4 layers, vocabulary
32768), built once into tandem's cache.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.append(str(ROOT / "python"))

import bench_hf  # noqa: E402
import tandem  # noqa: E402
from tandem.dense import TandemRMSNorm  # noqa: E402
from tandem.run import timed_generate  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", default="int4", help="cpu.format (default int4)")
    p.add_argument("--dense", default="int4", help="cpu.dense_format (default int4; not torch)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=24)
    a = p.parse_args()
    if a.dense == "torch":
        p.error("--dense torch leaves the norms to torch: nothing to compare")
    d = bench_hf.model_dir("qwen3-30b-a3b", 4, 32768)
    cfg = {"version": 1, "cpu": {"format": a.format, "dense_format": a.dense}, "gpu": {"device": "auto"}}
    model = tandem.load_model(d, cfg, progress=False)
    slots = [(par, n, m) for par in model.modules() for n, m in par.named_children() if isinstance(m, TandemRMSNorm)]
    print(f"{d}: {len(slots)} RMSNorms fused; format {a.format}, dense {a.dense}; {a.prompt}-token prompt, "
          f"{a.new} new tokens, {a.rounds} rounds alternated")
    ids = torch.randint(0, 256, (1, a.prompt), generator=torch.Generator().manual_seed(1))
    gen = dict(max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False)
    timed_generate(model, ids, **dict(gen, max_new_tokens=4, min_new_tokens=4))  # warm-up
    res: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(a.rounds):
        for fused in (False, True):
            for par, n, m in slots:
                setattr(par, n, m if fused else m.inner)
            res[fused].append(timed_generate(model, ids, **gen)[1].decode_tps)
    wins = sum(f > t for t, f in zip(res[False], res[True]))
    for fused in (False, True):
        r = res[fused]
        print(f"{'fused' if fused else 'torch':>6}: decode tok/s median {statistics.median(r):.1f}, best {max(r):.1f}, "
              f"rounds {[round(x, 1) for x in r]}")
    print(f"fused faster in {wins} of {a.rounds} alternated pairs; median ratio "
          f"{statistics.median(f / t for t, f in zip(res[False], res[True])):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
