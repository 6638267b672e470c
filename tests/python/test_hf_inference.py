"""tandem inside transformers: logits, generation, deferral, placement, bad input.

Reference: the unmodified transformers model loaded from the same checkpoint. Tolerances
are relative to the reference's largest |value| and were measured over these models
(3 kinds x fp32/bf16 x 2 seeds); each bound is stated next to what was measured.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn
from hf_models import (KINDS, VOCAB, max_rel, DeferralReference, V4Block, build, clean_tokens, expert_fp64, moe_experts,
                       record_routing)

import tandem

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FORMATS = {"bf16": {"format": "bf16"}, "int8": {"format": "int8"}, "int4": {"format": "int4", "group_size": 32}}

# One MoE layer given the reference's own inputs (so routing is identical), vs fp64:
# bf16 weights, inputs and intermediate each round once (relative error <= u = 2^-8 each,
# 8 significant bits; about 2^-9 on average) and the sums run in fp32: bound 4u = 1.6e-2
# relative to the largest |output| (measured <= 5.6e-3; the same at every kernel level,
# since these roundings do not depend on the CPU, only the fp32 sums' order does). int8: per-row weight scales
# (error <= max|w|/254) and int8 activations: bound 6e-2 (measured <= 2.6e-2). int4,
# groups of 32, symmetric (error <= max|w|/14 per group): bound 0.35 (measured <= 0.21).
LAYER_BOUND = {"bf16": 1.6e-2, "int8": 6e-2, "int4": 0.35}
# Whole-model logits on tokens whose routing matched (see hf_models.clean_tokens), BF16
# experts: fp32 models see only tandem's bf16 rounding (bound 1.5e-2, measured <= 4.3e-3);
# bf16 models add the reference's own bf16 rounding of every expert output and sum
# (bound 4e-2, measured <= 1.5e-2).
LOGIT_BOUND = {"fp32": 1.5e-2, "bf16": 4e-2}


def cfg(fmt: str = "bf16", **gpu) -> dict:
    return {"version": 1, "cpu": dict(FORMATS[fmt], virtual_subpools=2), "gpu": {"device": "none", **gpu}}


def tokens(seed: int, batch: int = 2, seq: int = 40) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(kind, dtype, seed) -> (checkpoint dir, a fresh reference model loaded from it); each
    checkpoint is built once per module, the reference is new on every call (tests hook
    and patch it)."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(kind: str, dtype: str, seed: int = 1):
        key = (kind, dtype, seed)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{kind}-{dtype}-{seed}")
            build(kind, seed, DTYPES[dtype], out)
            cache[key] = out
        path = cache[key]
        return path, AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()

    return get


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(models, kind, dtype, seed):
    path, ref = models(kind, dtype, seed)
    model = tandem.load_model(path, cfg(), progress=False)
    assert model.dtype == DTYPES[dtype]
    assert not any(".mlp.experts." in k for k in model.state_dict()), "expert weights must not be torch state"
    ids = tokens(seed)
    ra, rb = record_routing(ref), record_routing(model)
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    clean = clean_tokens(ra, rb, *ids.shape)
    assert clean.float().mean() >= 0.25, f"routing differs for most tokens ({(~clean).sum().item()} of {clean.numel()})"
    err = max_rel(b, a, clean)
    print(f"{kind} {dtype} seed {seed}: clean tokens {clean.sum().item()}/{clean.numel()}, max rel err {err:.2e}")
    assert err <= LOGIT_BOUND[dtype]


@pytest.mark.parametrize("deferred", [0, 1])
def test_prompt_longer_than_max_tokens_runs_in_chunks(models, deferred):
    """80 tokens through buffers.max_tokens = 16: the experts run in chunks of 16 and the
    logits match transformers as one call does (chunks defer nothing, so with
    gpu.deferred_experts the long batch is the exact MoE)."""
    path, ref = models("qwen3_moe", "fp32")
    model = tandem.load_model(path, dict(cfg(), buffers={"max_tokens": 16}, gpu={"device": "none",
                                                                                  "deferred_experts": deferred}),
                              progress=False)
    ids = tokens(3)
    assert ids.numel() > 16
    ra, rb = record_routing(ref), record_routing(model)
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    clean = clean_tokens(ra, rb, *ids.shape)
    assert clean.float().mean() >= 0.25
    assert max_rel(b, a, clean) <= LOGIT_BOUND["fp32"]
    e = model.tandem_engine
    assert sum(e.counts(0)["deferred"]) == 0  # chunks defer nothing
    assert e.counts(0)["tokens"] == ids.numel()


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_each_moe_layer_matches_fp64(models, kind, dtype, fmt):
    """Every MoE layer, fed the reference's own (hidden, top_k_index, top_k_weights)."""
    path, ref = models(kind, dtype)
    model = tandem.load_model(path, cfg(fmt), progress=False)
    calls = []
    hooks = [ex.register_forward_hook(lambda m, a, o: calls.append((m, [t.clone() for t in a])))
             for ex in moe_experts(ref)]
    with torch.no_grad():
        ref(tokens(3))
    for h in hooks:
        h.remove()
    ours = moe_experts(model)
    assert len(calls) == len(ours)
    for (hf_mod, (x, idx, w)), mine in zip(calls, ours):
        with torch.no_grad():
            want = expert_fp64(hf_mod)(x.double(), idx, w.double())
            got = mine(x, idx, w)
        assert got.dtype == x.dtype and got.shape == x.shape
        err = max_rel(got, want)
        print(f"{kind} {dtype} {fmt} layer {mine.layer}: {err:.2e}")
        assert err <= LAYER_BOUND[fmt]


def greedy_agrees(ref, model, prompt: torch.Tensor, new: int, tol: float) -> int:
    """Greedy decoding of both; returns the number of steps compared. Every step must pick the
    same token, except that with tol > 0 comparison stops at the first step where the
    reference's top-2 logit gap is within tol x its largest |logit| (a near-tie that any
    rounding difference may break either way, as transformers' own grouped_mm and eager
    expert paths do for bf16 models)."""
    with torch.no_grad():
        g = ref.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, output_scores=True,
                         return_dict_in_generate=True)
        mine = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    ref_tokens = g.sequences[0, prompt.shape[1]:]
    got = mine[0, prompt.shape[1]:]
    for step, scores in enumerate(g.scores):
        # min_new_tokens sets the EOS score to -inf: the scale is the largest finite |logit|
        # (with the -inf in it every step looked like a near-tie and nothing was compared).
        z = scores[0].float()
        z = z[z.isfinite()]
        top2 = z.topk(2).values
        if tol > 0 and (top2[0] - top2[1]) <= tol * z.abs().max():
            return step
        assert got[step] == ref_tokens[step], f"step {step}: tandem {got[step]}, transformers {ref_tokens[step]}"
    assert len(got) == len(ref_tokens) == new
    return new


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_identical(models, kind, dtype):
    path, ref = models(kind, dtype)
    model = tandem.load_model(path, cfg(), progress=False)
    # fp32 models: every one of the 32 tokens identical. bf16 models: identical up to the
    # first near-tie of the reference (within the bf16 logit bound).
    tol = 0.0 if dtype == "fp32" else LOGIT_BOUND[dtype] / 2
    compared = greedy_agrees(ref, model, tokens(5, 1, 8), 32, tol)
    print(f"{kind} {dtype}: {compared} of 32 greedy steps compared")


def test_sampling_runs_with_kv_cache(models):
    path, _ = models("qwen3_moe", "fp32")
    model = tandem.load_model(path, cfg(), progress=False)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(tokens(6, 2, 5), max_new_tokens=12, do_sample=True, temperature=0.9, top_p=0.9)
    assert out.shape == (2, 17)


@pytest.mark.parametrize("deferred", [1, 2])
@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_deferral_matches_a_reference_that_defers(models, kind, deferred):
    path, ref = models(kind, "fp32")
    hot = {1: [0, 3]} if kind == "qwen3_moe" else {}
    hot_layers = {model_layer: e for model_layer, e in hot.items()}
    model = tandem.load_model(path, cfg(deferred_experts=deferred, hot_experts={"layers": hot_layers}),
                              progress=False)
    ids = tokens(7)
    with torch.no_grad():
        plain = ref(ids).logits.clone()
    DeferralReference(ref, deferred, hot={model.tandem_engine.index_of(k): v for k, v in hot.items()})
    ra, rb = record_routing(ref), record_routing(model)
    with torch.no_grad():
        want, got = ref(ids).logits, model(ids).logits
    clean = clean_tokens(ra, rb, *ids.shape)
    assert clean.float().mean() >= 0.25
    err = max_rel(got, want, clean)
    moved = max_rel(plain, want, clean)
    print(f"{kind} deferred {deferred}: err {err:.2e}; deferral moves logits by {moved:.2e}")
    assert err <= LOGIT_BOUND["fp32"]
    assert moved > 10 * LOGIT_BOUND["fp32"], "deferral should change the output (else this test cannot fail)"
    e = model.tandem_engine
    assert sum(sum(e.counts(i)["deferred"]) for i in range(e.moe_layers - 1)) > 0
    assert sum(e.counts(e.moe_layers - 1)["deferred"]) == 0, "the last MoE layer defers nothing"


def test_hot_experts_from_the_config_run_on_the_device_stream(models):
    path, ref = models("qwen3_moe", "fp32")
    hot = {0: [1, 2], 2: [0, 5, 7]}
    model = tandem.load_model(path, cfg(hot_experts={"layers": hot}), progress=False)
    e = model.tandem_engine
    assert [e.hot(i) for i in range(3)] == [[1, 2], [], [0, 5, 7]]
    ids = tokens(8)
    ra, rb = record_routing(ref), record_routing(model)
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    clean = clean_tokens(ra, rb, *ids.shape)
    assert max_rel(b, a, clean) <= LOGIT_BOUND["fp32"]
    for i in range(3):
        c = e.counts(i)
        routed = torch.bincount(rb[i].flatten(), minlength=8).tolist()
        for x in range(8):
            where = "hot" if x in hot.get(i, []) else "cold"
            other = "cold" if where == "hot" else "hot"
            assert c[where][x] == routed[x] and c[other][x] == 0, f"layer {i} expert {x}: {c}"
        assert c["tokens"] == ids.numel()


def test_dynamic_hot_experts_move_to_the_routed_ones_and_keep_the_logits(models):
    """gpu.hot_experts.dynamic on the host stream: the hot set of each layer (2 of 8, starting
    uniform) is re-chosen every 2 forward steps from the routing seen; after several steps
    each layer's hot experts are among its most-routed ones, and every step's logits still
    match transformers (the hot copies are the CPU packs' own weights)."""
    path, ref = models("qwen3_moe", "fp32")
    conf = cfg(hot_experts={"count": 2, "dynamic": True, "rebalance_steps": 2, "hysteresis": 0.0})
    model = tandem.load_model(path, conf, progress=False)
    e = model.tandem_engine
    assert [e.hot(i) for i in range(e.moe_layers)] == [[0, 4]] * e.moe_layers
    ids = tokens(12)
    ra, rb = record_routing(ref), record_routing(model)
    for step in range(5):  # the same input each step; rebalances at the start of steps 2 and 4
        ra.clear(), rb.clear()
        with torch.no_grad():
            a, b = ref(ids).logits, model(ids).logits
        assert max_rel(b, a, clean_tokens(ra, rb, *ids.shape)) <= LOGIT_BOUND["fp32"], f"step {step}"
    assert e.rebalances >= 1 and e.hot_moves >= 1
    for i in range(e.moe_layers):
        routed = torch.bincount(rb[i].flatten(), minlength=8)
        top = set(torch.argsort(routed, descending=True, stable=True)[:2].tolist())
        ties = {x for x in range(8) if routed[x] >= routed[sorted(top, key=lambda x: routed[x])[0]]}
        assert set(e.hot(i)) <= ties, f"layer {i}: hot {e.hot(i)}, routed {routed.tolist()}"


def test_hot_count_auto(models, monkeypatch):
    """gpu.hot_experts: auto. On the host stream there is no device memory to fill: no hot
    experts. On CUDA the loader's budget is the free memory less everything else the model
    puts there (parameters and buffers outside the routed experts, in the load dtype) and
    less the reserve for the KV cache (checked here with a stand-in for torch's query)."""
    import types

    from tandem import loader as tl

    path, _ = models("qwen3_moe", "fp32")
    model = tandem.load_model(path, cfg(hot_experts="auto"), progress=False)
    e = model.tandem_engine
    assert e.hot_budget == 0 and all(e.hot(i) == [] for i in range(e.moe_layers))
    base = nn.Sequential(nn.Linear(10, 20), nn.LayerNorm(20))     # 10*20+20 + 20+20 = 260 values
    experts = nn.Linear(100, 100)                                 # not counted
    base.add_module("experts", experts)
    blocks = [types.SimpleNamespace(block=types.SimpleNamespace(experts=experts))]
    gib = 2 ** 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 40 * gib))
    cj = {"gpu": {"hot_experts": {"count": "auto"}}}
    assert tl._auto_hot_budget(cj, base, blocks, torch.bfloat16, torch.device("cuda", 0)) == 10 * gib - 260 * 2 - 4 * gib
    assert tl._auto_hot_budget(cj, base, blocks, torch.float32, torch.device("cuda", 0)) == 10 * gib - 260 * 4 - 4 * gib
    assert tl._auto_hot_budget(cj, base, blocks, torch.bfloat16, torch.device("cpu")) is None
    assert tl._auto_hot_budget({"gpu": {"hot_experts": {"count": 4}}}, base, blocks, torch.bfloat16,
                               torch.device("cuda", 0)) is None
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 * gib, 16 * gib))  # reserve 2 GiB > free
    assert tl._auto_hot_budget(cj, base, blocks, torch.bfloat16, torch.device("cuda", 0)) == 0


def test_hot_count_policy(models):
    path, _ = models("deepseek_v3", "fp32")
    model = tandem.load_model(path, cfg(hot_experts={"count": 4}), progress=False)
    e = model.tandem_engine
    assert e.layers == [1, 2] and all(len(e.hot(i)) == 4 for i in range(2))


def test_offload_an_existing_model(models):
    path, ref = models("mixtral", "fp32")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = tandem.offload(model, cfg(), progress=False)
    assert model.tandem_engine is engine and engine.moe_layers == 3
    assert not any(".mlp.experts." in n for n, _ in model.named_parameters())
    ids = tokens(9)
    ra, rb = record_routing(ref), record_routing(model)
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    assert max_rel(b, a, clean_tokens(ra, rb, *ids.shape)) <= LOGIT_BOUND["fp32"]
    with pytest.raises(ValueError, match="already offloaded"):
        tandem.offload(model, cfg())
    model.to(torch.bfloat16)  # the rest of the model follows .to(); the experts stay in tandem
    with torch.no_grad():
        assert model(ids).logits.dtype == torch.bfloat16


class V4Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(2))
        for layer in self.model.layers:
            layer.mlp = V4Block()

    def forward(self, x):
        for layer in self.model.layers:
            x = x + layer.mlp(x)[0]
        return x


def test_offload_v4_per_expert_layout():
    torch.manual_seed(11)
    ref = V4Model()
    import copy

    model = copy.deepcopy(ref)
    tandem.offload(model, cfg(), progress=False)
    assert isinstance(model.model.layers[0].mlp.experts, tandem.TandemExperts)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        a, b = ref(x), model(x)
        _, logits = model.model.layers[0].mlp(x)
    assert logits.shape == (10, 8), "the v4 block still returns router logits"
    assert max_rel(b, a) <= LAYER_BOUND["bf16"]


def test_gradients_refused_with_a_clear_error(models):
    path, _ = models("qwen3_moe", "fp32")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tandem.offload(model, cfg(), progress=False)
    with pytest.raises(RuntimeError, match="torch.no_grad"):
        model(tokens(1))


# ---- bad input ---------------------------------------------------------------------------

def rewrite(src, dst, drop=(), add=None, reshape=None):
    """Copies checkpoint dir src to dst with tensors dropped / added / replaced."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(os.path.join(dst, "model.safetensors"))
    for k in drop:
        del sd[k]
    sd.update(add or {})
    for k, shape in (reshape or {}).items():
        sd[k] = torch.zeros(shape, dtype=sd[k].dtype)
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_missing_extra_and_misshapen_keys_are_named(models, tmp_path):
    path, _ = models("qwen3_moe", "fp32")
    key = "model.layers.1.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=f"no tensor '{key}'"):
        tandem.load_model(rewrite(path, tmp_path / "a", drop=[key]), cfg(), progress=False)
    expert = "model.layers.2.mlp.experts.5.up_proj.weight"
    with pytest.raises(ValueError, match=f"has no tensor {expert}"):
        tandem.load_model(rewrite(path, tmp_path / "b", drop=[expert]), cfg(), progress=False)
    with pytest.raises(ValueError, match="model.layers.0.mlp.extra_thing"):
        tandem.load_model(rewrite(path, tmp_path / "c", add={"model.layers.0.mlp.extra_thing": torch.zeros(3)}), cfg(),
                          progress=False)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \[65\], the model needs \[64\]"):
        tandem.load_model(rewrite(path, tmp_path / "d", reshape={"model.norm.weight": (65,)}), cfg(), progress=False)
    with pytest.raises(ValueError, match=r"experts.0.down_proj.weight has shape \[64, 63\]"):
        tandem.load_model(rewrite(path, tmp_path / "e", reshape={"model.layers.0.mlp.experts.0.down_proj.weight": (64, 63)}),
                          cfg(), progress=False)


def test_unsupported_model_and_bad_config(models, tmp_path):
    path, _ = models("qwen3_moe", "fp32")
    import shutil

    shutil.copytree(path, tmp_path / "m")
    c = json.loads((tmp_path / "m" / "config.json").read_text())
    c["model_type"] = "llama"
    (tmp_path / "m" / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        tandem.load_model(tmp_path / "m", cfg(), progress=False)
    with pytest.raises(ValueError, match="no config.json"):
        tandem.load_model(tmp_path, cfg(), progress=False)
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ncpu:\n  format: fp8\n")
    with pytest.raises(ValueError, match=r"bad.yaml:3:\d+: cpu.format: 'fp8'"):
        tandem.load_model(path, bad, progress=False)
    with pytest.raises(ValueError, match="gpu.hot_experts.layers: layer 7 is not a MoE layer"):
        tandem.load_model(path, cfg(hot_experts={"layers": {7: [1]}}), progress=False)
    with pytest.raises(ValueError, match="no checkpoint given"):
        tandem.load_model(None, cfg(), progress=False)


def test_bad_tensors_at_the_experts_boundary(models):
    path, _ = models("qwen3_moe", "fp32")
    model = tandem.load_model(path, cfg(), progress=False)
    ex = moe_experts(model)[0]
    x, idx, w = torch.randn(4, 64), torch.randint(0, 8, (4, 3)), torch.rand(4, 3)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"hidden_states has shape \(4, 32\)"):
            ex(torch.randn(4, 32), idx, w)
        with pytest.raises(ValueError, match="top_k_weights has shape"):
            ex(x, idx, w[:, :2])
        with pytest.raises(ValueError, match="must be an integer tensor"):
            ex(x, idx.float(), w)
        # (the old pattern "outside.*9" matched only the source line number, routing.cpp:59)
        with pytest.raises(ValueError, match=r"ids\[0, 0\] = 9 is outside \[-1, 8\)"):
            ex(x, torch.full((4, 3), 9), w)
        out = ex(x[:, :].t().contiguous().t(), idx, w)  # non-contiguous input is copied, not misread
        assert torch.allclose(out, ex(x.contiguous(), idx, w))
        assert ex(x[:0], idx[:0], w[:0]).shape == (0, 64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_path_matches_transformers(models):
    path, ref = models("qwen3_moe", "bf16")
    model = tandem.load_model(path, {"version": 1, "gpu": {"device": "auto", "hot_experts": {"count": 4}}},
                              progress=False)
    assert model.device.type == "cuda" and model.tandem_engine.is_cuda
    ids = tokens(10)
    ra, rb = record_routing(ref), record_routing(model)
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids.cuda()).logits.cpu()
    assert max_rel(b, a, clean_tokens(ra, [r.cpu() for r in rb], *ids.shape)) <= LOGIT_BOUND["bf16"]
    compared = greedy_agrees(ref.cuda(), model, tokens(5, 1, 8).cuda(), 32, 2 * LOGIT_BOUND["bf16"])
    print(f"cuda greedy: {compared} of 32 steps compared")


def test_accelerate_prepare_leaves_the_experts_in_place(models):
    from accelerate import Accelerator

    path, ref = models("qwen3_moe", "fp32")
    model = tandem.load_model(path, cfg(), progress=False)
    engine = model.tandem_engine
    prepared = Accelerator(cpu=True).prepare(model)
    assert prepared.model.layers[0].mlp.experts.engine is engine
    ids = tokens(12)
    ra, rb = record_routing(ref), record_routing(prepared)
    with torch.no_grad():
        a, b = ref(ids).logits, prepared(ids).logits
    assert max_rel(b, a, clean_tokens(ra, rb, *ids.shape)) <= LOGIT_BOUND["fp32"]


ISA_LEVELS = ["scalar", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx"]


def levels_here() -> list[str]:
    return ISA_LEVELS[:ISA_LEVELS.index(tandem.hardware_isa()) + 1]


@pytest.mark.parametrize("train", [False, True])
def test_model_runs_the_kernel_level_it_is_given(models, monkeypatch, train):
    """One rule for every kernel choice: config cpu.isa, lowered by TANDEM_ISA, capped by the
    hardware. A model (inference engine or training layers) forced to each level this CPU
    has reports it and computes within the BF16 bound at it; TANDEM_ISA lowers an auto
    config; a level above the hardware is refused naming cpu.isa."""
    path, ref = models("qwen3_moe", "fp32")
    ids = tokens(4, 1, 24)
    ra = record_routing(ref)
    with torch.no_grad():
        want = ref(ids).logits
    monkeypatch.delenv("TANDEM_ISA", raising=False)
    for level in levels_here():
        model = tandem.load_model(path, dict(cfg(), cpu={"isa": level, "virtual_subpools": 2}), train=train,
                                  progress=False)
        assert model.tandem_engine.isa == level
        assert f"isa={level}" in repr(model.model.layers[0].mlp.experts)
        rb = record_routing(model)
        with torch.no_grad():
            got = model(ids).logits
        clean = clean_tokens(ra, rb, *ids.shape)
        assert clean.float().mean() >= 0.25, level
        assert max_rel(got, want, clean) <= LOGIT_BOUND["fp32"], level
    monkeypatch.setenv("TANDEM_ISA", levels_here()[-2] if len(levels_here()) > 1 else "scalar")
    model = tandem.load_model(path, cfg(), train=train, progress=False)
    assert model.tandem_engine.isa == os.environ["TANDEM_ISA"]
    if tandem.hardware_isa() != "amx":
        above = ISA_LEVELS[ISA_LEVELS.index(tandem.hardware_isa()) + 1]
        monkeypatch.delenv("TANDEM_ISA")
        with pytest.raises(ValueError, match=f"cpu.isa={above} asks for more than this CPU provides"):
            tandem.load_model(path, dict(cfg(), cpu={"isa": above}), train=train, progress=False)
