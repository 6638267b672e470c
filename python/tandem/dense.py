"""The CPU's other linear layers on tandem's kernels: ``TandemLinear`` and ``replace_dense``;
and their RMSNorms fused (``TandemRMSNorm``, ``replace_norms``).

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


class TandemRMSNorm(nn.Module):
    """A transformers RMSNorm (the Llama-family form: ``weight * (x / rms(x)).to(bf16)``) on
    tandem's fused kernel (``_C.rms_norm_bf16``: one pass per row instead of torch's six ops
    and two casts) for bf16 CPU inputs; any other input goes to the module it replaces.
    ``replace_norms`` swaps a norm only after checking on a probe that this kernel computes
    what that module computes."""

    def __init__(self, norm: nn.Module, eps: float, name: str) -> None:
        super().__init__()
        # The module's own weight Parameter, under the same name: state_dict keys, .to() and
        # the module kept for other inputs (not registered, so not a second copy) all see it.
        self.weight = norm.weight
        object.__setattr__(self, "_inner", norm)
        self.eps = float(eps)
        self.name = name

    @property
    def inner(self) -> nn.Module:
        """The module this one replaced (runs every input the fused kernel does not take)."""
        return self._inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.device.type != "cpu" or x.numel() == 0
                or x.shape[-1] != w.shape[0] or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return self.inner(x)
        from . import _C

        x = x.contiguous()
        y = torch.empty_like(x)
        w = w.contiguous()
        _C.rms_norm_bf16(x.data_ptr(), w.data_ptr(), self.eps, x.numel() // x.shape[-1], x.shape[-1], y.data_ptr())
        return y

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, fused (tandem)"


def _norm_eps(mod: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(mod, attr, None)
        if isinstance(v, float):
            return v
    return None


def replace_norms(model: nn.Module) -> list[str]:
    """Swaps the model's bf16 CPU RMSNorm modules for ``TandemRMSNorm`` where the fused kernel
    computes what the module does: each candidate (a module whose class name ends in
    "RMSNorm", with a 1-D bf16 ``weight`` and an epsilon) is run on a probe of random rows
    (several magnitudes) both ways, and replaced only if every output agrees within one bf16
    rounding (the kernel sums the squares in another order than torch). Other forms (Gemma's
    ``1 + weight``, norms in fp32, LayerNorms) fail the probe and stay in torch. Returns the
    names replaced."""
    todo = []
    for name, mod in model.named_modules():
        for child_name, child in mod.named_children():
            if not type(child).__name__.endswith("RMSNorm") or isinstance(child, TandemRMSNorm):
                continue
            w = getattr(child, "weight", None)
            eps = _norm_eps(child)
            if (not isinstance(w, torch.Tensor) or w.dim() != 1 or w.dtype != torch.bfloat16
                    or w.device.type != "cpu" or eps is None):
                continue
            todo.append((mod, child_name, f"{name}.{child_name}" if name else child_name, child, eps))
    done: list[str] = []
    checked: dict[tuple, bool] = {}
    g = torch.Generator().manual_seed(0)
    for parent, attr, full, child, eps in todo:
        fused = TandemRMSNorm(child, eps, full)
        n = child.weight.shape[0]
        key = (type(child), n, eps)  # one probe per kind and size (the weight is the module's own)
        if key not in checked:
            probe = torch.randn(4, n, generator=g) * torch.tensor([[1e-3], [1.0], [30.0], [1.0]])
            probe = probe.to(torch.bfloat16)
            with torch.no_grad():
                want, got = child(probe), fused(probe)
            ok = want.dtype == got.dtype and want.shape == got.shape
            if ok:
                diff = (got.float() - want.float()).abs()
                ok = bool((diff <= want.float().abs() * 2.0 ** -7 + 1e-30).all())
            checked[key] = ok
        if checked[key]:
            setattr(parent, attr, fused)
            done.append(full)
    return done


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
    norms = getattr(model, "tandem_norms", None)
    fused = f"; {len(norms)} RMSNorms fused" if norms else ""
    return f"dense layers: {len(done)} on tandem's kernels ({formats}; {packed / 2**20:.1f} MiB packed){fused}"
