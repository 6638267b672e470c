"""The CPU's other linear layers on tandem's kernels: ``TandemLinear`` and ``replace_dense``.

A model whose non-expert weights sit on the CPU runs its attention projections, shared
experts, dense MLPs and lm_head through torch, on torch's threads, beside tandem's pool.
``replace_dense`` swaps each such ``nn.Linear`` for a ``TandemLinear``: the weight packed
once (tandem's bf16, int8 or int4 formats, as the experts), each forward one task on the
engine's pool (the pool's cores, the kernel level of the engine: AMX, VNNI, AVX-512).
Config ``cpu.dense_format`` chooses:

- ``auto`` (default): tandem's bf16 kernels for bf16 weights (the same products,
  accumulated in fp32, the output rounded to the input's dtype as torch rounds it), torch
  for weights of any other dtype (so fp32 / fp16 models keep their own arithmetic);
- ``torch``: every layer stays transformers' own;
- ``bf16`` / ``int8`` / ``int4``: every layer packed in that format (fp32 and fp16 weights
  are rounded; int8 is per output row, int4 uses ``cpu.group_size`` / ``cpu.zero_point``).

Linear layers that are direct children of a MoE block (its router, a shared-expert gate)
stay in torch: they choose which experts run. Inference only: a ``TandemLinear`` has no
gradient, and training (``train=True``) leaves every layer to torch.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn


DENSE_FORMATS = ("auto", "torch", "bf16", "int8", "int4")
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class TandemLinear(nn.Module):
    """``nn.Linear``'s forward (``x @ W.T + b``) on tandem's packed kernels and pool.

    The weight lives packed in C++ (``weight`` is not kept; a NaN or Inf in it is refused,
    naming the element); the bias stays a torch tensor and is added in fp32 before the
    output is rounded to the input's dtype."""

    def __init__(self, engine: Any, linear: nn.Linear, fmt: str, *, name: str,
                 group_size: int = 128, zero_point: bool = False) -> None:
        super().__init__()
        w = linear.weight.detach()
        if w.device.type != "cpu":
            raise ValueError(f"{name}: weight is on {w.device}; tandem's dense kernels run on the CPU")
        if w.dtype not in _DTYPES:
            raise ValueError(f"{name}: weight dtype {w.dtype} is not supported (float32, bfloat16, float16)")
        w = w.contiguous()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.format = fmt
        self.name = name
        self.source_dtype = w.dtype
        self._dense = engine.dense_linear(w.data_ptr(), self.out_features, self.in_features, _DTYPES[w.dtype], fmt,
                                          group_size=group_size, zero_point=zero_point, name=name)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed weight (what a forward reads)."""
        return self._dense.bytes

    @property
    def source_bytes(self) -> int:
        """Bytes the weight had as a torch tensor (what ``tandem doctor`` counts for it)."""
        return self.in_features * self.out_features * self.source_dtype.itemsize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.name}: input has {x.shape[-1]} features, the layer takes {self.in_features}")
        if x.device.type != "cpu":
            raise ValueError(f"{self.name}: input is on {x.device}; this layer runs on the CPU")
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(f"{self.name}: tandem's dense layers are inference only (no gradient); load the "
                               "model with train=True, or set cpu.dense_format: torch, to train through it")
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype not in (torch.bfloat16, torch.float32):
            x2 = x2.float()
        x2 = x2.contiguous()
        m = x2.shape[0]
        y = torch.empty(m, self.out_features, dtype=torch.float32)
        self._dense.forward(x2.data_ptr(), x2.dtype == torch.bfloat16, m, self.in_features, y.data_ptr(),
                            self.out_features)
        if self.bias is not None:
            y += self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={self.format} (from {str(self.source_dtype).removeprefix('torch.')})")


def dense_choice(fmt: str, weight_dtype: torch.dtype) -> str | None:
    """The format a layer with weights of `weight_dtype` gets under ``cpu.dense_format``
    `fmt`, or None for torch."""
    if fmt not in DENSE_FORMATS:
        raise ValueError(f"cpu.dense_format: {fmt!r} is not one of: {', '.join(DENSE_FORMATS)}")
    if fmt == "torch":
        return None
    if fmt == "auto":
        return "bf16" if weight_dtype == torch.bfloat16 else None
    return fmt


def replace_dense(model: nn.Module, engine: Any, cpu_cfg: dict, keep: set[int] | None = None) -> dict[str, str]:
    """Swaps the model's CPU ``nn.Linear`` layers for ``TandemLinear`` under
    ``cpu_cfg['dense_format']``; `keep`: ids of modules left alone (routers). Returns
    {module name: format} of the layers replaced. Tied weights (lm_head tied to the
    embeddings) are packed like any other: the embedding keeps its own tensor."""
    fmt = cpu_cfg.get("dense_format", "auto")
    keep = keep or set()
    todo = []
    for name, mod in model.named_modules():
        for child_name, child in mod.named_children():
            if type(child) is not nn.Linear or id(child) in keep:
                continue
            if child.weight.device.type != "cpu":
                continue
            f = dense_choice(fmt, child.weight.dtype)
            if f is not None:
                todo.append((mod, child_name, f"{name}.{child_name}" if name else child_name, child, f))
    done: dict[str, str] = {}
    for parent, attr, full, child, f in todo:
        setattr(parent, attr, TandemLinear(engine, child, f, name=full, group_size=int(cpu_cfg.get("group_size", 128)),
                                           zero_point=bool(cpu_cfg.get("zero_point", False))))
        done[full] = f
    return done


def describe_dense(model: nn.Module) -> str:
    """One line for the CLI: which linear layers run on tandem's kernels, in which formats."""
    done = getattr(model, "tandem_dense", None)
    if done is None:
        return "dense layers: transformers' own (not CPU inference)"
    if not done:
        return "dense layers: transformers' own (cpu.dense_format torch, or no bf16 weights for auto)"
    counts = Counter(done.values())
    packed = sum(m.packed_bytes for m in model.modules() if isinstance(m, TandemLinear))
    formats = ", ".join(f"{n} {f}" for f, n in sorted(counts.items()))
    return f"dense layers: {len(done)} on tandem's kernels ({formats}; {packed / 2**20:.1f} MiB packed)"
