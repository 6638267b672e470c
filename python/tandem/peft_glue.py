"""PEFT's LoRA wrappers over tandem's experts: which model and experts module lie under PEFT's
wrappers (``hf_model``, ``innermost``, ``has_v4_lora``), routing the v5 ``ParamWrapper``
chain's forward to ``TandemLoraExperts`` (``route_peft_wrappers``, a forward pre-hook of each
MoE block, and ``claim_wrappers``), and v4 per-expert ``lora.Linear`` layers run in tandem
(``attach_v4_lora``). The adapters themselves are read by ``tandem.lora``.
"""
from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from .adapters import repack
from .discovery import patch_v4_block, v4_modules
from .lora import is_param_wrapper, linear_lora, param_wrapper_lora
from .modules import FrozenLinear, TandemExperts, TandemLoraExperts


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
        elif isinstance(te, TandemExperts):
            claim_inference_wrappers(ex, te)


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


def _chain(outer: nn.Module) -> list[nn.Module]:
    out, m = [], outer
    while is_param_wrapper(m):
        out.append(m)
        m = m.base_layer
    return out


def watch_block(block: nn.Module, te: nn.Module) -> None:
    """Block `block` holds tandem's fused experts `te`: PEFT wrappers over them are routed
    to tandem at the block's forward (``route_peft_wrappers``) and at merge time
    (``install_merge_dispatch``, which finds the chain's outermost wrapper through here)."""
    block.register_forward_pre_hook(route_peft_wrappers)
    te.__dict__["_tandem_block"] = weakref.ref(block)
    install_merge_dispatch()


def _tandem_chain(wrapper: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(outermost wrapper, tandem experts) when `wrapper` belongs to a chain over tandem's experts."""
    te, _ = innermost(wrapper)
    if not isinstance(te, (TandemExperts, TandemLoraExperts)):
        return None
    ref = te.__dict__.get("_tandem_block")
    block = ref() if ref is not None else None
    outer = getattr(block, "experts", None)
    if outer is None or not is_param_wrapper(outer) or innermost(outer)[0] is not te:
        outer = wrapper
    return outer, te


def install_merge_dispatch() -> None:
    """PEFT's ParamWrapper.merge / unmerge, for wrappers over tandem's experts, become
    tandem's (any wrapper of the chain, with or without a forward first; PEFT's own would
    add B A to a storage-free placeholder and crash); every other ParamWrapper keeps PEFT's."""
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:  # no PEFT: nothing can wrap the experts
        return
    if ParamWrapper.__dict__.get("_tandem_dispatch"):
        return
    peft_merge, peft_unmerge = ParamWrapper.merge, ParamWrapper.unmerge

    @functools.wraps(peft_merge)
    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        hit = _tandem_chain(self)
        if hit is None:
            return peft_merge(self, safe_merge=safe_merge, adapter_names=adapter_names)
        outer, te = hit
        if isinstance(te, TandemLoraExperts):
            _refuse_merge(te.layer)
        return _merge_into_packs(outer, te, adapter_names)

    @functools.wraps(peft_unmerge)
    def unmerge(self) -> None:
        hit = _tandem_chain(self)
        if hit is None:
            return peft_unmerge(self)
        outer, te = hit
        if isinstance(te, TandemExperts):
            _unmerge_packs(outer, te)

    ParamWrapper.merge, ParamWrapper.unmerge = merge, unmerge
    ParamWrapper._tandem_dispatch = True


def claim_inference_wrappers(outer: nn.Module, te: TandemExperts) -> None:
    """Routes a PEFT ParamWrapper chain over tandem's inference experts (which run no LoRA):
    unmerged, an active adapter is refused at the forward instead of being dropped (merged,
    the packs hold it: ``_merge_into_packs``)."""
    outer.forward = functools.partial(_inference_experts_forward, outer, te)


def _inference_experts_forward(wrapper: nn.Module, te: TandemExperts, hidden_states: torch.Tensor,
                               top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    where = f"tandem experts (model layer {te.layer})"
    if args or kwargs.get("adapter_names"):
        raise ValueError(f"{where}: unexpected arguments to the experts (mixed-adapter batches are not supported)")
    chain = _chain(wrapper)
    if any(m.merged for m in chain) and any(getattr(m, "disable_adapters", False) for m in chain):
        _unmerge_packs(wrapper, te)  # as PEFT's own forward does: disabled means the base weights
    if not any(m.merged for m in chain):
        if param_wrapper_lora(wrapper, te.num_experts, te.hidden_dim, te.intermediate_dim, where) is not None:
            raise ValueError(f"{where}: a LoRA adapter is active on these experts, but this model was loaded for "
                             "inference, whose engine runs no LoRA (the adapter would be silently dropped). Merge "
                             "it into tandem's packs first: model.merge_and_unload() (or model.merge_adapter()), "
                             "or load it with tandem.load_model(path, config, adapter=DIR); to train it, load the "
                             "model with train=True")
    return te(hidden_states, top_k_index, top_k_weights)


def _merge_into_packs(outer: nn.Module, te: TandemExperts, adapter_names: list[str] | None = None) -> None:
    """Re-packs te's layer with the chain's active adapter merged (``tandem.adapters.repack``,
    which refuses non-finite merged weights: PEFT's safe_merge check, always on)."""
    where = f"tandem experts (model layer {te.layer})"
    if te.exchange is not None:
        raise ValueError(f"{where}: these experts are shared by this machine's ranks ({te.exchange.mg.describe()}); "
                         "merging an adapter into them is not supported: merge it into a checkpoint first (tandem "
                         "merge) and load that, or set distributed.cpu_experts: per_rank")
    chain = _chain(outer)
    if any(m.merged for m in chain):  # the chain merges as one: done by its first wrapper's call
        return
    names = {a for m in chain for a in m.active_adapters if a in m.lora_A}
    if adapter_names is not None and set(adapter_names) != names:
        raise ValueError(f"{where}: merging adapters {sorted(adapter_names)} while {sorted(names)} are active; tandem "
                         "merges the active adapter (model.set_adapter(name) first)")
    lora = param_wrapper_lora(outer, te.num_experts, te.hidden_dim, te.intermediate_dim, where)
    if lora is None:
        return
    repack(te, lora)
    for m in chain:
        m.merged_adapters.extend(a for a in m.active_adapters if a in m.lora_A and a not in m.merged_adapters)


def _unmerge_packs(outer: nn.Module, te: TandemExperts) -> None:
    chain = _chain(outer)
    if not any(m.merged for m in chain):
        return
    repack(te, None)
    for m in chain:
        m.merged_adapters.clear()


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
