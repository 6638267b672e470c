"""LoRA fine-tuning of a whole model from a torch loop: tandem (experts in the CPU pools
through tandem.load_model(train=True)) vs stock transformers + PEFT on the same machine,
each configuration in its own process.

    .venv/bin/python bench/bench_train.py                     # demo model and 30B-shaped model
    .venv/bin/python bench/bench_train.py --models demo --steps 10

Models (random weights, bf16 checkpoints; built once into $TANDEM_CACHE or ~/.cache/tandem):
  demo  the `tandem run` / `tandem train` demo: Qwen3-MoE, 4 layers, hidden 256, 16 experts
        (intermediate 256), top-4
  30b   Qwen3-30B-A3B-shaped layers: hidden 2048, 32 heads (4 KV, head_dim 128), 128 experts
        (intermediate 768), top-8; --layers of them (default 2: the real model's 48 layers do
        not fit this machine's 24 GiB in stock PEFT) and a 2048-token vocabulary
Both sides: weights bf16, the same PEFT LoraConfig as `tandem train` (r 8, alpha 16, every
linear layer but the head + target_parameters on the experts' gate_up_proj / down_proj),
AdamW on the LoRA parameters, batch --batch x --seq random tokens, --warmup untimed steps then
--steps timed ones. Stock PEFT runs the experts with transformers' own experts forward and
PEFT's ParamWrapper (it folds B A into every expert's weight each forward).

Printed per model: training tokens/s, seconds per step, the experts' base FLOP rate (12 *
tokens * top_k * hidden * inter per layer and step: forward gate/up/down, backward dOut Wd and
[dg du][Wg; Wu]) against the machine's vdpbf16ps peak (build/bench/bench_ceilings), and peak
resident memory of the process (VmHWM, loading included) and after loading.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_hf  # noqa: E402
from bench_sft import bf16_peak, status_kib  # noqa: E402

def model_dir(name: str, layers: int) -> Path:
    return bench_hf.model_dir(name, layers, vocab=None if name == "demo" else 2048)


def run_one(args) -> dict:
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    import tandem
    from tandem.train import peft_config

    path = Path(args.path)
    t0 = time.perf_counter()
    if args.impl == "tandem":
        model = tandem.load_model(path, {"version": 1, "gpu": {"device": "none"}}, dtype=torch.bfloat16, train=True,
                                  progress=False)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = get_peft_model(model, peft_config(model, 8, 16.0))
    model.train()
    load_s = time.perf_counter() - t0
    weights_mib = status_kib("VmRSS") / 1024
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, V, (args.batch, args.seq), generator=g)
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t
        if step >= args.warmup:
            times.append(dt)
        losses.append(loss.item())
    cfg = model.config
    return dict(impl=args.impl, seconds=sorted(times)[len(times) // 2], load_s=load_s, weights_mib=weights_mib,
                peak_mib=status_kib("VmHWM") / 1024, tokens=args.batch * args.seq, torch_threads=torch.get_num_threads(),
                layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, inter=cfg.moe_intermediate_size,
                top_k=cfg.num_experts_per_tok, losses=losses)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="demo,30b")
    ap.add_argument("--impls", default="tandem,stock")
    ap.add_argument("--layers", type=int, default=2, help="layers of the 30B-shaped model")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--impl", help=argparse.SUPPRESS)  # internal: one configuration in this process
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.impl:
        print(json.dumps(run_one(args)))
        return 0
    results = {}
    for name in args.models.split(","):
        path = model_dir(name, args.layers)
        peak = bf16_peak()
        res = {}
        for impl in args.impls.split(","):
            cmd = [sys.executable, __file__, "--impl", impl, "--path", str(path), "--batch", str(args.batch),
                   "--seq", str(args.seq), "--warmup", str(args.warmup), "--steps", str(args.steps)]
            p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, TQDM_DISABLE="1"))
            if p.returncode != 0:
                print(f"{name} {impl} failed:\n{p.stderr[-3000:]}", flush=True)
                continue
            res[impl] = json.loads(p.stdout.strip().splitlines()[-1])
        after = bf16_peak()
        peak = max(x for x in (peak, after, 0.0) if x is not None) or None
        print(f"\n== {name} ({path.name}); batch {args.batch} x {args.seq} tokens; vdpbf16ps peak {peak} GFLOP/s")
        print(f"{'impl':>7} | {'s/step':>7} {'tokens/s':>9} {'expert GFLOP/s':>14} {'%peak':>6} | {'peak GiB':>8} "
              f"{'loaded GiB':>10} | {'torch thr':>9} {'first loss':>10}")
        for impl, r in res.items():
            flops = 12.0 * r["tokens"] * r["top_k"] * r["hidden"] * r["inter"] * r["layers"]
            gf = flops / r["seconds"] / 1e9
            r["expert_gflops"] = gf
            print(f"{impl:>7} | {r['seconds']:>7.3f} {r['tokens'] / r['seconds']:>9.0f} {gf:>14.1f} "
                  f"{100 * gf / peak if peak else float('nan'):>5.1f}% | {r['peak_mib'] / 1024:>8.2f} "
                  f"{r['weights_mib'] / 1024:>10.2f} | {r['torch_threads']:>9} {r['losses'][0]:>10.4f}")
        if "tandem" in res and "stock" in res:
            t, s = res["tandem"], res["stock"]
            print(f"tandem vs stock PEFT: {s['seconds'] / t['seconds']:.2f}x tokens/s, "
                  f"{t['peak_mib'] / s['peak_mib']:.2f}x peak memory")
        results[name] = dict(peak_gflops=peak, **res)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
