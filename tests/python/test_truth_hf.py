"""Nothing silently wrong at the transformers boundary (issue 16).

- load_model keeps the tensors transformers keeps in fp32 (``_keep_in_fp32_modules_strict``
  for bf16/fp16, ``_keep_in_fp32_modules`` for fp16): every non-expert tensor has the dtype
  and value ``from_pretrained`` gives it.
- offload / load_model accept an experts module only when it computes the kernels'
  silu(gate) * up experts: structure checks, and its own forward run once on a test input.
- The inference experts module refuses a CUDA call on another device or stream than the
  engine's, and keeps the temporaries it hands tandem alive until tandem ran.
"""
from __future__ import annotations

import types

import pytest
import torch
from hf_models import KINDS, V4Block, V4Expert, build, hf_config, moe_experts
from torch import nn

import tandem
from tandem import experts_check as tcheck
from tandem.dense import TandemLinear
from tandem import modules as tmodules

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cfg(**gpu) -> dict:
    return {"version": 1, "cpu": {"format": "bf16", "virtual_subpools": 2}, "gpu": {"device": "none", **gpu}}


@pytest.fixture(scope="module")
def fp32_dirs(tmp_path_factory):
    """kind -> an fp32 checkpoint directory (so loading in bf16 / fp16 really rounds)."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            out = tmp_path_factory.mktemp(f"truth-{kind}")
            build(kind, 3, torch.float32, out)
            cache[kind] = out
        return cache[kind]

    return get


def fresh(kind: str, dtype: torch.dtype = torch.float32, seed: int = 5) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config(kind)).to(dtype).eval()


# ---- 5. non-expert tensors: dtype and value as from_pretrained --------------------------

def non_expert_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    out.update(model.named_buffers())  # persistent and not (rotary inv_freq)
    # tandem.dense layers (bf16 weights on tandem's kernels): their packed weight, as it
    # multiplies (a bf16 pack holds the bf16 values exactly), in the source's dtype.
    for name, m in model.named_modules():
        if isinstance(m, TandemLinear):
            out[f"{name}.weight"] = m.dequantized().to(m.source_dtype)
    return {k: v for k, v in out.items() if ".mlp.experts." not in k}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_every_non_expert_tensor_matches_from_pretrained(fp32_dirs, kind, dtype):
    from transformers import AutoModelForCausalLM

    path = fp32_dirs(kind)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    model = tandem.load_model(path, cfg(), dtype=DTYPES[dtype], progress=False)
    # bf16: the linear layers run on tandem's kernels (cpu.dense_format auto), compared by
    # their packed weights; fp32 / fp16: torch's own.
    assert any(isinstance(m, TandemLinear) for m in model.modules()) == (dtype == "bf16")
    want, got = non_expert_tensors(ref), non_expert_tensors(model)
    assert sorted(got) == sorted(want)
    bad = [f"{k}: {got[k].dtype} vs transformers' {want[k].dtype}" for k in want if got[k].dtype != want[k].dtype]
    assert not bad, "dtypes differ: " + "; ".join(bad)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"values differ: {bad}"
    if kind == "deepseek_v3":  # the tensor this is about: fp32 at every dtype (strict list)
        bias = got["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert bias.dtype == torch.float32
        assert torch.equal(bias, ref.model.layers[1].mlp.gate.e_score_correction_bias)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_keep_in_fp32_rule_is_transformers_rule(dtype):
    """Both lists (gpt-oss has _keep_in_fp32_modules, DeepSeek-V3 _keep_in_fp32_modules_strict),
    every tensor name, every dtype: the same answer as transformers' dtype plan."""
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.core_model_loading import build_glob_alternation

    from tandem.loader import _keep_in_fp32

    with torch.device("meta"):
        gpt = GptOssForCausalLM(GptOssConfig(vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                             num_local_experts=4, num_experts_per_tok=2,
                                             layer_types=["full_attention"] * 2))
        ds = fresh_meta("deepseek_v3")
    assert gpt._keep_in_fp32_modules and ds._keep_in_fp32_modules_strict
    kept = 0
    for model in (gpt, ds):
        plan = model._get_dtype_plan(DTYPES[dtype])
        theirs = build_glob_alternation(list(plan))[0] if plan else None
        mine = _keep_in_fp32(model, DTYPES[dtype])
        names = list(model.state_dict())
        want = [n for n in names if theirs is not None and theirs.search(n)]
        assert [n for n in names if mine(n)] == want
        kept += len(want)
    if dtype != "fp32":
        assert kept, "the rule must keep something here, else this test cannot fail"


def fresh_meta(kind: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(hf_config(kind))


# ---- 6. experts that do not compute silu(gate) * up are refused -------------------------

def clamped_forward(self, hidden_states, top_k_index, top_k_weights):
    """A clamped SwiGLU (limit 7, as gpt-oss): the kind of variant the kernels do not compute."""
    out = torch.zeros_like(hidden_states)
    for t in range(hidden_states.shape[0]):
        for k in range(top_k_index.shape[1]):
            e = int(top_k_index[t, k])
            gate, up = nn.functional.linear(hidden_states[t], self.gate_up_proj[e]).chunk(2, dim=-1)
            h = self.act_fn(gate.clamp(max=7.0)) * up.clamp(-7.0, 7.0)
            out[t] += top_k_weights[t, k] * nn.functional.linear(h, self.down_proj[e])
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_stock_experts_pass_and_offload(kind):
    model = fresh(kind, torch.bfloat16)
    for i, ex in enumerate(moe_experts(model)):
        tcheck.check_experts(ex, f"layer {i}")
    tandem.offload(model, cfg(), progress=False)
    assert all(isinstance(ex, tandem.TandemExperts) for ex in moe_experts(model))


@pytest.mark.parametrize("kind", KINDS)
def test_act_fn_other_than_silu_is_refused(kind):
    from transformers.activations import ACT2FN

    model = fresh(kind)
    moe_experts(model)[-1].act_fn = ACT2FN["gelu"]
    name = type(moe_experts(model)[0]).__name__
    with pytest.raises(ValueError, match=rf"{name} \(model layer 2\): its activation act_fn is GELUActivation"):
        tandem.offload(model, cfg(), progress=False)
    assert getattr(model, "tandem_engine", None) is None


def test_clamped_forward_in_a_subclass_is_refused_by_the_numeric_check():
    model = fresh("qwen3_moe")
    base = type(moe_experts(model)[0])
    clamped = type("ClampedExperts", (base,), {"forward": clamped_forward})
    for ex in moe_experts(model):
        ex.__class__ = clamped  # structure unchanged: act_fn silu, same tensors; only forward differs
    with pytest.raises(ValueError, match=r"ClampedExperts \(model layer 0\): its forward differs from silu\(gate\) "
                                         r"\* up experts \(max rel diff"):
        tandem.offload(model, cfg(), progress=False)


def test_clamped_forward_patched_on_one_instance_is_refused():
    """The numeric check runs once per kind of module: a forward patched on one layer's
    instance is another kind, checked on its own."""
    model = fresh("mixtral")
    ex = moe_experts(model)[2]
    ex.forward = types.MethodType(clamped_forward, ex)
    with pytest.raises(ValueError, match=r"MixtralExperts \(model layer 2\): its forward differs"):
        tandem.offload(model, cfg(), progress=False)


def test_unknown_instance_forward_is_refused():
    model = fresh("qwen3_moe")
    ex = moe_experts(model)[1]
    ex.forward = lambda x, i, w: torch.zeros_like(x)
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts \(model layer 1\): its forward was replaced"):
        tandem.offload(model, cfg(), progress=False)


def test_own_gating_is_refused():
    model = fresh("deepseek_v3")
    base = type(moe_experts(model)[0])

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=7.0)) * up.clamp(-7.0, 7.0)

    sub = type("SoftcapExperts", (base,), {"_apply_gate": _apply_gate})
    for ex in moe_experts(model):
        ex.__class__ = sub
    # Its eager forward (the stock one) ignores the gate that transformers' grouped backends
    # call: neither plain silu nor a clamped SwiGLU describes both.
    with pytest.raises(ValueError, match=r"SoftcapExperts \(model layer 1\): it gates with its own "
                                         r"SoftcapExperts._apply_gate, and its forward and gate match none"):
        tandem.offload(model, cfg(), progress=False)


def test_extra_tensors_are_refused():
    model = fresh("qwen3_moe")
    ex = moe_experts(model)[0]
    ex.down_proj_bias = nn.Parameter(torch.zeros(ex.num_experts, ex.hidden_dim))
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts \(model layer 0\): it has tensors tandem's kernels do not "
                                         r"use \(down_proj_bias\)"):
        tandem.offload(model, cfg(), progress=False)


def test_clamped_swiglu_experts_are_recognized_by_their_own_forward_and_gate():
    """DeepSeek-V4's experts (stock layout, act_fn silu, clamped at swiglu_limit) compute a
    clamped SwiGLU with alpha 1 and up + 0; MiniMax-M3's the gpt-oss form without biases
    (its swiglu_alpha, up + 1): the numeric check picks each from the candidates its settings
    give, and a limit the module does not apply is not what it reports."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Config, DeepseekV4Experts
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (MiniMaxM3VLExperts,
                                                                          MiniMaxM3VLTextConfig)

    torch.manual_seed(0)
    ex = DeepseekV4Experts(DeepseekV4Config(hidden_size=64, intermediate_size=32, n_routed_experts=4))
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.1)
        ex.down_proj.normal_(0, 0.1)
    math = tcheck.check_experts(ex, "layer 0")
    assert (math.activation, math.alpha, math.limit, math.up_offset, math.bias) == \
        ("clamped_swiglu", 1.0, float(ex.limit), 0.0, False)
    mm = MiniMaxM3VLExperts(MiniMaxM3VLTextConfig(hidden_size=64, intermediate_size=32, num_local_experts=4))
    with torch.no_grad():
        mm.gate_up_proj.normal_(0, 0.1)
        mm.down_proj.normal_(0, 0.1)
    math = tcheck.check_experts(mm, "layer 0")
    assert (math.activation, math.alpha, math.up_offset) == ("clamped_swiglu", float(mm.swiglu_alpha), 1.0)


class GeluV4Expert(V4Expert):
    def forward(self, x):
        return self.down_proj(nn.functional.gelu(self.gate_proj(x)) * self.up_proj(x))


class V4Model(nn.Module):
    def __init__(self, expert: type = V4Expert, bias: bool = False):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(nn.Module() for _ in range(2))
        for layer in self.model.layers:
            layer.mlp = V4Block()
            layer.mlp.experts = nn.ModuleList(expert(64, 64) for _ in range(8))
            if bias:
                for ex in layer.mlp.experts:
                    ex.up_proj.bias = nn.Parameter(torch.zeros(64))


def test_v4_per_expert_modules():
    torch.manual_seed(0)
    tandem.offload(V4Model(), cfg(), progress=False)  # stock: accepted
    with pytest.raises(ValueError, match=r"GeluV4Expert \(model layer 0\): its forward differs"):
        tandem.offload(V4Model(GeluV4Expert), cfg(), progress=False)
    with pytest.raises(ValueError, match=r"V4Expert \(model layer 0\): its projections have biases"):
        tandem.offload(V4Model(bias=True), cfg(), progress=False)
    from transformers.activations import ACT2FN

    m = V4Model()
    m.model.layers[1].mlp.experts[3].act_fn = ACT2FN["relu"]
    with pytest.raises(ValueError, match=r"V4Expert \(model layer 1\): its activation act_fn is ReLU"):
        tandem.offload(m, cfg(), progress=False)


def test_load_model_checks_the_experts_class(fp32_dirs, monkeypatch):
    """load_model has no expert weights in torch: the class and act_fn checks apply, and the
    class's own forward runs on random weights."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as q

    path = fp32_dirs("qwen3_moe")
    monkeypatch.setattr(q.Qwen3MoeExperts, "forward", clamped_forward)
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts \(model layer 0\): its forward differs"):
        tandem.load_model(path, cfg(), progress=False)
    monkeypatch.undo()
    from transformers.activations import GELUActivation

    init = q.Qwen3MoeExperts.__init__

    def gelu_init(self, config):  # hidden_act says silu, the class's act_fn is not
        init(self, config)
        self.act_fn = GELUActivation()

    monkeypatch.setattr(q.Qwen3MoeExperts, "__init__", gelu_init)
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts \(model layer 0\): its activation act_fn is GELU"):
        tandem.load_model(path, cfg(), progress=False)


def test_the_numeric_check_is_cheap(monkeypatch):
    """Once per kind of module (not per layer), on copies of _PROBE_EXPERTS experts only."""
    model = fresh("deepseek_v3")  # 2 MoE layers of 16 experts
    runs, copied = [], []
    real_numerics, real_probe = tcheck.check_experts_numerics, tcheck._probe_tensor
    monkeypatch.setattr(tcheck, "check_experts_numerics", lambda ex, where: (runs.append(where),
                                                                             real_numerics(ex, where))[1])
    monkeypatch.setattr(tcheck, "_probe_tensor", lambda t, rows, gen: copied.append(real_probe(t, rows, gen)) or
                        copied[-1])
    tandem.offload(model, cfg(), progress=False)
    assert runs == ["model layer 1"]
    assert [c.shape[0] for c in copied] == [tcheck._PROBE_EXPERTS] * 2


# ---- 8. device, stream and temporaries ---------------------------------------------------

def test_cuda_call_on_another_device_is_refused():
    """The check TandemExperts.forward makes on every CUDA call (no GPU needed for the logic)."""
    b = tmodules.CudaBinding(device=0)
    tmodules.check_cuda_call("w", b, torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"hidden_states is on cuda:1 but this model's tandem engine runs on cuda:0"):
        tmodules.check_cuda_call("w", b, torch.device("cuda", 1))


class FakeEngine:
    """Stands in for _C.Engine: records calls; forward fails as a partly enqueued layer might."""

    def __init__(self, is_cuda: bool = False, fail: bool = False):
        self.is_cuda, self.fail, self.calls = is_cuda, fail, []
        self.experts, self.hidden, self.inter = 4, 8, 8

    def forward(self, *args, synchronize):
        self.calls.append(("forward", synchronize))
        if self.fail:
            raise ValueError("enqueue failed half way")

    def synchronize(self):
        self.calls.append(("synchronize",))


def test_cuda_engine_not_from_make_engine_is_refused():
    with pytest.raises(ValueError, match="not made by tandem.engine.make_engine"):
        tandem.TandemExperts(FakeEngine(is_cuda=True), 0, 3)


def test_host_path_waits_for_the_stream_even_when_forward_fails():
    """The host stream reads x / ids / weights and writes out on its own thread: the call
    waits for it (synchronize=True), and when enqueueing fails half way it still waits before
    the temporaries made in forward (contiguous copies, int64 ids, fp32 weights) are freed."""
    x, ids, w = torch.randn(3, 8).t().contiguous().t(), torch.zeros(3, 2, dtype=torch.int32), torch.rand(3, 2)
    ok = FakeEngine()
    tandem.TandemExperts(ok, 0, 3)(x, ids, w)
    assert ok.calls == [("forward", True)]
    bad = FakeEngine(fail=True)
    with pytest.raises(ValueError, match="half way"):
        tandem.TandemExperts(bad, 0, 3)(x, ids, w)
    assert bad.calls == [("forward", True), ("synchronize",)]


def test_host_path_is_done_when_forward_returns(fp32_dirs):
    """With deferred experts (still running on the pool after a call returns), a call's
    inputs and temporaries can be overwritten and freed at once: the stream copied them into
    its own slots before the call returned."""
    path = fp32_dirs("qwen3_moe")
    ref = tandem.load_model(path, cfg(), progress=False)
    model = tandem.load_model(path, cfg(deferred_experts=1), progress=False)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(6, 64, generator=g) for _ in range(3)]
    ids = [torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(6)]).to(torch.int32) for _ in range(3)]
    ws = [torch.rand(6, 3, generator=g) for _ in range(3)]
    with torch.no_grad():
        got = []
        for ex, x, i, w in zip(moe_experts(model), xs, ids, ws):
            xx, ii, ww = x.clone(), i.clone(), w.clone()
            got.append(ex(xx, ii, ww).clone())
            xx.fill_(float("nan")), ii.fill_(7), ww.fill_(float("nan"))
            del xx, ii, ww
        # reference: each layer in full, then layer i's deferred part moves into layer i + 1
        full = [ex(x, i, w) for ex, x, i, w in zip(moe_experts(ref), xs, ids, ws)]
    total_got, total_want = sum(o.double() for o in got), sum(o.double() for o in full)
    assert torch.isfinite(total_got).all()
    assert torch.allclose(total_got, total_want, rtol=1e-4, atol=1e-4 * total_want.abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_calls_follow_torchs_current_stream(fp32_dirs):
    """Each call enqueues on torch's current stream at the time of the call, after the
    engine's earlier work: the same inputs give the same output on the default stream, on
    side streams (one the model was not loaded under, one it was), and back again."""
    path = fp32_dirs("qwen3_moe")
    model = tandem.load_model(path, {"version": 1, "gpu": {"device": "auto", "hot_experts": {"count": 2}}},
                              progress=False)
    ex = moe_experts(model)[0]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 64, generator=g).cuda()
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(4)]).cuda()
    w = torch.rand(4, 3, generator=g).cuda()
    with torch.no_grad():
        want = ex(x, ids, w).clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            outs = [ex(x, ids, w) for _ in range(3)]  # back to back on the side stream
        torch.cuda.current_stream().wait_stream(side)
        outs.append(ex(x, ids, w))
    for o in outs:
        assert torch.equal(o, want)
    side2 = torch.cuda.Stream()
    with torch.cuda.stream(side2):  # another model loaded (and first called) under a side stream
        m2 = tandem.load_model(path, {"version": 1, "gpu": {"device": "auto", "hot_experts": {"count": 2}}},
                               progress=False)
        with torch.no_grad():
            a = moe_experts(m2)[0](x, ids, w)
    torch.cuda.current_stream().wait_stream(side2)
    with torch.no_grad():
        assert torch.equal(a, moe_experts(m2)[0](x, ids, w))
        assert torch.equal(a, want)  # the same checkpoint, config and inputs: the same arithmetic
        if torch.cuda.device_count() > 1:
            with pytest.raises(ValueError, match="hidden_states is on cuda:1"):
                ex(x.to("cuda:1"), ids.to("cuda:1"), w.to("cuda:1"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("deferred", [0, 1])
def test_torch_cuda_graph_captures_a_decode_step_with_the_cpu_experts(fp32_dirs, deferred):
    """A whole decoder forward (router, hot experts on the GPU, CPU experts as host nodes)
    captured by torch.cuda.graph and replayed for many steps with new inputs written into the
    static input: every replay matches the eager forward of the same input, and replaying an
    input again gives the same bits. A token count the engine has not run before is refused
    inside the capture with an error saying what to do.

    Bound: captured and eager torch kernels may differ in reduction order (measured on an
    H200: up to 6e-5 on logits of magnitude ~1), and a last-bit change in x can flip its bf16
    rounding for the GPU's hot experts, a 2^-8 relative change of one input element; 1e-2 of
    the largest logit covers both. A stale or unordered buffer (the failure this test is for)
    gives another step's values: differences of the logits' own magnitude."""
    path = fp32_dirs("qwen3_moe")
    conf = {"version": 1, "gpu": {"device": "auto", "hot_experts": {"count": 2}, "deferred_experts": deferred}}
    model = tandem.load_model(path, conf, progress=False)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(11)
    static_ids = torch.randint(0, vocab, (1, 4), generator=g).cuda()
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm-up at the captured shape, as torch.cuda.graph expects
                model(static_ids, use_cache=False)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = model(static_ids, use_cache=False).logits
        for step in range(8):
            ids = torch.randint(0, vocab, (1, 4), generator=g).cuda()
            static_ids.copy_(ids)
            graph.replay()
            got = static_logits.clone()
            want = model(ids, use_cache=False).logits
            err = (got - want).abs().max().item()
            assert err <= 1e-2 * want.abs().max().item(), f"replay {step}: max |graph - eager| = {err}"
            graph.replay()
            assert torch.equal(static_logits, got), f"replay {step} again"
        new_shape = torch.randint(0, vocab, (1, 7), generator=g).cuda()  # (a pageable upload cannot be captured)
        with pytest.raises(Exception, match="run the same batch shape"):
            g2 = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g2):
                model(new_shape, use_cache=False)
    # the engine still works after the refused capture
    with torch.no_grad():
        ids = torch.randint(0, vocab, (1, 4), generator=g).cuda()
        assert torch.isfinite(model(ids, use_cache=False).logits).all()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_cuda_call_leaves_torchs_current_device_alone(fp32_dirs):
    path = fp32_dirs("qwen3_moe")
    model = tandem.load_model(path, {"version": 1, "gpu": {"device": "cuda:1"}}, progress=False)
    x = torch.randn(4, 64, device="cuda:1")
    ids, w = torch.randint(0, 8, (4, 3), device="cuda:1"), torch.rand(4, 3, device="cuda:1")
    torch.cuda.set_device(0)
    with torch.no_grad():
        moe_experts(model)[0](x, ids, w)
    assert torch.cuda.current_device() == 0
