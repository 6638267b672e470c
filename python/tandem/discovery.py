"""Where a transformers MoE model keeps its routed experts, and the shapes of their layouts.

``find_moe_blocks`` lists a decoder-only model's MoE blocks; ``expert_shape`` reads
(experts, hidden, intermediate) of a transformers v5 fused experts module or a v4 ModuleList of
per-expert MLPs. The v4 helpers find a per-expert MLP's gate / up / down projections
(``v4_modules``, ``v4_projections``) and give a v4 softmax-top-k block a forward that calls
the experts module with (hidden, top_k_index, top_k_weights) (``check_v4_block``,
``patch_v4_block``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .expert_math import PLAIN, ExpertMath
from .modules import FrozenLinear, TandemExperts

@dataclass(frozen=True)
class MoeBlock:
    """Where one MoE layer's routed experts live in a transformers model."""
    layer: int             # model layer index
    block: nn.Module       # the MoE block (mlp / block_sparse_moe)
    attr: str              # its attribute name on the decoder layer
    experts: nn.Module     # the experts module (fused v5) or ModuleList (v4 layout)
    path: str              # the experts module's name in the model ("model.layers.3.mlp.experts")


def find_moe_blocks(model: nn.Module) -> list[MoeBlock]:
    """The MoE blocks of a decoder-only transformers model, in layer order."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (expected model.model.layers)")
    found = []
    for i, layer in enumerate(layers):
        # Wherever the decoder layer keeps its MoE block (mlp, block_sparse_moe, feed_forward,
        # ...): the child module holding an `experts` module.
        for attr, block in layer.named_children():
            experts = getattr(block, "experts", None)
            if isinstance(experts, nn.Module):
                prefix = "model." if base is not model else ""
                found.append(MoeBlock(i, block, attr, experts, f"{prefix}layers.{i}.{attr}.experts"))
                break
    if not found:
        raise ValueError(f"{type(model).__name__}: no decoder layer has a block with routed experts (a child module "
                         "with an `experts` module, such as mlp.experts)")
    return found


_OAI_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def oai_math(experts: nn.Module) -> ExpertMath | None:
    """gpt-oss's experts layout (``GptOssExperts``), or None: float ``alpha`` and ``limit``,
    an ``_apply_gate`` of its class, and exactly gate_up_proj [E, H, 2I] (gate and up
    interleaved along the last dimension: gate at even columns), gate_up_proj_bias [E, 2I],
    down_proj [E, I, H] and down_proj_bias [E, H]. That it computes the gpt-oss formula is
    checked on its own forward (experts_check)."""
    if isinstance(experts, nn.ModuleList) or getattr(type(experts), "_apply_gate", None) is None:
        return None
    alpha, limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (alpha, limit)):
        return None
    names = sorted(n for n, _ in experts.named_parameters(recurse=False))
    if names != sorted(_OAI_TENSORS) or any(True for _ in experts.named_buffers()):
        return None
    gu, gb, dn, db = (getattr(experts, n) for n in _OAI_TENSORS)
    if gu.dim() != 3 or gu.shape[2] % 2:
        return None
    E, H, two_i = gu.shape
    I = two_i // 2
    if (tuple(gb.shape), tuple(dn.shape), tuple(db.shape)) != ((E, two_i), (E, I, H), (E, H)):
        return None
    return ExpertMath("clamped_swiglu", float(alpha), float(limit), 1.0, True)


def clamped_candidates(experts: nn.Module) -> list[ExpertMath]:
    """The maths a stock-layout experts module with its class's own ``_apply_gate`` may compute,
    from its scalar settings (``limit`` / ``swiglu_limit``, ``swiglu_alpha`` / ``alpha``): a
    clamped SwiGLU with up + 0 or up + 1, and plain silu(gate) * up (a gate that only changes
    precision). Which one it is, if any, its own forward decides (experts_check)."""
    out = []
    limit = next((getattr(experts, a) for a in ("limit", "swiglu_limit") if _number(getattr(experts, a, None))), None)
    if limit is not None and math.isfinite(limit) and limit > 0:
        alpha = next((getattr(experts, a) for a in ("swiglu_alpha", "alpha") if _number(getattr(experts, a, None))), 1.0)
        out = [ExpertMath("clamped_swiglu", float(alpha), float(limit), o) for o in (0.0, 1.0)]
    return out + [PLAIN]


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def oai_weights(experts: nn.Module, rows: int | None = None) -> tuple[torch.Tensor, ...]:
    """A gpt-oss experts module's first `rows` experts (all: None) in the kernels' layout:
    gate, up [E, I, H], down [E, H, I] and the biases gate, up [E, I], down [E, H] (views
    of its tensors, not copies)."""
    gu, gb, dn, db = (getattr(experts, n).detach()[:rows] for n in _OAI_TENSORS)
    return (gu[..., 0::2].transpose(1, 2), gu[..., 1::2].transpose(1, 2), dn.transpose(1, 2),
            gb[:, 0::2], gb[:, 1::2], db)


def expert_shape(experts: nn.Module) -> tuple[int, int, int]:
    """(experts, hidden, intermediate) of a fused v5 experts module or a v4 ModuleList."""
    if isinstance(experts, TandemExperts):
        return experts.num_experts, experts.hidden_dim, experts.intermediate_dim
    if oai_math(experts) is not None:
        E, H, two_i = experts.gate_up_proj.shape
        return E, H, two_i // 2
    if isinstance(experts, nn.ModuleList):
        g = _unwrap_linear(v4_modules(experts[0])[0])
        return len(experts), g.in_features, g.out_features
    gu, dn = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(dn, torch.Tensor) or gu.dim() != 3:
        raise ValueError(f"{type(experts).__name__}: expected fused gate_up_proj [E, 2I, H] and down_proj [E, H, I] "
                         "(transformers v5) or a ModuleList of per-expert MLPs (v4)")
    if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
        raise ValueError(f"{type(experts).__name__}: transposed or interleaved gate/up layouts are not supported")
    if getattr(experts, "has_bias", False):
        raise ValueError(f"{type(experts).__name__}: experts with biases are not supported")
    E, two_i, H = gu.shape
    if tuple(dn.shape) != (E, H, two_i // 2):
        E_, H_, two_i_ = gu.shape
        if tuple(dn.shape) == (E_, two_i_ // 2, H_) and two_i_ % 2 == 0:  # x @ W: Llama 4's layout, unflagged
            raise ValueError(f"{type(experts).__name__}: gate_up_proj {tuple(gu.shape)} and down_proj "
                             f"{tuple(dn.shape)} are in the transposed layout ([E, H, 2I] and [E, I, H], used as "
                             "x @ W), which tandem supports only in gpt-oss's form")
        raise ValueError(f"{type(experts).__name__}: down_proj has shape {tuple(dn.shape)}, "
                         f"gate_up_proj {tuple(gu.shape)} needs {(E, H, two_i // 2)}")
    return E, H, two_i // 2


def v4_modules(expert: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """gate / up / down of a v4 per-expert MLP as they sit in the tree (nn.Linear or PEFT lora.Linear)."""
    for names in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
        mods = [getattr(expert, n, None) for n in names]
        if all(isinstance(_unwrap_linear(m), (nn.Linear, FrozenLinear)) for m in mods):
            return mods[0], mods[1], mods[2]
    raise ValueError(f"{type(expert).__name__}: a per-expert module needs gate_proj/up_proj/down_proj "
                     "or w1/w3/w2 linear layers")


def _unwrap_linear(m: nn.Module | None) -> nn.Module | None:
    while m is not None and hasattr(m, "base_layer") and hasattr(m, "lora_A"):
        m = m.base_layer
    return m


def v4_projections(expert: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
    mods = tuple(_unwrap_linear(m) for m in v4_modules(expert))
    if all(isinstance(m, nn.Linear) for m in mods):
        return mods[0], mods[1], mods[2]
    raise ValueError(f"{type(expert).__name__}: a per-expert module needs gate_proj/up_proj/down_proj "
                     "or w1/w3/w2 linear layers")


# ---- v4 layout: per-expert ModuleList, the block does its own routing ----------------

def check_v4_block(block: nn.Module) -> None:
    if not isinstance(getattr(block, "gate", None), nn.Linear):
        raise ValueError(f"{type(block).__name__}: a v4 per-expert MoE block needs a gate nn.Linear router "
                         "(softmax top-k); grouped/sigmoid v4 routers are not supported, use transformers v5")
    if hasattr(block, "shared_expert") or hasattr(block, "shared_experts"):
        raise ValueError(f"{type(block).__name__}: v4 blocks with shared experts are not supported, use transformers v5")


def patch_v4_block(block: nn.Module, model: nn.Module, run: Callable | None = None) -> None:
    """Gives a v4-style softmax-top-k MoE block (gate: nn.Linear, experts: ModuleList; Qwen3-MoE
    and Mixtral in transformers v4) a forward that routes like v4 and calls the experts
    module (or `run`) with (hidden, top_k_index, top_k_weights), returning (out, router_logits)."""
    cfg = getattr(model, "config", None)
    top_k = getattr(block, "top_k", None) or getattr(cfg, "num_experts_per_tok", None)
    if not top_k:
        raise ValueError(f"{type(block).__name__}: cannot tell top_k (no block.top_k or config.num_experts_per_tok)")
    norm = getattr(block, "norm_topk_prob", getattr(cfg, "norm_topk_prob", True))
    if getattr(cfg, "model_type", "") == "mixtral":
        norm = True

    def forward(hidden_states: torch.Tensor):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        logits = block.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        w, idx = torch.topk(probs, top_k, dim=-1)
        if norm:
            w = w / w.sum(dim=-1, keepdim=True)
        out = (run or block.experts)(x, idx, w.to(x.dtype))
        return out.view(b, s, h), logits

    block.forward = forward
