"""tandem.decode_step.use_head_step: one token through a whole causal LM (embedding row,
the model step's stack, final norm, lm_head) without transformers' module calls.

The head step gives the logits of the causal LM's own forward bit for bit, in every format
and attention kind, through greedy steps and through ``generate``; calls it does not take
(labels, router logits, hooks on the parts it skips, a replaced lm_head, positional
arguments after input_ids, a token outside the vocabulary) run the model's forward; a probe
that disagrees installs nothing. The rotary table its steps read holds the rotary module's
own bits for every position, grows, follows a changed inv_freq and is not used for rotary
embeddings that rescale with the length.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_models import VOCAB, checkpoint_cache, greedy_logits

import tandem
from tandem import decode_step, kv_cache

CFG = {"version": 1, "cpu": {"virtual_subpools": 2}, "gpu": {"device": "none"}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, "hs-")


def load(ckpt, kind, fmt="bf16", calls=None):
    cpu = dict(CFG["cpu"], format=fmt, dense_format=fmt)
    if fmt == "int4":
        cpu["group_size"] = 32
    model = tandem.load_model(ckpt(kind, "bf16"), dict(CFG, cpu=cpu), progress=False)
    if calls is not None:
        calls.clear()  # the install probe's
    return model


@pytest.fixture
def head_calls(monkeypatch):
    """Counts the head step's runs (the path was really taken)."""
    calls = []
    real = decode_step._HeadStep.__call__

    def counting(self, ids, cache, n):
        out = real(self, ids, cache, n)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(decode_step._HeadStep, "__call__", counting)
    return calls


def decode(model, **kw):
    return greedy_logits(model, kv_cache.GrowingCache, **kw)


def same(a, b):
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kind,fmt", [("qwen3_moe", "bf16"), ("qwen3_moe", "int4"), ("mixtral", "int8"),
                                      ("deepseek_v2", "bf16"), ("deepseek_v2_qlora", "int8")])
def test_head_step_is_bit_identical_to_the_models_forward(ckpt, kind, fmt, head_calls):
    model = load(ckpt, kind, fmt, head_calls)
    assert model.tandem_head_step is True
    head = model.tandem_head
    head.enabled = False
    want = decode(model)
    assert head_calls == []
    head.enabled = True
    got = decode(model)
    assert head_calls == [True] * 12  # every one-token step
    assert same(want, got)
    # the module path itself, without any of the one-token paths, agrees too
    head.enabled = model.model.tandem_model_step.enabled = False
    for layer in model.model.layers:
        layer.tandem_decoder_step.enabled = False
    assert same(want, decode(model))


def test_generate_with_and_without_the_head_step(ckpt, head_calls):
    model = load(ckpt, "qwen3_moe", "int8", head_calls)
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    gen = dict(max_new_tokens=10, do_sample=False, output_scores=True, return_dict_in_generate=True)
    outs = []
    for on in (False, True):
        model.tandem_head.enabled = on
        head_calls.clear()
        outs.append(model.generate(ids, **gen))
        assert len(head_calls) == (9 if on else 0)
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert all(torch.equal(a, b) for a, b in zip(outs[0].scores, outs[1].scores))


def test_calls_the_head_step_does_not_take(ckpt, head_calls):
    model = load(ckpt, "qwen3_moe", calls=head_calls)
    head = model.tandem_head
    head.enabled = False
    want = decode(model)
    head.enabled = True

    def same_without_the_head(**kw):
        head_calls.clear()
        got = decode(model, **kw)
        assert head_calls == []
        return got

    for part in (model.lm_head, model.model.norm, model.model.embed_tokens, model.model):
        seen = []
        h = part.register_forward_hook(lambda m, i, o: seen.append(1))
        try:
            assert same(want, same_without_the_head())
        finally:
            h.remove()
        assert len(seen) == 13  # the prompt and every step saw the part
    assert same(want, decode(model)) and len(head_calls) == 12  # hooks gone: the path again
    # extra outputs, and the output-capture hooks transformers leaves behind
    same_without_the_head(output_hidden_states=True)
    head_calls.clear()
    assert same(want, decode(model)) and len(head_calls) == 12
    with torch.no_grad():
        cache = kv_cache.GrowingCache(config=model.config)
        ids = torch.randint(0, VOCAB, (1, 4), generator=torch.Generator().manual_seed(3))
        model(ids, past_key_values=cache, use_cache=True)
        one = ids[:, :1]
        head_calls.clear()
        out = model(input_ids=one, past_key_values=cache, use_cache=True, labels=one)  # a loss
        assert out.loss is not None and head_calls == []
        cache.crop(-1)
        kw = dict(input_ids=one, past_key_values=cache, use_cache=True)
        assert head.takes(kw) == 4
        assert head.takes(dict(kw, output_router_logits=True)) is None
        assert head.takes(dict(kw, logits_to_keep=torch.tensor([0]))) is None
        assert head.takes(dict(kw, output_attentions=True)) is None
        out = model(one, None, None, cache, use_cache=True)  # positional arguments after input_ids
        assert head_calls == [] and out.logits.shape == (1, 1, VOCAB)
        cache.crop(-1)
        with pytest.raises(IndexError):  # outside the vocabulary: the embedding's own error
            model(input_ids=torch.tensor([[VOCAB]]), past_key_values=cache, use_cache=True)
        assert head_calls == [False]
        assert cache.get_seq_length() == 4  # the refused call appended nothing
        model.tandem_head.enabled = True
        head_calls.clear()
        lm = model.lm_head
        model.lm_head = nn.Sequential(lm)  # a replaced lm_head
        try:
            out = model(input_ids=one, past_key_values=cache, use_cache=True)
        finally:
            model.lm_head = lm
        assert head_calls == [] and out.logits.shape == (1, 1, VOCAB)
        model(input_ids=one, past_key_values=cache, use_cache=True)
        assert head_calls == [True]


def test_a_probe_that_disagrees_installs_no_head_step(ckpt, monkeypatch):
    real = decode_step._HeadStep.__call__

    def off_by_one_ulp(self, ids, cache, n):
        out = real(self, ids, cache, n)
        out.logits = (out.logits.view(torch.int16) + 1).view(torch.bfloat16)
        return out

    monkeypatch.setattr(decode_step._HeadStep, "__call__", off_by_one_ulp)
    model = load(ckpt, "qwen3_moe")
    assert model.tandem_model_step is True and model.tandem_head_step is False
    assert "tandem_head" not in model.__dict__ and "tandem_module_forward" not in model.__dict__


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v2"])
def test_the_rotary_table_holds_the_modules_bits(ckpt, kind):
    model = load(ckpt, kind)
    rotary = model.model.rotary_emb
    mla = kind.startswith("deepseek")
    table = decode_step._RopeTable(rotary, mla)
    assert table.on
    x = torch.zeros(1, 1, 1, dtype=torch.bfloat16)

    def check(n):
        ptrs = table.row(n)
        assert ptrs is not None
        one = rotary(x, torch.tensor([[n]]))
        if mla:
            want = [torch.view_as_real(one).reshape(-1)]
            got_ptrs = [ptrs[2]]
        else:
            want = [one[0].reshape(-1), one[1].reshape(-1)]
            got_ptrs = ptrs[:2]
        for part, p, w in zip(table.parts, got_ptrs, want):
            assert p == part[n].data_ptr() and torch.equal(part[n], w)

    for n in (0, 1, 5, 255):
        check(n)
    assert table.length == 256
    check(700)  # grown by doubling, remade whole
    assert table.length == 1024
    with torch.no_grad():
        rotary.inv_freq.mul_(1.5)  # changed in place: the table is remade from it
    check(3)
    check(1000)


def test_no_rotary_table_for_rotary_embeddings_that_rescale():
    class Dynamic(nn.Module):
        rope_type = "dynamic"

        def __init__(self):
            super().__init__()
            self.inv_freq = torch.ones(4)

    assert not decode_step._RopeTable(Dynamic(), False).on
    assert decode_step._RopeTable(Dynamic(), False).row(3) is None


def test_a_table_that_disagrees_with_the_module_is_not_used():
    class Odd(nn.Module):
        """Position 7's one-position call differs from its row in a many-position call."""
        rope_type = "default"

        def __init__(self):
            super().__init__()
            self.inv_freq = torch.ones(4)

        def forward(self, x, pos):
            ang = pos[..., None].float() * torch.cat([self.inv_freq, self.inv_freq])
            if pos.numel() == 1 and int(pos) == 7:
                ang = ang + 1
            return ang.cos().to(x.dtype), ang.sin().to(x.dtype)

    table = decode_step._RopeTable(Odd(), False)
    assert table.row(7) is None and not table.on  # the row asked for is always among those checked
    assert table.row(3) is None  # and the module's calls from then on
