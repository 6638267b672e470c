"""Prefill and decode tokens/s of a transformers MoE model run through tandem vs the same
model in plain transformers, on the same machine, each in its own process (so peak
memory is that variant's own).

    .venv/bin/python bench/bench_hf.py                        # demo model + Qwen3-30B-A3B shapes
    .venv/bin/python bench/bench_hf.py --models demo --prompt 64 --new 32
    .venv/bin/python bench/bench_hf.py --models qwen3-30b-a3b --dense torch,auto,int8

--dense: the cpu.dense_format values to run tandem with (tandem.dense: the non-expert
linear layers in torch, or on tandem's kernels in bf16 / int8 / int4); each is a variant.

Random-weight checkpoints are built once under $TANDEM_CACHE (default ~/.cache/tandem).
Qwen3-30B-A3B shapes (hidden 2048, 128 experts, top-8, expert intermediate 768, 32 heads,
4 KV heads, vocab 151936) use --layers of its 48 layers so the reference fits in memory.
Ceiling: decode reads every non-expert weight and top_k experts per MoE layer per token;
the ratio is that byte rate over the machine's measured read bandwidth
(build/bench/bench_ceilings).
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

QWEN3_30B = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                 num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144, vocab_size=151936,
                 max_position_embeddings=4096, norm_topk_prob=True, tie_word_embeddings=False)


# DeepSeek-V2-Lite's shapes: MLA attention (kv_lora_rank 512), a dense first layer, 64 routed
# experts (top 6, softmax, no renormalization) and 2 shared experts. Its queries are compressed
# as DeepSeek-V2's are (q_lora_rank 1536; the Lite model has none): llama.cpp's quantizer
# (llama-cpp-python 0.3.36) refuses a deepseek2 GGUF without deepseek2.attention.q_lora_rank.
DEEPSEEK_V2_LITE = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=1536,
                        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, moe_intermediate_size=1408,
                        intermediate_size=10944, first_k_dense_replace=1, topk_method="greedy", norm_topk_prob=False,
                        routed_scaling_factor=1.0, vocab_size=102400, max_position_embeddings=4096,
                        tie_word_embeddings=False)
SHAPES = ("qwen3-30b-a3b", "deepseek-v2-lite")


def model_dir(name: str, layers: int, vocab: int | None = None) -> Path:
    """The demo checkpoint, or a random Qwen3-30B-A3B- or DeepSeek-V2-Lite-shaped one (`name`)
    with `layers` layers (and a smaller vocabulary when `vocab` is given), built once into
    tandem's cache."""
    import torch

    from tandem import demo

    if name == "demo":
        return demo.ensure_demo_model()
    if name not in SHAPES:
        raise ValueError(f"model {name!r}: one of demo, {', '.join(SHAPES)}")
    out = demo.cache_dir() / (f"bench-{name}-{layers}l" + (f"-v{vocab}" if vocab else ""))
    if (out / "model.safetensors.index.json").is_file() or (out / "model.safetensors").is_file():
        return out
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    print(f"building a random {name} checkpoint with {layers} layers in {out} (once)", flush=True)
    torch.manual_seed(0)
    if name == "deepseek-v2-lite":
        cls, cfg = DeepseekV2ForCausalLM, DeepseekV2Config(
            num_hidden_layers=layers, **dict(DEEPSEEK_V2_LITE, **({"vocab_size": vocab} if vocab else {})))
    else:
        cls, cfg = Qwen3MoeForCausalLM, Qwen3MoeConfig(
            num_hidden_layers=layers, **dict(QWEN3_30B, **({"vocab_size": vocab} if vocab else {})))
    with torch.device("cpu"):
        m = cls(cfg).to(torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    m.save_pretrained(tmp)
    tmp.rename(out)
    return out


def status_kib(field: str) -> int:
    """VmRSS / VmHWM of this process (VmHWM, unlike ru_maxrss, starts afresh at exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def run_variant(args) -> dict:
    """One variant in this process: load, warm up, then time generations."""
    import torch
    from transformers import AutoModelForCausalLM

    import tandem
    from tandem.run import timed_generate

    torch.manual_seed(0)
    t0 = time.perf_counter()
    if args.variant.startswith("tandem"):
        cpu = {"format": args.format, "dense_format": args.variant.split("/")[1]}
        if "int4" in (cpu["format"], cpu["dense_format"]):
            cpu["group_size"] = args.group_size
        cfg = {"version": 1, "cpu": cpu,
               "gpu": {"device": "auto"}}
        model = tandem.load_model(args.dir, cfg, progress=False)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16).eval()
        if torch.cuda.is_available():
            model = model.cuda()
    load_s = time.perf_counter() - t0
    peak_load = status_kib("VmHWM")
    after_load = status_kib("VmRSS")
    vocab = model.config.vocab_size
    ids = torch.randint(0, min(vocab, 256), (1, args.prompt), generator=torch.Generator().manual_seed(1))
    ids = ids.to(model.device)
    # Exactly `new` tokens, as llama-bench decodes: no end-of-sequence token stops the run. (Not
    # min_new_tokens: its logits processor compares the whole vocabulary with the EOS ids at
    # every step, 0.9 ms per token at a 32768-token vocabulary on the 2-core test machine, a
    # cost of the benchmark's, not of the model's.)
    model.generation_config.eos_token_id = None
    gen = dict(max_new_tokens=args.new, do_sample=False)
    timed_generate(model, ids, **dict(gen, max_new_tokens=4))  # warm-up
    pre, dec = [], []
    for _ in range(args.repeat):
        _, t = timed_generate(model, ids, **gen)
        pre.append(t.prefill_tps)
        dec.append(t.decode_tps)
    c = model.config
    n_moe = sum(1 for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    expert_bytes = 3 * c.hidden_size * c.moe_intermediate_size * 2  # transformers: bf16
    if args.variant.startswith("tandem"):  # the packed format's bytes (scales included)
        experts = getattr(c, "num_experts", None) or c.n_routed_experts
        expert_bytes = model.tandem_engine.cpu_bytes / (model.tandem_engine.moe_layers * experts)
    non_expert = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".mlp.experts." not in n)
    non_expert += sum(m.packed_bytes for m in model.modules() if hasattr(m, "packed_bytes"))  # tandem.dense layers
    # Decode reads every non-expert weight except the embedding table (one row) per token,
    # and top_k experts per MoE layer (at one token: distinct experts, weights read once).
    embed = model.model.embed_tokens.weight
    per_token = non_expert - embed.numel() * embed.element_size() + n_moe * c.num_experts_per_tok * expert_bytes
    return dict(variant=args.variant, load_s=load_s, prefill_tps=statistics.median(pre),
                decode_tps=statistics.median(dec), peak_rss_gib=peak_load / 2**20, rss_after_load_gib=after_load / 2**20,
                decode_bytes=per_token, threads=torch.get_num_threads(),
                tandem_cpu_gib=(model.tandem_engine.cpu_bytes / 2**30 if args.variant.startswith("tandem") else None),
                device=str(model.device))


def ceilings() -> dict:
    exe = ROOT / "build" / "bench" / "bench_ceilings"
    if not exe.exists():
        return {}
    out = subprocess.run([str(exe)], capture_output=True, text=True).stdout
    m = re.search(r"read bandwidth\s+([\d.]+) GB/s", out)
    machine = out.splitlines()[0] if out else ""
    res = {"read_gbs": float(m.group(1)) if m else None, "machine": machine}
    # The instruction peaks (GFLOP/s) a BF16 kernel's rate is measured against.
    for key, label in (("fma_zmm", "peak vfmadd231ps zmm"), ("fma_ymm", "peak vfmadd231ps ymm"),
                       ("dpbf16", "peak vdpbf16ps zmm"), ("amx_bf16", "peak AMX tdpbf16ps")):
        m = re.search(re.escape(label) + r"[^\n]*?\s([\d.]+) GFLOP/s", out)
        res[key] = float(m.group(1)) if m else None
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="demo,qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=4, help="layers of the Qwen3-30B-A3B-shaped model")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--format", default="bf16")
    p.add_argument("--group-size", type=int, default=128, help="int4's group (DeepSeek-V2-Lite's dense MLP, k = 10944, "
                   "needs 64)")
    p.add_argument("--dense", default="torch,auto", help="cpu.dense_format values, one tandem variant each")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return 0
    ceil = ceilings()
    print(ceil.get("machine", ""))
    bw = ceil.get("read_gbs")
    print(f"read bandwidth (bench_ceilings): {bw} GB/s; prompt {args.prompt} tokens, {args.new} new, "
          f"median of {args.repeat}; tandem format {args.format}")
    results = []
    for name in args.models.split(","):
        d = model_dir(name, args.layers)
        row = {"model": name}
        cores = os.cpu_count() or 1
        dense = args.dense.split(",")
        for variant in ["transformers"] + [f"tandem/{d}" for d in dense] + [f"tandem-t{cores}/{dense[0]}"]:
            cmd = [sys.executable, __file__, "--variant", variant, "--dir", str(d), "--prompt", str(args.prompt),
                   "--new", str(args.new), "--repeat", str(args.repeat), "--format", args.format,
                   "--group-size", str(args.group_size)]
            env = dict(os.environ)
            if not variant.startswith("tandem/"):  # tandem-tN: torch keeps N threads next to the pool
                env["TANDEM_TORCH_THREADS"] = str(cores)
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if r.returncode:
                print(r.stderr, file=sys.stderr)
                return 1
            row[variant] = json.loads(r.stdout.strip().splitlines()[-1])
        results.append(row)
        hf, td = row["transformers"], row[f"tandem/{dense[0]}"]
        print(f"\n{name} ({d.name}), device {td['device']}")
        print(f"{'':18}{'torch thr':>10}{'prefill tok/s':>14}{'decode tok/s':>14}{'load s':>8}{'peak RSS GiB':>14}"
              f"{'RSS after load':>16}")
        for label, x in row.items():
            if label == "model":
                continue
            print(f"{label:18}{x['threads']:>10}{x['prefill_tps']:>14.1f}{x['decode_tps']:>14.2f}{x['load_s']:>8.1f}"
                  f"{x['peak_rss_gib']:>14.2f}{x['rss_after_load_gib']:>16.2f}")
        for df in dense:
            t = row[f"tandem/{df}"]
            line = (f"tandem/{df} vs transformers: prefill {t['prefill_tps'] / hf['prefill_tps']:.2f}x, decode "
                    f"{t['decode_tps'] / hf['decode_tps']:.2f}x; decode reads {t['decode_bytes'] / 2**20:.1f} MiB/token")
            if bw:
                rate = t["decode_bytes"] * t["decode_tps"] / 1e9
                line += f" -> {rate:.1f} GB/s = {rate / bw:.0%} of the measured read bandwidth"
            print(line)
        print(f"tandem packed experts {td['tandem_cpu_gib']:.2f} GiB; peak RSS during load {td['peak_rss_gib']:.2f} GiB")
    if args.json:
        Path(args.json).write_text(json.dumps({"ceilings": ceil, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
