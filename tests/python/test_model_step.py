"""tandem.decode_step.use_model_step: one token through every decoder layer in one C++ call.

The base model's one-token path (embedding, rotary embedding, ``_C.DecoderStack`` running
each layer's step with the layer appending its key and value into the ``GrowingCache``'s
buffers, final norm) gives the same logits, bit for bit, as the per-layer steps and as
transformers' layers over tandem's modules, in every format, across cache growth; calls it
does not take (another cache, a hook on a decoder layer, extra outputs, a mask that hides a
key, a position that is not the cache's length, a replaced layer forward) run the base
model's own forward; a probe that disagrees installs nothing; bad stacks are refused.
"""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_models import VOCAB, checkpoint_cache, greedy_logits

import tandem
from tandem import _C, decode_step, kv_cache

CFG = {"version": 1, "cpu": {"virtual_subpools": 2}, "gpu": {"device": "none"}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, "ms-")


def load(ckpt, kind, fmt="bf16"):
    cpu = dict(CFG["cpu"], format=fmt, dense_format=fmt)
    if fmt == "int4":
        cpu["group_size"] = 32
    return tandem.load_model(ckpt(kind, "bf16"), dict(CFG, cpu=cpu), progress=False)


class CountingStack:
    """The model step's C++ stack, counting its runs (the path was really taken)."""

    def __init__(self, real):
        self.real, self.runs = real, 0

    def run(self, *args):
        self.runs += 1
        return self.real.run(*args)


def counted(model) -> CountingStack:
    fast = model.model.tandem_model_step
    if not isinstance(fast.stack, CountingStack):
        fast.stack = CountingStack(fast.stack)
    fast.stack.runs = 0
    return fast.stack


def decode(model, cache_cls=kv_cache.GrowingCache, **kw):
    """Logits of a prompt and greedy one-token steps on a GrowingCache by default
    (hf_models.greedy_logits)."""
    return greedy_logits(model, cache_cls, **kw)


def paths(model, on_model, on_layers):
    model.model.tandem_model_step.enabled = on_model
    for layer in model.model.layers:
        layer.tandem_decoder_step.enabled = on_layers


@pytest.mark.parametrize("kind,fmt", [("qwen3_moe", "bf16"), ("qwen3_moe", "int4"), ("mixtral", "int8"),
                                      ("deepseek_v2", "bf16"), ("deepseek_v2", "int4"),
                                      ("deepseek_v2_qlora", "bf16")])
def test_model_step_is_bit_identical_to_the_layer_and_module_paths(ckpt, kind, fmt):
    model = load(ckpt, kind, fmt)
    assert model.tandem_model_step is True
    assert model.model.tandem_model_step.mla == (kind.startswith("deepseek"))
    stack = counted(model)
    want = {}
    for name, on_model, on_layers in (("module", False, False), ("layers", False, True), ("model", True, True)):
        paths(model, on_model, on_layers)
        stack.runs = 0
        want[name] = decode(model)
        assert stack.runs == (12 if on_model else 0)  # every one-token step, no prefill
    for a, b, c in zip(want["module"], want["layers"], want["model"]):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_the_cache_growing_under_the_model_step(ckpt, monkeypatch):
    """Buffers that grow every few steps (GROW_MIN 2): the table of pointers is made again
    and the logits stay those of the module path."""
    monkeypatch.setattr(kv_cache, "GROW_MIN", 2)
    monkeypatch.setattr(kv_cache, "GROW_FRACTION", 1000)
    model = load(ckpt, "qwen3_moe")
    stack = counted(model)
    paths(model, True, True)
    got = decode(model, n=20, prompt=3)
    assert stack.runs == 20
    paths(model, False, False)
    want = decode(model, n=20, prompt=3)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_generate_with_and_without_the_model_step(ckpt):
    model = load(ckpt, "deepseek_v2")
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    gen = dict(max_new_tokens=10, do_sample=False, output_scores=True, return_dict_in_generate=True)
    stack = counted(model)
    outs = []
    for on in (False, True):
        paths(model, on, True)
        stack.runs = 0
        outs.append(model.generate(ids, **gen))
        assert stack.runs == (9 if on else 0)
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert all(torch.equal(a, b) for a, b in zip(outs[0].scores, outs[1].scores))


def test_calls_the_model_step_does_not_take(ckpt):
    model = load(ckpt, "qwen3_moe")
    stack = counted(model)
    paths(model, False, False)
    want = decode(model)
    paths(model, True, True)

    def same_without_the_stack(**kw):
        stack.runs = 0
        got = decode(model, **kw)
        assert stack.runs == 0
        assert all(torch.equal(a, b) for a, b in zip(want, got))

    same_without_the_stack(cache_cls=DynamicCache)  # not a GrowingCache: the layers' own steps
    layer = model.model.layers[1]
    seen = []
    h = layer.register_forward_hook(lambda m, i, o: seen.append(1))  # a hook on a decoder layer
    try:
        same_without_the_stack()
    finally:
        h.remove()
    assert len(seen) == 13  # the prompt and every step
    h = layer.mlp.experts.register_forward_pre_hook(lambda m, a: None)  # a hook on a layer's part
    try:
        same_without_the_stack()
    finally:
        h.remove()
    # extra outputs: the base model's forward, which returns them (and whose output capture
    # hooks the layers and the final norm, so their torch paths run: compared with itself)
    paths(model, False, False)
    want_all = decode(model, output_hidden_states=True)
    paths(model, True, True)
    stack.runs = 0
    got = decode(model, output_hidden_states=True)
    assert stack.runs == 0 and all(torch.equal(a, b) for a, b in zip(want_all, got))
    # its capture hooks stay on the layers, inert: a plain decode takes the path again
    assert any(layer._forward_hooks for layer in model.model.layers)
    got = decode(model)
    assert stack.runs == 12 and all(torch.equal(a, b) for a, b in zip(want, got))
    with torch.no_grad():
        cache = kv_cache.GrowingCache(config=model.config)
        ids = torch.randint(0, VOCAB, (1, 4), generator=torch.Generator().manual_seed(3))
        model(ids, past_key_values=cache, use_cache=True)
        one = ids[:, :1]
        out = model(one, past_key_values=cache, use_cache=True, output_hidden_states=True)
        assert len(out.hidden_states) == model.config.num_hidden_layers + 1
        # a mask that hides a cached key, a position that is not the cache's length
        fast = model.model.tandem_model_step
        mask = torch.ones(1, 6, dtype=torch.long)
        assert fast.takes(one, None, mask, None, cache, True, {}) == 5
        mask[0, 2] = 0
        assert fast.takes(one, None, mask, None, cache, True, {}) is None
        assert fast.takes(one, None, None, torch.tensor([[4]]), cache, True, {}) is None
        assert fast.takes(one, None, None, torch.tensor([[5]]), cache, True, {}) == 5
        assert fast.takes(one, None, None, None, cache, False, {}) is None
        assert fast.takes(ids[:, :2], None, None, None, cache, True, {}) is None  # two tokens
        assert fast.takes(one, None, None, None, cache, True, {"output_attentions": True}) is None
        assert fast.takes(one, None, None, None, cache, True, {"return_dict": False}) is None
    assert torch.is_grad_enabled() and fast.takes(one, None, None, None, cache, True, {}) is None
    with torch.no_grad():
        model.train()
        assert fast.takes(one, None, None, None, cache, True, {}) is None
        model.eval()
        real = layer.forward  # a decoder layer's forward replaced
        layer.forward = lambda *a, **k: real(*a, **k)
        assert fast.takes(one, None, None, None, cache, True, {}) is None
        layer.forward = real
        assert fast.takes(one, None, None, None, cache, True, {}) == 5
        gate = layer.mlp.gate
        layer.mlp.gate = gate.inner  # a replaced part (the router put back)
        assert fast.takes(one, None, None, None, cache, True, {}) is None
        layer.mlp.gate = gate
        layer.tandem_decoder_step.enabled = False  # one layer's step switched off
        assert fast.takes(one, None, None, None, cache, True, {}) is None
        layer.tandem_decoder_step.enabled = True
        assert fast.takes(one, None, None, None, cache, True, {}) == 5


def test_mla_calls_the_model_step_does_not_take(ckpt):
    """DeepSeek-V2: a hooked shared-experts MLP and an in-place change to kv_b_proj send the
    call to the base model's forward (whose layers then decide for themselves)."""
    model = load(ckpt, "deepseek_v2")
    fast = model.model.tandem_model_step
    layer = model.model.layers[1]
    with torch.no_grad():
        cache = kv_cache.GrowingCache(config=model.config)
        ids = torch.randint(0, VOCAB, (1, 4), generator=torch.Generator().manual_seed(3))
        model(ids, past_key_values=cache, use_cache=True)
        one = ids[:, :1]
        assert fast.takes(one, None, None, None, cache, True, {}) == 4
        h = layer.mlp.shared_experts.down_proj.register_forward_hook(lambda *a: None)
        assert fast.takes(one, None, None, None, cache, True, {}) is None
        h.remove()
        assert fast.takes(one, None, None, None, cache, True, {}) == 4
        layer.self_attn.kv_b_proj.weight.mul_(1.0)
        assert fast.takes(one, None, None, None, cache, True, {}) is None


def test_a_probe_that_disagrees_installs_no_model_step(ckpt, monkeypatch):
    real = decode_step._ModelStep.__call__

    def off_by_one_ulp(self, ids, cache, n):
        out = real(self, ids, cache, n)
        out.last_hidden_state = (out.last_hidden_state.view(torch.int16) + 1).view(torch.bfloat16)
        return out

    monkeypatch.setattr(decode_step._ModelStep, "__call__", off_by_one_ulp)
    model = load(ckpt, "qwen3_moe")
    assert model.tandem_decoder_steps > 0 and model.tandem_model_step is False
    assert "tandem_model_step" not in model.model.__dict__


def test_no_model_step_unless_every_layer_has_its_step(ckpt, monkeypatch):
    real = decode_step._probe

    def first_only(module_forward, step, rotary, seed):
        return seed == 0 and real(module_forward, step, rotary, seed)

    monkeypatch.setattr(decode_step, "_probe", first_only)
    model = load(ckpt, "qwen3_moe")
    assert model.tandem_decoder_steps == 1 and model.tandem_model_step is False


def test_bad_stacks_are_refused(ckpt):
    with pytest.raises(Exception, match="no layers"):
        _C.DecoderStack([])
    model = load(ckpt, "qwen3_moe")
    step = model.model.layers[0].tandem_decoder_step.step
    stack = _C.DecoderStack([step])
    x = torch.zeros(step_hidden := model.config.hidden_size, dtype=torch.bfloat16)
    with pytest.raises(Exception, match="null cache table"):
        stack.run(x.data_ptr(), 0, 0, 0, 0, 3)
    table = torch.zeros(1, 6, dtype=torch.int64)
    with pytest.raises(Exception, match="null cache"):
        stack.run(x.data_ptr(), 0, 0, 0, table.data_ptr(), 3)
    assert len(stack) == 1 and step_hidden > 0


def test_the_quick_check_refuses_what_the_full_check_refuses(ckpt):
    """``_ModelStep.layers_ok`` first runs its flat check (``_quick_ok``), valid while no hook
    was registered anywhere since the full check last passed: every change the full check
    refuses is refused by both, and undoing it takes the path again."""
    model = load(ckpt, "qwen3_moe")
    fast = model.model.tandem_model_step
    layer = model.model.layers[2]
    assert fast.layers_ok() and fast._quick_ok()
    h = model.lm_head.register_forward_hook(lambda *a: None)  # a hook on a module the step does not watch
    assert not fast._quick_ok()  # a new hook somewhere: the full check again, which passes
    assert fast.layers_ok() and fast._quick_ok()
    h.remove()
    h = layer.post_attention_layernorm.register_forward_pre_hook(lambda *a: None)
    assert not fast.layers_ok() and not fast._quick_ok()
    h.remove()
    assert fast.layers_ok() and fast._quick_ok()
    step = layer.tandem_decoder_step
    gate = layer.mlp.gate
    norm_w = layer.input_layernorm.weight
    data = norm_w.data

    def refused(change, undo):
        change()
        try:
            assert not fast._quick_ok() and not fast.layers_ok()
        finally:
            undo()
        assert fast.layers_ok() and fast._quick_ok()

    refused(lambda: setattr(layer.mlp, "gate", gate.inner), lambda: setattr(layer.mlp, "gate", gate))
    refused(lambda: layer.train(), lambda: layer.eval())
    refused(lambda: setattr(step, "enabled", False), lambda: setattr(step, "enabled", True))
    real = layer.forward
    refused(lambda: setattr(layer, "forward", lambda *a, **k: real(*a, **k)), lambda: setattr(layer, "forward", real))
    refused(lambda: setattr(norm_w, "data", data.clone()), lambda: setattr(norm_w, "data", data))  # the weight moved
    pack = step.packs[0]
    refused(lambda: setattr(pack, "bf16_on_pool", False), lambda: setattr(pack, "bf16_on_pool", True))
