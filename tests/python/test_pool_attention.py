"""Decode attention on tandem's pool (tandem.attention.use_pool_attention): the function
transformers calls instead of SDPA in a CPU model loaded by tandem.load_model.

- Function level, against fp64 on random inputs (GQA, a padding mask, MLA's value dim):
  within one bf16 rounding of the output plus the fp32 score error, as SDPA itself is.
- Which calls it takes: one-token bf16 CPU decode; prefill, float masks, dropout and
  unknown keyword arguments (softcap, sinks) go to transformers' SDPA unchanged.
- Model level: load_model sets it (not with cpu.dense_format torch, not over a user's
  eager choice), generation with the KV cache runs the pool for every decode step, and
  the logits of every step stay within generate_check's bound of SDPA's.
"""
from __future__ import annotations

import pytest
import torch

from hf_models import VOCAB, checkpoint_cache

import tandem
from tandem import attention as ta


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, "attn-")


@pytest.fixture(scope="module")
def engine():
    from tandem.engine import make_engine

    return make_engine({"version": 1, "cpu": {"virtual_subpools": 2}}, (4, 32, 16), [0])


class _Attn(torch.nn.Module):
    def __init__(self, groups: int, engine) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True
        self.__dict__["tandem_attention_engine"] = engine


def _reference(q, k, v, mask, scale):
    """fp64 attention, [B, Hq, 1, D] -> [B, 1, Hq, Dv], and the fp32 score error bound."""
    G = q.shape[1] // k.shape[1]
    kr, vr = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = (q.double() @ kr.transpose(-1, -2)) * scale
    mag = (q.double().abs() @ kr.abs().transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    out = (s.softmax(-1) @ vr).transpose(1, 2)
    score_err = q.shape[-1] * 2.0 ** -24 * mag.max().item()
    return out, score_err


@pytest.mark.parametrize("B,Hq,Hkv,D,Dv,L", [(1, 8, 2, 32, 32, 70), (2, 4, 4, 16, 16, 9), (2, 6, 2, 24, 16, 600)])
def test_matches_fp64_within_one_bf16_rounding(engine, B, Hq, Hkv, D, Dv, L):
    g = torch.Generator().manual_seed(B * 1000 + L)
    q = torch.randn(B, Hq, 1, D, generator=g).bfloat16()
    k = torch.randn(B, Hkv, L, D, generator=g).bfloat16()
    v = torch.randn(B, Hkv, L, Dv, generator=g).bfloat16()
    mask = None
    if B == 2:  # the first sequence left-padded by a third of the keys
        mask = torch.ones(B, 1, 1, L, dtype=torch.bool)
        mask[0, ..., : L // 3] = False
    with torch.inference_mode():
        got, _ = ta.pool_attention_forward(_Attn(Hq // Hkv, engine), q, k, v, mask, scaling=0.3)
    want, score_err = _reference(q, k, v, mask, 0.3)
    assert got.shape == (B, 1, Hq, Dv) and got.dtype == torch.bfloat16
    bound = want.abs() * 2.0 ** -8 + (2 * score_err + 4 * L * 2.0 ** -24) * v.abs().max().item()
    err = (got.double() - want).abs()
    worst = err.flatten().argmax()
    assert (err <= bound).all(), f"max error {err.flatten()[worst]:.3g}, bound there {bound.flatten()[worst]:.3g}"


def test_other_calls_go_to_sdpa(engine, monkeypatch):
    """Only one-token bf16 CPU decode with a bool mask (or none) runs on the pool."""
    seen = []
    real = ta._sdpa
    monkeypatch.setattr(ta, "_sdpa", lambda *a, **k: seen.append(1) or real(*a, **k))
    mod = _Attn(2, engine)
    q = torch.randn(1, 4, 1, 16).bfloat16()
    k = torch.randn(1, 2, 5, 16).bfloat16()
    v = torch.randn(1, 2, 5, 16).bfloat16()
    with torch.inference_mode():
        ta.pool_attention_forward(mod, q, k, v, None)
        assert seen == []
        cases = [
            dict(query=torch.randn(1, 4, 3, 16).bfloat16()),                         # prefill
            dict(attention_mask=torch.zeros(1, 1, 1, 5)),                            # float (additive) mask
            dict(query=q.float(), key=k.float(), value=v.float()),                   # fp32
            dict(softcap=30.0),                                                      # unknown math
            dict(s_aux=torch.zeros(4)),                                              # attention sinks
        ]
        for c in cases:
            args = dict(query=q, key=k, value=v, attention_mask=None)
            args.update(c)
            extra = {n: c[n] for n in ("softcap", "s_aux") if n in c}
            try:
                ta.pool_attention_forward(mod, args["query"], args["key"], args["value"], args["attention_mask"],
                                          **extra)
            except ValueError:
                pass  # SDPA refuses softcap itself: what matters is that it got the call
        assert len(seen) == len(cases)
        ta.pool_attention_forward(mod, q, k, v, None, dropout=0.1)
        assert len(seen) == len(cases) + 1
    no_engine = _Attn(2, None)
    del no_engine.__dict__["tandem_attention_engine"]
    with torch.inference_mode():
        ta.pool_attention_forward(no_engine, q, k, v, None)
    assert len(seen) == len(cases) + 2


def test_load_model_decodes_on_the_pool_and_matches_sdpa(ckpt, monkeypatch):
    """Greedy generation with the KV cache: every decode step's attention runs on the pool
    (SDPA sees only the prompt), and each step's logits are within generate_check's bound
    (relative L2 < 2e-2) of the same model with SDPA, while both generated alike."""
    path = ckpt("qwen3_moe", "bf16")
    model = tandem.load_model(path, {"version": 1, "cpu": {"virtual_subpools": 2}, "gpu": {"device": "none"}},
                              progress=False)
    layers = model.config.num_hidden_layers
    assert model.config._attn_implementation == "tandem" and model.tandem_attention == layers
    seen = []
    real = ta._sdpa
    monkeypatch.setattr(ta, "_sdpa", lambda *a, **k: seen.append(a[1].shape[2]) or real(*a, **k))
    prompt = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    gen = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.inference_mode():
        a = model.generate(prompt, **gen)
        assert seen == [12] * layers  # the prompt only
        model.set_attn_implementation("sdpa")
        b = model.generate(prompt, **gen)
    n = prompt.shape[1]
    for s in range(6):
        want, got = b.logits[s][0].float(), a.logits[s][0].float()
        assert ((got - want).norm() / want.norm()).item() < 2e-2, f"step {s}"
        if a.sequences[0, n + s] != b.sequences[0, n + s]:
            break


def test_left_alone_with_dense_torch_or_eager(ckpt):
    path = ckpt("qwen3_moe", "bf16")
    base = {"version": 1, "gpu": {"device": "none"}}
    m = tandem.load_model(path, dict(base, cpu={"dense_format": "torch"}), progress=False)
    assert m.config._attn_implementation == "sdpa" and not hasattr(m, "tandem_attention")
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager")
    assert ta.use_pool_attention(eager, None) == 0 and eager.config._attn_implementation == "eager"
