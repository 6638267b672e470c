"""Peak memory and speed of `tandem merge` against PEFT's merge_and_unload + save_pretrained.

    .venv/bin/python bench/bench_merge.py [--layers 2 --experts 64 --hidden 2048 --inter 768]

Builds a random-weight bf16 Qwen3-MoE checkpoint (sharded at 500 MB) and a random LoRA
adapter on attention and the routed experts (r 8), then runs, each in its own process:
  tandem   `python -m tandem merge` (streams tensor by tensor)
  peft     from_pretrained + PeftModel.from_pretrained + merge_and_unload + save_pretrained
           (what a user without tandem runs: the whole model in memory)
  import   a process that only imports torch, transformers, peft and tandem (the floor)
and prints each one's peak RSS (getrusage of the child), its wall time and its write rate,
with the checkpoint's size and its largest tensor for scale.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEFT_MERGE = """
import sys, torch
from transformers import AutoModelForCausalLM
from peft import PeftModel
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
m = PeftModel.from_pretrained(m, sys.argv[2]).merge_and_unload()
m.save_pretrained(sys.argv[3], max_shard_size="500MB")
"""
IMPORTS = "import torch, transformers, peft, tandem, tandem.merge"


# RUSAGE_CHILDREN's maximum spans every child a process waited for: each variant runs
# under a fresh watcher process of its own, which reports its one child's peak.
WATCH = """
import resource, subprocess, sys
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stderr.write(r.stderr[-3000:] if r.returncode else "")
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(r.returncode)
"""


def child(argv: list[str]) -> tuple[float, float]:
    """(peak RSS of the command in GB, wall seconds)."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", WATCH, *argv], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{argv[:4]} failed:\n{r.stderr}")
    wall = time.perf_counter() - t0
    return int(r.stdout.split()[-1]) / 2**20, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--variants", default="import,tandem,peft")
    ap.add_argument("--dir", help="work directory (default: a temporary one, removed)")
    args = ap.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    work = Path(args.dir or tempfile.mkdtemp(prefix="bench-merge-"))
    try:
        cfg = Qwen3MoeConfig(vocab_size=32000, hidden_size=args.hidden, num_hidden_layers=args.layers,
                             num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                             moe_intermediate_size=args.inter, intermediate_size=4 * args.inter,
                             num_experts=args.experts, num_experts_per_tok=8)
        torch.manual_seed(0)
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(work / "model", max_shard_size="500MB")
        peft = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                                target_parameters=["mlp.experts.gate_up_proj",
                                                                   "mlp.experts.down_proj"]))
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
        peft.save_pretrained(work / "adapter")
        largest = max(p.numel() * p.element_size() for p in model.parameters())
        del model, peft
        files = sorted((work / "model").glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        print(f"checkpoint: {size / 1e9:.2f} GB in {len(files)} shards (bf16, {args.layers} layers x {args.experts} "
              f"experts, hidden {args.hidden}, inter {args.inter}); largest tensor {largest / 1e6:.0f} MB "
              f"(a fused experts stack in memory: {args.experts * 3 * args.hidden * args.inter * 2 / 1e6:.0f} MB "
              f"per layer); built in {time.perf_counter() - t0:.0f} s")
        print(f"{'variant':8} {'peak RSS GB':>12} {'wall s':>8} {'write GB/s':>11}")
        for v in args.variants.split(","):
            out = work / f"out-{v}"
            if v == "import":
                rss, wall = child([sys.executable, "-c", IMPORTS])
            elif v == "tandem":
                rss, wall = child([sys.executable, "-m", "tandem", "merge", "--model", str(work / "model"),
                                   "--adapter", str(work / "adapter"), "--out", str(out), "--no-progress"])
            elif v == "peft":
                rss, wall = child([sys.executable, "-c", PEFT_MERGE, str(work / "model"), str(work / "adapter"),
                                   str(out)])
            else:
                raise SystemExit(f"unknown variant {v!r}")
            rate = f"{size / wall / 1e9:11.2f}" if v != "import" else f"{'-':>11}"
            print(f"{v:8} {rss:12.2f} {wall:8.1f} {rate}", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
