"""tandem.dense.use_gated_mlps: gated MLPs (DeepSeek-V2's dense first layer and shared
experts) in one call, ``_C.gated_mlp_bf16``.

The path's output is checked against an fp64 reference of down(silu(gate x) * up x) on the
packed weights, within a bound derived from its roundings; against the module's own forward
(transformers' MLP over the same TandemLinears) it differs only where torch's exponential
and the kernel table's round differently. Calls it does not take (a gradient, another
dtype, a hook or a replaced layer) run the module's forward; a probe that disagrees
installs nothing.
"""
from __future__ import annotations

import pytest
import torch

from hf_models import checkpoint_cache

import tandem
from tandem import dense

CFG = {"version": 1, "cpu": {"virtual_subpools": 2}, "gpu": {"device": "none"}}
U = 2.0 ** -8  # a bf16 rounding's relative error bound (2^-9) doubled for first-order terms


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, "mlp-")


def mlps_of(model):
    return [m for m in model.modules() if "tandem_mlp" in m.__dict__]


def reference_and_bound(mlp, x):
    """fp64 down(silu(g) * u) of the packed weights, and the bound on |path - reference|:
    g, u rounded to bf16 after fp32 sums, silu (|silu'| <= 1.1) and the product rounded to
    bf16, the down product's fp32 sum and bf16 rounding."""
    wg, wu, wd = (m.dequantized().double() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    xd = x.double()
    k, n = wg.shape[1], wd.shape[1]
    g, u = xd @ wg.T, xd @ wu.T
    eg = U * g.abs() + k * 2.0 ** -24 * (xd.abs() @ wg.abs().T)
    eu = U * u.abs() + k * 2.0 ** -24 * (xd.abs() @ wu.abs().T)
    s = g * torch.sigmoid(g)
    h = s * u
    es = 1.1 * eg + U * s.abs()
    eh = u.abs() * es + (s.abs() + es) * eu + U * (h.abs() + u.abs() * es)
    y = h @ wd.T
    ey = eh @ wd.abs().T + U * y.abs() + n * 2.0 ** -24 * (h.abs() @ wd.abs().T)
    return y, 2 * ey


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_gated_mlp_matches_the_reference_and_the_module(ckpt, fmt):
    cpu = dict(CFG["cpu"], format=fmt, dense_format=fmt)
    if fmt == "int4":
        cpu["group_size"] = 32
    model = tandem.load_model(ckpt("deepseek_v2", "bf16"), dict(CFG, cpu=cpu), progress=False)
    names = model.tandem_mlps
    assert names == ["model.layers.0.mlp"] + [f"model.layers.{i}.mlp.shared_experts" for i in (1, 2)]
    g = torch.Generator().manual_seed(3)
    for mlp in mlps_of(model):
        fast = mlp.tandem_mlp
        for rows, scale in ((1, 1.0), (3, 0.05), (70, 1.0), (130, 6.0)):  # 70 / 130: more than one 64-row pass
            x = (torch.randn(rows, fast.hidden, generator=g) * scale).to(torch.bfloat16)
            with torch.no_grad():
                got = mlp(x)
                fast.enabled = False
                module = mlp(x)
                fast.enabled = True
            want, bound = reference_and_bound(mlp, x)
            assert got.dtype == torch.bfloat16 and got.shape == x.shape
            assert ((got.double() - want).abs() <= bound + 1e-30).all()
            # the module's own forward: the same roundings but for the exponential's last bit
            assert (got.double() - module.double()).norm() <= 2.0 ** -8 * module.double().norm()
    x = torch.zeros(0, 64, dtype=torch.bfloat16)
    assert mlps_of(model)[0](x).shape == (0, 64)


def test_calls_it_does_not_take_run_the_module(ckpt, monkeypatch):
    model = tandem.load_model(ckpt("deepseek_v2", "bf16"), CFG, progress=False)
    mlp = model.model.layers[1].mlp.shared_experts
    fast = mlp.tandem_mlp
    calls = []
    real = dense._GatedMlp.__call__
    monkeypatch.setattr(dense._GatedMlp, "__call__", lambda self, x: calls.append(1) or real(self, x))
    x = torch.randn(2, fast.hidden).to(torch.bfloat16)
    with torch.no_grad():
        mlp(x)
    assert calls == [1]
    calls.clear()
    seen = []
    h = mlp.up_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with torch.no_grad():
        mlp(x)
    h.remove()
    assert not calls and seen == [(2, fast.intermediate)]  # the hook saw the module's call
    with torch.no_grad():
        mlp(x.float())  # another dtype: the module (torch's fp32 over the TandemLinears)
    assert not calls
    down = mlp.down_proj
    mlp.down_proj = torch.nn.Linear(down.in_features, down.out_features, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        mlp(x)
    assert not calls
    mlp.down_proj = down
    xg = x.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="inference only"):  # the module's TandemLinear says so
        mlp(xg)
    assert not calls


def test_a_probe_that_disagrees_installs_nothing(ckpt, monkeypatch):
    real = dense._GatedMlp.__call__
    monkeypatch.setattr(dense._GatedMlp, "__call__", lambda self, x: real(self, x) * 1.05)
    model = tandem.load_model(ckpt("deepseek_v2", "bf16"), CFG, progress=False)
    assert model.tandem_mlps == [] and not mlps_of(model)
    assert model.tandem_decoder_steps == 0  # a layer's step needs its MLP's path


def test_other_activations_are_left_alone(ckpt):
    model = tandem.load_model(ckpt("deepseek_v2", "bf16"), CFG, progress=False)
    mlp = model.model.layers[0].mlp
    del mlp.__dict__["tandem_mlp"], mlp.__dict__["forward"], mlp.__dict__["tandem_module_forward"]
    mlp.act_fn = torch.nn.GELU()
    assert dense.use_gated_mlps(model) == []
