"""Non-expert and adapter-merge reads of a checkpoint's tensors into torch (the routed
experts' fast path is the C++ loader, which reads the mapped files itself)."""
from __future__ import annotations

from typing import Any

import torch

from . import _C


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def block_size(n: int, blocks: int) -> int:
    """The block length along a dimension of n values split into `blocks` scale blocks: the
    power of two that gives that many blocks (128 in practice), else ceil(n / blocks); the
    rule the C++ expert loader applies (checkpoint_expert in runtime/experts.cpp)."""
    b = 1
    while b <= n:
        if -(-n // b) == blocks:
            return b
        b *= 2
    return -(-n // blocks)


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """Block-scaled FP8 (DeepSeek-V3 style: one fp32 scale per block of the 2-d weight)."""
    if w.dim() != 2 or scale_inv.dim() != 2 or scale_inv.dtype != torch.float32 or \
            not (1 <= scale_inv.shape[0] <= w.shape[0] and 1 <= scale_inv.shape[1] <= w.shape[1]):
        raise ValueError(f"{name}_scale_inv has shape {list(scale_inv.shape)} ({scale_inv.dtype}) for the "
                         f"{list(w.shape)} FP8 weight {name!r}: expected a 2-d F32 tensor of block scales, at most "
                         "one per element")
    n, k = w.shape
    bn, bk = block_size(n, scale_inv.shape[0]), block_size(k, scale_inv.shape[1])
    s = scale_inv.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    if s.shape != w.shape:
        raise ValueError(f"{name}_scale_inv has shape {list(scale_inv.shape)}, which no block size fits to the "
                         f"{list(w.shape)} FP8 weight {name!r}")
    return w.float() * s


GPTQ_PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor | None, name: str) -> torch.Tensor:
    """The fp32 weight [n, k] of a 4-bit GPTQ linear layer (the original "gptq" format: int32
    qweight [k / 8, n] and qzeros [groups, n / 8] holding zero - 1, fp16 scales [groups, n];
    g_idx maps each k to its group, act-order included). The arithmetic of the C++ reader
    (kernels.h, Q4Source)."""
    k8, n = qweight.shape
    groups = scales.shape[0]
    k = 8 * k8
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or scales.dtype != torch.float16:
        raise ValueError(f"{name}: 4-bit GPTQ needs int32 qweight and qzeros and float16 scales, got "
                         f"{qweight.dtype}, {qzeros.dtype}, {scales.dtype}")
    if tuple(qzeros.shape) != (groups, n // 8) or tuple(scales.shape) != (groups, n) or n % 8 or k % groups:
        raise ValueError(f"{name}: GPTQ tensors do not fit together (qweight {list(qweight.shape)}, qzeros "
                         f"{list(qzeros.shape)}, scales {list(scales.shape)}; other bit widths are not supported)")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    q = ((qweight.unsqueeze(1) >> shifts.view(1, 8, 1)) & 15).reshape(k, n)
    z = (((qzeros.unsqueeze(2) >> shifts.view(1, 1, 8)) & 15).reshape(groups, n) + 1) & 15
    g = g_idx.long() if g_idx is not None else torch.arange(k) // (k // groups)
    if g.shape != (k,) or int(g.min()) < 0 or int(g.max()) >= groups:
        raise ValueError(f"{name}: g_idx does not map its {k} inputs to the {groups} groups")
    return (scales.float()[g] * (q - z[g]).float()).t().contiguous()


class TensorReader:
    """Tensors by name from a (sharded) safetensors checkpoint, read with the safetensors library."""

    def __init__(self, ckpt: _C.Checkpoint):
        from safetensors import safe_open

        self._open = safe_open
        self.ckpt = ckpt
        self._files: dict[str, Any] = {}

    def file(self, name: str) -> str:
        return self.ckpt.info(name)[2]

    def get_gptq(self, base: str) -> torch.Tensor:
        """The fp32 weight of the GPTQ-quantized layer whose tensors are base.qweight, ..."""
        parts = {p: self.get(base + p) for p in GPTQ_PARTS if base + p in self.ckpt}
        missing = [base + p for p in GPTQ_PARTS[:3] if p not in parts]
        if missing:
            raise ValueError(f"{self.file(base + '.qweight')}: {base}.qweight is GPTQ-quantized but "
                             f"{missing[0]!r} is missing")
        try:
            return dequantize_gptq(parts[".qweight"], parts[".qzeros"], parts[".scales"], parts.get(".g_idx"), base)
        except ValueError as e:
            raise ValueError(f"{self.file(base + '.qweight')}: {e}") from None

    def get(self, name: str) -> torch.Tensor:
        file = self.file(name)
        if file not in self._files:
            self._files[file] = self._open(file, framework="pt")
        t = self._files[file].get_tensor(name)
        if t.dtype in _FP8:
            # Without its block scales an FP8 weight is off by the scale: never use it unscaled.
            kind = "F8_E4M3" if t.dtype == torch.float8_e4m3fn else "F8_E5M2"
            if f"{name}_scale_inv" not in self.ckpt:
                raise ValueError(f"{file}: tensor {name!r} is {kind} but the checkpoint has no "
                                 f"{name + '_scale_inv'!r} (its block scales); FP8 weights need them")
            try:
                t = dequantize_fp8(t, self.get(f"{name}_scale_inv"), name)
            except ValueError as e:
                raise ValueError(f"{file}: {e}") from None
        if t.is_floating_point():
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                where = [int(i) for i in bad.nonzero()[0]]
                raise ValueError(f"{file}: tensor {name!r} element {where} is {t[tuple(where)].item()}; non-finite "
                                 "weights are refused (fix the checkpoint)")
        return t
