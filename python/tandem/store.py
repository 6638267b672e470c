"""`tandem convert`: a model's routed experts packed once into a store, so later starts read
them instead of re-quantizing the checkpoint.

    tandem convert --model /models/Qwen3-235B-A22B --config configs/qwen3-235b-a22b.yaml
    tandem run --model /models/Qwen3-235B-A22B --config ... --store /models/Qwen3-235B-A22B/tandem-int4-g128

The store (``runtime/include/tandem/expert_store.h``) holds every expert of every MoE layer in
the config's ``cpu.format`` (or ``--format``), one file per layer and a manifest written last:
an interrupted conversion resumes where it stopped (finished layer files are kept) and never
loads half-written. Its layout does not depend on this machine's NUMA nodes or threads. A
model loads from it with ``--store DIR``, ``cpu.store: DIR`` in the config, or
``tandem.load_model(..., store=DIR)``; a store for other experts, another format or a changed
checkpoint is refused, naming the field.
"""
from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Any

from . import _C
from .config import ConfigLike, config_json
from .progress import progress_bar


def _format_of(cfg: dict[str, Any], fmt: str | None, group: int | None, zero_point: bool | None) -> dict[str, Any]:
    cpu = cfg["cpu"]
    out = {"format": fmt or cpu["format"], "group_size": group or cpu["group_size"],
           "zero_point": cpu["zero_point"] if zero_point is None else zero_point}
    if out["format"] not in ("bf16", "int8", "int4", "mxfp4"):
        raise ValueError(f"format {out['format']!r} is not one of: bf16, int8, int4, mxfp4")
    if out["format"] != "int4":
        if group is not None or zero_point:
            raise ValueError(f"--group-size / --zero-point apply to int4 only, not {out['format']}")
        out.update(group_size=128, zero_point=False)
    elif out["group_size"] not in (32, 64, 128):
        raise ValueError(f"group size {out['group_size']} is not one of 32, 64, 128")
    return out


def default_store(model: str | os.PathLike, fmt: dict[str, Any]) -> Path:
    """Where `tandem convert` writes by default: <model>/tandem-<format>[-g<group>[-zp]], or for
    a GGUF file <dir>/<file name without .gguf>.tandem-<format>... beside it."""
    name = _C.store_dir_name(fmt["format"], fmt["group_size"], fmt["zero_point"])
    p = Path(model)
    return p.with_name(f"{p.name.removesuffix('.gguf')}.{name}") if p.is_file() else p / name


def convert(model: str | os.PathLike, config: ConfigLike = None, *, format: str | None = None,
            group_size: int | None = None, zero_point: bool | None = None, out: str | os.PathLike | None = None,
            progress: bool = True, verify: bool = False) -> dict[str, Any]:
    """Writes (or finishes, or confirms) the expert store of checkpoint `model`.

    The format is the config's cpu.format / group_size / zero_point unless given here. out:
    the store directory (default: default_store). verify: read the store back afterwards and
    compare every file with its hash. Returns {"path", "layers_written", "layers_kept",
    "bytes", "up_to_date", "seconds", "source_bytes"}.
    """
    from .loader import open_model_experts

    cfg = config_json(config)
    fmt = _format_of(cfg, format, group_size, zero_point)
    me = open_model_experts(model)
    if me.math.bias:
        raise ValueError(f"{me.path}: this model's experts compute {me.math.describe()}; a packed expert store holds "
                         "experts without biases only (load the checkpoint directly)")
    out = Path(out) if out is not None else default_store(me.path, fmt)
    E, H, I = me.shape
    # The packs, each 4 KiB aligned, and a 4 KiB header per layer file (an upper bound).
    per_layer = _C.moe_layer_cpu_bytes(E, H, I, fmt["format"], fmt["group_size"], fmt["zero_point"]) + E * 8192 + 4096
    _check_space(out, per_layer * len(me.layers))
    bar = progress_bar(progress, E * len(me.layers), f"converting experts to {out.name}")
    t0 = time.perf_counter()
    try:
        report = _C.convert_experts(me.ckpt, me.naming, E, H, I, me.layers, fmt["format"], fmt["group_size"],
                                    fmt["zero_point"], str(out), progress=(lambda d, t: bar(d)) if bar else None)
    finally:
        if bar:
            bar(None)
    report["seconds"] = time.perf_counter() - t0
    report["path"] = str(out)
    report["source_bytes"] = sum(me.ckpt.nbytes(t) for t in {  # a set: fused tensors serve every expert
        t for L in me.layers for e in range(E) for p in me.naming
        for t in _C.expert_tensor_names(me.ckpt, _C.expert_key(p, L, e))})
    if verify:
        store = _C.ExpertStore(str(out))
        vbar = progress_bar(progress, len(me.layers), "verifying the store")
        try:
            store.verify(progress=(lambda d, t: vbar(d)) if vbar else None)
        finally:
            if vbar:
                vbar(None)
    return report


def _check_space(out: Path, need: int) -> None:
    """Refuses before writing anything when the disk cannot hold the store (what a resumed run
    already wrote counts as written)."""
    probe = out
    while not probe.exists():
        probe = probe.parent
    have = sum(f.stat().st_size for f in out.glob("layer-*.tpk")) if out.is_dir() else 0
    free = shutil.disk_usage(probe).free
    if need - have > free:
        raise OSError(f"{out}: the store needs {(need - have) / 1e9:.2f} GB more, the disk holding {probe} has "
                      f"{free / 1e9:.2f} GB free")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory or .gguf file (default: the config's model.path, else the built-in demo "
                                   "model)")
    p.add_argument("--config", help="placement YAML whose cpu.format (group_size, zero_point) the store holds")
    p.add_argument("--format", choices=("bf16", "int8", "int4", "mxfp4"), help="the experts' format (default: the config's "
                   "cpu.format)")
    p.add_argument("--group-size", type=int, choices=(32, 64, 128), help="int4: k values per scale (default: the "
                   "config's, 128)")
    p.add_argument("--zero-point", action="store_true", default=None, help="int4: asymmetric groups")
    p.add_argument("--out", metavar="DIR", help="store directory (default: <model>/tandem-<format>[-g<group>])")
    p.add_argument("--verify", action="store_true", help="read the store back and check every file's hash")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from .cli_checks import InputError, select_model_and_config
    from . import demo

    sel = select_model_and_config(args)
    try:  # before the demo model is built
        _format_of(config_json(sel.config), args.format, args.group_size, args.zero_point)
    except ValueError as e:
        raise InputError(str(e)) from None
    model_dir = sel.model or str(demo.ensure_demo_model(progress=not args.no_progress))
    if args.out is None:
        target = Path(model_dir) if Path(model_dir).is_dir() else Path(model_dir).parent
        if not os.access(target, os.W_OK | os.X_OK):
            raise InputError(f"{model_dir} is not writable: choose where the store goes with --out DIR")
    r = convert(model_dir, sel.config, format=args.format, group_size=args.group_size, zero_point=args.zero_point,
                out=args.out, progress=not args.no_progress, verify=args.verify)
    if r["replaced"]:
        print(f"the store in {r['path']} no longer loaded ({r['replaced']}); finished it again")
    if r["up_to_date"]:
        what = "already up to date"
    else:
        kept = f", {r['layers_kept']} kept from an earlier run" if r["layers_kept"] else ""
        what = (f"{r['layers_written']} layers written{kept}, {r['bytes'] / 1e9:.2f} GB in {r['seconds']:.1f} s "
                f"(read {r['source_bytes'] / 1e9:.2f} GB of source experts)")
    print(f"store: {r['path']}: {what}{'; verified' if args.verify else ''}")
    print(f"load it with --store {r['path']} (or cpu.store in the config)")
    return 0
