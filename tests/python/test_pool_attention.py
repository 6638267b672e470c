"""Decode and prefill attention on tandem's pool (tandem.attention.use_pool_attention): the
function transformers calls instead of SDPA in a CPU model loaded by tandem.load_model; and
the SDPA calls it does not take split by heads over the pool's cores (bit-identical to whole
calls).

- Function level, against fp64 on random inputs (GQA, a padding mask, MLA's value dim):
  within one bf16 rounding of the output plus the fp32 score error, as SDPA itself is;
  prefill (causal prompts, chunks after cached keys, padding) within that plus the bf16
  rounding of the probabilities.
- Which calls it takes: bf16 CPU decode and prefill (from PREFILL_MIN_QUERIES queries);
  float masks, dropout, short query runs, and unknown keyword arguments (softcap, sinks) go
  to transformers' SDPA unchanged.
- Model level: load_model sets it (not with cpu.dense_format torch, not over a user's
  eager choice), generation with the KV cache runs the pool for every decode step, and
  the logits of every step stay within generate_check's bound of SDPA's.
"""
from __future__ import annotations

import pytest
import torch

from hf_models import VOCAB, checkpoint_cache, clean_tokens, record_routing

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
    """fp64 attention of [B, Hq, Lq, D] queries (Lq = 1: a decode step) at the keys' last
    positions (causal when mask is None, else the bool mask [B or 1, 1, Lq or 1, L] alone) ->
    [B, Lq, Hq, Dv], the fp32 score error bound per query row ([B, Lq, Hq, 1], over the keys it
    admits) and whether each row admits a key."""
    G = q.shape[1] // k.shape[1]
    Lq, L = q.shape[2], k.shape[2]
    kr, vr = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = (q.double() @ kr.transpose(-1, -2)) * scale
    mag = (q.double().abs() @ kr.abs().transpose(-1, -2)) * scale
    if mask is None:
        mask = torch.ones(Lq, L, dtype=torch.bool).tril(L - Lq)[None, None]
    s = s.masked_fill(~mask, float("-inf"))
    live = mask.expand(s.shape).any(-1, keepdim=True)
    out = torch.where(live, s.softmax(-1), 0.0).nan_to_num() @ vr
    score_err = q.shape[-1] * 2.0 ** -24 * mag.masked_fill(~mask, 0).amax(-1, keepdim=True)
    return out.transpose(1, 2), score_err.transpose(1, 2), live.transpose(1, 2)


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
    want, score_err, _ = _reference(q, k, v, mask, 0.3)
    assert got.shape == (B, 1, Hq, Dv) and got.dtype == torch.bfloat16
    bound = want.abs() * 2.0 ** -8 + (2 * score_err + 4 * L * 2.0 ** -24) * v.abs().max().item()
    err = (got.double() - want).abs()
    worst = err.flatten().argmax()
    assert (err <= bound).all(), f"max error {err.flatten()[worst]:.3g}, bound there {bound.flatten()[worst]:.3g}"


def test_other_calls_go_to_sdpa(engine, monkeypatch):
    """Only bf16 CPU calls with a bool mask (or none) and one query or at least
    PREFILL_MIN_QUERIES run on the pool."""
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
            dict(query=torch.randn(1, 4, 3, 16).bfloat16()),                         # a 3-query prefill
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


@pytest.mark.parametrize("dense", ["auto", "int8"])
def test_mla_decodes_from_the_latents_and_matches_the_expansion(ckpt, monkeypatch, dense):
    """DeepSeek-V3's MLA: each decode step's attention runs from the cached latents (kv_b_proj's
    rows absorbed; no expansion of the cache; kv_b_proj kept a torch layer whatever the dense
    format). With bf16 dense layers the logits are within the bound of the test above of the
    same model expanding the cache through SDPA, while both generated alike. (int8 dense layers
    quantize every layer's input again, which magnifies any one-rounding difference between two
    attention paths, the pool attention on expanded keys as much as this one: the attention
    itself is checked against fp64 in the next test.)"""
    path = ckpt("deepseek_v3", "bf16")
    model = tandem.load_model(path, {"version": 1, "cpu": {"dense_format": dense}, "gpu": {"device": "none"}},
                              progress=False)
    assert model.tandem_mla == model.config.num_hidden_layers
    assert type(model.model.layers[0].self_attn.kv_b_proj) is torch.nn.Linear
    absorbed, expanded = [], []
    real_mla, real_sdpa = ta._mla_decode, ta._sdpa
    monkeypatch.setattr(ta, "_mla_decode", lambda *a: absorbed.append(1) or real_mla(*a))
    monkeypatch.setattr(ta, "_sdpa", lambda *a, **k: expanded.append(a[1].shape[2]) or real_sdpa(*a, **k))
    prompt = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    gen = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.inference_mode():
        a = model.generate(prompt, **gen)
        layers = model.config.num_hidden_layers
        assert expanded == [10] * layers and len(absorbed) == 5 * layers  # the prompt expanded, 5 steps absorbed
        if dense != "auto":
            return
        model.set_attn_implementation("sdpa")
        b = model.generate(prompt, **gen)
    n = prompt.shape[1]
    for row in range(2):
        for s in range(6):
            want, got = b.logits[s][row].float(), a.logits[s][row].float()
            assert ((got - want).norm() / want.norm()).item() < 2e-2, f"row {row}, step {s}"
            if a.sequences[row, n + s] != b.sequences[row, n + s]:
                break


@pytest.mark.parametrize("on_pool", [False, True])
def test_mla_absorbed_attention_matches_fp64(ckpt, seed, on_pool):
    """One MLA decode step from random latents, against the expansion in fp64. The absorbed
    form rounds at most three products to bf16 (q W_UK in torch, the softmax-weighted latent,
    the output), each a relative error of at most 2^-9 per element: a relative L2 error under
    3 x 2^-9 plus the fp32 sums' (negligible); transformers' expansion rounds as many times
    (its keys, values, output). On the pool (latent and value widths of whole 64-output
    panels) both per-head products run as grouped layers on tandem's kernels."""
    path = ckpt("deepseek_v3", "bf16")
    model = tandem.load_model(path, {"version": 1, "gpu": {"device": "none"}}, progress=False)
    mod = model.model.layers[1].self_attn
    if on_pool:  # the test model's widths (16) are below a panel: a module with wider ones, same engine
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

        cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                               kv_lora_rank=128, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=64)
        engine = mod.__dict__["tandem_attention_engine"]
        torch.manual_seed(seed)
        mod = DeepseekV3Attention(cfg, 0).to(torch.bfloat16)
        mod.__dict__["tandem_attention_engine"] = engine
    nope, rope, v, r, H = mod.qk_nope_head_dim, mod.qk_rope_head_dim, mod.v_head_dim, mod.kv_lora_rank, \
        mod.config.num_attention_heads
    g = torch.Generator().manual_seed(seed)
    B, S = 3, 37
    q = torch.randn(B, H, 1, nope + rope, generator=g).bfloat16()
    kv = torch.randn(B, 1, S, r, generator=g).bfloat16()
    k_rope = torch.randn(B, 1, S, rope, generator=g).bfloat16()
    mask = torch.rand(B, 1, 1, S, generator=g) > 0.2
    mask[..., 0] = True
    got = ta._mla_decode(mod, q, (kv, k_rope), mask, 0.0, mod.scaling, {}).double()   # [B, 1, H, v]
    w = mod.kv_b_proj.weight.double().view(H, nope + v, r)
    k = torch.einsum("bsr,hnr->bhsn", kv[:, 0].double(), w[:, :nope])
    val = torch.einsum("bsr,hvr->bhsv", kv[:, 0].double(), w[:, nope:])
    scores = (torch.einsum("bhn,bhsn->bhs", q[:, :, 0, :nope].double(), k)
              + torch.einsum("bhe,bse->bhs", q[:, :, 0, nope:].double(), k_rope[:, 0].double())) * mod.scaling
    scores = scores.masked_fill(~mask[:, 0], float("-inf"))
    want = torch.einsum("bhs,bhsv->bhv", torch.softmax(scores, -1), val)[:, None]
    err = ((got - want).norm() / want.norm()).item()
    print(f"absorbed MLA vs fp64 (pool: {on_pool}): relative L2 {err:.2e}")
    assert err < 3 * 2.0 ** -9
    wk, wv = mod.__dict__["tandem_absorbed"][1:]
    assert isinstance(wk, tandem._C.DenseLinear) == on_pool and isinstance(wv, tandem._C.DenseLinear) == on_pool
    if on_pool:
        assert (wk.groups, wk.n, wk.k) == (H, H * r, nope) and (wv.groups, wv.n, wv.k) == (H, H * v, r)


def test_prefill_head_parts(engine, monkeypatch):
    """Which prefill calls split their heads over the pool's threads, and how: whole GQA
    groups per part (every part with the one key head of an MQA), and none for calls that
    are small, need a gradient, have a per-head mask or unknown math, or when torch already
    has as many threads as the pool."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    mod = _Attn(4, engine)
    threads = engine.threads
    assert threads >= 2
    q, k = torch.zeros(1, 8, 128, 16), torch.zeros(1, 2, 128, 16)
    parts = ta._head_parts(mod, q, k, k, None, {"dropout": 0.0, "scaling": 0.25})
    assert parts == [(0, 4, 0, 1), (4, 8, 1, 2)]  # two kv groups: at most two parts
    mqa = ta._head_parts(mod, q, k[:, :1], k[:, :1], None, {})
    assert len(mqa) == min(threads, 8) and all(p[2:] == (0, 1) for p in mqa)
    assert [p[0] for p in mqa] + [8] == sorted({p[0] for p in mqa} | {8})  # contiguous, covering 0..8
    three = ta._head_parts(mod, torch.zeros(1, 6, 128, 16), torch.zeros(1, 3, 128, 16), torch.zeros(1, 3, 128, 16),
                           None, {})
    assert len(three) == min(threads, 3)  # three kv groups of two query heads, whole groups per part
    assert all(q0 == 2 * k0 and q1 == 2 * k1 for q0, q1, k0, k1 in three)
    assert three[0][0] == 0 and three[-1][1] == 6 and all(a[1] == b[0] for a, b in zip(three, three[1:]))
    mask = torch.ones(1, 1, 128, 128, dtype=torch.bool)
    assert ta._head_parts(mod, q, k, k, mask, {}) == parts
    assert ta._head_parts(mod, q, k, k, torch.ones(1, 8, 128, 128, dtype=torch.bool), {}) is None  # per head
    assert ta._head_parts(mod, q[:, :, :4], k[:, :, :4], k[:, :, :4], None, {}) is None  # small
    assert ta._head_parts(mod, q, k, k, None, {"softcap": 30.0}) is None
    assert ta._head_parts(mod, q.requires_grad_(), k, k, None, {}) is None
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert ta._head_parts(mod, q.detach(), k, k, None, {}) is None
    no_engine = _Attn(4, None)
    del no_engine.__dict__["tandem_attention_engine"]
    assert ta._head_parts(no_engine, q.detach(), k, k, None, {}) is None


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "deepseek_v2"])
def test_prefill_split_over_heads_gives_sdpas_bits(ckpt, kind, monkeypatch):
    """A model's prefill logits with every SDPA call's heads split over threads are those of
    whole calls, bit for bit (each head's arithmetic is the same alone), with and without a
    padding mask; the split really ran."""
    path = ckpt(kind, "bf16")
    model = tandem.load_model(path, {"version": 1, "cpu": {"virtual_subpools": 2}, "gpu": {"device": "none"}},
                              progress=False)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :7] = 0  # left padding
    split = []
    real = ta._helpers
    monkeypatch.setattr(ta, "_helpers", lambda n: split.append(n) or real(n))
    outs = {}
    monkeypatch.setattr(ta, "PREFILL_MIN_QUERIES", 1 << 30)  # every prefill through SDPA
    for on in (False, True):
        monkeypatch.setattr(ta, "PREFILL_SPLIT_MIN", 1 if on else 1 << 60)
        split.clear()
        with torch.no_grad():
            outs[on] = (model(ids).logits, model(ids, attention_mask=mask).logits)
        assert bool(split) == on
    assert all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))


@pytest.mark.parametrize("B,Hq,Hkv,D,Dv,Lq,L,padded", [
    (1, 8, 2, 32, 32, 70, 70, False),     # a causal prompt, GQA
    (2, 4, 4, 16, 16, 40, 40, True),      # left padding (bool mask), MHA
    (2, 6, 2, 24, 16, 33, 300, True),     # a chunk after 267 cached keys, MLA-like value dim
    (1, 4, 1, 64, 64, 200, 200, False),   # MQA, two key blocks
])
def test_prefill_matches_fp64(engine, monkeypatch, B, Hq, Hkv, D, Dv, Lq, L, padded):
    """A prompt's (or chunk's) attention on the pool against fp64: per element within one
    bf16 rounding of the output, one of the probabilities (2^-8 of max |v|), the fp32 score
    error, the fp32 sums over L keys and the exponentials' polynomial (2.4e-7 relative: 2^-21
    of max |v|); rows that admit no key are zeros."""
    g = torch.Generator().manual_seed(B * 1000 + L + Lq)
    q = torch.randn(B, Lq, Hq, D, generator=g).bfloat16().transpose(1, 2)  # as the projections leave it
    k = torch.randn(B, Hkv, L, D, generator=g).bfloat16()
    v = torch.randn(B, Hkv, L, Dv, generator=g).bfloat16()
    mask = None
    if padded:  # causal, and the first sequence's first 9 keys padding (its first rows see none)
        mask = torch.ones(Lq, L, dtype=torch.bool).tril(L - Lq)[None, None].repeat(B, 1, 1, 1)
        mask[0, ..., :9] = False
    calls = []
    real = ta._prefill
    monkeypatch.setattr(ta, "_prefill", lambda *a: calls.append(real(*a)) or calls[-1])
    with torch.inference_mode():
        got, _ = ta.pool_attention_forward(_Attn(Hq // Hkv, engine), q, k, v, mask, scaling=0.3)
    assert len(calls) == 1 and calls[0] is not None  # the pool ran it
    want, score_err, live = _reference(q, k, v, mask, 0.3)
    assert got.shape == (B, Lq, Hq, Dv) and got.dtype == torch.bfloat16
    vmax = v.abs().max().item()
    bound = want.abs() * 2.0 ** -8 + (2.0 ** -8 + 2 * score_err + 2 * L * 2.0 ** -24 + 2.0 ** -21) * vmax
    err = (got.double() - want).abs()
    worst = err.flatten().argmax()
    assert (err <= bound).all(), f"max error {err.flatten()[worst]:.3g}, bound there {bound.flatten()[worst]:.3g}"
    assert (got.masked_select(~live) == 0).all()


def test_prefill_calls_it_leaves_to_sdpa(engine, monkeypatch):
    """Prefill calls on the pool: bf16 with a bool mask or none, at least PREFILL_MIN_QUERIES
    queries; a float mask, fewer queries, and a mask-free causal call with fewer queries than
    keys (torch's is_causal aligns them with the first keys) go to SDPA."""
    seen = []
    real = ta._sdpa
    monkeypatch.setattr(ta, "_sdpa", lambda *a, **k: seen.append(1) or real(*a, **k))
    mod = _Attn(2, engine)
    n = ta.PREFILL_MIN_QUERIES
    q = torch.randn(1, 4, n, 16).bfloat16()
    k = torch.randn(1, 2, n, 16).bfloat16()
    with torch.inference_mode():
        ta.pool_attention_forward(mod, q, k, k, None)
        ta.pool_attention_forward(mod, q, k, k, torch.ones(1, 1, n, n, dtype=torch.bool))
        assert seen == []
        ta.pool_attention_forward(mod, q, k, k, torch.zeros(1, 1, n, n))               # float mask
        ta.pool_attention_forward(mod, q[:, :, : n - 1], k, k, None)                  # causal, Lq < L, no mask
        ta.pool_attention_forward(mod, q[:, :, : n - 1], k[:, :, : n - 1], k[:, :, : n - 1], None)  # short
        assert len(seen) == 3


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "deepseek_v2"])
def test_model_prefill_on_the_pool_matches_sdpa(ckpt, kind, monkeypatch):
    """A model's prefill (40-token prompts, with and without left padding) with its attention
    on the pool against the same model with SDPA: the pool ran every layer's call, each call
    within test_prefill_matches_fp64's bound of fp64 attention on its own inputs (the masks
    and layouts transformers hands it), and at the tokens routed alike in both runs
    (hf_models.clean_tokens: a router near-tie flips under any rounding difference; this
    random Mixtral flips most of its rows somewhere) the logits within generate_check's
    bound (relative L2 < 2e-2)."""
    path = ckpt(kind, "bf16")
    model = tandem.load_model(path, {"version": 1, "cpu": {"virtual_subpools": 2}, "gpu": {"device": "none"}},
                              progress=False)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :7] = 0
    calls = []
    real = ta._prefill

    def checked(engine, module, q, k, v, mask, scaling, is_causal):
        out = real(engine, module, q, k, v, mask, scaling, is_causal)
        calls.append(out)
        if out is not None:
            want, score_err, live = _reference(q, k, v, mask, scaling)
            terms = 2.0 ** -8 + 2 * score_err + 2 * k.shape[2] * 2.0 ** -24 + 2.0 ** -21
            bound = want.abs() * 2.0 ** -8 + terms * v.abs().max()
            assert ((out.double() - want).abs() <= bound).all() and (out.masked_select(~live) == 0).all()
        return out

    monkeypatch.setattr(ta, "_prefill", checked)
    rec = record_routing(model)
    outs, routes = {}, {}
    for on in (False, True):
        monkeypatch.setattr(ta, "PREFILL_MIN_QUERIES", 16 if on else 1 << 30)
        calls.clear()
        with torch.no_grad():
            outs[on] = (model(ids).logits, model(ids, attention_mask=mask).logits)
        assert len(calls) == 2 * model.config.num_hidden_layers  # every layer's call, run by the pool when on
        assert all((c is not None) == on for c in calls)
        routes[on] = list(rec)
        rec.clear()
    n = len(routes[True]) // 2
    for j, (want, got) in enumerate(zip(outs[False], outs[True])):
        clean = clean_tokens(routes[False][j * n:(j + 1) * n], routes[True][j * n:(j + 1) * n], *ids.shape)
        if j == 1:
            clean[1, :7] = False  # (the padded positions' logits are not compared)
        assert clean.sum() >= 8, f"routing differs for nearly every token ({(~clean).sum().item()})"
        err = (got - want).float().norm(dim=-1) / want.float().norm(dim=-1)
        print(f"{kind} {'padded' if j else 'plain'}: {clean.sum().item()} of {clean.numel()} tokens routed alike, "
              f"relative L2 there <= {err[clean].max().item():.2e}")
        assert (err[clean] < 2e-2).all()
