"""tandem: run and LoRA-fine-tune huge Mixture-of-Experts models on one workstation.

The C++ runtime lives in ``tandem._C``; this package is the thin, typed Python face:

    import tandem
    cfg = tandem.load_config("configs/qwen3-30b-a3b.yaml")   # validated placement
    print(tandem.doctor().text)                             # what this machine offers
    model = tandem.load_model("/models/Qwen3-30B-A3B", "configs/qwen3-30b-a3b.yaml")
    tandem.offload(hf_model, "configs/x.yaml")              # or: an already loaded model
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

try:
    # torch first: it loads its own CUDA 13.x cuBLAS / NCCL; _C then binds to those (same
    # sonames, newer minor). The other way round torch would get the toolkit's older copies
    # and fail on symbols they lack (e.g. "undefined symbol: ncclCommResume").
    import torch  # noqa: F401
except ImportError:  # torch is optional for the C++-only parts (doctor, config, checkpoints)
    pass
from . import _C
from ._C import Checkpoint, Engine, cpu_features, effective_isa, hardware_isa  # noqa: F401

__version__: str = _C.__version__
__all__ = ["Checkpoint", "DoctorReport", "Engine", "TandemExperts", "convert", "cpu_features", "doctor", "effective_isa",
           "hardware_isa", "load_config", "load_model", "offload", "parse_config", "trace"]


def __getattr__(name: str):
    # torch / transformers load only when the model integration is used.
    if name == "attention":  # tandem.attention.generation_attention (SDPA backends for generation on CUDA)
        import importlib
        return importlib.import_module(".attention", __name__)
    if name == "offload":
        from .engine import offload
        return offload
    if name == "TandemExperts":
        from .modules import TandemExperts
        return TandemExperts
    if name == "convert":
        from .store import convert
        return convert
    if name == "load_model":
        from .loader import load_model
        return load_model
    if name in ("demo", "lora", "store", "train", "tracing"):
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")


class trace:  # noqa: N801 (a namespace, like tandem::trace)
    """The Chrome trace recorder (TANDEM_TRACE=path.json also enables it and writes at exit; a
    config's ``trace.enabled`` enables it in load_model / offload and writes ``trace.path`` at
    exit: see ``tandem.tracing``)."""
    enable = staticmethod(_C.trace_enable)
    enabled = staticmethod(_C.trace_enabled)
    write = staticmethod(_C.trace_write)
    span_count = staticmethod(_C.trace_span_count)


def load_config(path: str | os.PathLike) -> dict[str, Any]:
    """Parse and validate a placement YAML file with the C++ parser (one source of truth).

    Raises ValueError naming the file, line, key and allowed values on invalid input,
    OSError when the file cannot be read. Relative paths inside resolve against the file.
    """
    return json.loads(_C.load_config_json(os.fspath(path)))


def parse_config(text: str, origin: str = "<string>", base_dir: str | os.PathLike = "") -> dict[str, Any]:
    """Like load_config, from YAML text."""
    return json.loads(_C.parse_config_json(text, origin, os.fspath(base_dir)))


@dataclass(frozen=True)
class DoctorReport:
    ok: bool
    text: str
    data: dict[str, Any]


def doctor(config: str | os.PathLike | None = None, gpu_kernel_check: bool = True) -> DoctorReport:
    """Report ISA features, NUMA topology, memory and GPUs; validate `config` if given."""
    ok, text, data = _C.doctor(os.fspath(config) if config else "", gpu_kernel_check)
    return DoctorReport(ok, text, json.loads(data))
