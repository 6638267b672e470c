"""tandem.kv_cache.GrowingCache: a DynamicCache that appends in place.

It holds the same values as transformers' DynamicCache and attention reads the same
positions, so every logit is bit-identical to DynamicCache's (prefill, decode steps, a
padded batch, beam search, crop); a step copies only its own states (the buffer is
reallocated a few times, not at every step); load_model's generate uses it unless the
caller chose a cache.
"""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_models import VOCAB, checkpoint_cache

import tandem
from tandem.kv_cache import GROW_MIN, GrowingCache, GrowingLayer

CFG = {"version": 1, "cpu": {"virtual_subpools": 2}, "gpu": {"device": "none"}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, "kv-")


def batch():
    """Two prompts, the first left-padded by 3."""
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0
    return ids, mask


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_same_logits_as_dynamic_cache_and_appends_in_place(ckpt, kind):
    model = tandem.load_model(ckpt(kind, "bf16"), CFG, progress=False)
    ids, mask = batch()
    logits, ptrs = {}, []
    for cls in (DynamicCache, GrowingCache):
        cache = cls(config=model.config)
        steps = []
        with torch.no_grad():
            out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            tok, m = out.logits[:, -1:].argmax(-1), mask
            for _ in range(40):
                m = torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], 1)
                out = model(tok, attention_mask=m, past_key_values=cache, use_cache=True)
                steps.append(out.logits)
                tok = out.logits[:, -1:].argmax(-1)
                if cls is GrowingCache:
                    ptrs.append(cache.layers[0].keys.data_ptr())
        logits[cls] = steps
        if cls is GrowingCache:
            assert all(type(layer) is GrowingLayer for layer in cache.layers)
            assert cache.get_seq_length() == 12 + 40
    for a, b in zip(logits[DynamicCache], logits[GrowingCache]):
        assert torch.equal(a, b)
    # 52 positions fit the first buffer (12 + max(3, GROW_MIN) positions): one allocation.
    assert 12 + 40 <= 12 + GROW_MIN and len(set(ptrs)) == 1


def test_growth_reallocates_rarely_and_keeps_the_values():
    layer = GrowingLayer()
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(1, 2, n, 4, generator=g) for n in [5] + [1] * 600 + [300]]
    ptrs = set()
    for c in chunks:
        k, v = layer.update(c, -c)
        ptrs.add(k.data_ptr())
    want = torch.cat(chunks, -2)
    assert torch.equal(k, want) and torch.equal(v, -want)
    assert len(ptrs) <= 4  # 906 positions: 261 -> 517 -> ... a handful of buffers, not 602
    layer.crop(-10)  # crop replaces the views: the next append moves the kept part to a new buffer
    k, _ = layer.update(chunks[1], -chunks[1])
    assert torch.equal(k, torch.cat([want[..., :-10, :], chunks[1]], -2))
    layer.keys = layer.keys.clone()  # replaced by another method (reorder_cache does so)
    layer.values = layer.values.clone()
    k, _ = layer.update(chunks[2], -chunks[2])
    assert torch.equal(k, torch.cat([want[..., :-10, :], chunks[1], chunks[2]], -2))


def test_filled_views_are_made_when_read():
    """``filled(n)`` (the model step's append) records n; the keys and values are the
    buffers' first n positions whenever read, the length is known without them, room is
    reserved without them, and transformers' own assignments (crop, reset) see them first."""
    layer = GrowingLayer()
    g = torch.Generator().manual_seed(1)
    first = torch.randn(1, 2, 6, 4, generator=g)
    layer.update(first, -first)
    n = layer.reserve(1)
    assert n == 6
    kb, vb = layer._buffers
    step = torch.randn(1, 2, 1, 4, generator=g)
    kb[..., 6:7, :].copy_(step)  # as the C++ stack writes position n
    vb[..., 6:7, :].copy_(-step)
    layer.filled(7)
    assert "_pending" in layer.__dict__ and layer.__dict__["_pending"] == 7
    assert layer.get_seq_length() == 7 and layer.__dict__["_pending"] == 7  # no views made for the length
    assert layer.reserve(1) == 7 and layer._buffers[0] is kb  # room without them
    want = torch.cat([first, step], -2)
    assert torch.equal(layer.keys, want) and torch.equal(layer.values, -want)
    assert layer.keys.data_ptr() == kb.data_ptr() and layer.__dict__["_pending"] is None
    layer.filled(7)
    layer.crop(-2)  # reads, then assigns: the pending views first
    assert torch.equal(layer.keys, want[..., :5, :]) and layer.get_seq_length() == 5
    layer.filled(7)  # (not owned any more after the crop: a new buffer at the next reserve)
    layer.values = layer.values.clone()  # an assignment of one makes both views first
    assert torch.equal(layer.keys, want) and torch.equal(layer.values, -want)
    layer.filled(3)
    layer.reset()
    assert layer.keys is None and layer.values is None and not layer.is_initialized
    assert layer.get_seq_length() == 0


def test_generate_uses_it_unless_the_caller_chose_a_cache(ckpt):
    model = tandem.load_model(ckpt("qwen3_moe", "bf16"), CFG, progress=False)
    ids, mask = batch()
    gen = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    default = model.generate(ids, **gen)
    assert type(default.past_key_values) is GrowingCache
    mine = DynamicCache(config=model.config)
    explicit = model.generate(ids, past_key_values=mine, **gen)
    assert explicit.past_key_values is mine
    assert torch.equal(default.sequences, explicit.sequences)
    static = model.generate(ids, cache_implementation="static", **gen)
    assert not isinstance(static.past_key_values, GrowingCache)
    assert model.generate(ids, use_cache=False, **gen).past_key_values is None
    beams = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, num_beams=2)
    assert torch.equal(model.generate(ids, **beams), model.generate(ids, past_key_values=DynamicCache(), **beams))


def test_sliding_window_layers_stay_transformers_own():
    from transformers import GptOssConfig
    from transformers.cache_utils import DynamicSlidingWindowLayer

    c = GptOssConfig(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8)
    cache = GrowingCache(config=c)
    assert [type(layer) for layer in cache.layers] == [DynamicSlidingWindowLayer, GrowingLayer] * 2
    assert GrowingCache().layer_class_to_replicate is GrowingLayer


def test_models_with_a_cache_of_their_own_are_left_alone():
    """generate keeps MiniMax's own cache (it refuses any other), encoder-decoders' and
    Mamba's; the wrapper is not installed for them."""
    from types import SimpleNamespace

    from tandem.kv_cache import default_cache_is_dynamic, use_growing_cache

    class MiniMaxForCausalLM:
        config = SimpleNamespace(is_encoder_decoder=False)

        @classmethod
        def _supports_default_dynamic_cache(cls):
            return False

        def generate(self):
            return "own"

    m = MiniMaxForCausalLM()
    use_growing_cache(m)
    assert not default_cache_is_dynamic(m) and m.generate() == "own" and "generate" not in vars(m)
    encdec = SimpleNamespace(config=SimpleNamespace(is_encoder_decoder=True), generate=lambda: "own")
    assert not default_cache_is_dynamic(encdec)
