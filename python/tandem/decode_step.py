"""Whole decoder layers of one-token CPU decode in C++: ``use_decoder_steps``.

With every linear layer, norm, router and the attention on tandem's kernels, a CPU decode
step still spent a quarter to a third of its time between them: transformers' module calls,
views, casts, the rotary embedding's six bf16 operations, the residual adds, each a torch
operation of a few microseconds, about forty per layer (a 4-layer Qwen3-30B-A3B-shaped model
at int4: ~3 ms of a 13 ms token). ``use_decoder_steps(model, engine)`` gives each
Qwen3-MoE or Mixtral decoder layer whose parts are all tandem's (a fused q/k/v
``TandemLinear``, ``TandemRMSNorm`` norms, a ``TandemRouter``, ``TandemExperts`` on this
engine, the pool attention) a one-token path of two C++ calls (``_C.DecoderLayerStep``, tandem/decode_layer.h):
norm, q/k/v, Qwen3's per-head q/k norms and the rotary embedding; then the caller's cache appends the key and
value as transformers' layer would; then attention, o_proj, residual, norm, router, experts
and residual. Every rounding is the module path's, so the output is bit-identical to it.

A layer takes the path only after a probe shows it: two one-token steps of random hidden
states through the layer's own forward and through the C++ step, on fresh caches, must give
the same bits (a transformers version whose layer computes something else keeps its own
forward). At each call the path is taken for one sequence of one token, bf16 on the CPU, no
gradient, in eval mode, the pool attention in use, no attention mask (or one that keeps every key), no
other keyword that changes the math, and no hooks on the layer's parts (output capture such
as ``output_attentions`` works through hooks); any other call runs transformers' forward.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from .attention import ATTENTION_NAME, _unknown_kwargs
from .peft_glue import route_peft_wrappers

# Decoder layers whose forward is norm, attention, residual, norm, MoE block, residual, and
# the MoE blocks whose eval forward is router then experts (no shared expert); the probe
# still decides per layer.
SUPPORTED = frozenset({"Qwen3MoeDecoderLayer", "MixtralDecoderLayer"})
MOE_BLOCKS = frozenset({"Qwen3MoeSparseMoeBlock", "MixtralSparseMoeBlock"})


def _parts(layer: nn.Module, engine: Any) -> dict | None:
    """The layer's tandem parts and shapes, or None when one is not tandem's."""
    from .dense import TandemLinear, TandemRMSNorm
    from .modules import TandemExperts
    from .router import TandemRouter

    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or type(mlp).__name__ not in MOE_BLOCKS:
        return None
    q, k, v, o = (getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
    qk = [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]  # Qwen3's per-head norms
    if qk != [None, None]:
        norms += qk
    gate, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
    if not (all(isinstance(t, TandemLinear) for t in (q, k, v, o)) and all(isinstance(n, TandemRMSNorm) for n in norms)
            and isinstance(gate, TandemRouter) and isinstance(experts, TandemExperts)):
        return None
    packed = q._packed
    if not (k._packed is packed and v._packed is packed and packed.members == 3 and not packed.biases
            and o._columns is None and o.bias is None):
        return None
    D = getattr(attn, "head_dim", None)
    if not isinstance(D, int) or getattr(attn, "sliding_window", None) is not None:
        return None
    nq, nkv = q.out_features, k.out_features
    if (q._columns != (0, nq) or k._columns != (nq, nq + nkv) or v._columns != (nq + nkv, nq + 2 * nkv)
            or nq % D or nkv % D or v.out_features != nkv):
        return None
    if (gate.groups != 1 or gate.scale != 1.0 or gate.logits_dtype != torch.bfloat16
            or gate.scores_dtype not in (torch.bfloat16, torch.float32)):
        return None
    if experts.engine is not engine or experts.exchange is not None or engine.is_cuda:
        return None
    if any(n.weight.dtype != torch.bfloat16 or not n.weight.is_contiguous() for n in norms):
        return None
    return dict(attn=attn, mlp=mlp, q=q, o=o, gate=gate, experts=experts, norms=norms, D=D, nq=nq, nkv=nkv)


class _Step:
    """One layer's C++ step and what a call checks before taking it."""

    def __init__(self, layer: nn.Module, engine: Any, p: dict, name: str) -> None:
        attn, gate, norms = p["attn"], p["gate"], p["norms"]
        self.layer, self.attn, self.D = layer, attn, p["D"]
        self.Hq, self.Hkv = p["nq"] // p["D"], p["nkv"] // p["D"]
        self.hidden = p["q"].in_features
        qk = len(norms) == 4  # Qwen3's q_norm / k_norm
        self.weights = [n.weight for n in norms]
        self.ptrs = [w.data_ptr() for w in self.weights]
        self.packs = (p["q"]._packed, p["o"]._packed)
        # hooks on any of these mean a caller watches their inputs or outputs: the module path
        # (tandem's own pre-hook on the MoE block, which routes PEFT wrappers of its experts,
        # excepted: wrapped experts are no longer these parts, checked below)
        self.watched = [layer, attn, p["mlp"], gate, p["experts"], p["q"], p["o"], *norms,
                        attn.k_proj, attn.v_proj]
        self.hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in self.watched]
        if any(h is not route_peft_wrappers for m in self.watched
               for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())):
            raise ValueError(f"{name}: its modules have forward hooks")
        # the parts as they were found: a replaced one (PEFT wrapping the experts, a new
        # projection) sends every call to the module path
        self.parts = [(layer._modules, "self_attn", attn), (layer._modules, "mlp", p["mlp"]),
                      (p["mlp"]._modules, "gate", gate), (p["mlp"]._modules, "experts", p["experts"]),
                      *((attn._modules, a, getattr(attn, a)) for a in ("q_proj", "k_proj", "v_proj", "o_proj")
                        + (("q_norm", "k_norm") if qk else ())),
                      (layer._modules, "input_layernorm", norms[0]),
                      (layer._modules, "post_attention_layernorm", norms[1])]
        if qk and norms[2].eps != norms[3].eps:
            raise ValueError(f"{name}: q_norm and k_norm have different eps")
        self.step = engine.decoder_layer_step(
            self.hidden, self.Hq, self.Hkv, self.D, float(attn.scaling), self.ptrs[0], self.ptrs[1], norms[0].eps,
            self.ptrs[2] if qk else 0, self.ptrs[3] if qk else 0, norms[2].eps if qk else 0.0, p["q"]._packed.dense,
            p["o"]._packed.dense, gate._dense, gate.top_k, gate.renorm, gate.sorted, gate.scores_dtype == torch.float32,
            p["experts"].index, name)
        self.config = attn.config
        self.enabled = True  # (bench/ab_decode.py turns it off to compare)

    def takes(self, x: torch.Tensor, mask: torch.Tensor | None, cache: Any, pos_emb: Any, kwargs: dict) -> bool:
        if (not self.enabled or self.layer.training or x.dtype != torch.bfloat16 or x.device.type != "cpu"
                or x.shape != (1, 1, self.hidden) or cache is None
                or not isinstance(pos_emb, tuple) or len(pos_emb) != 2
                or getattr(self.config, "_attn_implementation", None) != ATTENTION_NAME
                or (torch.is_grad_enabled() and x.requires_grad) or _unknown_kwargs(kwargs)):
            return False
        cos, sin = pos_emb
        if (cos.dtype != torch.bfloat16 or sin.dtype != torch.bfloat16 or cos.numel() != self.D or sin.numel() != self.D
                or not cos.is_contiguous() or not sin.is_contiguous()):
            return False
        if mask is not None and not (mask.dtype == torch.bool and mask.numel() == mask.shape[-1] and bool(mask.all())):
            return False
        if (any(w.data_ptr() != p for w, p in zip(self.weights, self.ptrs))
                or not all(pk.bf16_on_pool for pk in self.packs)):
            return False
        if _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks:
            return False
        if any(d.get(a) is not m for d, a, m in self.parts):
            return False
        return all((len(m._forward_hooks), len(m._forward_pre_hooks)) == h for m, h in zip(self.watched, self.hooks))

    def __call__(self, x: torch.Tensor, cache: Any, pos_emb: tuple) -> torch.Tensor:
        """The layer's output for x [1, 1, hidden]; the cache gets this step's key and value
        (a cache whose keys are not [1, kv_heads, keys, head_dim] bf16 rows is refused)."""
        x = x.contiguous()
        cos, sin = pos_emb
        q = torch.empty(1, self.Hq, 1, self.D, dtype=torch.bfloat16)
        k = torch.empty(1, self.Hkv, 1, self.D, dtype=torch.bfloat16)
        v = torch.empty(1, self.Hkv, 1, self.D, dtype=torch.bfloat16)
        self.step.qkv(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr())
        keys, values = cache.update(k, v, self.attn.layer_idx)
        L = keys.shape[2]
        if (keys.dtype != torch.bfloat16 or values.dtype != torch.bfloat16 or keys.shape != (1, self.Hkv, L, self.D)
                or values.shape != keys.shape or keys.stride(3) != 1 or values.stride(3) != 1):
            raise RuntimeError(f"{self.step.name}: the KV cache returned keys {tuple(keys.shape)} {keys.dtype}; the "
                               "decoder-layer step reads [1, kv_heads, keys, head_dim] bf16 with contiguous rows")
        y = torch.empty_like(x)
        self.step.rest(x.data_ptr(), q.data_ptr(), keys.data_ptr(), keys.stride(1), keys.stride(2), values.data_ptr(),
                       values.stride(1), values.stride(2), L, y.data_ptr())
        return y


def _probe(module_forward: Any, step: _Step, rotary: nn.Module, seed: int) -> bool:
    """Two one-token steps of random hidden states (positions 0 and 1) through the layer's
    own forward and through the step, each on a fresh cache: the same bits?"""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(seed)
    outs = []
    try:
        with torch.no_grad():
            xs = [torch.randn(1, 1, step.hidden, generator=g).to(torch.bfloat16) for _ in range(2)]
            for fast in (False, True):
                cache = DynamicCache(config=step.config)
                got = []
                for pos, x in enumerate(xs):
                    pos_ids = torch.tensor([[pos]])
                    pe = rotary(x, pos_ids)
                    if fast:
                        got.append(step(x, cache, pe))
                    else:
                        y = module_forward(x, attention_mask=None, position_ids=pos_ids, past_key_values=cache,
                                           use_cache=True, position_embeddings=pe)
                        got.append(y[0] if isinstance(y, tuple) else y)
                outs.append(got)
    except (ValueError, RuntimeError):  # either path refused the probe: not this step
        return False
    return all(isinstance(a, torch.Tensor) and a.shape == b.shape and torch.equal(a, b) for a, b in zip(*outs))


def use_decoder_steps(model: nn.Module, engine: Any) -> int:
    """Gives `model`'s supported decoder layers (module docstring) the one-token C++ step
    where the probe agrees; returns how many. Needs the pool attention in use."""
    if engine is None or getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        return 0
    rotary = next((m for n, m in model.named_modules() if n.endswith("rotary_emb")), None)
    if rotary is None:
        return 0
    n = 0
    for name, layer in model.named_modules():
        if type(layer).__name__ not in SUPPORTED or "tandem_module_forward" in layer.__dict__:
            continue
        p = _parts(layer, engine)
        if p is None:
            continue
        try:
            step = _Step(layer, engine, p, name)
        except (ValueError, RuntimeError):
            continue
        module_forward = layer.forward  # the bound method: every call the step does not take
        if not _probe(module_forward, step, rotary, seed=n):
            continue
        _install(layer, step, module_forward)
        n += 1
    return n


def _install(layer: nn.Module, step: _Step, module_forward: Any) -> None:

    def forward(hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        if step.takes(hidden_states, attention_mask, past_key_values, position_embeddings, kwargs):
            return step(hidden_states, past_key_values, position_embeddings)
        return module_forward(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, use_cache=use_cache,
                              position_embeddings=position_embeddings, **kwargs)

    layer.forward = forward
    layer.tandem_module_forward = module_forward
    layer.tandem_decoder_step = step
