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
DeepSeek-V2 decoder layers get the same two calls with MLA (the query and kv_a products, the
latent's norm, the complex rotary embedding; the cache stores the latent and the rope key;
then ``tandem.attention``'s weight-absorbed one-token attention over the latents) and a
feed-forward of routed plus shared experts, or the dense first layer's MLP (each gated MLP on
``tandem.dense.use_gated_mlps``' path, which the module path runs too). DeepSeek-V3 layers
keep their forward (a sigmoid router with a bias, another rotary embedding).

``use_model_step(model)`` then runs every layer's step in one C++ call per token
(``_C.DecoderStack``, each layer appending its key and value into the ``GrowingCache``'s
buffers itself) from a patched base-model forward (``_ModelStep``): the per-layer Python
between the steps (~200 us a layer) goes; its own probe and checks decide as below.

A layer takes the path only after a probe shows it: two one-token steps of random hidden
states through the layer's own forward and through the C++ step, on fresh caches, must give
the same bits (a transformers version whose layer computes something else keeps its own
forward). At each call the path is taken for one sequence of one token, bf16 on the CPU, no
gradient, in eval mode, the pool attention in use, no attention mask (or one that keeps every key), no
other keyword that changes the math, and no hooks on the layer's parts (output capture such
as ``output_attentions`` works through hooks); any other call runs transformers' forward.
"""
from __future__ import annotations

import functools
import itertools
import operator
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _torch_module
from torch.utils.hooks import RemovableHandle

from .attention import ATTENTION_NAME, _unknown_kwargs
from .peft_glue import route_peft_wrappers

# Decoder layers whose forward is norm, attention, residual, norm, feed-forward, residual;
# the MoE blocks whose eval forward is router then experts (DeepSeek-V2's: plus its shared
# experts' MLP on the same input); the dense MLPs of the layers without routed experts.
# The probe still decides per layer.
SUPPORTED = frozenset({"Qwen3MoeDecoderLayer", "MixtralDecoderLayer", "DeepseekV2DecoderLayer"})
MOE_BLOCKS = frozenset({"Qwen3MoeSparseMoeBlock", "MixtralSparseMoeBlock", "DeepseekV2Moe"})
SHARED_EXPERTS = {"DeepseekV2Moe": "shared_experts"}
DENSE_MLPS = frozenset({"DeepseekV2MLP"})


_enabled = operator.attrgetter("enabled")
_training = operator.attrgetter("training")
_bf16_on_pool = operator.attrgetter("bf16_on_pool")
_initialized = operator.attrgetter("is_initialized")
_buffers = operator.attrgetter("_buffers")


def _capture_hook(h: Any) -> bool:
    """transformers' output-capture hook (output_hidden_states and the like): installed on a
    model's layers at the first call that asks for such outputs and left there, inert while
    no capture is active (``_capturing``)."""
    return getattr(h, "__qualname__", "").endswith("output_capturing_hook")


def _hooks(m: nn.Module) -> tuple[int, int]:
    """A module's forward hooks (transformers' inert output-capture hooks not counted) and
    pre-hooks."""
    fh = m._forward_hooks
    n = sum(1 for h in fh.values() if not _capture_hook(h)) if fh else 0
    return n, len(m._forward_pre_hooks)


try:
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # a transformers without it captures differently; its hooks count as hooks
    _active_collector = None


def _capturing() -> bool:
    """Whether transformers is capturing layer outputs now (a call with output_hidden_states,
    output_attentions, ...): the layers must then run their forward, which the hooks see."""
    # (every forward sets a collector; it is empty when nothing is captured)
    return _active_collector is not None and bool(_active_collector.get())


def _attention_parts(attn: nn.Module) -> dict | None:
    """The GQA attention's tandem parts (Qwen3-MoE / Mixtral), or None."""
    from .dense import TandemLinear, TandemRMSNorm

    q, k, v, o = (getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    qk = [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]  # Qwen3's per-head norms
    qk = [] if qk == [None, None] else qk
    if not (all(isinstance(t, TandemLinear) for t in (q, k, v, o)) and all(isinstance(n, TandemRMSNorm) for n in qk)):
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
    names = ("q_proj", "k_proj", "v_proj", "o_proj") + (("q_norm", "k_norm") if qk else ())
    return dict(kind="gqa", q=q, o=o, qk=qk, norms=qk, D=D, nq=nq, nkv=nkv, names=names,
                watched=[q, k, v, o, *qk], packs=(q._packed, o._packed))


def _mla_parts(attn: nn.Module) -> dict | None:
    """DeepSeek-V2's MLA attention's tandem parts (its one-token path on the pool:
    tandem.attention.use_mla_absorption), or None."""
    from .attention import _absorbed_weights, is_mla
    from .dense import TandemLinear, TandemRMSNorm, fused_pair

    if not is_mla(attn) or "tandem_expand_kv" not in attn.__dict__:
        return None
    engine = attn.__dict__.get("tandem_attention_engine")
    H = getattr(attn, "num_heads", None)
    nope, rope, v_dim, r = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim, attn.kv_lora_rank
    kv_a, kv_norm, o = attn.kv_a_proj_with_mqa, attn.kv_a_layernorm, attn.o_proj
    low_rank = getattr(attn, "q_lora_rank", None) is not None
    q = attn.q_a_proj if low_rank else attn.q_proj
    q_norm, q_b = (attn.q_a_layernorm, attn.q_b_proj) if low_rank else (None, None)
    if (engine is None or not isinstance(H, int) or attn.kv_b_proj.weight.dtype != torch.bfloat16
            or r % 64 or v_dim % 64 or rope % 2 or nope < 1):
        return None
    if not (all(isinstance(t, TandemLinear) for t in (q, kv_a, o) + ((q_b,) if low_rank else ()))
            and all(isinstance(n, TandemRMSNorm) for n in (kv_norm,) + ((q_norm,) if low_rank else ()))):
        return None
    if (not fused_pair(q, kv_a) or kv_a.out_features != r + rope or o._columns is not None or o.bias is not None
            or (low_rank and (q_b._columns is not None or q_b.bias is not None))
            or (not low_rank and q.out_features != H * (nope + rope))):
        return None
    scaling = getattr(attn, "scaling", None)
    if not isinstance(scaling, float):
        return None
    wk, wv = _absorbed_weights(attn, H, nope, v_dim, r, engine)
    names = ("kv_a_proj_with_mqa", "kv_a_layernorm", "o_proj", "kv_b_proj") + (
        ("q_a_proj", "q_a_layernorm", "q_b_proj") if low_rank else ("q_proj",))
    norms = [kv_norm] + ([q_norm] if low_rank else [])
    return dict(kind="mla", q=q, o=o, q_b=q_b, q_norm=q_norm, kv_norm=kv_norm, norms=norms, H=H, nope=nope,
                rope=rope, v_dim=v_dim, r=r, wk=wk, wv=wv, names=names, kv_b=attn.kv_b_proj.weight,
                watched=[q, kv_a, o, attn.kv_b_proj, *norms] + ([q_b] if low_rank else []),
                packs=(q._packed, o._packed) + ((q_b._packed,) if low_rank else ()))


def _ffn_parts(mlp: nn.Module, engine: Any) -> dict | None:
    """The feed-forward's tandem parts: routed experts (and shared experts), or a dense MLP."""
    from .modules import TandemExperts
    from .router import TandemRouter

    kind = type(mlp).__name__
    if kind in DENSE_MLPS:
        fast = mlp.__dict__.get("tandem_mlp")
        return None if fast is None else dict(moe=False, shared=fast, names=(), watched=[])
    if kind not in MOE_BLOCKS:
        return None
    gate, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
    if not (isinstance(gate, TandemRouter) and isinstance(experts, TandemExperts)):
        return None
    if gate.logits_dtype not in (torch.bfloat16, torch.float32) or gate.scores_dtype not in (torch.bfloat16,
                                                                                              torch.float32):
        return None
    if experts.engine is not engine or experts.exchange is not None or engine.is_cuda:
        return None
    shared, names = None, ("gate", "experts")
    if kind in SHARED_EXPERTS:
        attr = SHARED_EXPERTS[kind]
        shared = getattr(mlp, attr, None)
        shared = None if shared is None else shared.__dict__.get("tandem_mlp")
        if shared is None:
            return None
        names += (attr,)
    return dict(moe=True, gate=gate, experts=experts, shared=shared, names=names, watched=[gate, experts])


def _parts(layer: nn.Module, engine: Any) -> dict | None:
    """The layer's tandem parts and shapes, or None when one is not tandem's."""
    from .dense import TandemRMSNorm

    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return None
    at = _mla_parts(attn) if hasattr(attn, "kv_a_proj_with_mqa") else _attention_parts(attn)
    ffn = _ffn_parts(mlp, engine)
    norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
    if at is None or ffn is None or not all(isinstance(n, TandemRMSNorm) for n in norms):
        return None
    if any(n.weight.dtype != torch.bfloat16 or not n.weight.is_contiguous() for n in norms + at["norms"]):
        return None
    return dict(attn=attn, mlp=mlp, at=at, ffn=ffn, norms=norms)


class _Step:
    """One layer's C++ step and what a call checks before taking it."""

    def __init__(self, layer: nn.Module, engine: Any, p: dict, name: str) -> None:
        attn, at, ffn, norms = p["attn"], p["at"], p["ffn"], p["norms"]
        self.layer, self.attn, self.mla = layer, attn, at["kind"] == "mla"
        self.weights = [n.weight for n in norms + at["norms"]]
        self.ptrs = [w.data_ptr() for w in self.weights]
        self.packs = at["packs"] + ((ffn["shared"].packs if ffn["shared"] is not None else ()))
        # hooks on any of these mean a caller watches their inputs or outputs: the module path
        # (tandem's own pre-hook on the MoE block, which routes PEFT wrappers of its experts,
        # excepted: wrapped experts are no longer these parts, checked below; and tandem's
        # pre-hook on an MLA attention, which records the call's length)
        shared_mods = [] if ffn["shared"] is None else [ffn["shared"].mod, *(m for _, m in ffn["shared"].parts)]
        self.watched = [layer, p["mlp"], *norms, *at["watched"], *ffn["watched"], *shared_mods]
        self.hooks = [_hooks(m) for m in self.watched]
        own_pre = attn._forward_pre_hooks.values() if self.mla else ()
        if any(h is not route_peft_wrappers for m in self.watched
               for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values()) if not _capture_hook(h)):
            raise ValueError(f"{name}: its modules have forward hooks")
        if _hooks(attn) != (0, len(own_pre)):
            raise ValueError(f"{name}: its attention has forward hooks")
        self.attn_hooks = _hooks(attn)
        # the parts as they were found: a replaced one (PEFT wrapping the experts, a new
        # projection) sends every call to the module path
        self.parts = [(layer._modules, "self_attn", attn), (layer._modules, "mlp", p["mlp"]),
                      (layer._modules, "input_layernorm", norms[0]),
                      (layer._modules, "post_attention_layernorm", norms[1]),
                      *((attn._modules, a, getattr(attn, a)) for a in at["names"]),
                      *((p["mlp"]._modules, a, getattr(p["mlp"], a)) for a in ffn["names"])]
        self.shared = ffn["shared"]
        if self.shared is not None:  # its layers as found (their hooks are watched above)
            self.parts += [(self.shared.mod._modules, a, m) for a, m in self.shared.parts]
        mlp_dense = dict(mlp_gate_up=self.shared.dense[0], mlp_down=self.shared.dense[1]) if self.shared else {}
        route = {}
        if ffn["moe"]:
            gate = ffn["gate"]
            route = dict(router=gate._dense, top_k=gate.top_k, renorm=gate.renorm,
                         scores_f32=gate.scores_dtype == torch.float32, sorted=gate.sorted,
                         logits_f32=gate.logits_dtype == torch.float32, route_scale=gate.scale, groups=gate.groups,
                         top_groups=gate.top_groups, moe_index=ffn["experts"].index)
        self.hidden = norms[0].weight.shape[0]
        if self.mla:
            H, D = at["H"], at["nope"] + at["rope"]
            self.Hq, self.D, self.rank, self.rope = H, D, at["r"], at["rope"]
            self.kv_b = (at["kv_b"], at["kv_b"].data_ptr(), at["kv_b"]._version)
            low = {} if at["q_b"] is None else dict(q_b=at["q_b"]._packed.dense, q_a_norm=self.ptrs[3],
                                                     q_a_eps=at["q_norm"].eps)
            self.step = engine.decoder_layer_step(
                self.hidden, H, 1, D, float(attn.scaling), self.ptrs[0], self.ptrs[1], norms[0].eps,
                at["q"]._packed.dense, at["o"]._packed.dense, name, mla_rank=at["r"], rope=at["rope"],
                v_dim=at["v_dim"], kv_norm=self.ptrs[2], kv_eps=at["kv_norm"].eps, w_uk=at["wk"], w_uv=at["wv"],
                **low, **route, **mlp_dense)
        else:
            qk = bool(at["qk"])
            if qk and at["qk"][0].eps != at["qk"][1].eps:
                raise ValueError(f"{name}: q_norm and k_norm have different eps")
            self.D = at["D"]
            self.Hq, self.Hkv = at["nq"] // self.D, at["nkv"] // self.D
            self.step = engine.decoder_layer_step(
                self.hidden, self.Hq, self.Hkv, self.D, float(attn.scaling), self.ptrs[0], self.ptrs[1], norms[0].eps,
                at["q"]._packed.dense, at["o"]._packed.dense, name, q_norm=self.ptrs[2] if qk else 0,
                k_norm=self.ptrs[3] if qk else 0, qk_eps=at["qk"][0].eps if qk else 0.0, **route, **mlp_dense)
        self.config = attn.config
        self.enabled = True  # (bench/ab_decode.py turns it off to compare)

    def _pos_ok(self, pos_emb: Any) -> bool:
        if self.mla:  # DeepSeek-V2's complex frequencies [.., rope / 2]
            return (isinstance(pos_emb, torch.Tensor) and pos_emb.dtype == torch.complex64
                    and pos_emb.numel() * 2 == self.rope and pos_emb.is_contiguous())
        if not isinstance(pos_emb, tuple) or len(pos_emb) != 2:
            return False
        cos, sin = pos_emb
        return (cos.dtype == torch.bfloat16 and sin.dtype == torch.bfloat16 and cos.numel() == self.D
                and sin.numel() == self.D and cos.is_contiguous() and sin.is_contiguous())

    def takes(self, x: torch.Tensor, mask: torch.Tensor | None, cache: Any, pos_emb: Any, kwargs: dict) -> bool:
        if (x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape != (1, 1, self.hidden) or cache is None or not self._pos_ok(pos_emb)
                or getattr(self.config, "_attn_implementation", None) != ATTENTION_NAME
                or (torch.is_grad_enabled() and x.requires_grad) or _unknown_kwargs(kwargs)):
            return False
        if mask is not None and not (mask.dtype == torch.bool and mask.numel() == mask.shape[-1] and bool(mask.all())):
            return False
        if _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks or _capturing():
            return False
        return self.layer_ok()

    def layer_ok(self) -> bool:
        """The checks of ``takes`` that do not depend on the call: the step is on, its
        weights, packs and parts are the ones found, and none of its modules has hooks
        (global hooks are the caller's to check)."""
        if not self.enabled or self.layer.training:
            return False
        if (any(w.data_ptr() != p for w, p in zip(self.weights, self.ptrs))
                or not all(pk.bf16_on_pool for pk in self.packs)):
            return False
        if not self.special_ok():
            return False
        if any(d.get(a) is not m for d, a, m in self.parts):
            return False
        if _hooks(self.attn) != self.attn_hooks:
            return False
        return all(_hooks(m) == h for m, h in zip(self.watched, self.hooks))

    def special_ok(self) -> bool:
        """The checks of ``layer_ok`` only some layers have: MLA's kv_b_proj unchanged and
        absorbed, the shared experts' MLP path on."""
        if self.mla and (self.kv_b[0].data_ptr() != self.kv_b[1] or self.kv_b[0]._version != self.kv_b[2]
                         or self.attn.__dict__.get("tandem_absorbed") is None):
            return False  # kv_b_proj changed: the module path absorbs it again
        if self.shared is not None and not self.shared.enabled:
            return False  # the MLP's own path is off: the module path computes it in torch
        return True

    def __call__(self, x: torch.Tensor, cache: Any, pos_emb: Any) -> torch.Tensor:
        """The layer's output for x [1, 1, hidden]; the cache gets this step's key and value
        (a cache whose keys are not [1, kv_heads, keys, head_dim] bf16 rows is refused)."""
        x = x.contiguous()
        if self.mla:
            return self._call_mla(x, cache, pos_emb)
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

    def _call_mla(self, x: torch.Tensor, cache: Any, freqs: torch.Tensor) -> torch.Tensor:
        q = torch.empty(1, self.Hq, 1, self.D, dtype=torch.bfloat16)
        latent = torch.empty(1, 1, 1, self.rank, dtype=torch.bfloat16)
        k_rope = torch.empty(1, 1, 1, self.rope, dtype=torch.bfloat16)
        self.step.qkv_mla(x.data_ptr(), torch.view_as_real(freqs).data_ptr(), q.data_ptr(), latent.data_ptr(),
                          k_rope.data_ptr())
        lat, kr = cache.update(latent, k_rope, self.attn.layer_idx)
        L = lat.shape[2]
        if (lat.dtype != torch.bfloat16 or kr.dtype != torch.bfloat16 or lat.shape != (1, 1, L, self.rank)
                or kr.shape != (1, 1, L, self.rope) or lat.stride(3) != 1 or kr.stride(3) != 1):
            raise RuntimeError(f"{self.step.name}: the KV cache returned latents {tuple(lat.shape)} {lat.dtype}; the "
                               "decoder-layer step reads [1, 1, keys, rank] and [1, 1, keys, rope] bf16 rows")
        y = torch.empty_like(x)
        self.step.rest_mla(x.data_ptr(), q.data_ptr(), lat.data_ptr(), lat.stride(2), kr.data_ptr(), kr.stride(2), L,
                           y.data_ptr())
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


# Base models whose forward is: embed_tokens, position ids from the cache's length, a causal
# mask, rotary_emb once, every decoder layer in order, norm (transformers' Qwen3-MoE, Mixtral
# and DeepSeek-V2). The probe still decides.
MODEL_STEP_BASES = frozenset({"Qwen3MoeModel", "MixtralModel", "DeepseekV2Model"})
# Keywords of a base model's forward that do not change a one-token decode without extra
# outputs (a set output_* or return_dict=False sends the call to the module path).
_MODEL_HARMLESS = frozenset({"cache_position", "use_cache", "return_dict"})
_OUTPUT_FLAGS = ("output_attentions", "output_hidden_states", "output_router_logits")


# Rotary embeddings whose output for a position depends on nothing but that position and
# the module's inv_freq (the "dynamic" and "longrope" kinds rescale with the call's length).
STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})
ROPE_TABLE_MAX = 1 << 16  # positions a table holds at most; later ones call the module


class _RopeTable:
    """The rotary embedding of positions [0, length) from one call of the model's own rotary
    module, for the one-token steps to read their position's row instead of calling it
    (~30 us a call, several times that once a token's weights have gone through the
    caches). Made for the first ``ROPE_TABLE_MAX`` positions, grown by doubling, and used
    only if eight rows spread over it, its last and the position asked for have the bits of
    one-position calls (a vectorized cos over another length could round differently);
    remade when inv_freq or attention_scaling change."""

    def __init__(self, rotary: nn.Module, mla: bool) -> None:
        self.rotary, self.mla = rotary, mla
        kind = getattr(rotary, "rope_type", None)
        self.on = isinstance(kind, str) and kind in STATIC_ROPE and isinstance(getattr(rotary, "inv_freq", None),
                                                                               torch.Tensor)
        self.length, self.key = 0, None
        self.x = torch.zeros(1, 1, 1, dtype=torch.bfloat16)  # the dtype the steps read

    def _state(self) -> tuple:
        f = self.rotary.inv_freq
        return f.data_ptr(), f._version, getattr(self.rotary, "attention_scaling", None)

    def _split(self, pe: Any) -> tuple[torch.Tensor, ...] | None:
        """The table's tensors: (cos, sin) [length, D] bf16, or MLA's frequencies as fp32
        pairs [length, rope]."""
        if self.mla:
            if not isinstance(pe, torch.Tensor) or pe.dtype != torch.complex64:
                return None
            return (torch.view_as_real(pe).reshape(pe.shape[-2], -1).contiguous(),)
        if not isinstance(pe, tuple) or len(pe) != 2 or any(t.dtype != torch.bfloat16 for t in pe):
            return None
        return tuple(t.reshape(t.shape[-2], -1).contiguous() for t in pe)

    def _make(self, n: int) -> bool:
        length = max(256, self.length)
        while length <= n:
            length *= 2
        length = min(length, ROPE_TABLE_MAX)
        with torch.no_grad():
            key = self._state()
            parts = self._split(self.rotary(self.x, torch.arange(length)[None]))
            if parts is None or self._state() != key:
                return False
            for p in sorted({n, length - 1, *range(0, length, length // 8)}):
                one = self._split(self.rotary(self.x, torch.tensor([[p]])))
                if one is None or not all(torch.equal(a[p:p + 1], b) for a, b in zip(parts, one)):
                    return False
        self.parts, self.length, self.key = parts, length, key
        self.rows = [(t.data_ptr(), t.shape[1] * t.element_size()) for t in parts]
        return True

    def row(self, n: int) -> tuple[int, int, int] | None:
        """Position n's pointers for the stack (cos, sin, 0), or (0, 0, frequencies); None
        where the module must be called."""
        if not self.on or n >= ROPE_TABLE_MAX:
            return None
        if n >= self.length or self._state() != self.key:
            if not self._make(n):
                self.on = False  # not of this form: the module's calls from now on
                return None
        if self.mla:
            p, b = self.rows[0]
            return 0, 0, p + n * b
        (c, b), (s, _) = self.rows
        return c + n * b, s + n * b, 0


class _ModelStep:
    """One token through a whole base model: embedding, rotary embedding, every decoder
    layer's step in one C++ call (``_C.DecoderStack``, each layer appending its key and
    value into a ``GrowingCache``'s buffers itself), final norm. The per-layer path's
    arithmetic without its Python between the layers."""

    def __init__(self, base: nn.Module, steps: list[_Step]) -> None:
        from . import _C

        self.base, self.steps, self.config = base, steps, base.config
        self.layers = list(base.layers)
        self.mla = steps[0].mla
        if any(st.mla != self.mla for st in steps):
            raise ValueError("decoder layers of two attention kinds")
        self.stack = _C.DecoderStack([st.step for st in steps])
        self.forwards = [(layer.__dict__, layer.__dict__.get("forward")) for layer in self.layers]
        self.table = torch.zeros(len(steps), 6, dtype=torch.int64)  # per layer: the cache's pointers and strides
        self.bufs: list = []  # the buffers the table was made from
        self.rope = _RopeTable(base.rotary_emb, self.mla)
        self.pe = None  # the rotary module's output while the stack reads it (no table row)
        self.enabled = True
        # Every layer's per-call checks as flat lists (``_quick_ok``).
        self._q_layers = [st.layer for st in steps]
        self._q_fw = ([d for d, _ in self.forwards], [f for _, f in self.forwards])
        self._q_w = [w for st in steps for w in st.weights]
        self._q_ptrs = [p for st in steps for p in st.ptrs]
        self._q_packs = [pk for st in steps for pk in st.packs]
        parts = [pt for st in steps for pt in st.parts]
        self._q_parts = ([d for d, _, _ in parts], [a for _, a, _ in parts], [m for _, _, m in parts])
        self._q_special = [st for st in steps if st.mla or st.shared is not None]
        self._q_snap: int | None = None  # torch's hook handles made when the full check last passed

    def takes(self, input_ids: Any, inputs_embeds: Any, attention_mask: Any, position_ids: Any, cache: Any,
              use_cache: Any, kwargs: dict) -> int | None:
        """The cache's length n when this call is one token of a decode step the layers
        take (position n, every earlier key kept), else None."""
        from .kv_cache import GrowingCache, GrowingLayer

        base = self.base
        if (not self.enabled or base.training or torch.is_grad_enabled() or inputs_embeds is not None
                or not isinstance(input_ids, torch.Tensor) or input_ids.shape != (1, 1) or input_ids.is_cuda
                or type(cache) is not GrowingCache or use_cache is False
                or (use_cache is None and not getattr(self.config, "use_cache", True))
                or getattr(self.config, "_attn_implementation", None) != ATTENTION_NAME
                or base.config.num_hidden_layers != len(self.layers)):
            return None
        if any(k not in _MODEL_HARMLESS and v is not None and v is not False for k, v in kwargs.items()):
            return None
        if kwargs.get("return_dict") is False or any(getattr(self.config, f, False) for f in _OUTPUT_FLAGS):
            return None
        if _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks or _capturing():
            return None
        layers = cache.layers
        if (len(layers) != len(self.layers) or not all(map(_initialized, layers))
                or not all(map(operator.is_, map(type, layers), itertools.repeat(GrowingLayer)))):
            return None
        n = layers[0].get_seq_length()  # (the layers' views are not made: GrowingLayer.filled)
        if n < 1 or any(map(n.__ne__, map(GrowingLayer.get_seq_length, layers))):
            return None
        if position_ids is not None and (position_ids.numel() != 1 or int(position_ids) != n):
            return None
        cp = kwargs.get("cache_position")
        if cp is not None and (cp.numel() != 1 or int(cp) != n):
            return None
        if attention_mask is not None and not (attention_mask.dim() == 2 and attention_mask.shape == (1, n + 1)
                                               and bool(attention_mask.all())):
            return None
        return n if self.layers_ok() else None

    def layers_ok(self) -> bool:
        """Every layer's ``_Step.layer_ok`` (the decoder layer among its watched modules),
        plus its installed forward still in place."""
        if self._quick_ok():
            return True
        ok = all(d.get("forward") is f for d, f in self.forwards) and all(st.layer_ok() for st in self.steps)
        self._q_snap = RemovableHandle.next_id if ok else None
        return ok

    def _quick_ok(self) -> bool:
        """``layers_ok`` in C-level loops over flat lists (a Python loop over 48 layers' checks
        cost ~1.1 ms a token, on caches a token's weights had just gone through). The hooks:
        no hook registered anywhere since the full check last passed (torch numbers every
        handle it makes, ``RemovableHandle.next_id``). When that check passed, the watched
        modules held only tandem's own hooks and transformers' inert capture hooks; removing
        those changes nothing the stack computes. The rest as ``_Step.layer_ok`` checks it."""
        snap = self._q_snap
        if snap is None or RemovableHandle.next_id != snap:
            return False
        fw, parts = self._q_fw, self._q_parts
        return (all(map(_enabled, self.steps)) and not any(map(_training, self._q_layers))
                and list(map(torch.Tensor.data_ptr, self._q_w)) == self._q_ptrs
                and all(map(_bf16_on_pool, self._q_packs))
                and all(map(operator.is_, map(dict.get, fw[0], itertools.repeat("forward")), fw[1]))
                and all(map(operator.is_, map(dict.get, parts[0], parts[1]), parts[2]))
                and all(st.special_ok() for st in self._q_special))

    def _cache_table(self, cache: Any) -> None:
        """Room for one more position in every layer's buffers, and the table of their
        pointers and strides (remade when a buffer moved)."""
        layers = cache.layers
        for c in layers:
            c.reserve(1)
        bufs = list(map(_buffers, layers))
        if len(bufs) == len(self.bufs) and all(map(operator.is_, bufs, self.bufs)):
            return
        rows = []
        for kb, vb in bufs:
            if kb.dtype != torch.bfloat16 or vb.dtype != torch.bfloat16 or kb.stride(-1) != 1 or vb.stride(-1) != 1:
                raise RuntimeError("the KV cache does not hold bf16 rows: the model step cannot append to it")
            rows.append((kb.data_ptr(), kb.stride(1), kb.stride(2), vb.data_ptr(), vb.stride(1), vb.stride(2)))
        self.table = torch.tensor(rows, dtype=torch.int64)
        self.bufs = bufs

    def position(self, x: torch.Tensor, n: int) -> tuple[int, int, int] | None:
        """The stack's rotary arguments for position n (cos and sin pointers, or MLA's
        frequencies): a row of the table, else the rotary module's own output for n (kept
        in ``self.pe`` while the stack reads it); None when that is not of the steps' form."""
        ptrs = self.rope.row(n)
        if ptrs is not None:
            return ptrs
        pe = self.base.rotary_emb(x, torch.tensor([[n]], device=x.device))
        if not self.steps[0]._pos_ok(pe):
            return None
        self.pe = pe
        if self.mla:
            return 0, 0, torch.view_as_real(pe).data_ptr()
        return pe[0].data_ptr(), pe[1].data_ptr(), 0

    def run(self, x: torch.Tensor, cache: Any, n: int, pos: tuple[int, int, int]) -> None:
        """x [hidden] bf16, contiguous, in place through every layer at position n; the
        cache's views then end at n + 1."""
        self._cache_table(cache)
        self.stack.run(x.data_ptr(), *pos, self.table.data_ptr(), n)
        self.pe = None
        for c in cache.layers:
            c.filled(n + 1)  # (the views are made when read)

    def __call__(self, input_ids: torch.Tensor, cache: Any, n: int) -> Any:
        from transformers.modeling_outputs import MoeModelOutputWithPast

        base = self.base
        x = base.embed_tokens(input_ids)
        if x.dtype != torch.bfloat16 or x.shape != (1, 1, self.steps[0].hidden):
            return None
        x = x.contiguous().clone()
        pos = self.position(x, n)
        if pos is None:
            return None
        self.run(x, cache, n, pos)
        return MoeModelOutputWithPast(last_hidden_state=base.norm(x), past_key_values=cache)


def _probe_model(module_forward: Any, fast: _ModelStep, seed: int) -> bool:
    """A random 3-token prompt through the base model's own forward, then two one-token
    steps through it and through the model step, each on a fresh cache: the same bits?"""
    from .kv_cache import GrowingCache

    g = torch.Generator().manual_seed(seed)
    vocab = fast.base.embed_tokens.weight.shape[0]
    ids = torch.randint(0, vocab, (1, 5), generator=g)
    outs = []
    try:
        with torch.no_grad():
            for use_fast in (False, True):
                cache = GrowingCache(config=fast.config)
                module_forward(input_ids=ids[:, :3], past_key_values=cache, use_cache=True)
                got = []
                for t in (3, 4):
                    one = ids[:, t:t + 1]
                    if use_fast:  # (takes is not asked: the model may still be in training mode here)
                        y = fast(one, cache, t)
                    else:
                        y = module_forward(input_ids=one, past_key_values=cache, use_cache=True)
                    if y is None:
                        return False
                    got.append(y.last_hidden_state)
                outs.append(got)
    except (ValueError, RuntimeError):
        return False
    return all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(*outs))


def use_model_step(model: nn.Module) -> bool:
    """Gives `model`'s base model (``model.model``) the one-token path of ``_ModelStep``
    when every decoder layer has its step (``use_decoder_steps``) and a probe agrees;
    returns whether it did. Every call the path does not take runs the base model's forward."""
    base = getattr(model, "model", None)
    if base is None or type(base).__name__ not in MODEL_STEP_BASES or "tandem_module_forward" in base.__dict__:
        return False
    layers = getattr(base, "layers", None)
    if not layers or any("tandem_decoder_step" not in layer.__dict__ for layer in layers):
        return False
    if not all(hasattr(base, a) for a in ("embed_tokens", "rotary_emb", "norm")):
        return False
    try:
        fast = _ModelStep(base, [layer.tandem_decoder_step for layer in layers])
    except (ValueError, RuntimeError):
        return False
    module_forward = base.forward
    if not _probe_model(module_forward, fast, seed=len(layers)):
        return False

    def forward(input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                use_cache=None, **kwargs):
        n = fast.takes(input_ids, inputs_embeds, attention_mask, position_ids, past_key_values, use_cache, kwargs)
        if n is not None:
            out = fast(input_ids, past_key_values, n)
            if out is not None:
                return out
        return module_forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                              **kwargs)

    base.forward = forward
    base.tandem_module_forward = module_forward
    base.tandem_model_step = fast
    return True


# Causal LMs whose forward is: the base model, its last hidden state's last position (or
# all, ``logits_to_keep``) through lm_head, a loss only with labels, an auxiliary loss only
# with router logits. The probe still decides.
HEAD_STEP_MODELS = frozenset({"Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV2ForCausalLM"})
# The causal LM's own keywords the head step reads; every other goes to the model step's checks.
_HEAD_ARGS = ("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "use_cache",
              "labels", "logits_to_keep")


class _HeadStep:
    """One token through a whole causal LM: the embedding's row, the model step's stack,
    the final norm (``_C.rms_norm_bf16``, as ``TandemRMSNorm``) and lm_head (its
    ``TandemLinear``'s packed weight, bf16 out, as its forward) called directly, and the
    output the model's forward returns (logits and the cache). transformers' module calls
    around them (embedding, rotary embedding, norm, lm_head, the causal LM's and base
    model's glue: ~1 ms of Python a token on the 2-core machine, since a token's weights
    have just gone through the caches) go."""

    def __init__(self, model: nn.Module, fast: _ModelStep) -> None:
        from .dense import TandemLinear, TandemRMSNorm

        base = fast.base
        self.model, self.fast, self.base = model, fast, base
        lm, norm, emb = model.lm_head, base.norm, base.embed_tokens
        if not (type(lm) is TandemLinear and lm.fused_with == 1 and lm.bias is None and type(norm) is TandemRMSNorm
                and type(emb) is nn.Embedding and emb.max_norm is None):
            raise ValueError("lm_head, the final norm or the embedding is not of the head step's form")
        H = fast.steps[0].hidden
        if lm.in_features != H or norm.weight.shape != (H,) or emb.weight.shape[1] != H:
            raise ValueError("lm_head, the final norm or the embedding does not take the hidden size")
        self.lm, self.norm, self.emb, self.H, self.V = lm, norm, emb, H, lm.out_features
        self.parts = [(model._modules, "lm_head", lm), (model._modules, "model", base),
                      (base._modules, "norm", norm), (base._modules, "embed_tokens", emb),
                      (base._modules, "rotary_emb", base.rotary_emb)]
        # hooks on these would see calls the step no longer makes (the causal LM's own hooks
        # still run: its forward is what is replaced)
        self.watched = [base, lm, norm, emb, base.rotary_emb]
        self.hooks = [_hooks(m) for m in self.watched]
        if any(h != (0, 0) for h in self.hooks):
            raise ValueError("the base model, lm_head, the final norm or the embedding has hooks")
        self.base_forward = base.__dict__.get("forward")
        self.x = torch.empty(H, dtype=torch.bfloat16)
        self.xn = torch.empty(H, dtype=torch.bfloat16)
        self.out_cls = None  # the forward's output type (set by the probe)
        self.enabled = True

    def ok(self) -> bool:
        """The checks that do not depend on the call: the parts, weights and forwards found
        at install, no hooks on them, the kernels' own bf16 output."""
        norm, emb, lm = self.norm, self.emb, self.lm
        return (self.enabled and self.base.__dict__.get("forward") is self.base_forward
                and all(d.get(a) is m for d, a, m in self.parts)
                and all(_hooks(m) == h for m, h in zip(self.watched, self.hooks))
                and norm.weight.dtype == torch.bfloat16 and norm.weight.is_contiguous()
                and emb.weight.dtype == torch.bfloat16 and emb.weight.device.type == "cpu"
                and not lm._packed.biases and lm._packed.bf16_on_pool)

    def __call__(self, input_ids: torch.Tensor, cache: Any, n: int) -> Any:
        from . import _C

        tok = int(input_ids)
        w = self.emb.weight
        if not 0 <= tok < w.shape[0]:
            return None  # the module path raises its own error
        x, xn = self.x, self.xn
        x.copy_(w[tok])
        pos = self.fast.position(x, n)
        if pos is None:
            return None
        self.fast.run(x, cache, n, pos)
        _C.rms_norm_bf16(x.data_ptr(), self.norm.weight.data_ptr(), self.norm.eps, 1, self.H, xn.data_ptr())
        logits = torch.empty(1, 1, self.V, dtype=torch.bfloat16)
        packed = self.lm._packed
        packed.dense.forward_bf16(xn.data_ptr(), True, 1, self.H, logits.data_ptr(), self.V)
        packed.runs += 1
        return self.out_cls(logits=logits, past_key_values=cache)

    def takes(self, kwargs: dict) -> int | None:
        """The cache's length when this call of the causal LM's forward (keywords only) is
        one the model step takes and its output is the logits alone; else None."""
        if (kwargs.get("labels") is not None or kwargs.get("output_router_logits")
                or not isinstance(kwargs.get("logits_to_keep", 0), int)
                or getattr(self.model.config, "return_dict", True) is False or not self.ok()):
            return None
        rest = {k: v for k, v in kwargs.items() if k not in _HEAD_ARGS}
        get = kwargs.get
        return self.fast.takes(get("input_ids"), get("inputs_embeds"), get("attention_mask"), get("position_ids"),
                               get("past_key_values"), get("use_cache"), rest)


def _probe_head(module_forward: Any, head: _HeadStep, seed: int) -> bool:
    """A random 3-token prompt through the causal LM's own forward, then two one-token
    steps through it and through the head step, each on a fresh cache: the same logits,
    bit for bit, in the same output type? (The head step returns the type the forward
    returned: ``head.out_cls`` is set from the forward's first step.)"""
    from .kv_cache import GrowingCache

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, head.emb.weight.shape[0], (1, 5), generator=g)
    outs, types = [], []
    try:
        with torch.no_grad():
            for use_head in (False, True):
                cache = GrowingCache(config=head.model.config)
                module_forward(input_ids=ids[:, :3], past_key_values=cache, use_cache=True)
                got = []
                for t in (3, 4):
                    one = ids[:, t:t + 1]
                    y = head(one, cache, t) if use_head else module_forward(input_ids=one, past_key_values=cache,
                                                                            use_cache=True, logits_to_keep=1)
                    if y is None:
                        return False
                    if head.out_cls is None:
                        head.out_cls = type(y)
                    types.append((type(y), tuple(y.keys())))
                    got.append(y.logits)
                outs.append(got)
    except (ValueError, RuntimeError, TypeError):
        return False
    if len(set(types)) != 1:
        return False
    return all(a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(*outs))


def use_head_step(model: nn.Module) -> bool:
    """Gives a causal LM whose base model has the model step (``use_model_step``) the
    one-token path of ``_HeadStep`` where a probe agrees; returns whether it did. Every call
    the path does not take (positional arguments after input_ids, labels, router logits,
    any call the model step would not take) runs the model's own forward."""
    base = getattr(model, "model", None)
    fast = getattr(base, "tandem_model_step", None) if base is not None else None
    if (type(model).__name__ not in HEAD_STEP_MODELS or not isinstance(fast, _ModelStep)
            or "tandem_module_forward" in model.__dict__):
        return False
    try:
        head = _HeadStep(model, fast)
    except ValueError:
        return False
    module_forward = model.forward
    if not _probe_head(module_forward, head, seed=len(fast.steps)):
        return False

    @functools.wraps(module_forward)
    def forward(*args, **kwargs):
        if not args or (len(args) == 1 and "input_ids" not in kwargs):  # input_ids alone may be positional
            kw = dict(kwargs, input_ids=args[0]) if args else kwargs
            n = head.takes(kw)
            if n is not None:
                out = head(kw["input_ids"], kw["past_key_values"], n)
                if out is not None:
                    return out
        return module_forward(*args, **kwargs)

    model.forward = forward
    model.tandem_module_forward = module_forward
    model.tandem_head = head
    return True
