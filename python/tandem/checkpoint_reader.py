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


GPTQ_PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")       # GPTQ and AWQ: base + part
CT_PARTS = ("_packed", "_scale", "_zero_point", "_shape", "_g_idx")  # compressed-tensors: x.weight + part
_AWQ_SLOT = (0, 4, 1, 5, 2, 6, 3, 7)  # the nibble AWQ packs output r % 8 into
_SCALES = (torch.float16, torch.bfloat16, torch.float32)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., m] -> [..., m, 8]: nibble i of each word."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (words.unsqueeze(-1) >> shifts) & 15


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
    """The fp32 weight [n, k] of a 4-bit AWQ (GEMM) layer: int32 qweight [k, n / 8] and qzeros
    [groups, n / 8] in AWQ's interleaved nibble order, scales [groups, n]."""
    k, n8 = qweight.shape
    n, groups = 8 * n8, scales.shape[0]
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (groups, n8) \
            or tuple(scales.shape) != (groups, n) or k % groups or scales.dtype not in _SCALES:
        raise ValueError(f"{name}: AWQ tensors do not fit together (qweight {list(qweight.shape)}, qzeros "
                         f"{list(qzeros.shape)}, scales {list(scales.shape)})")
    slot = torch.tensor(_AWQ_SLOT)
    q = _nibbles(qweight)[..., slot].reshape(k, n)
    z = _nibbles(qzeros)[..., slot].reshape(groups, n)
    g = torch.arange(k) // (k // groups)
    return (scales.float()[g] * (q - z[g]).float()).t().contiguous()


def dequantize_packed(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                      name: str, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 weight [n, k] of a 4-bit compressed-tensors pack-quantized layer: int32
    weight_packed [n, k / 8] (value + 8), weight_scale [n, groups], optional weight_zero_point
    int32 [n / 8, groups] (packed along n, value + 8)."""
    n, k8 = packed.shape
    k, groups = 8 * k8, scale.shape[1] if scale.dim() == 2 else 0
    if packed.dtype != torch.int32 or scale.dim() != 2 or scale.shape[0] != n or not groups or k % groups:
        raise ValueError(f"{name}: compressed-tensors tensors do not fit together (weight_packed "
                         f"{list(packed.shape)}, weight_scale {list(scale.shape)}; group-wise scales are read)")
    if scale.dtype not in _SCALES:
        raise ValueError(f"{name}: weight_scale is {scale.dtype}; float16 / bfloat16 / float32 are read")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // (k // groups)):
        raise ValueError(f"{name}: weight_g_idx permutes the groups along k (act-order): not supported (quantize "
                         "without actorder, or load a bf16 / FP8 checkpoint)")
    q = _nibbles(packed).reshape(n, k)
    if zero_point is None:
        z = torch.full((n, groups), 8, dtype=torch.int32)
    else:
        if zero_point.dtype != torch.int32 or tuple(zero_point.shape) != (n // 8, groups):
            raise ValueError(f"{name}: weight_zero_point {list(zero_point.shape)} is not packed int32 [n / 8, groups]")
        z = _nibbles(zero_point.t()).reshape(groups, n).t()
    g = torch.arange(k) // (k // groups)
    return (scale.float()[:, g] * (q - z[:, g]).float()).contiguous()


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor | None, name: str) -> torch.Tensor:
    """The fp32 weight [n, k] of a 4-bit GPTQ linear layer (the original "gptq" format: int32
    qweight [k / 8, n] and qzeros [groups, n / 8] holding zero - 1, fp16 scales [groups, n];
    g_idx maps each k to its group, act-order included). The arithmetic of the C++ reader
    (kernels.h, Q4Source)."""
    k8, n = qweight.shape
    groups = scales.shape[0]
    k = 8 * k8
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or scales.dtype not in _SCALES:
        raise ValueError(f"{name}: 4-bit GPTQ needs int32 qweight and qzeros and float16 / bfloat16 / float32 "
                         f"scales, got {qweight.dtype}, {qzeros.dtype}, {scales.dtype}")
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

    def __init__(self, ckpt: _C.Checkpoint, gguf: Any = None):
        from safetensors import safe_open

        self._open = safe_open
        self.ckpt = ckpt
        self.gguf = gguf  # a gguf_checkpoint.GGUFModel when ckpt is its table: tensors read (dequantized) by it
        self._files: dict[str, Any] = {}

    def file(self, name: str) -> str:
        return self.ckpt.info(name)[2]

    def quantized_parts(self, name: str) -> list[str] | None:
        """The tensors holding weight `name` ("x.weight") 4-bit quantized, or None when it is not."""
        parts = _C.expert_tensor_names(self.ckpt, name)
        return parts if parts and name not in parts else None

    def get_quantized(self, name: str) -> torch.Tensor:
        """The fp32 weight `name` ("x.weight") of a 4-bit GPTQ, AWQ or compressed-tensors layer."""
        parts = {p: self.get(p) for p in self.quantized_parts(name) or []}
        file = self.file(next(iter(parts))) if parts else "the checkpoint"

        def need(p: str) -> torch.Tensor:
            if p not in parts:
                raise ValueError(f"{file}: {name} is 4-bit quantized but {p!r} is missing")
            return parts[p]
        try:
            if name + "_packed" in parts:
                return dequantize_packed(parts[name + "_packed"], need(name + "_scale"), parts.get(name + "_zero_point"),
                                         name, parts.get(name + "_g_idx"))
            base = name[:-len(".weight")]
            qweight, qzeros, scales = need(base + ".qweight"), need(base + ".qzeros"), need(base + ".scales")
            if qweight.dim() == 2 and scales.dim() == 2 and qweight.shape[1] * 8 == scales.shape[1]:
                return dequantize_awq(qweight, qzeros, scales, base)  # [k, n / 8]; GPTQ's is [k / 8, n]
            return dequantize_gptq(qweight, qzeros, scales, parts.get(base + ".g_idx"), base)
        except ValueError as e:
            raise ValueError(f"{file}: {e}") from None

    def get(self, name: str) -> torch.Tensor:
        file = self.file(name)
        if self.gguf is not None:
            t = self.gguf.read(name, self.ckpt.info(name)[1])
        else:
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
