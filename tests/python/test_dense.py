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
def test_bf16_layers_run_on_tandem_and_compute_what_torch_does(ckpt, kind, monkeypatch):
    """auto on a bf16 model: every CPU nn.Linear but the routers becomes a TandemLinear in
    bf16. Its products are exact in fp32 and summed in fp32, then rounded to bf16 once,
    as torch's bf16 linear does: only the order of the fp32 sums may differ, which moves
    an output by one bf16 step where it lands within ~2^-16 relative of a rounding
    boundary. Logits against the same model with cpu.dense_format torch: bound 2^-6 of
    the largest |logit| (a few such steps carried through 3 layers; measured: 0, the
    outputs were identical). The prompts' attention runs in SDPA in both (the pool's
    prefill attention, which only the first model would use, rounds differently:
    test_pool_attention.py checks it)."""
    from transformers import AutoModelForCausalLM

    from tandem import attention

    monkeypatch.setattr(attention, "PREFILL_MIN_QUERIES", 1 << 30)

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
    wq = layer.dequantized().double()
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


# ---- layers called on one input share a packed weight (TandemLinear.fused) -----------------

class SharedInput(nn.Module):
    """q/k/v called on one variable, o on another, w on two different ones."""

    def __init__(self, bias: bool):
        super().__init__()
        self.q = nn.Linear(192, 96, bias=bias)
        self.k = nn.Linear(192, 40, bias=bias)
        self.v = nn.Linear(192, 40, bias=bias)
        self.o = nn.Linear(96, 192, bias=bias)
        self.w = nn.Linear(192, 8, bias=bias)

    def forward(self, x):
        y = self.o(self.q(x))
        h = self.k(x) * self.v(x)
        return y, h, self.w(x) + self.w(y)


@pytest.mark.parametrize("fmt,bias", [("bf16", False), ("bf16", True), ("int8", True), ("int4", False)])
def test_fused_layers_give_the_bits_of_each_layer_alone(ckpt, fmt, bias):
    """Sibling layers that their module's forward calls on one variable (here q, k, v;
    read from the forward's source) share one packed weight; each output column is the same
    dot product as alone (same packed row, same quantized input), so every member's output
    has the bits of the layer packed alone, for fp32 and bf16 inputs of any shape. Layers
    called on another variable (o), or on several (w), stay alone."""
    from tandem.dense import replace_dense

    model = tandem.load_model(ckpt("qwen3_moe", "bf16"), cfg(), progress=False)
    engine = model.tandem_engine
    torch.manual_seed(5)
    mod = SharedInput(bias).to(torch.bfloat16)
    alone = {n: TandemLinear(engine, getattr(mod, n), fmt, name=n, group_size=32) for n in "qkv"}
    done = replace_dense(mod, engine, {"dense_format": fmt, "group_size": 32})
    assert done == {n: fmt for n in "qkvow"}
    assert [getattr(mod, n).fused_with for n in "qkvow"] == [3, 3, 3, 1, 1]
    packed = mod.q._packed
    assert mod.k._packed is packed and mod.v._packed is packed and mod.o._packed is not packed
    assert sum(getattr(mod, n).packed_bytes for n in "qkv") == packed.dense.bytes
    for shape, dtype in [((3, 192), torch.float32), ((2, 5, 192), torch.bfloat16), ((1, 1, 192), torch.bfloat16)]:
        x = torch.randn(shape).to(dtype)
        runs = packed.runs
        with torch.no_grad():
            got = {n: getattr(mod, n)(x) for n in "kqv"}  # any order: the first call runs, the others take theirs
            want = {n: alone[n](x) for n in "qkv"}
        assert packed.runs == runs + 1
        for n in "qkv":
            assert got[n].dtype == dtype and got[n].shape == want[n].shape
            assert torch.equal(got[n], want[n]), (n, shape, dtype)
    with torch.no_grad():
        y, h, g = mod(torch.randn(4, 192).bfloat16())
    assert y.shape == (4, 192) and h.shape == (4, 40) and g.shape == (4, 8)


def test_fused_layers_run_again_for_a_new_or_modified_input(ckpt):
    """A member takes the group's last output only for the same tensor, unmodified, and once
    per run: another tensor with equal values, an in-place change, or a member asking twice
    runs the kernels again (outputs stay correct)."""
    from tandem.dense import replace_dense

    model = tandem.load_model(ckpt("qwen3_moe", "bf16"), cfg(), progress=False)
    torch.manual_seed(6)
    mod = SharedInput(False).to(torch.bfloat16)
    ref = {n: getattr(mod, n) for n in "qkv"}
    replace_dense(mod, model.tandem_engine, {"dense_format": "bf16"})
    packed = mod.q._packed
    x = torch.randn(2, 192).bfloat16()
    with torch.no_grad():
        def check(n, inp):
            want = ref[n](inp).float()
            got = getattr(mod, n)(inp).float()
            assert ((got - want).abs() <= want.abs() * 2 ** -7 + 1e-6).all(), n
        r = packed.runs
        check("q", x)
        check("k", x.clone())        # equal values, another tensor: runs
        assert packed.runs == r + 2
        check("v", x.clone())
        assert packed.runs == r + 3
        y = x.clone()
        check("q", y)
        y.mul_(2)                    # modified in place after q ran on it
        check("k", y)
        assert packed.runs == r + 5
        check("k", y)                # k again on the same input: runs
        assert packed.runs == r + 6
        with torch.inference_mode():  # inference tensors (no version counter): identity alone
            z = torch.randn(2, 192).bfloat16()
            check("q", z)
            check("k", z)
            check("v", z)
        assert packed.runs == r + 7 and packed._last is None  # every member served: dropped


def test_models_fuse_their_projections(ckpt):
    """Qwen3-MoE: q/k/v share one packed weight; DeepSeek-V3: each attention's q_a and kv_a
    projections, the dense MLP's and the shared experts' gate and up; o, down, lm_head and
    the routers stay alone (torch's, for the routers)."""
    m = tandem.load_model(ckpt("qwen3_moe", "bf16"), cfg(), progress=False)
    att = m.model.layers[0].self_attn
    assert [getattr(att, n).fused_with for n in ("q_proj", "k_proj", "v_proj", "o_proj")] == [3, 3, 3, 1]
    assert m.lm_head.fused_with == 1
    d = tandem.load_model(ckpt("deepseek_v3", "bf16"), cfg(), progress=False)
    fused = {n for n, mod in d.named_modules() if isinstance(mod, TandemLinear) and mod.fused_with > 1}
    want = set()
    for i, layer in enumerate(d.model.layers):
        a = layer.self_attn
        first = "q_a_proj" if hasattr(a, "q_a_proj") else "q_proj"
        want |= {f"model.layers.{i}.self_attn.{first}", f"model.layers.{i}.self_attn.kv_a_proj_with_mqa"}
        mlp = layer.mlp.shared_experts if hasattr(layer.mlp, "shared_experts") else layer.mlp
        prefix = next(n for n, mod in d.named_modules() if mod is mlp)
        want |= {f"{prefix}.gate_proj", f"{prefix}.up_proj"}
    assert fused == want


def test_a_fused_member_with_a_bad_weight_is_named(ckpt):
    from tandem.dense import replace_dense

    model = tandem.load_model(ckpt("qwen3_moe", "bf16"), cfg(), progress=False)
    mod = SharedInput(False)
    with torch.no_grad():
        mod.v.weight[7, 3] = float("inf")
    with pytest.raises(ValueError, match=r"^v: weight element \(7, 3\) is inf: not finite"):
        replace_dense(mod, model.tandem_engine, {"dense_format": "bf16"})
