"""The placement config's ``trace`` section, made to do what docs/CONFIG.md says.

    trace:
      enabled: true              # record a Chrome trace
      path: tandem_trace.json    # where it goes, relative to the working directory

The rule, for every entry point that takes a config:

- ``tandem.load_model(dir, config)`` / ``tandem.offload(model, config)``: when the config has
  ``trace.enabled: true``, recording starts as the call returns (``tandem.trace.enable()``)
  and ``trace.path`` (resolved against the working directory *at that call*) is written when
  the Python interpreter exits (``atexit``). ``tandem.tracing.write_pending()`` writes it
  earlier (and again at exit, with every span recorded by then); ``tandem.trace.write(path)``
  writes a trace anywhere, at any time.
- ``tandem run`` / ``tandem train``: the trace is written at the end of the command, to
  ``--trace FILE`` when given, else to the config's ``trace.path`` when ``trace.enabled``.

``TANDEM_TRACE=path`` in the environment (recording from the start, written at exit by
the C++ runtime) works independently of all this.
"""
from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path
from typing import Any, Mapping

from . import _C

_pending: list[Path] = []  # written at interpreter exit, in order, without repeats
_registered = False


def config_trace_path(cfg: Mapping[str, Any]) -> Path | None:
    """The absolute path a parsed config (``tandem.load_config`` / ``parse_config`` output)
    asks the trace to be written to, or None when its ``trace.enabled`` is false."""
    trace = cfg.get("trace") or {}
    if not trace.get("enabled"):
        return None
    return Path(os.path.abspath(trace.get("path") or "tandem_trace.json"))


def apply_config(cfg: Mapping[str, Any]) -> Path | None:
    """Starts recording and schedules ``trace.path`` for writing at interpreter exit when the
    parsed config `cfg` has ``trace.enabled: true``; returns that path (else None)."""
    path = config_trace_path(cfg)
    if path is None:
        return None
    global _registered
    _C.trace_enable(True)
    if path not in _pending:
        _pending.append(path)
    if not _registered:
        atexit.register(_write_at_exit)
        _registered = True
    return path


def pending() -> list[Path]:
    """The paths that will be written at interpreter exit."""
    return list(_pending)


def write_pending() -> list[Path]:
    """Writes every pending trace path now (they stay pending: exit writes them again with
    the spans recorded until then). Returns the paths written."""
    for p in _pending:
        _C.trace_write(str(p))
    return list(_pending)


def cancel_pending() -> None:
    """Forget the pending paths (the CLI writes its trace itself at the end of a command)."""
    _pending.clear()


def _write_at_exit() -> None:
    for p in _pending:
        try:
            _C.trace_write(str(p))
        except Exception as e:  # noqa: BLE001 (at exit: report, never raise)
            print(f"tandem: could not write the trace to {p}: {e}", file=sys.stderr)
