"""Decode (and prefill) tokens/s of one of tandem's per-token changes against the same model without it,
alternated in one process (this machine's load changes from minute to minute, so only
alternated figures compare):

- ``norms``: the model's RMSNorms fused (tandem.dense.TandemRMSNorm) / transformers' own;
- ``projections``: the layers a module calls on one input sharing a packed weight
  (q/k/v, an MLP's gate and up, MLA's q_a / kv_a; ``TandemLinear.fused``) / each layer on
  its own packed weight;
- ``routers``: the MoE routers on tandem's kernels (tandem.router.TandemRouter) /
  transformers' own;
- ``cache``: generate's default KV cache, appending in place (``tandem.kv_cache``) /
  transformers' DynamicCache (torch.cat at every step); worth it with long prompts;
- ``bf16out``: tandem's dense layers' bf16 outputs rounded on the pool's threads / an fp32
  output rounded by torch (``.to(bfloat16)``: an allocation and a copy per layer call);
- ``mla``: MLA's one-token attention from the latents in one call on the pool
  (``_C.Engine.mla_decode``) / in torch bmm on one thread (DeepSeek-V2 / V3 shapes only);
- ``layers``: whole decoder layers' one-token steps in C++ (``tandem.decode_step``) /
  transformers' layer over tandem's modules;
- ``caller``: the calling thread runs worker 0's part of each pool task on an idle pool
  (``Engine.caller_runs``, tandem/pool.h) / it sleeps until the workers finish;
- ``model``: every decoder layer's step in one C++ call per token (``tandem.decode_step.use_model_step``)
  / one call pair per layer from transformers' layer loop;
- ``mlps``: gated MLPs (shared experts, dense MLPs) in one call (``tandem.dense.use_gated_mlps``) /
  transformers' MLP over tandem's layers (DeepSeek-V2 shapes; with the decoder-layer steps
  off in both arms, since a step needs its MLP's path);
- ``head``: the whole causal LM's token without module calls (``tandem.decode_step.use_head_step``:
  embedding row, stack, final norm, lm_head) / the model step inside transformers' causal LM;
- ``split``: prefill SDPA calls split by heads over the pool's threads
  (``tandem.attention.PREFILL_SPLIT_MIN``) / whole on torch's one thread (read the prefill ratio;
  try ``--prompt 512``; with ``prefill`` off, since the pool's flash attention takes those calls);
- ``prefill``: prefill attention on the pool (``tandem.attention.PREFILL_MIN_QUERIES``: flash
  attention on tandem's BF16 kernels) / SDPA split by heads (read the prefill ratio).

    .venv/bin/python bench/ab_decode.py norms                  # int4 experts, int4 dense layers
    .venv/bin/python bench/ab_decode.py projections --format bf16 --dense auto --rounds 8
    .venv/bin/python bench/ab_decode.py projections --model deepseek-v2-lite --group-size 64
    .venv/bin/python bench/ab_decode.py routers --format bf16 --dense auto
    .venv/bin/python bench/ab_decode.py cache --prompt 4096 --rounds 4
    .venv/bin/python bench/ab_decode.py mla --model deepseek-v2-lite --group-size 64
    .venv/bin/python bench/ab_decode.py layers --format bf16 --dense auto
    .venv/bin/python bench/ab_decode.py layers --model deepseek-v2-lite --group-size 64 --format bf16 --dense auto
    .venv/bin/python bench/ab_decode.py mlps --model deepseek-v2-lite --group-size 64
    .venv/bin/python bench/ab_decode.py head --rounds 8
    .venv/bin/python bench/ab_decode.py split --prompt 512 --new 4 --format bf16 --dense auto
    .venv/bin/python bench/ab_decode.py prefill --prompt 2048 --new 2 --format bf16 --dense auto --rounds 3

The checkpoints are bench_hf.py's random ones (Qwen3-30B-A3B or DeepSeek-V2-Lite shapes,
4 layers, vocabulary 32768), built once into tandem's cache.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.append(str(ROOT / "python"))

import bench_hf  # noqa: E402
import tandem  # noqa: E402
from tandem.dense import TandemLinear, TandemRMSNorm  # noqa: E402
from tandem.router import TandemRouter  # noqa: E402
from tandem.run import timed_generate  # noqa: E402


def norm_slots(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, nn.Module]]:
    """(parent, attribute, with the change, without it) for every fused RMSNorm."""
    return [(par, n, m, m.inner) for par in model.modules() for n, m in par.named_children()
            if isinstance(m, TandemRMSNorm)]


def router_slots(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, nn.Module]]:
    """(parent, attribute, with the change, without it) for every router on tandem's kernels."""
    return [(par, n, m, m.inner) for par in model.modules() for n, m in par.named_children()
            if isinstance(m, TandemRouter)]


class _MlaSlot:
    """setattr target: puts an MLA attention module's engine (its one-token step then runs
    on the pool) or, given None, removes it (torch bmm)."""

    def __init__(self, mod):
        object.__setattr__(self, "mod", mod)

    def __setattr__(self, name, engine):
        if engine is None:
            self.mod.__dict__.pop("tandem_attention_engine", None)
        else:
            self.mod.__dict__["tandem_attention_engine"] = engine


def mla_slots(model: nn.Module) -> list:
    """(slot, key, with the change, without it) for every MLA attention module on the pool."""
    from tandem.attention import is_mla

    return [(_MlaSlot(m), "engine", m.__dict__["tandem_attention_engine"], None)
            for m in model.modules() if is_mla(m) and "tandem_attention_engine" in m.__dict__]


def head_slots(model: nn.Module) -> list:
    """(the causal LM's one-token step, "enabled", True, False)."""
    head = getattr(model, "tandem_head", None)
    return [(head, "enabled", True, False)] if head is not None else []


def split_slots(model: nn.Module) -> list:
    """(tandem.attention, "PREFILL_SPLIT_MIN", its value, never)."""
    from tandem import attention

    attention.PREFILL_MIN_QUERIES = 1 << 30  # (these calls would go to the pool's flash attention)
    return [(attention, "PREFILL_SPLIT_MIN", attention.PREFILL_SPLIT_MIN, 1 << 62)]


def prefill_slots(model: nn.Module) -> list:
    """(tandem.attention, "PREFILL_MIN_QUERIES", its value, never)."""
    from tandem import attention

    return [(attention, "PREFILL_MIN_QUERIES", attention.PREFILL_MIN_QUERIES, 1 << 30)]


def bf16out_slots(model: nn.Module) -> list:
    """(packed weight, "bf16_on_pool", True, False) for every packed dense weight."""
    packs = {id(m._packed): m._packed for m in model.modules() if isinstance(m, TandemLinear)}
    return [(p, "bf16_on_pool", True, False) for p in packs.values()]


def layer_slots(model: nn.Module) -> list:
    """(decoder-layer step, "enabled", True, False) for every layer with a C++ step."""
    return [(m.tandem_decoder_step, "enabled", True, False) for m in model.modules()
            if "tandem_decoder_step" in m.__dict__]


def caller_slots(model: nn.Module) -> list:
    """(engine, "caller_runs", True, False)."""
    return [(model.tandem_engine, "caller_runs", True, False)]


def model_slots(model: nn.Module) -> list:
    """(the base model's one-call step, "enabled", True, False)."""
    fast = getattr(model.model, "tandem_model_step", None)
    return [(fast, "enabled", True, False)] if fast is not None else []


def mlp_slots(model: nn.Module) -> list:
    """(gated MLP path, "enabled", True, False) for every gated MLP with the one-call path;
    the decoder-layer steps are turned off (they need it)."""
    for m in model.modules():
        if "tandem_decoder_step" in m.__dict__:
            m.tandem_decoder_step.enabled = False
    return [(m.tandem_mlp, "enabled", True, False) for m in model.modules() if "tandem_mlp" in m.__dict__]


def projection_slots(model: nn.Module, cfg: dict) -> list[tuple[nn.Module, str, nn.Module, nn.Module]]:
    """(parent, attribute, fused member, the same layer packed alone) for every fused layer:
    the model was loaded with cpu.dense_format torch; its linear layers are replaced here as
    load_model replaces them, and the fused ones are also packed alone from their weights."""
    from tandem.attention import is_mla, use_mla_absorption, use_pool_attention
    from tandem.dense import replace_dense, replace_norms

    engine = model.tandem_engine
    keep = {id(c) for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module)
            for c in m.children() if isinstance(c, nn.Linear)}
    keep |= {id(m.kv_b_proj) for m in model.modules() if is_mla(m)}
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    replace_dense(model, engine, cfg["cpu"], keep)
    replace_norms(model)
    if use_pool_attention(model, engine):
        use_mla_absorption(model)
    opts = dict(group_size=cfg["cpu"].get("group_size", 128))
    slots = []
    for pname, par in model.named_modules():
        for n, m in par.named_children():
            if isinstance(m, TandemLinear) and m.fused_with > 1:
                alone = TandemLinear(engine, linears[f"{pname}.{n}"], m.format, name=m.name, **opts)
                slots.append((par, n, m, alone))
    return slots


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("norms", "projections", "routers", "cache", "mla", "bf16out", "layers", "mlps",
                                    "caller", "model", "head", "split", "prefill"))
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(bench_hf.SHAPES))
    p.add_argument("--format", default="int4", help="cpu.format (default int4)")
    p.add_argument("--dense", default="int4", help="cpu.dense_format (default int4; not torch)")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--layers", type=int, default=4, help="layers of the random checkpoint (default 4)")
    p.add_argument("--new", type=int, default=24)
    a = p.parse_args()
    if a.dense == "torch":
        p.error("--dense torch leaves these layers to torch: nothing to compare")
    d = bench_hf.model_dir(a.model, a.layers, 32768)
    cpu = {"format": a.format, "dense_format": a.dense}
    if "int4" in (a.format, a.dense):  # the config refuses a group size no layer uses
        cpu["group_size"] = a.group_size
    cfg = {"version": 1, "cpu": cpu,
           "gpu": {"device": "auto"}}
    if a.what in ("norms", "routers", "cache", "mla", "bf16out", "layers", "mlps", "caller", "model", "head", "split",
                  "prefill"):
        model = tandem.load_model(d, cfg, progress=False)
        slots = {"norms": norm_slots, "routers": router_slots, "mla": mla_slots,
                 "bf16out": bf16out_slots, "layers": layer_slots, "mlps": mlp_slots,
                 "caller": caller_slots, "model": model_slots, "head": head_slots,
                 "split": split_slots, "prefill": prefill_slots}.get(a.what, lambda m: [])(model)
    else:
        model = tandem.load_model(d, dict(cfg, cpu=dict(cfg["cpu"], dense_format="torch")), progress=False)
        slots = projection_slots(model, cfg)
    print(f"{d}: {len(slots)} modules swapped ({a.what}); format {a.format}, dense {a.dense}; {a.prompt}-token "
          f"prompt, {a.new} new tokens, {a.rounds} rounds alternated")
    ids = torch.randint(0, 256, (1, a.prompt), generator=torch.Generator().manual_seed(1))
    model.generation_config.eos_token_id = None  # exactly `new` tokens (bench_hf.py says why not min_new_tokens)
    gen = dict(max_new_tokens=a.new, do_sample=False)
    timed_generate(model, ids, **dict(gen, max_new_tokens=4))  # warm-up
    res: dict[bool, list[float]] = {False: [], True: []}
    pre: dict[bool, list[float]] = {False: [], True: []}
    outs: dict[bool, torch.Tensor] = {}
    for _ in range(a.rounds):
        for on in (False, True):
            for par, n, with_it, without in slots:
                setattr(par, n, with_it if on else without)
            extra = {}
            if a.what == "cache" and not on:
                from transformers import DynamicCache

                extra["past_key_values"] = DynamicCache(config=model.config)
            out, t = timed_generate(model, ids, **gen, **extra)
            res[on].append(t.decode_tps)
            pre[on].append(t.prefill_tps)
            outs[on] = out
    same = torch.equal(outs[False], outs[True])
    wins = sum(f > t for t, f in zip(res[False], res[True]))
    for on in (False, True):
        r = res[on]
        print(f"{'with' if on else 'without':>7}: decode tok/s median {statistics.median(r):.1f}, best {max(r):.1f}, "
              f"rounds {[round(x, 1) for x in r]}; prefill tok/s median {statistics.median(pre[on]):.0f}")
    print(f"with the change faster in {wins} of {a.rounds} alternated pairs; median ratio "
          f"{statistics.median(f / t for t, f in zip(res[False], res[True])):.3f} (prefill "
          f"{statistics.median(f / t for t, f in zip(pre[False], pre[True])):.3f}); same tokens: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
