"""The CPU's other linear layers on tandem's kernels (tandem.dense, config cpu.dense_format).

Model level: which layers are replaced, and that the bf16 path computes what torch's bf16
linear computes. Layer level: int8 / int4 against the packed weights' own dequantized
values in fp64, with bounds from the activation quantization. Bad input: named errors.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_models import VOCAB, checkpoint_cache

import tandem
from tandem.dense import TandemLinear, TandemRMSNorm, dense_choice, replace_norms

def cfg(dense: str | None = None, **cpu) -> dict:
    c = {"virtual_subpools": 2, **cpu}
    if dense is not None:
        c["dense_format"] = dense
    return {"version": 1, "cpu": c, "gpu": {"device": "none"}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, "dense-")


def linear_names(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if type(m) is nn.Linear}


def routers(model: nn.Module) -> set[str]:
    """Linear layers that are direct children of a MoE block (a module with `experts`)."""
    out = set()
    for name, mod in model.named_modules():
        if isinstance(getattr(mod, "experts", None), nn.Module):
            out |= {f"{name}.{c}" for c, m in mod.named_children() if type(m) is nn.Linear}
    return out


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_bf16_layers_run_on_tandem_and_compute_what_torch_does(ckpt, kind):
    """auto on a bf16 model: every CPU nn.Linear but the routers becomes a TandemLinear in
    bf16. Its products are exact in fp32 and summed in fp32, then rounded to bf16 once,
    as torch's bf16 linear does: only the order of the fp32 sums may differ, which moves
    an output by one bf16 step where it lands within ~2^-16 relative of a rounding
    boundary. Logits against the same model with cpu.dense_format torch: bound 2^-6 of
    the largest |logit| (a few such steps carried through 3 layers; measured: 0, the
    outputs were identical)."""
    from transformers import AutoModelForCausalLM

    path = ckpt(kind, "bf16")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    # MLA's kv_b_proj stays torch's: one-token steps use its rows (tandem.attention.use_mla_absorption).
    want = {n for n in linear_names(ref) - routers(ref) if not n.endswith(".kv_b_proj")}
    model = tandem.load_model(path, cfg(), progress=False)
    assert set(model.tandem_dense) == want and set(model.tandem_dense.values()) == {"bf16"}
    for name in want:
        assert isinstance(model.get_submodule(name), TandemLinear), name
    for name in routers(ref):  # still torch's (the routers decide which experts run)
        assert type(model.get_submodule(name)) is nn.Linear, name
    norms = {n for n, m in ref.named_modules() if type(m).__name__.endswith("RMSNorm")}
    assert norms and set(model.tandem_norms) == norms  # every Llama-form RMSNorm fused
    plain = tandem.load_model(path, cfg("torch"), progress=False)
    assert plain.tandem_dense == {} and not any(isinstance(m, (TandemLinear, TandemRMSNorm)) for m in plain.modules())
    assert not hasattr(plain, "tandem_norms")
    for seed in (1, 2):
        with torch.no_grad():
            a, b = model(tokens(seed)).logits.double(), plain(tokens(seed)).logits.double()
        assert ((a - b).abs().max() / b.abs().max()).item() <= 2 ** -6


class GemmaLikeRMSNorm(nn.Module):
    """Another RMSNorm form (Gemma's: scaled by 1 + weight, in fp32): must fail the probe."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n).bfloat16())
        self.eps = 1e-6

    def forward(self, x):
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def test_fused_rmsnorm_computes_what_the_module_does_or_is_not_used():
    """replace_norms fuses a Llama-form RMSNorm (within one bf16 rounding of torch's on any
    input; another dtype or a gradient goes to the module itself) and leaves a norm of
    another form, a LayerNorm and fp32 norms alone."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    torch.manual_seed(3)
    llama = Qwen3MoeRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        llama.weight.copy_(torch.randn(64))
    model = nn.ModuleDict({"a": llama.bfloat16(), "b": GemmaLikeRMSNorm(64), "c": nn.LayerNorm(64).bfloat16(),
                           "d": Qwen3MoeRMSNorm(64)})  # d: fp32 weight
    assert replace_norms(model) == ["a"]
    assert isinstance(model["a"], TandemRMSNorm) and type(model["b"]) is GemmaLikeRMSNorm
    fused, ref = model["a"], model["a"].inner
    for scale in (1e-3, 1.0, 100.0):
        x = (torch.randn(3, 5, 64) * scale).bfloat16()
        with torch.no_grad():
            got, want = fused(x), ref(x)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2.0 ** -7).all()
    xf = torch.randn(2, 64)
    assert torch.equal(fused(xf), ref(xf))  # fp32 input: the module's own forward
    xg = torch.randn(2, 64).bfloat16().requires_grad_()
    assert fused(xg).requires_grad  # autograd goes through the module
    assert replace_norms(model) == []  # already fused: nothing more
    assert set(model.state_dict()) == {"a.weight", "b.weight", "c.weight", "c.bias", "d.weight"}  # keys unchanged
    model.to(torch.float32)  # .to() reaches the replaced module's weight too
    assert fused.inner.weight is fused.weight and fused.weight.dtype == torch.float32


def test_biases_and_the_shared_expert_gate(tmp_path):
    """Qwen2-MoE: q/k/v carry biases (added in fp32 before the output's rounding, as torch
    adds them), and its shared_expert_gate is an nn.Linear inside the MoE block, which
    stays torch's. Bound as in the test above."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    torch.manual_seed(4)
    c = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=128, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                       max_position_embeddings=256, initializer_range=0.08)
    ref = AutoModelForCausalLM.from_config(c).to(torch.bfloat16)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0, 0.5)
    ref.save_pretrained(tmp_path)
    model = tandem.load_model(tmp_path, cfg(), progress=False)
    assert "model.layers.0.self_attn.q_proj" in model.tandem_dense
    assert "model.layers.0.mlp.shared_expert.down_proj" in model.tandem_dense
    assert type(model.get_submodule("model.layers.0.mlp.shared_expert_gate")) is nn.Linear
    assert model.get_submodule("model.layers.0.self_attn.q_proj").bias is not None
    plain = tandem.load_model(tmp_path, cfg("torch"), progress=False)
    with torch.no_grad():
        a, b = model(tokens(1)).logits.double(), plain(tokens(1)).logits.double()
    assert ((a - b).abs().max() / b.abs().max()).item() <= 2 ** -6


def test_auto_leaves_fp32_weights_to_torch_and_explicit_formats_take_every_layer(ckpt):
    path = ckpt("qwen3_moe", "fp32")
    assert tandem.load_model(path, cfg(), progress=False).tandem_dense == {}
    model = tandem.load_model(path, cfg("int8"), progress=False)
    assert len(model.tandem_dense) == 13 and set(model.tandem_dense.values()) == {"int8"}
    with torch.no_grad():
        logits = model(tokens(1)).logits
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert dense_choice("auto", torch.float16) is None and dense_choice("bf16", torch.float16) == "bf16"


def test_training_keeps_torch_layers(ckpt):
    model = tandem.load_model(ckpt("qwen3_moe", "bf16"), cfg(), train=True, progress=False)
    assert not any(isinstance(m, TandemLinear) for m in model.modules())


@pytest.mark.parametrize("fmt,group,zero_point", [("int8", 128, False), ("int4", 32, False), ("int4", 64, True)])
def test_quantized_layer_matches_its_dequantized_weights(ckpt, fmt, group, zero_point):
    """x (rounded to bf16) is quantized per row to int8: each element moves by at most
    s/2, s = max|x_r| / 127, so |y - x . Wq^T| <= s/2 * sum_c |Wq[j, c]| (Wq: the packed
    weights, dequantized), plus fp32 sums (negligible at this k) and the output's bf16
    rounding (2^-8 relative) when x is bf16."""
    model = tandem.load_model(ckpt("qwen3_moe", "bf16"), cfg(), progress=False)
    engine = model.tandem_engine
    torch.manual_seed(3)
    lin = nn.Linear(192, 70, bias=True)
    layer = TandemLinear(engine, lin, fmt, name="probe", group_size=group, zero_point=zero_point)
    wq = torch.from_numpy(layer._dense.dequantized()).double()
    assert wq.shape == (70, 192) and layer.packed_bytes > 0
    x = torch.randn(3, 5, 192)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        with torch.no_grad():
            y = layer(xd)
        assert y.dtype == dtype and y.shape == (3, 5, 70)
        xb = xd.to(torch.bfloat16).double().reshape(-1, 192)
        exact = xb @ wq.T + lin.bias.double()
        s = xb.abs().amax(-1, keepdim=True) / 127
        bound = s / 2 * wq.abs().sum(-1) + (2 ** -8 if dtype == torch.bfloat16 else 1e-6) * exact.abs()
        assert ((y.double().reshape(-1, 70) - exact).abs() <= bound + 1e-6).all()
    # The packed weights are the source's within the format's step: int8 max|w_j| / 254
    # per row; int4 (its groups' range) / 30 (symmetric: max|w| / 14 over 2).
    w = lin.weight.double()
    err = (wq - w).abs().max().item()
    assert err <= (w.abs().max().item() / 254 if fmt == "int8" else w.abs().max().item() / 7)


def test_bad_input_is_named(ckpt, tmp_path):
    model = tandem.load_model(ckpt("qwen3_moe", "bf16"), cfg(), progress=False)
    engine = model.tandem_engine
    lin = nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        lin.weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"probe: weight element \(3, 5\) is nan: not finite"):
        TandemLinear(engine, lin, "bf16", name="probe")
    good = TandemLinear(engine, nn.Linear(64, 8), "bf16", name="probe")
    with pytest.raises(ValueError, match="probe: input has 63 features, the layer takes 64"):
        good(torch.zeros(2, 63))
    with pytest.raises(RuntimeError, match="inference only"):
        good(torch.zeros(2, 64, requires_grad=True))
    with torch.no_grad():  # no gradient wanted: fine
        assert good(torch.zeros(2, 64, requires_grad=True)).shape == (2, 8)
    with pytest.raises(ValueError, match="cpu.dense_format: 'fp8' is not one of"):
        tandem.load_model(ckpt("qwen3_moe", "bf16"), cfg("fp8"), progress=False)
    # A layer whose k no group divides is refused by name (DeepSeek's kv_b_proj, k = 16, was one
    # before it stayed a torch layer for MLA decode).
    odd = nn.Linear(48, 8)
    with pytest.raises(Exception, match=r"odd: k = 48 is not a multiple of the int4 group size 32"):
        TandemLinear(engine, odd, "int4", name="odd", group_size=32)
    m = tandem.load_model(ckpt("deepseek_v3", "bf16"), cfg("int4", group_size=32), progress=False)
    assert type(m.model.layers[0].self_attn.kv_b_proj) is nn.Linear
