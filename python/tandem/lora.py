"""LoRA fine-tuning of tandem-offloaded experts from ordinary torch / PEFT training loops.

``ExpertsFunction`` is the ``torch.autograd.Function`` around the C++ SFT path
(``_C.LoraLayer``, tandem/lora.h): its inputs are the hidden states, the routing weights
and the six LoRA matrices of a layer as ordinary tensors, and its backward returns their
gradients, so optimizers, gradient clipping, DDP all-reduce, gradient accumulation and
mixed precision see plain torch tensors. Each forward's saved state (a ``LoraContext``)
rides on a small tensor saved for backward, so gradient checkpointing (reentrant or not)
recomputes a fresh context and frees the first one with the tensor.

PEFT layouts are read as PEFT stores them, without copies of the parameters:

* transformers v5 fused experts, ``target_parameters=["mlp.experts.gate_up_proj",
  "mlp.experts.down_proj"]``: ``ParamWrapper``s around the experts module, lora_A
  ``[r*E, in]`` (expert-major rows) and lora_B ``[out, r*E]`` (column k*E + e);
* transformers v4 per-expert modules, ``target_modules=["gate_proj", "up_proj",
  "down_proj"]``: one ``lora.Linear`` per expert projection.

The wrappers stay in the module tree (so ``save_pretrained``, ``load_adapter``,
``set_adapter``, ``disable_adapter`` are stock PEFT); tandem replaces only their forward.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

from . import _C

_NAMES = ("a_gate", "b_gate", "a_up", "b_up", "a_down", "b_down")


@dataclass
class LoraTensors:
    """One layer's adapters as six [experts, rows, cols] tensors (any strides with a unit
    stride in the last or second-to-last dimension): A [r, in], B [out, r] per projection,
    and the scaling applied to B A."""
    a_gate: torch.Tensor
    b_gate: torch.Tensor
    a_up: torch.Tensor
    b_up: torch.Tensor
    a_down: torch.Tensor
    b_down: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a_gate.shape[1]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, n) for n in _NAMES)


def _spec(t: torch.Tensor) -> tuple[int, int, int, int, bool]:
    """(pointer, elements reachable, expert stride, ld, transposed) of a [E, rows, cols] fp32 CPU tensor."""
    E, rows, cols = t.shape
    s0, s1, s2 = t.stride()
    reach = 1 + (E - 1) * s0 + (rows - 1) * s1 + (cols - 1) * s2
    if s2 == 1 or cols == 1:
        return t.data_ptr(), reach, s0, max(s1, cols), False
    return t.data_ptr(), reach, s0, max(s2, rows), True


def _cpu_fp32(t: torch.Tensor) -> torch.Tensor:
    """t as an fp32 CPU tensor the C++ side can read (differentiable; a no-op when it is one)."""
    t = t.to(device="cpu", dtype=torch.float32)
    s = t.stride()
    if not (s[2] == 1 or s[1] == 1 or t.shape[2] == 1):
        t = t.contiguous()
    return t


class ExpertsFunction(torch.autograd.Function):
    """out = tandem's experts (with LoRA) of x routed by (ids, weights); see module doc."""

    @staticmethod
    def forward(ctx, layer: _C.LoraLayer, train: bool, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                *lora: torch.Tensor) -> torch.Tensor:
        T, H = x.shape
        K = ids.shape[1]
        xin = (x if x.dtype in (torch.bfloat16, torch.float32) else x.float()).contiguous()
        ids64 = ids.to(torch.int64).contiguous()
        w32 = weights.to(torch.float32).contiguous()
        out = torch.empty((T, H), dtype=torch.float32)
        # train: grad mode was on at the call and something needs a gradient (the caller's
        # view: inside forward grad mode is off, and needs_input_grad ignores no_grad).
        specs = [_spec(t) for t in lora]
        c = layer.forward(xin.data_ptr(), xin.dtype == torch.bfloat16, T, ids64.data_ptr(), w32.data_ptr(), K,
                          out.data_ptr(), specs, train)
        if train:
            # The context lives on a tensor saved for backward: it is freed with that tensor
            # (after backward, or when checkpointing drops it and recomputes a new one).
            handle = torch.empty(0)
            handle.tandem_context = c
            ctx.save_for_backward(handle, *lora)
            ctx.layer, ctx.shape, ctx.x_dtype, ctx.w_dtype = layer, (T, H, K), x.dtype, weights.dtype
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        handle, *lora = ctx.saved_tensors
        c = getattr(handle, "tandem_context", None)
        if c is None or not c.valid:
            raise RuntimeError(f"tandem experts (model layer {ctx.layer.layer_index}): the forward's saved state is gone "
                               "(a second backward through the same graph, or saved-tensor hooks that copy tensors); "
                               "run the forward again")
        T, H, K = ctx.shape
        need_x, need_w = ctx.needs_input_grad[2], ctx.needs_input_grad[4]
        g = d_out.contiguous()
        if g.dtype not in (torch.float32, torch.bfloat16):
            g = g.float()
        g = g.cpu()
        d_x = torch.empty((T, H), dtype=torch.float32) if need_x else None
        d_w = torch.empty((T, K), dtype=torch.float32) if need_w else None
        grads = [torch.zeros(t.shape, dtype=torch.float32) if ctx.needs_input_grad[5 + i] else None
                 for i, t in enumerate(lora)]
        gspecs = [_spec(t) if t is not None else (0, 0, 0, 0, False) for t in grads] if lora else []
        ctx.layer.backward(c, [_spec(t) for t in lora], g.data_ptr(), g.dtype == torch.bfloat16,
                           d_x.data_ptr() if d_x is not None else 0, False, d_w.data_ptr() if d_w is not None else 0,
                           gspecs)
        del handle.tandem_context
        return (None, None, d_x.to(ctx.x_dtype) if d_x is not None else None, None,
                d_w.to(ctx.w_dtype) if d_w is not None else None, *grads)


@functools.lru_cache(maxsize=64)
def _zeros(E: int, rows: int, cols: int) -> torch.Tensor:
    """Shared read-only zero adapters for a projection without LoRA."""
    return torch.zeros((E, rows, cols))


def run_experts(layer: _C.LoraLayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                lora: LoraTensors | None, where: str) -> torch.Tensor:
    """The experts of one layer with `lora` (None: the frozen base), differentiable in x,
    weights and every LoRA tensor. x on any device; the work runs on the CPU pools."""
    dev = x.device
    if lora is not None:
        r = lora.rank
        if r != layer.rank or not math.isclose(lora.scaling, layer.scaling, rel_tol=1e-7):
            layer.set_lora(r, lora.scaling * r, False)
        E, H, I = layer.experts, layer.hidden, layer.inter
        want = ((r, H), (I, r), (r, H), (I, r), (r, I), (H, r))
        ts = []
        for name, t, (rows, cols) in zip(_NAMES, lora.tensors(), want):
            if tuple(t.shape) != (E, rows, cols):
                raise ValueError(f"{where}: LoRA {name} has shape {tuple(t.shape)}, expected {(E, rows, cols)} "
                                 f"(experts {E}, rank {r})")
            ts.append(_cpu_fp32(t))
    else:
        ts = []
    if dev.type != "cpu":
        x, ids, weights = x.cpu(), ids.cpu(), weights.cpu()
    train = torch.is_grad_enabled() and (x.requires_grad or weights.requires_grad or any(t.requires_grad for t in ts))
    out = ExpertsFunction.apply(layer, train, x, ids, weights, *ts)
    return out if dev.type == "cpu" else out.to(dev)


# ---- PEFT ----------------------------------------------------------------------------

def is_param_wrapper(m: nn.Module) -> bool:
    return type(m).__name__ == "ParamWrapper" and hasattr(m, "parameter_name") and hasattr(m, "base_layer")


def _active(m: nn.Module, where: str) -> str | None:
    """The one active adapter of a PEFT layer (None: disabled or no adapter here)."""
    if getattr(m, "disable_adapters", False):
        return None
    if getattr(m, "merged", False):
        raise ValueError(f"{where}: the LoRA adapter is merged into the base weights; tandem keeps its base frozen in "
                         "the CPU pools, so unmerge it (model.unmerge_adapter()) to run it")
    names = [a for a in m.active_adapters if a in m.lora_A]
    if len(names) > 1:
        raise ValueError(f"{where}: {len(names)} active LoRA adapters ({', '.join(names)}) on the experts; tandem "
                         "runs one at a time (model.set_adapter(name))")
    return names[0] if names else None


def param_wrapper_lora(wrapper: nn.Module, E: int, H: int, I: int, where: str) -> LoraTensors | None:
    """The adapters of a (nested) PEFT ParamWrapper chain on fused v5 experts. lora_B of
    gate_up_proj has one row per output of the experts' gate_up product: gate then up, or,
    where the module keeps them interleaved (gpt-oss: ``is_concatenated`` False), gate and up
    alternating."""
    found: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    m = wrapper
    while is_param_wrapper(m):
        name = _active(m, where)
        if m.parameter_name not in ("gate_up_proj", "down_proj"):
            raise ValueError(f"{where}: PEFT targets experts parameter {m.parameter_name!r}; tandem supports "
                             "gate_up_proj and down_proj")
        if name is not None:
            found[m.parameter_name] = (m.lora_A[name].weight, m.lora_B[name].weight, float(m.scaling[name]))
        m = m.base_layer
    if not found:
        return None
    interleaved = not getattr(m, "is_concatenated", True)
    ranks = {p: a.shape[0] // E for p, (a, b, s) in found.items()}
    r = max(ranks.values())
    scaling = found.get("gate_up_proj", found.get("down_proj"))[2]
    out: dict[str, torch.Tensor] = {}
    for p, (a, b, s) in found.items():
        rp = ranks[p]
        cols = H if p == "gate_up_proj" else I
        rows = 2 * I if p == "gate_up_proj" else H
        if tuple(a.shape) != (rp * E, cols) or tuple(b.shape) != (rows, rp * E):
            raise ValueError(f"{where}: PEFT {p} lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                             f"{E} experts of [{rows} x {cols}]")
        A = a.view(E, rp, cols)                        # row e*r + k
        B = b.view(rows, rp, E).permute(2, 0, 1)       # column k*E + e
        if s != scaling:
            B = B * (s / scaling)
        if rp < r:  # zero-pad to the layer's rank: padded rows / columns add nothing and get no gradient
            A = nn.functional.pad(A, (0, 0, 0, r - rp))
            B = nn.functional.pad(B, (0, r - rp))
        out[p] = (A, B.contiguous())
    gu = out.get("gate_up_proj")
    dn = out.get("down_proj")
    if gu is None:
        gu = (_zeros(E, r, H), _zeros(E, 2 * I, r))
    if dn is None:
        dn = (_zeros(E, r, I), _zeros(E, H, r))
    b_gate, b_up = (gu[1][:, 0::2], gu[1][:, 1::2]) if interleaved else (gu[1][:, :I], gu[1][:, I:])
    return LoraTensors(a_gate=gu[0], b_gate=b_gate, a_up=gu[0], b_up=b_up, a_down=dn[0], b_down=dn[1],
                       scaling=scaling)


def linear_lora(experts: nn.ModuleList, projections: list[tuple[nn.Module, nn.Module, nn.Module]], E: int, H: int,
                I: int, where: str) -> LoraTensors | None:
    """The adapters of v4 per-expert PEFT lora.Linear layers (gate, up, down of every expert)."""
    per: list[list[tuple[torch.Tensor, torch.Tensor, float] | None]] = [[], [], []]
    for mods in projections:
        for j, m in enumerate(mods):
            name = _active(m, where) if hasattr(m, "lora_A") else None
            per[j].append((m.lora_A[name].weight, m.lora_B[name].weight, float(m.scaling[name])) if name else None)
    present = [x for p in per for x in p if x is not None]
    if not present:
        return None
    r = max(a.shape[0] for a, _, _ in present)
    scaling = present[0][2]
    shapes = ((I, H), (I, H), (H, I))
    stacked = []
    for j, (rows, cols) in enumerate(shapes):
        As, Bs = [], []
        for e, x in enumerate(per[j]):
            if x is None:
                As.append(torch.zeros(r, cols))
                Bs.append(torch.zeros(rows, r))
                continue
            a, b, s = x
            if tuple(a.shape[1:]) != (cols,) or tuple(b.shape) != (rows, a.shape[0]):
                raise ValueError(f"{where}: expert {e} lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                                 f"[{rows} x {cols}]")
            if s != scaling:
                b = b * (s / scaling)
            if a.shape[0] < r:
                a, b = nn.functional.pad(a, (0, 0, 0, r - a.shape[0])), nn.functional.pad(b, (0, r - b.shape[1]))
            As.append(a.float())
            Bs.append(b.float())
        stacked += [torch.stack(As), torch.stack(Bs)]
    return LoraTensors(*stacked, scaling=scaling)
