"""MoE routers on tandem's kernels (tandem.router): which routers are replaced, and that a
replaced one computes what the module does.

The logits are a bf16 linear on tandem's kernels (fp32 sums rounded once, as torch's bf16
linear; only the order of the sums differs); the softmax, top k and division by their sum
are then checked exactly against an fp64 reference taken from the router's own logits.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_models import VOCAB, checkpoint_cache

import tandem
from tandem.router import TandemRouter, replace_routers

E, H, K = 16, 64, 4


def cfg(dense: str | None = None) -> dict:
    c = {"virtual_subpools": 2}
    if dense is not None:
        c["dense_format"] = dense
    return {"version": 1, "cpu": c, "gpu": {"device": "none"}}


@pytest.fixture(scope="module")
def engine():
    from tandem.engine import make_engine

    return make_engine({"version": 1, "cpu": {"virtual_subpools": 2}}, (4, 32, 16), [0])


class Block(nn.Module):
    def __init__(self, gate: nn.Module):
        super().__init__()
        self.gate = gate
        self.experts = nn.Identity()


def hf_router(kind: str, norm: bool = True) -> nn.Module:
    """A transformers router module with random bf16 weights (E experts, top K)."""
    from transformers import DeepseekV3Config, GptOssConfig, MixtralConfig, OlmoeConfig, Qwen3MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    common = dict(hidden_size=H, num_experts_per_tok=K)
    if kind == "qwen3_moe":
        r = Qwen3MoeTopKRouter(Qwen3MoeConfig(num_experts=E, norm_topk_prob=norm, **common))
    elif kind == "olmoe":
        r = OlmoeTopKRouter(OlmoeConfig(num_experts=E, norm_topk_prob=norm, **common))
    elif kind == "mixtral":
        r = MixtralTopKRouter(MixtralConfig(num_local_experts=E, **common))
    elif kind == "gpt_oss":
        r = GptOssTopKRouter(GptOssConfig(num_local_experts=E, **common))
    elif kind == "deepseek_v3":
        r = DeepseekV3TopkRouter(DeepseekV3Config(n_routed_experts=E, n_group=1, topk_group=1, **common))
    else:
        raise ValueError(kind)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in r.parameters():
            p.normal_(0, 0.3)
    return r.to(torch.bfloat16)


class HotRouter(nn.Module):
    """The softmax-then-top-k form at temperature 1/2: must fail the probe."""

    def __init__(self):
        super().__init__()
        self.top_k = K
        self.weight = nn.Parameter(torch.randn(E, H).bfloat16())

    def forward(self, x):
        logits = nn.functional.linear(x.reshape(-1, H), self.weight)
        p = torch.softmax(2 * logits.float(), dim=-1)
        v, i = torch.topk(p, self.top_k, dim=-1)
        return logits, (v / v.sum(-1, keepdim=True)).to(logits.dtype), i


def on_random_rows(router: nn.Module, tr: nn.Module, seed: int, cases):
    """For each (rows, magnitude) in cases: rows, random bf16 inputs of that magnitude, and
    what the module and the TandemRouter return on them."""
    g = torch.Generator().manual_seed(seed)
    for rows, mag in cases:
        x = (torch.randn(rows, H, generator=g) * mag).bfloat16()
        with torch.no_grad():
            yield rows, x, router(x), tr(x)


def reference(logits: torch.Tensor, k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts torch.topk picks from the fp32 softmax of `logits` (as transformers' router;
    equal probabilities resolved by its algorithm), and their fp64 scores."""
    order = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1).indices
    v = torch.gather(torch.softmax(logits.double(), dim=-1), 1, order)
    return (v / v.sum(-1, keepdim=True) if renorm else v), order


@pytest.mark.parametrize("kind,norm", [("qwen3_moe", True), ("qwen3_moe", False), ("olmoe", False), ("mixtral", True)])
def test_router_computes_what_the_module_does(engine, kind, norm):
    """Replaced, and on random inputs of several magnitudes and row counts: logits within
    one bf16 step of torch's (the fp32 sums' order), the experts torch.topk picks from the
    softmax of those logits, their scores within one rounding of their dtype of the fp64
    reference, and the same experts as the module wherever its k-th and (k+1)-th logits are
    further apart than the logits' error."""
    router = hf_router(kind, norm)
    block = Block(router)
    assert replace_routers(block, engine, [block]) == ["gate"]
    tr = block.gate
    assert isinstance(tr, TandemRouter) and tr.inner is router and tr.renorm == norm
    compared = clean = 0
    for rows, _, (wl, ws, wi), (gl, gs, gi) in on_random_rows(router, tr, 11, ((1, 1.0), (7, 0.1), (300, 1.0),
                                                                                 (64, 4.0))):
        assert gl.dtype == wl.dtype and gs.dtype == ws.dtype and gi.dtype == torch.int64
        assert gl.shape == wl.shape and gs.shape == ws.shape == gi.shape == (rows, K)
        step = wl.float().abs() * 2.0 ** -7 + 1e-30  # one bf16 step of each logit
        assert ((gl.float() - wl.float()).abs() <= step).all()
        rv, ri = reference(gl, K, norm)
        assert torch.equal(gi, ri)
        tol = 2.0 ** -8 if gs.dtype == torch.bfloat16 else 2.0 ** -20  # the score's rounding, fp32 softmax error
        assert ((gs.double() - rv).abs() <= rv * tol * 2 + 1e-12).all()
        srt = wl.float().sort(-1, descending=True).values
        far = (srt[:, K - 1] - srt[:, K]) > 2 * step.max(-1).values
        compared += rows
        clean += int(far.sum())
        assert torch.equal(gi[far].sort(-1).values, wi[far].sort(-1).values)
    assert clean >= 0.8 * compared  # the experts comparison covered most rows


def deepseek_v2_router(method: str, scale: float) -> nn.Module:
    """transformers' DeepSeek-V2 router (fp32 logits of its bf16 weight, softmax, greedy or
    group-limited top k with torch.topk(sorted=False), scaled), random bf16 weights."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    r = DeepseekV2TopkRouter(DeepseekV2Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K,
                                              topk_method=method, n_group=4, topk_group=2,
                                              routed_scaling_factor=scale))
    torch.manual_seed(6)
    with torch.no_grad():
        r.weight.normal_(0, 0.3)
    return r.to(torch.bfloat16)


@pytest.mark.parametrize("method,scale", [("greedy", 1.0), ("greedy", 16.0), ("group_limited_greedy", 2.5)])
def test_deepseek_v2_router_computes_what_the_module_does(engine, method, scale):
    """DeepSeek-V2's router replaced: fp32 logits within the fp32 sums' error of the module's
    (|error| <= H * 2^-24 * sum |x w|, the summation order's), and from those logits the
    experts of the fp64 reference (groups: only the 2 of 4 groups with the most probable
    expert compete), scores = probability * scale within the fp32 softmax's error; where
    the module's k-th and (k+1)-th probabilities are further apart than that, the same
    experts in the same order as the module's (torch.topk(sorted=False) keeps
    std::nth_element's order), with scores as close as the two logits allow."""
    router = deepseek_v2_router(method, scale)
    block = Block(router)
    assert replace_routers(block, engine, [block]) == ["gate"]
    tr = block.gate
    assert isinstance(tr, TandemRouter) and tr.logits_dtype == torch.float32 and not tr.sorted
    assert (tr.groups, tr.top_groups) == ((4, 2) if method != "greedy" else (1, 1)) and tr.scale == scale
    compared = same = 0
    for rows, x, (wl, ws, wi), (gl, gs, gi) in on_random_rows(router, tr, 12, ((1, 1.0), (9, 0.1), (200, 1.0),
                                                                                (64, 4.0))):
        assert gl.dtype == wl.dtype == torch.float32 and gs.dtype == ws.dtype == torch.float32
        bound = H * 2.0 ** -24 * (x.double().abs() @ router.weight.double().abs().T) + 1e-30
        assert ((gl.double() - wl.double()).abs() <= bound).all()
        p = torch.softmax(gl.double(), -1)
        if method != "greedy":
            best = p.view(rows, 4, E // 4).amax(-1)
            keep = torch.zeros(rows, 4, dtype=torch.bool).scatter(1, best.topk(2, -1).indices, True)
            p = p.masked_fill(~keep.repeat_interleave(E // 4, 1), 0.0)
        top = p.topk(K + 1, -1)
        assert torch.equal(gi.sort(-1).values, top.indices[:, :K].sort(-1).values)
        want = torch.gather(p, 1, gi) * scale
        assert ((gs.double() - want).abs() <= want * 2.0 ** -20 + 1e-12).all()
        far = (top.values[:, K - 1] - top.values[:, K]) > top.values[:, K - 1] * 2.0 ** -16
        compared += rows
        same += int(far.sum())
        assert torch.equal(gi[far], wi[far])
        # a probability moves by the largest logit difference, twice, and by the rounding of
        # its exponent (logit - max, relative 2^-24 each side) and of exp, sum and divide
        dl = (gl.double() - wl.double()).abs().amax(-1, keepdim=True)
        t = gl.double().amax(-1, keepdim=True) - torch.gather(gl.double(), 1, gi)
        assert ((gs.double() - ws.double()).abs() <= ws.double() * (2 * dl + (t + 8) * 2.0 ** -23))[far].all()
    assert same >= 0.8 * compared


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "deepseek_v2"])
def test_equal_probabilities_pick_the_experts_torch_picks(engine, kind):
    """Experts with the same weight row tie on every token: the router keeps the one the
    module keeps (torch.topk's algorithm), on inputs whose logits are exact (one or two
    power-of-two features), so both sides see the same values."""
    from tandem.router import _probe

    router = deepseek_v2_router("group_limited_greedy", 2.5) if kind == "deepseek_v2" else hf_router(kind)
    with torch.no_grad():
        router.weight.copy_(router.weight[torch.arange(E) // 3 * 3])  # experts 3i, 3i+1, 3i+2 alike
    block = Block(router)
    assert replace_routers(block, engine, [block]) == ["gate"]
    x = _probe(H, 200, seed=7)
    with torch.no_grad():
        wl, ws, wi = router(x)
        gl, gs, gi = block.gate(x)
    assert torch.equal(gl, wl) and torch.equal(gi, wi)
    tol = 2.0 ** -7 if gs.dtype == torch.bfloat16 else 2.0 ** -18
    assert ((gs.float() - ws.float()).abs() <= ws.float().abs() * tol).all()


@pytest.mark.parametrize("kind", ["gpt_oss", "deepseek_v3", "hot"])
def test_routers_of_other_forms_stay_in_torch(engine, kind):
    """A bias or correction buffer (gpt-oss, DeepSeek) or other math (a temperature) is not
    this form: the router is left as it is."""
    router = HotRouter() if kind == "hot" else hf_router(kind)
    block = Block(router)
    assert replace_routers(block, engine, [block]) == []
    assert block.gate is router


def test_other_inputs_go_to_the_module(engine):
    """An input that needs a gradient, or fp32: the module's own forward (which refuses fp32
    against its bf16 weight); the state_dict keys are the module's."""
    router = hf_router("qwen3_moe")
    block = Block(router)
    replace_routers(block, engine, [block])
    tr = block.gate
    xg = torch.randn(3, H).bfloat16().requires_grad_()
    got = tr(xg)
    assert got[1].requires_grad
    for a, b in zip(got, router(xg)):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="same dtype"):
        tr(torch.randn(3, H))
    assert set(block.state_dict()) == {"gate.weight"}
    assert replace_routers(block, engine, [block]) == []  # already replaced


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, "router-")


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_load_model_replaces_the_routers_it_can(ckpt, kind):
    """CPU inference: every softmax-then-top-k router on tandem's kernels (DeepSeek's grouped
    sigmoid stays in torch); cpu.dense_format torch leaves them all. The model's logits
    against the torch-router model: every token whose experts are the same in both (the
    routers' logits differ by the fp32 sums' order) within 2^-6 of the largest logit, as
    the dense layers' test bounds them, and most tokens compared."""
    from hf_models import clean_tokens, record_routing

    path = ckpt(kind, "bf16")
    model = tandem.load_model(path, cfg(), progress=False)
    blocks = [m for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module)]
    routers = {n for n, m in model.named_modules() if isinstance(m, TandemRouter)}
    assert set(model.tandem_routers) == routers
    assert len(routers) == (0 if kind == "deepseek_v3" else len(blocks))
    plain = tandem.load_model(path, cfg(), progress=False)
    for name in routers:  # the same model with the routers put back
        parent, _, attr = name.rpartition(".")
        setattr(plain.get_submodule(parent), attr, model.get_submodule(name).inner)
    x = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    ra, rb = record_routing(model), record_routing(plain)
    with torch.no_grad():
        a, b = model(x).logits.double(), plain(x).logits.double()
    ok = clean_tokens(ra, rb, 2, 40)
    assert ok.float().mean() >= 0.8
    assert ((a - b).abs()[ok].max() / b.abs().max()).item() <= 2 ** -6
    torch_routers = tandem.load_model(path, cfg("torch"), progress=False)
    assert not any(isinstance(m, TandemRouter) for m in torch_routers.modules())


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "deepseek_v2"])
def test_router_logits_are_recorded_from_tandems_routers(ckpt, kind):
    """output_router_logits: transformers records the outputs of the modules of its router
    class; tandem's routers are of that class too (before, nothing was recorded and the
    auxiliary loss failed with an IndexError). Against the same model with the module
    routers put back: as many router logits, of the same shapes and dtype, within 2^-6 of
    the largest (the fp32 sums' order, as the test above bounds the logits), and the same
    auxiliary loss within 1%."""
    path = ckpt(kind, "bf16")
    model = tandem.load_model(path, cfg(), progress=False)
    routers = {n: m for n, m in model.named_modules() if isinstance(m, TandemRouter)}
    assert routers and all(isinstance(m, type(m.inner)) for m in routers.values())
    assert all(m.num_experts == m.inner.num_experts for m in routers.values())  # the router's own attributes
    plain = tandem.load_model(path, cfg(), progress=False)
    for name, m in routers.items():
        parent, _, attr = name.rpartition(".")
        setattr(plain.get_submodule(parent), attr, m.inner)
    x = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = model(x, output_router_logits=True)
        ref = plain(x, output_router_logits=True)
    assert len(out.router_logits) == len(ref.router_logits) == len(routers)
    for a, b in zip(out.router_logits, ref.router_logits):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert ((a.double() - b.double()).abs().max() / b.double().abs().max()).item() <= 2 ** -6
    if ref.aux_loss is not None:
        assert out.aux_loss is not None
        assert abs(out.aux_loss.item() - ref.aux_loss.item()) <= 0.01 * abs(ref.aux_loss.item())
