"""gpt-oss's routed experts read from a checkpoint, one MoE layer at a time, into the kernels'
layout (gate, up [E, I, H], down [E, H, I] and fp32 biases) for ``Engine.load_layer``.

Two layouts, as transformers reads them:
- dense (what ``save_pretrained`` writes; bf16 / fp16 / fp32): ``gate_up_proj`` [E, H, 2I]
  with gate and up interleaved along the last dimension (gate at even columns),
  ``down_proj`` [E, I, H], ``gate_up_proj_bias`` [E, 2I], ``down_proj_bias`` [E, H];
- MXFP4 (OpenAI's release, ``quantization_config.quant_method: mxfp4``): ``<proj>_blocks``
  [E, rows, k/32, 16] uint8 (two e2m1 values per byte, the low nibble first) and
  ``<proj>_scales`` [E, rows, k/32] uint8 (E8M0: 2^(s - 127) per 32 values), rows in output
  order (gate_up: 2I rows, gate and up interleaved; down: H rows of I). Dequantized here to
  bf16, exactly (every e2m1 value times a power of two is a bf16 value within bf16's range).

Every tensor's shape and dtype is checked, the error naming the key and file; what a layer
reads is returned so that the loader's every-key-used rule covers it.
"""
from __future__ import annotations

import torch

# e2m1 (MXFP4's element format): sign, 2 exponent bits, 1 mantissa bit.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_PROJ = ("gate_up_proj", "down_proj")


def _dequantize_rows(blocks: torch.Tensor, scales: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    b = blocks.to(torch.uint8)
    vals = torch.stack((lut[(b & 0x0F).int()], lut[(b >> 4).int()]), dim=-1)  # [rows, g, 16, 2]
    vals = vals.flatten(-2)  # [rows, g, 32]: element 2j the low nibble of byte j
    return torch.ldexp(vals, scales.to(torch.int32)[..., None] - 127).flatten(-2)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[..., rows, g, 16] uint8 blocks and [..., rows, g] uint8 E8M0 scales -> [..., rows, 32 g],
    in chunks of rows (the fp32 temporaries stay a few tens of MB whatever the tensor's size)."""
    lut = torch.tensor(_E2M1, dtype=torch.float32)
    *lead, rows, g, _ = blocks.shape
    b, s = blocks.reshape(-1, g, 16), scales.reshape(-1, g)
    out = torch.empty(b.shape[0], 32 * g, dtype=dtype)
    step = max(1, (1 << 22) // (32 * g))  # about 16 MB of fp32 per chunk
    for r0 in range(0, b.shape[0], step):
        out[r0:r0 + step] = _dequantize_rows(b[r0:r0 + step], s[r0:r0 + step], lut).to(dtype)
    return out.reshape(*lead, rows, 32 * g)


class OaiExpertsReader:
    """Reads gpt-oss experts of an opened checkpoint (``TensorReader``); ``prefix`` per layer
    is the experts module's key prefix (e.g. ``model.layers.3.mlp.experts``)."""

    def __init__(self, reader, where: str, shape: tuple[int, int, int]):
        self.reader, self.where, self.shape = reader, where, shape

    def _has(self, key: str) -> bool:
        return key in self.reader.ckpt

    def keys(self, prefix: str) -> list[str]:
        """The tensors a layer reads (those present), for the every-key-used rule."""
        out = []
        for p in _PROJ:
            for s in ("", "_blocks", "_scales", "_bias"):
                if self._has(f"{prefix}.{p}{s}"):
                    out.append(f"{prefix}.{p}{s}")
        return out

    def _get(self, key: str, shape: tuple[int, ...], what: str) -> torch.Tensor:
        if not self._has(key):
            raise ValueError(f"{self.where}: checkpoint has no tensor {key!r} ({what} of gpt-oss's experts)")
        t = self.reader.get(key)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{self.reader.file(key)}: tensor {key!r} has shape {list(t.shape)}, gpt-oss's experts "
                             f"need {list(shape)} ({what})")
        return t

    def _float(self, key: str, shape: tuple[int, ...], what: str) -> torch.Tensor:
        t = self._get(key, shape, what)
        if not t.dtype.is_floating_point:
            raise ValueError(f"{self.reader.file(key)}: tensor {key!r} is {str(t.dtype).removeprefix('torch.')}, "
                             f"not a floating-point {what}")
        return t

    def _matrix(self, prefix: str, proj: str, rows: int, k: int) -> torch.Tensor:
        """[E, rows, k] in output order (dense: transposed from [E, k, rows])."""
        E = self.shape[0]
        key = f"{prefix}.{proj}"
        if self._has(key):
            return self._float(key, (E, k, rows), f"the {proj} weight [experts, in, out]").transpose(1, 2)
        if self._has(key + "_blocks") or self._has(key + "_scales"):
            if k % 32:
                raise ValueError(f"{self.where}: {key}: MXFP4 needs a multiple of 32 input features, not {k}")
            blocks = self._get(key + "_blocks", (E, rows, k // 32, 16), f"the MXFP4 blocks of {proj}")
            scales = self._get(key + "_scales", (E, rows, k // 32), f"the MXFP4 scales of {proj}")
            for name, t in ((key + "_blocks", blocks), (key + "_scales", scales)):
                if t.dtype != torch.uint8:
                    raise ValueError(f"{self.reader.file(name)}: tensor {name!r} is "
                                     f"{str(t.dtype).removeprefix('torch.')}, MXFP4 stores uint8")
            return mxfp4_dequantize(blocks, scales)
        raise ValueError(f"{self.where}: checkpoint has no tensor {key!r} (nor its MXFP4 {key}_blocks / _scales): the "
                         "routed experts of gpt-oss")

    def layer(self, prefix: str) -> tuple[torch.Tensor, ...]:
        """gate, up [E, I, H], down [E, H, I] (contiguous, the checkpoint's float dtype or bf16
        for MXFP4) and fp32 biases gate, up [E, I], down [E, H]."""
        E, H, I = self.shape
        gu = self._matrix(prefix, "gate_up_proj", 2 * I, H)      # [E, 2I, H], rows interleaved
        dn = self._matrix(prefix, "down_proj", H, I)             # [E, H, I]
        gb = self._float(f"{prefix}.gate_up_proj_bias", (E, 2 * I), "gate_up bias").float()
        db = self._float(f"{prefix}.down_proj_bias", (E, H), "down bias").float()
        dtype = gu.dtype if gu.dtype == dn.dtype else torch.float32
        return (gu[:, 0::2].to(dtype).contiguous(), gu[:, 1::2].to(dtype).contiguous(), dn.to(dtype).contiguous(),
                gb[:, 0::2].contiguous(), gb[:, 1::2].contiguous(), db.contiguous())


def expert_pointers(tensors: tuple[torch.Tensor, ...]) -> tuple[list[int], list[int], list[int], str,
                                                                  list[torch.Tensor], dict]:
    """``Engine.load_layer``'s arguments from gate, up [E, I, H], down [E, H, I] and the gate,
    up, down biases: per-expert pointers of CPU-contiguous copies (weights in their dtype,
    biases fp32; views that already are stay as they are), the dtype's name, the tensors that
    hold them, and the bias keyword arguments."""
    keep = [t.cpu().contiguous() for t in tensors[:3]] + [t.cpu().float().contiguous() for t in tensors[3:]]

    def ptrs(t: torch.Tensor) -> list[int]:
        step = t[0].numel() * t.element_size()
        return [t.data_ptr() + e * step for e in range(t.shape[0])]

    g, u, d, gb, ub, db = (ptrs(t) for t in keep)
    return g, u, d, str(keep[0].dtype).removeprefix("torch."), keep, dict(gate_bias=gb, up_bias=ub, down_bias=db)


def load_oai_layer(engine, index: int, tensors: tuple[torch.Tensor, ...], progress=None) -> None:
    """Packs MoE layer `index` from ``OaiExpertsReader.layer``'s tensors."""
    g, u, d, dtype, keep, biases = expert_pointers(tensors)
    engine.load_layer(index, g, u, d, dtype, progress=progress, **biases)
