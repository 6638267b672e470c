"""tandem: run and LoRA-fine-tune huge Mixture-of-Experts models on one workstation.

The C++ runtime lives in ``tandem._C``; this package is the thin, typed Python face:

    import tandem
    cfg = tandem.load_config("configs/qwen3-30b-a3b.yaml")   # validated placement
    print(tandem.doctor().text)                             # what this machine offers
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from . import _C
from ._C import Checkpoint, cpu_features, effective_isa, hardware_isa  # noqa: F401

__version__: str = _C.__version__
__all__ = ["Checkpoint", "DoctorReport", "cpu_features", "doctor", "effective_isa",
           "hardware_isa", "load_config", "parse_config"]


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
