"""tandem.decode_step: whole Qwen3-MoE, Mixtral and DeepSeek-V2 decoder layers' one-token
steps in C++.

The step rounds where the module path rounds, so a generation with it gives the same
logits, bit for bit, as the same model with every layer's step switched off (which runs
transformers' layer over tandem's modules), in every format; calls it does not take (a
batch of two, prefill, a hook on a part, a replaced part) run the module path; a layer
whose probe disagrees keeps its own forward; bad shapes are refused naming the layer.
"""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_models import VOCAB, checkpoint_cache
from hf_models import greedy_logits as decode  # logits of a 9-token prompt and n greedy steps

import tandem
from tandem import decode_step

CFG = {"version": 1, "cpu": {"virtual_subpools": 2}, "gpu": {"device": "none"}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, "dl-")


def steps_of(model):
    return [m.tandem_decoder_step for m in model.modules() if "tandem_decoder_step" in m.__dict__]


def set_enabled(model, on):
    for s in steps_of(model):
        s.enabled = on


@pytest.mark.parametrize("kind,fmt", [("qwen3_moe", "bf16"), ("qwen3_moe", "int8"), ("qwen3_moe", "int4"),
                                      ("mixtral", "bf16"), ("mixtral", "int4"), ("deepseek_v2", "bf16"),
                                      ("deepseek_v2", "int8"), ("deepseek_v2", "int4"), ("deepseek_v2_qlora", "bf16")])
def test_step_is_bit_identical_to_the_module_path(ckpt, kind, fmt):
    cpu = dict(CFG["cpu"], format=fmt, dense_format=fmt)
    if fmt == "int4":
        cpu["group_size"] = 32
    model = tandem.load_model(ckpt(kind, "bf16"), dict(CFG, cpu=cpu), progress=False)
    layers = [m for m in model.modules() if type(m).__name__ in decode_step.SUPPORTED]
    # (DeepSeek-V2: the dense first layer and the MoE layers with shared experts alike)
    assert model.tandem_decoder_steps == len(layers) == len(steps_of(model)) > 0
    model.model.tandem_model_step.enabled = False  # the layers' own calls here (test_model_step.py: all at once)
    calls = []
    for s in steps_of(model):
        real = s.step

        class Counting:  # counts the C++ calls (the path was really taken)
            name = real.name

            def __getattr__(self, attr, real=real):
                if attr in ("qkv", "qkv_mla"):
                    calls.append(1)
                return getattr(real, attr)

        s.step = Counting()
    for cache in (DynamicCache, tandem.kv_cache.GrowingCache):
        set_enabled(model, False)
        want = decode(model, cache)
        assert not calls
        set_enabled(model, True)
        got = decode(model, cache)
        assert len(calls) == 12 * len(layers)  # every one-token step of every layer, no prefill
        calls.clear()
        for a, b in zip(want, got):
            assert torch.equal(a, b)


def test_deepseek_v2_step_matches_transformers(ckpt):
    """The DeepSeek-V2 model with its steps decodes what transformers' own model decodes:
    logits within the bound test_pool_attention's MLA test and test_dense's logits test
    hold (tandem's bf16 kernels and the absorbed attention round differently from torch),
    the same greedy tokens where no near-tie decides."""
    from transformers import AutoModelForCausalLM

    d = ckpt("deepseek_v2", "bf16")
    model = tandem.load_model(d, CFG, progress=False)
    assert model.tandem_decoder_steps == model.config.num_hidden_layers
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    got, want = decode(model, DynamicCache), decode(ref, DynamicCache)
    for g, w in zip(got, want):
        g, w = g.double()[:, -1], w.double()[:, -1]
        assert (g - w).norm() <= 0.05 * w.norm()


def test_generate_and_calls_it_does_not_take(ckpt):
    model = tandem.load_model(ckpt("qwen3_moe", "bf16"), CFG, progress=False)
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    gen = dict(max_new_tokens=10, do_sample=False, output_scores=True, return_dict_in_generate=True)
    set_enabled(model, False)
    want = model.generate(ids, **gen)
    set_enabled(model, True)
    got = model.generate(ids, **gen)
    assert torch.equal(want.sequences, got.sequences)
    assert all(torch.equal(a, b) for a, b in zip(want.scores, got.scores))
    # A forward hook on a part: the module path runs (the hook sees every step), same logits.
    layer = next(m for m in model.modules() if "tandem_decoder_step" in m.__dict__)
    seen = []
    h = layer.self_attn.o_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    try:
        hooked = model.generate(ids, **gen)
    finally:
        h.remove()
    assert len(seen) == 1 + 9  # prefill and every decode step
    assert torch.equal(hooked.sequences, want.sequences)
    # A batch of two (padded): the module path, the same as with the steps off.
    batch = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(batch)
    mask[0, :2] = 0
    outs = []
    for on in (False, True):
        set_enabled(model, on)
        outs.append(model.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False))
    assert torch.equal(*outs)


def test_a_replaced_part_sends_calls_to_the_module_path(ckpt):
    model = tandem.load_model(ckpt("qwen3_moe", "bf16"), CFG, progress=False)
    layer = next(m for m in model.modules() if "tandem_decoder_step" in m.__dict__)
    step = layer.tandem_decoder_step
    x = torch.randn(1, 1, step.hidden).to(torch.bfloat16)
    pe = (torch.ones(1, 1, step.D, dtype=torch.bfloat16), torch.zeros(1, 1, step.D, dtype=torch.bfloat16))
    assert step.takes(x, None, DynamicCache(config=model.config), pe, {})
    gate = layer.mlp.gate
    layer.mlp.gate = gate.inner  # the router put back: the step no longer computes this layer
    assert not step.takes(x, None, DynamicCache(config=model.config), pe, {})
    layer.mlp.gate = gate
    assert step.takes(x, None, DynamicCache(config=model.config), pe, {})
    assert not step.takes(x, None, DynamicCache(config=model.config), pe, {"output_attentions": True})
    assert not step.takes(x.float(), None, DynamicCache(config=model.config), pe, {})
    model.train()  # (Mixtral's router jitters its input in training mode)
    assert not step.takes(x, None, DynamicCache(config=model.config), pe, {})
    model.eval()
    assert step.takes(x, None, DynamicCache(config=model.config), pe, {})


def test_a_probe_that_disagrees_keeps_the_layers_forward(ckpt, monkeypatch):
    real = decode_step._Step.__call__

    def off_by_one_ulp(self, x, cache, pe):
        y = real(self, x, cache, pe)
        return (y.view(torch.int16) + 1).view(torch.bfloat16)

    monkeypatch.setattr(decode_step._Step, "__call__", off_by_one_ulp)
    model = tandem.load_model(ckpt("qwen3_moe", "bf16"), CFG, progress=False)
    assert model.tandem_decoder_steps == 0 and not steps_of(model)
    assert not any("tandem_module_forward" in m.__dict__ for m in model.modules())


def test_no_step_without_tandems_parts(ckpt):
    model = tandem.load_model(ckpt("qwen3_moe", "bf16"), dict(CFG, cpu=dict(CFG["cpu"], dense_format="torch")),
                              progress=False)
    assert getattr(model, "tandem_decoder_steps", 0) == 0 and not steps_of(model)
    # DeepSeek-V3: not a supported layer (its sigmoid router with a bias stays in torch, its
    # rotary embedding is not V2's complex one)
    model = tandem.load_model(ckpt("deepseek_v3", "bf16"), CFG, progress=False)
    assert model.tandem_decoder_steps == 0


def test_bad_shapes_are_refused_naming_the_layer(ckpt):
    model = tandem.load_model(ckpt("qwen3_moe", "bf16"), CFG, progress=False)
    layer = next(m for m in model.modules() if "tandem_decoder_step" in m.__dict__)
    engine, attn = model.tandem_engine, layer.self_attn
    p = decode_step._parts(layer, engine)
    at, ffn = p["at"], p["ffn"]
    w = [n.weight for n in p["norms"] + at["qk"]]
    args = dict(hidden=at["q"].in_features, q_heads=at["nq"] // at["D"], kv_heads=at["nkv"] // at["D"],
                head_dim=at["D"], scale=float(attn.scaling), input_norm=w[0].data_ptr(), post_norm=w[1].data_ptr(),
                eps=1e-6, q_norm=w[2].data_ptr(), k_norm=w[3].data_ptr(), qk_eps=1e-6, qkv=at["q"]._packed.dense,
                o=at["o"]._packed.dense, router=ffn["gate"]._dense, top_k=ffn["gate"].top_k, renorm=True,
                sorted=True, scores_f32=False, moe_index=ffn["experts"].index, name="model.layers.0")
    engine.decoder_layer_step(**args)  # as built
    for bad, says in ((dict(q_heads=args["q_heads"] + args["kv_heads"]), "q/k/v weight"),
                      (dict(q_heads=args["q_heads"] + 1), "a multiple of the kv heads"),
                      (dict(qkv=at["o"]._packed.dense), "q/k/v weight"),
                      (dict(o=at["q"]._packed.dense), "o_proj weight"),
                      (dict(top_k=0), "top_k 0"),
                      (dict(moe_index=99), "MoE index 99"),
                      (dict(moe_index=-1), "neither routed experts nor a dense MLP"),
                      (dict(k_norm=0), "q_norm and k_norm"),
                      (dict(head_dim=1024, q_heads=1, kv_heads=1), "head_dim 1024")):
        with pytest.raises(ValueError, match="model.layers.0") as e:
            engine.decoder_layer_step(**dict(args, **bad))
        assert says in str(e.value)
    step = layer.tandem_decoder_step.step
    with pytest.raises(ValueError, match="step is qkv"):
        step.qkv_mla(1, 1, 1, 1, 1)


def test_bad_mla_shapes_are_refused_naming_the_layer(ckpt):
    model = tandem.load_model(ckpt("deepseek_v2", "bf16"), CFG, progress=False)
    layer = model.model.layers[1]
    engine, attn = model.tandem_engine, layer.self_attn
    p = decode_step._parts(layer, engine)
    at, ffn = p["at"], p["ffn"]
    w = [n.weight for n in p["norms"]]
    gu, down = ffn["shared"].dense
    args = dict(hidden=at["q"].in_features, q_heads=at["H"], kv_heads=1, head_dim=at["nope"] + at["rope"],
                scale=float(attn.scaling), input_norm=w[0].data_ptr(), post_norm=w[1].data_ptr(), eps=1e-6,
                qkv=at["q"]._packed.dense, o=at["o"]._packed.dense, name="model.layers.1", router=ffn["gate"]._dense,
                top_k=ffn["gate"].top_k, moe_index=ffn["experts"].index, mlp_gate_up=gu, mlp_down=down,
                mla_rank=at["r"], rope=at["rope"], v_dim=at["v_dim"], kv_norm=at["kv_norm"].weight.data_ptr(),
                kv_eps=1e-6, w_uk=at["wk"], w_uv=at["wv"])
    engine.decoder_layer_step(**args)  # as built
    for bad, says in ((dict(rope=at["rope"] + 1), "an even rope width"),
                      (dict(kv_heads=2, q_heads=at["H"] * 2), "one latent head"),
                      (dict(mla_rank=at["r"] + 64), "query / kv_a weight"),
                      (dict(w_uk=None), "both absorbed halves"),
                      (dict(kv_norm=0), "kv_a_layernorm"),
                      (dict(v_dim=at["v_dim"] * 2), "o_proj weight"),
                      (dict(mlp_gate_up=down), "gate/up weight"),
                      (dict(mlp_down=None), "down layer is missing")):
        with pytest.raises(ValueError, match="model.layers.1") as e:
            engine.decoder_layer_step(**dict(args, **bad))
        assert says in str(e.value)
    with pytest.raises(ValueError, match="step is rest_mla"):
        layer.tandem_decoder_step.step.rest(1, 1, 1, 0, 0, 1, 0, 0, 1, 1)


def test_mla_calls_it_does_not_take(ckpt):
    """DeepSeek-V2: a hooked shared-experts MLP, a changed kv_b_proj and a replaced part send
    the call to the module path; generate gives the same tokens and scores with the steps
    on and off."""
    model = tandem.load_model(ckpt("deepseek_v2", "bf16"), CFG, progress=False)
    layer = model.model.layers[1]
    step = layer.tandem_decoder_step
    x = torch.randn(1, 1, step.hidden).to(torch.bfloat16)
    freqs = torch.polar(torch.ones(1, 1, step.rope // 2), torch.zeros(1, 1, step.rope // 2))
    cache = DynamicCache(config=model.config)
    assert step.takes(x, None, cache, freqs, {})
    assert not step.takes(x, None, cache, (freqs.real, freqs.imag), {})  # not V2's complex frequencies
    h = layer.mlp.shared_experts.down_proj.register_forward_hook(lambda *a: None)
    assert not step.takes(x, None, cache, freqs, {})
    h.remove()
    assert step.takes(x, None, cache, freqs, {})
    with torch.no_grad():
        layer.self_attn.kv_b_proj.weight.mul_(1.0)  # an in-place change: absorbed again by the module path
    assert not step.takes(x, None, cache, freqs, {})
    model = tandem.load_model(ckpt("deepseek_v2", "bf16"), CFG, progress=False)
    layer, step = model.model.layers[1], model.model.layers[1].tandem_decoder_step
    gate = layer.mlp.gate
    layer.mlp.gate = gate.inner
    assert not step.takes(x, None, cache, freqs, {})
    layer.mlp.gate = gate
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    gen = dict(max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True)
    outs = []
    for on in (False, True):
        set_enabled(model, on)
        outs.append(model.generate(ids, **gen))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert all(torch.equal(a, b) for a, b in zip(outs[0].scores, outs[1].scores))
