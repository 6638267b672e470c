"""Non-expert and adapter-merge reads of a checkpoint's tensors into torch (the routed
experts' fast path is the C++ loader, which reads the mapped files itself)."""
from __future__ import annotations

from typing import Any

import torch

from . import _C


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Block-scaled FP8 (DeepSeek-V3 style: one fp32 scale per block of the 2-d weight)."""
    n, k = w.shape
    bn, bk = -(-n // scale_inv.shape[0]), -(-k // scale_inv.shape[1])
    s = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return w.float() * s


class TensorReader:
    """Tensors by name from a (sharded) safetensors checkpoint, read with the safetensors library."""

    def __init__(self, ckpt: _C.Checkpoint):
        from safetensors import safe_open

        self._open = safe_open
        self.ckpt = ckpt
        self._files: dict[str, Any] = {}

    def file(self, name: str) -> str:
        return self.ckpt.info(name)[2]

    def get(self, name: str) -> torch.Tensor:
        file = self.file(name)
        if file not in self._files:
            self._files[file] = self._open(file, framework="pt")
        t = self._files[file].get_tensor(name)
        if t.dtype == torch.float8_e4m3fn:
            # Without its block scales an FP8 weight is off by the scale: never use it unscaled.
            if f"{name}_scale_inv" not in self.ckpt:
                raise ValueError(f"{file}: tensor {name!r} is F8_E4M3 but the checkpoint has no "
                                 f"{name + '_scale_inv'!r} (its block scales); FP8 weights need them")
            t = dequantize_fp8(t, self.get(f"{name}_scale_inv"))
        if t.is_floating_point():
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                where = [int(i) for i in bad.nonzero()[0]]
                raise ValueError(f"{file}: tensor {name!r} element {where} is {t[tuple(where)].item()}; non-finite "
                                 "weights are refused (fix the checkpoint)")
        return t
