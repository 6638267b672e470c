"""PEFT's LoRA wrappers over tandem's experts: which model and experts module lie under PEFT's
wrappers (``hf_model``, ``innermost``, ``has_v4_lora``), routing the v5 ``ParamWrapper``
chain's forward to ``TandemLoraExperts`` (``route_peft_wrappers``, a forward pre-hook of each
MoE block, and ``claim_wrappers``), and v4 per-expert ``lora.Linear`` layers run in tandem
(``attach_v4_lora``). The adapters themselves are read by ``tandem.lora``.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from .discovery import patch_v4_block, v4_modules
from .lora import is_param_wrapper, linear_lora, param_wrapper_lora
from .modules import FrozenLinear, TandemLoraExperts


def hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT model (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def innermost(experts: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """(the experts module under any PEFT ParamWrappers, the innermost wrapper or None)."""
    wrapper = None
    while is_param_wrapper(experts):
        wrapper, experts = experts, experts.base_layer
    return experts, wrapper


def has_v4_lora(experts: nn.Module) -> bool:
    return isinstance(experts, nn.ModuleList) and any(hasattr(m, "lora_A") for m in v4_modules(experts[0]))


def route_peft_wrappers(block: nn.Module, args) -> None:
    """Forward pre-hook of a MoE block whose experts are tandem's: when PEFT has wrapped them
    (ParamWrapper on gate_up_proj / down_proj, before or after offloading), the outermost
    wrapper's forward becomes tandem's LoRA path instead of PEFT's weight parametrization
    (which would materialize every expert's W + BA)."""
    ex = block.experts
    if is_param_wrapper(ex) and "forward" not in ex.__dict__:
        te, _ = innermost(ex)
        if isinstance(te, TandemLoraExperts):
            claim_wrappers(ex, te)


def claim_wrappers(outer: nn.Module, te: "TandemLoraExperts") -> None:
    """Routes a PEFT ParamWrapper chain over tandem's experts to tandem: the outermost
    wrapper's forward calls tandem with the adapters; merging (which would fold B A into
    every expert's weight, here frozen in the CPU packs) is refused before anything is done."""
    outer.forward = functools.partial(_peft_experts_forward, outer, te)
    m = outer
    while is_param_wrapper(m):
        m.merge = functools.partial(_refuse_merge, te.layer)
        m = m.base_layer


def _refuse_merge(layer: int, *args, **kwargs) -> None:
    raise ValueError(f"tandem experts (model layer {layer}): merging LoRA into the experts is not supported: their "
                     "base is frozen in tandem's CPU packs. Layers merged before this one are merged now: call "
                     "model.unmerge_adapter() to undo them. To get merged weights, load the adapter onto the stock "
                     "model: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(...), dir)"
                     ".merge_and_unload()")


def _peft_experts_forward(wrapper: nn.Module, te: "TandemLoraExperts", hidden_states: torch.Tensor,
                          top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    where = f"tandem experts (model layer {te.layer})"
    if args or kwargs.get("adapter_names"):
        raise ValueError(f"{where}: unexpected arguments to the experts (mixed-adapter batches are not supported)")
    lora = param_wrapper_lora(wrapper, te.num_experts, te.hidden_dim, te.intermediate_dim, where)
    return te(hidden_states, top_k_index, top_k_weights, lora=lora)


def attach_v4_lora(block: nn.Module, model: nn.Module, experts: nn.ModuleList, te: TandemLoraExperts) -> None:
    """A v4 block whose per-expert projections carry PEFT lora.Linear layers: the ModuleList
    stays where PEFT put it (adapter names, save_pretrained, load_adapter unchanged), each
    wrapped nn.Linear gives way to a storage-free stand-in, and the block runs its experts in
    tandem with the per-expert adapters stacked per projection."""
    for ex in experts:  # projections PEFT left alone give up their weights too
        for name, child in list(ex.named_children()):
            if type(child) is nn.Linear:
                setattr(ex, name, FrozenLinear(child))
    mods = [v4_modules(ex) for ex in experts]
    for triple in mods:
        for m in triple:
            holder = m
            while hasattr(holder, "lora_A") and hasattr(holder.base_layer, "lora_A"):
                holder = holder.base_layer
            if hasattr(holder, "lora_A") and isinstance(holder.base_layer, nn.Linear):
                holder.base_layer = FrozenLinear(holder.base_layer)
    where = f"tandem experts (model layer {te.layer})"
    E, H, I = te.num_experts, te.hidden_dim, te.intermediate_dim
    # not a submodule: the ModuleList keeps the tree PEFT knows
    object.__setattr__(block, "tandem_experts", te)

    def run(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return te(x, idx, w, lora=linear_lora(experts, mods, E, H, I, where))

    patch_v4_block(block, model, run)
