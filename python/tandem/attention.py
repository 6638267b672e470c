"""Which of torch's attention (SDPA) backends tandem's generation commands let run on CUDA.

torch 2.11 sends the SDPA calls of transformers' models on an H100 / H200 to cuDNN, which
builds an execution plan for every new shape it sees. In generation every decode step has a
new key length, so every step of a first generation builds plans: on an H200 (2026-11-27)
the demo model decoded at 14-18 tokens/s in the first generate of a process and at 170 in a
later one over the same lengths, plain transformers and tandem alike (bench/RESULTS.md).
``generation_attention(device)`` runs a generation with every SDPA backend except cuDNN
(flash, memory-efficient, math: no per-shape plans), restoring torch's flags afterwards;
``TANDEM_SDPA_CUDNN=1`` keeps cuDNN. `tandem run`, `chat`, `serve` and `bench` use it; a
script that calls ``model.generate`` itself can do the same:

    with tandem.attention.generation_attention(model.device):
        model.generate(...)

torch's backend flags are process-wide while the context is open (not per thread).
"""
from __future__ import annotations

import contextlib
import os

import torch


def generation_sdpa_backends(device: torch.device | str) -> list | None:
    """The SDPA backends a generation on ``device`` may use, or None to leave torch's choice
    (CPU devices, or TANDEM_SDPA_CUDNN=1)."""
    if torch.device(device).type != "cuda" or os.environ.get("TANDEM_SDPA_CUDNN") == "1":
        return None
    from torch.nn.attention import SDPBackend

    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def generation_attention(device: torch.device | str) -> contextlib.AbstractContextManager:
    """A context for one generation on ``device``: on CUDA, SDPA without cuDNN (see above)."""
    backends = generation_sdpa_backends(device)
    if backends is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(backends)
