"""Attention for tandem's models: decode and prefill attention on tandem's pool for CPU
models (``use_pool_attention``), and which of torch's SDPA backends tandem's generation commands
let run on CUDA (``generation_attention``).

**Decode attention on the pool.** A CPU model whose linear layers run on tandem's kernels
still ran its attention in torch's SDPA, on the one thread torch keeps beside the pool:
a decode step read each layer's KV cache at one core's speed (on the 2-core AMX Xeon,
~160 us per layer at 150 cached tokens, as long as a 1.5 MB projection on the pool).
``use_pool_attention(model, engine)`` (called by ``tandem.load_model`` for CPU inference
unless ``cpu.dense_format`` is ``torch``) registers the attention function "tandem" with
transformers (``AttentionInterface``; masks as for SDPA) and sets the model to it. Its
calls with one query token (generation), bf16 q / k / v on the CPU, no dropout and a
boolean mask or none run ``_C.Engine.decode_attention`` (tandem/attention.h: every core
reads the cache, fp32 accumulation, one bf16 rounding, as SDPA's CPU kernels round).

**Prefill attention on the pool.** A prompt's (or a chunk's) calls of at least
``PREFILL_MIN_QUERIES`` queries, bf16 on the CPU, no dropout or gradient, a boolean mask or
none, run ``_C.Engine.prefill_attention`` (``_prefill``): flash attention whose two products
(scores, and probabilities times values) run on tandem's BF16 GEMM kernels on the pool, the
keys and values packed once per call, the softmax online in fp32, the probabilities rounded
to bf16 for the value product (SDPA's CPU flash attention's arithmetic, in another order).
On the 2-core Zen 4 machine, Qwen3-30B-A3B's heads, it ran 2.4-3.5x faster than the split
SDPA below at 512-4096 tokens (74-76% of the vdpbf16ps peak from 2048 on); the whole 4-layer
model's prefill 1.15x at 512 tokens and 1.23x at 2048 (bench/RESULTS.md). Every other call
(a float mask, softcap, attention sinks, gradients, fewer queries) goes to SDPA.

**SDPA on the pool's cores.** torch keeps one thread beside the pool, so a prompt's SDPA ran
on one core while the pool's waited: 5 ms per layer at 128 tokens and 64 ms at 512 for
Qwen3-30B-A3B's 32 heads on the 2-core Zen 4 machine, 10-13% of the whole prefill. The SDPA
calls the pool does not take (``_head_parts``: inference on the CPU, the pool having more
threads than torch, at least ``PREFILL_SPLIT_MIN`` query x key x head products, a mask
shared by the heads, no unknown keyword; an fp32 model's prefill, say) run as one SDPA call
per pool thread on contiguous groups of heads (whole GQA groups), on Python threads (torch
releases the GIL inside SDPA, and parked threads do not spin as torch's OpenMP workers would
on the pool's cores). Each head's arithmetic is the same alone, so the output is that of the
whole call, bit for bit.

torch 2.11 sends the SDPA calls of transformers' models on an H100 / H200 to cuDNN, which
builds an execution plan for every new shape it sees. In generation every decode step has a
new key length, so every step of a first generation builds plans: on an H200 (2026-11-27)
the demo model decoded at 14-18 tokens/s in the first generate of a process and at 170 in a
later one over the same lengths, plain transformers and tandem alike (bench/RESULTS.md).
``generation_attention(device)`` runs a generation with every SDPA backend except cuDNN
(flash, memory-efficient, math: no per-shape plans), restoring torch's flags afterwards;
``TANDEM_SDPA_CUDNN=1`` keeps cuDNN. `tandem run`, `chat`, `serve` and `bench` use it; a
script that calls ``model.generate`` itself can do the same:

    with tandem.attention.generation_attention(model.device):
        model.generate(...)

torch's backend flags are process-wide while the context is open (not per thread).

**MLA decode without re-expanding the cache.** transformers' DeepSeek-V2 / V3 attention (and
the models built on it) caches the compressed latents and, at every step, expands the whole
cache through ``kv_b_proj`` into per-head keys and values (``expand_kv``): a decode step's cost
grows with the context (at 160 cached tokens on DeepSeek-V2-Lite's shapes most of a token's
time). ``use_mla_absorption`` (with the pool attention above) computes a one-token step from the
latents instead, the weight-absorbed form llama.cpp and vLLM run: q_lat = q_nope W_UK per head,
scores = q_lat . latent + q_rope . k_rope, out = (softmax . latent) W_UV^T, where W_UK / W_UV
are ``kv_b_proj``'s key and value rows (kept a torch bf16 layer for this, whatever
``cpu.dense_format``). The same math as the expansion, rounded differently (scores and the
softmax in fp32). With the pool attention's engine (bf16, latent rank and value width in
whole 64-output panels) the step is one C++ call, ``_C.Engine.mla_decode``: both per-head
products as grouped layers on tandem's kernels and the attention over the latents on the
pool (tandem/attention.h); otherwise torch's bmm. Prefill, other masks and gradients expand
as transformers does.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch import nn

ATTENTION_NAME = "tandem"
# Keyword arguments transformers' attention modules pass that do not change the math of
# a one-token decode with the mask given (the mask already holds any sliding window).
_HARMLESS = frozenset({"sliding_window", "position_ids", "cache_position", "use_cache", "past_key_values",
                       "layer_idx", "is_causal"})


def _unknown_kwargs(kwargs: dict) -> bool:
    """Whether a call passes a keyword (set) that may change a one-token decode's math."""
    return any(v is not None and v is not False and k not in _HARMLESS for k, v in kwargs.items())


def _mask_rows(mask: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A bool mask [B or 1, 1, Lq or 1, keys] as the pool's uint8 rows [B or 1, Lq or 1, keys]
    with their batch and query strides (0: one row for every sequence / query); torch's bool
    bytes are 0 / 1, read as they are (no copy unless the keys are strided)."""
    rows = mask[:, 0]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows, 0 if rows.shape[0] == 1 else rows.stride(0), 0 if rows.shape[1] == 1 else rows.stride(1)

def _sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    parts = _head_parts(module, query, key, value, attention_mask, kwargs)
    if parts is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    # The heads in `parts` contiguous groups, each SDPA call on its own thread (the first on
    # this one): torch releases the GIL inside, and each head's arithmetic is the same alone.
    def part(q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        return sdpa_attention_forward(module, query[:, q0:q1], key[:, k0:k1], value[:, k0:k1], attention_mask,
                                      **kwargs)[0]

    futures = [_helpers(len(parts) - 1).submit(part, *p) for p in parts[1:]]
    outs = [part(*parts[0])] + [f.result() for f in futures]
    return torch.cat(outs, dim=2), None


# Prefill attention on the pool's cores: SDPA calls of at least this many query x key x head
# products (one 128-token prompt of Qwen3-30B-A3B's 32 heads is 2^19) have their heads split
# over threads, one per pool thread; smaller ones are not worth a thread's wake-up.
PREFILL_SPLIT_MIN = 1 << 16
_HELPERS: list = [None, 0]  # (executor, workers)


def _helpers(n: int) -> Any:
    """A thread pool of n workers (made again larger when asked for more)."""
    from concurrent.futures import ThreadPoolExecutor

    if _HELPERS[0] is None or _HELPERS[1] < n:
        _HELPERS[0], _HELPERS[1] = ThreadPoolExecutor(n, thread_name_prefix="tandem-attention"), n
    return _HELPERS[0]


def _head_parts(module, query, key, value, mask, kwargs) -> list[tuple[int, int, int, int]] | None:
    """How a prefill SDPA call of a CPU model on tandem's pool splits by heads: (q0, q1, k0, k1)
    per part, query heads [q0, q1) with key / value heads [k0, k1) (whole groups of a GQA, or
    every part with the one key head of an MQA); None to run it whole. torch keeps one thread
    beside the pool (``share_cpu_with_torch``), so a long prompt's attention ran on one core
    while the pool's cores waited: a 512-token prompt of a Qwen3-30B-A3B-shaped layer spent
    64 ms in it on the 2-core machine (bench/RESULTS.md). Split when the call is inference
    on the CPU, the pool has more threads than torch, the mask (if any) is the same for
    every head, and no keyword beyond dropout and scaling changes the math."""
    engine = module.__dict__.get("tandem_attention_engine")
    if engine is None or query.device.type != "cpu" or query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return None
    threads = getattr(engine, "threads", 1)
    B, Hq, Lq, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    if (threads <= torch.get_num_threads() or Lq * L * Hq < PREFILL_SPLIT_MIN or Hq < 2 or Hq % Hkv
            or value.shape[1] != Hkv
            or _unknown_kwargs({k: v for k, v in kwargs.items() if k not in ("dropout", "scaling")})
            or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))):
        return None
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[1] != 1):
        return None
    groups = Hkv if Hkv > 1 else Hq  # the units a part takes whole
    per = Hq // groups                # query heads per unit
    n = min(threads, groups)
    if n < 2:
        return None
    parts, u0 = [], 0
    for i in range(n):
        u1 = u0 + groups // n + (1 if i < groups % n else 0)
        k0, k1 = (u0, u1) if Hkv > 1 else (0, 1)
        parts.append((u0 * per, u1 * per, k0, k1))
        u0 = u1
    return parts


def pool_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract (query [B, Hq, Lq, D], key / value
    [B, Hkv, L, D] / [B, Hkv, L, Dv] -> ([B, Lq, Hq, Dv], None)): one-token CPU decode
    and prefill of PREFILL_MIN_QUERIES queries or more on the engine's pool, everything else
    through SDPA (see the module docstring)."""
    latent = module.__dict__.pop("tandem_latent", None)
    if latent is not None:  # MLA, one token: the latents stand in for key / value (use_mla_absorption)
        out = _mla_decode(module, query, latent, attention_mask, dropout, scaling, kwargs)
        if out is not None:
            return out, None
        key, value = module.__dict__["tandem_expand_kv"](*latent)
    engine = module.__dict__.get("tandem_attention_engine")
    B, Hq, Lq, D = query.shape
    if (engine is None or query.device.type != "cpu" or dropout
            or query.dtype != torch.bfloat16 or key.dtype != torch.bfloat16 or value.dtype != torch.bfloat16
            or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
            or _unknown_kwargs(kwargs)):
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if Lq != 1:
        out = _prefill(engine, module, query, key, value, attention_mask, scaling, kwargs.get("is_causal"))
        if out is not None:
            return out, None
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    Hkv, L = key.shape[1], key.shape[2]
    Dv = value.shape[3]
    mask, mask_b = None, 0
    if attention_mask is not None:
        m = attention_mask
        if (m.dtype != torch.bool or m.dim() != 4 or m.shape[-1] != L or m.shape[1] != 1 or m.shape[2] != 1
                or m.shape[0] not in (1, B)):
            return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        mask, mask_b, _ = _mask_rows(m)
    if (query.stride(3) != 1 or key.stride(3) != 1 or value.stride(3) != 1 or Hq % Hkv or value.shape[:3] != key.shape[:3]
            or key.shape[0] != B or key.shape[3] != D):
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = float(scaling) if scaling is not None else D ** -0.5
    out = torch.empty((B, 1, Hq, Dv), dtype=torch.bfloat16)
    engine.decode_attention(B, Hq, Hkv, D, Dv, L, scale, query.data_ptr(), query.stride(0), query.stride(1),
                            key.data_ptr(), key.stride(0), key.stride(1), key.stride(2),
                            value.data_ptr(), value.stride(0), value.stride(1), value.stride(2),
                            0 if mask is None else mask.data_ptr(), mask_b, out.data_ptr(), Hq * Dv, Dv)
    return out, None


# Prefill calls with at least this many query rows run on the pool's flash attention
# (``_prefill``); shorter ones (a few speculative tokens) through SDPA, whose per-call cost is
# lower than packing the keys and values.
PREFILL_MIN_QUERIES = 16


def _prefill(engine: Any, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, scaling: float | None,
             is_causal: bool | None) -> torch.Tensor | None:
    """A prompt's (or a chunk's) attention on the pool, its two products on tandem's BF16
    kernels (``_C.Engine.prefill_attention``, tandem/attention.h): [B, Lq, Hq, Dv] bf16, or
    None for a call it does not take (SDPA runs it). Causality as transformers' SDPA call
    decides it: without a mask, the module's ``is_causal`` (or the call's) with more than one
    query; a boolean mask [B or 1, 1, Lq or 1, L] holds the rest. torch's ``is_causal`` aligns
    the queries with the first keys, so a mask-free causal call with fewer queries than keys
    (which transformers never makes) is left to SDPA."""
    B, Hq, Lq, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    Dv = value.shape[3]
    if (Lq < PREFILL_MIN_QUERIES or key.dim() != 4 or value.dim() != 4 or Hq % Hkv or key.shape[0] != B
            or key.shape[3] != D or value.shape[:3] != key.shape[:3]
            or query.stride(3) != 1 or key.stride(3) != 1 or value.stride(3) != 1):
        return None
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    mask, mask_b, mask_l = None, 0, 0
    if attention_mask is not None:
        m = attention_mask
        if (m.dtype != torch.bool or m.dim() != 4 or m.shape[1] != 1 or m.shape[-1] != L
                or m.shape[0] not in (1, B) or m.shape[2] not in (1, Lq)):
            return None
        mask, mask_b, mask_l = _mask_rows(m)
        causal = False  # (the mask holds it)
    elif causal and Lq != L:
        return None
    scale = float(scaling) if scaling is not None else D ** -0.5
    if not 0 < scale < float("inf"):
        return None  # (the pool's kernel takes a positive scale)
    out = torch.empty((B, Lq, Hq, Dv), dtype=torch.bfloat16)
    engine.prefill_attention(B, Hq, Hkv, Lq, L, D, Dv, scale, causal, query.data_ptr(), query.stride(0),
                             query.stride(1), query.stride(2), key.data_ptr(), key.stride(0), key.stride(1),
                             key.stride(2), value.data_ptr(), value.stride(0), value.stride(1), value.stride(2),
                             0 if mask is None else mask.data_ptr(), mask_b, mask_l, out.data_ptr(), Lq * Hq * Dv,
                             Hq * Dv, Dv)
    return out


def is_mla(mod: nn.Module) -> bool:
    """A transformers MLA attention module whose cache holds the latents (DeepSeek-V2 / V3's)."""
    return (isinstance(getattr(mod, "kv_b_proj", None), nn.Linear) and callable(getattr(mod, "expand_kv", None))
            and all(isinstance(getattr(mod, a, None), int)
                    for a in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")))


def _mla_decode(module: nn.Module, query: torch.Tensor, latent: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, dropout: float, scaling: float | None,
                kwargs: dict) -> torch.Tensor | None:
    """One-token MLA attention from the cached latents (the module docstring's absorbed form):
    [B, 1, H, v_head_dim] bf16, or None for a call it does not take (expanded instead)."""
    kv, k_rope = latent  # [B, 1, S, r], [B, 1, S, rope]
    B, H, Lq, _ = query.shape
    nope, rope, v_dim, r = module.qk_nope_head_dim, module.qk_rope_head_dim, module.v_head_dim, module.kv_lora_rank
    S = kv.shape[2]
    if (Lq != 1 or dropout or query.shape[3] != nope + rope or kv.shape[3] != r or k_rope.shape[3] != rope
            or _unknown_kwargs(kwargs)):
        return None
    mask = None
    if attention_mask is not None:
        m = attention_mask
        if m.dim() != 4 or m.shape[-1] != S or m.shape[1] != 1 or m.shape[2] != 1 or m.shape[0] not in (1, B):
            return None
        mask = m if m.dtype == torch.bool else None
        if mask is None and not m.is_floating_point():
            return None
    engine = module.__dict__.get("tandem_attention_engine")
    if (engine is not None and not (query.dtype == module.kv_b_proj.weight.dtype == torch.bfloat16
                                    and r % 64 == 0 and v_dim % 64 == 0)):
        engine = None  # (the grouped layers' panels are 64 outputs wide; bf16 only)
    absorbed = _absorbed_weights(module, H, nope, v_dim, r, engine)
    if engine is None and absorbed[0].dtype != query.dtype:
        return None
    q_nope, q_rope = query[:, :, 0, :nope], query[:, :, 0, nope:]                  # [B, H, nope], [B, H, rope]
    scale = float(scaling) if scaling is not None else (nope + rope) ** -0.5
    if engine is not None:
        if (attention_mask is not None and mask is None) or kv.dtype != torch.bfloat16 or k_rope.dtype != torch.bfloat16:
            return None  # (an additive float mask, or latents in another dtype: expanded instead)
        return _mla_decode_on_pool(engine, absorbed, query, nope, kv, k_rope, mask, scale, r, v_dim)
    wk, wv = absorbed
    # Heads are rows of one product against each sequence's latents ([B, H, .] x [B, ., S]),
    # never a per-head copy of the cache; the weights' halves are batched over heads.
    q_lat = torch.bmm(q_nope.transpose(0, 1), wk).transpose(0, 1)                  # [B, H, r]
    kvf = kv[:, 0].float()                                                         # [B, S, r]
    # (latents x queries: the long operand untransposed, twice as fast here as queries x latents^T)
    scores = torch.bmm(kvf, q_lat.float().transpose(1, 2))                         # [B, S, H]
    scores += torch.bmm(k_rope[:, 0].float(), q_rope.float().transpose(1, 2))
    scores = scores.transpose(1, 2)                                                # [B, H, S]
    scores *= scale
    if mask is not None:
        scores.masked_fill_(~mask[:, 0], float("-inf"))
    elif attention_mask is not None:
        scores += attention_mask[:, 0].float()
    probs = torch.softmax(scores, dim=-1)
    o_lat = torch.bmm(probs, kvf).to(query.dtype)                                  # [B, H, r]
    out = torch.bmm(wv, o_lat.permute(1, 2, 0))                                    # [H, v, B]
    return out.permute(2, 0, 1).unsqueeze(1).contiguous()                          # [B, 1, H, v]


def _mla_decode_on_pool(engine: Any, absorbed: tuple, query: torch.Tensor, nope: int, kv: torch.Tensor,
                        k_rope: torch.Tensor, mask: torch.Tensor | None, scale: float, r: int,
                        v_dim: int) -> torch.Tensor:
    """The absorbed step in one call (``_C.Engine.mla_decode``, tandem/attention.h): q_lat =
    q_nope W_UK per head, attention of [q_lat, q_rope] over the latents as keys (the rope
    keys their second part) and values, then (softmax . latent) W_UV^T per head: three
    pool tasks, no torch operation between them."""
    wk, wv = absorbed
    B, H, _, D = query.shape
    rope, S = D - nope, kv.shape[2]
    if query.stride(3) != 1:
        query = query.contiguous()
    if kv.stride(3) != 1:
        kv = kv.contiguous()
    if k_rope.stride(3) != 1:
        k_rope = k_rope.contiguous()
    m, mask_b, _ = _mask_rows(mask) if mask is not None else (None, 0, 0)
    out = torch.empty(B, 1, H, v_dim, dtype=torch.bfloat16)
    engine.mla_decode(wk, wv, B, H, nope, rope, r, v_dim, S, scale, query.data_ptr(), query.stride(0),
                      query.stride(1), kv.data_ptr(), kv.stride(0), kv.stride(2), k_rope.data_ptr(), k_rope.stride(0),
                      k_rope.stride(2), 0 if m is None else m.data_ptr(), mask_b, out.data_ptr(), H * v_dim,
                      v_dim)
    return out


def _absorbed_weights(module: nn.Module, H: int, nope: int, v_dim: int, r: int, engine: Any = None) -> tuple:
    """kv_b_proj's key and value halves, made once per weight (its storage and version: an
    in-place change makes them again) and engine. With an engine (a bf16 weight): two
    grouped layers on its pool (``DenseLinear`` with H groups; tandem/dense.h), the key
    half transposed to [H * r, nope] (q_lat = q_nope W_UK per head) and the value half
    [H * v, r]; without: the halves as torch tensors [H, nope, r] / [H, v, r], contiguous
    (torch's bmm copies a strided batch at every call: 0.4 / 3 ms per layer and step here).
    Either takes as much memory as kv_b_proj itself (DeepSeek-V3: 32 MiB per layer)."""
    w = module.kv_b_proj.weight
    key = (w.data_ptr(), w._version, w.dtype, id(engine))
    cached = module.__dict__.get("tandem_absorbed")
    if cached is None or cached[0] != key:
        w3 = w.detach().view(H, nope + v_dim, r)
        wk, wv = w3[:, :nope, :].contiguous(), w3[:, nope:, :].contiguous()
        if engine is not None:
            name = f"layers.{getattr(module, 'layer_idx', '?')}.kv_b_proj"
            wkt = wk.transpose(1, 2).contiguous()  # [H, r, nope]: group h's r outputs from its nope inputs
            wk = engine.dense_linear(wkt.data_ptr(), H * r, nope, "bfloat16", "bf16", name=f"{name} (W_UK)", groups=H)
            wv = engine.dense_linear(wv.data_ptr(), H * v_dim, r, "bfloat16", "bf16", name=f"{name} (W_UV)", groups=H)
        cached = (key, wk, wv)
        module.__dict__["tandem_absorbed"] = cached
    return cached[1], cached[2]


def use_mla_absorption(model: nn.Module) -> int:
    """Makes `model`'s MLA attention modules (``is_mla``) decode from their latents (the
    module docstring) while the model uses the pool attention; returns how many."""
    n = 0
    for mod in model.modules():
        if not is_mla(mod) or "tandem_expand_kv" in mod.__dict__:
            continue
        expand = mod.expand_kv  # the bound method: prefill and every other call

        def deferred(kv, k_rope, mod=mod, expand=expand):
            if (mod.__dict__.get("tandem_lq") == 1 and kv.device.type == "cpu" and not torch.is_grad_enabled()
                    and getattr(mod.config, "_attn_implementation", None) == ATTENTION_NAME):
                mod.__dict__["tandem_latent"] = (kv, k_rope)
                return kv, k_rope  # placeholders: pool_attention_forward reads the latents
            return expand(kv, k_rope)

        def seq_length(m, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            m.__dict__["tandem_lq"] = h.shape[1] if isinstance(h, torch.Tensor) and h.dim() == 3 else None

        mod.__dict__["tandem_expand_kv"] = expand
        mod.expand_kv = deferred
        mod.register_forward_pre_hook(seq_length, with_kwargs=True)
        n += 1
    return n


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, pool_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


def use_pool_attention(model: nn.Module, engine: Any) -> int:
    """Runs `model`'s decode and prefill attention on `engine`'s pool: the model must use
    transformers' SDPA attention (its default on the CPU; an eager / flex / other choice is
    left alone, returning 0). Returns the number of attention modules that will."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return 0
    _register()
    n = 0
    for mod in model.modules():
        if hasattr(mod, "num_key_value_groups") or type(mod).__name__.endswith("Attention"):
            mod.__dict__["tandem_attention_engine"] = engine
            n += 1
    if n:
        model.set_attn_implementation(ATTENTION_NAME)
    return n


def sdpa_attention(model: nn.Module) -> None:
    """Gives a model set to the pool attention back to transformers' SDPA (for paths that
    take only SDPA-family models, such as continuous batching); others are left alone."""
    if getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME:
        model.set_attn_implementation("sdpa")


def generation_sdpa_backends(device: torch.device | str) -> list | None:
    """The SDPA backends a generation on ``device`` may use, or None to leave torch's choice
    (CPU devices, or TANDEM_SDPA_CUDNN=1)."""
    if torch.device(device).type != "cuda" or os.environ.get("TANDEM_SDPA_CUDNN") == "1":
        return None
    from torch.nn.attention import SDPBackend

    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def generation_attention(device: torch.device | str) -> contextlib.AbstractContextManager:
    """A context for one generation on ``device``: on CUDA, SDPA without cuDNN (see above)."""
    backends = generation_sdpa_backends(device)
    if backends is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(backends)
