"""Checks of `tandem run` / `tandem train` inputs that need no model, run before one is
loaded, so a typo fails in a second with one line instead of after minutes of loading.

Each failed check raises ``InputError`` (a ValueError): ``tandem.cli.main`` prints it as
``tandem: error: ...`` and exits with code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The "[check 'cond' failed at runtime/x.cpp:42]" / "[at runtime/x.cpp:42]" suffix that
# tandem::Error appends to its message (runtime/include/tandem/error.h): for bug reports,
# not for a user who mistyped a path. `tandem --verbose` keeps it.
_LOCATION = re.compile(r"\s+\[(?:check '.*' failed at|at) [^\]\s]+:\d+\]\s*$", re.S)


class InputError(ValueError):
    """A command-line input that cannot work (exit code 2)."""


def user_message(e: BaseException) -> str:
    """str(e) without tandem's internal source location, on one line."""
    text = _LOCATION.sub("", str(e)).strip()
    lines = [l for l in text.splitlines() if l.strip()]
    if not lines:
        return type(e).__name__
    return lines[0] + (" (...; --verbose shows all)" if len(lines) > 1 else "")


def check_output_file(path: str | os.PathLike, flag: str) -> Path:
    """`path` can be written (atomically: a temporary file renamed over it) by this process."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{flag} {path}: is a directory")
    parent = p.absolute().parent
    if not parent.is_dir():
        raise InputError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: the directory {parent} is not writable")
    return p


@dataclass
class Selection:
    """Which model and which placement config a command uses, and why."""
    model: str | None          # checkpoint directory; None: the built-in demo model
    model_source: str          # "--model", "model.path of F", "the built-in demo model"
    config: str | None         # config file; None: the defaults
    cfg: dict[str, Any]        # the parsed config (tandem.load_config), {} for the defaults

    @property
    def is_demo(self) -> bool:
        return self.model is None


def select_model_and_config(args: argparse.Namespace) -> Selection:
    """--model wins over the config's model.path (which the parser resolved against the
    config file's directory); with neither, the built-in demo model and (without --config)
    configs/demo.yaml. Checks that the config parses and the model directory exists."""
    import tandem

    check_store_argument(args)
    cfg: dict[str, Any] = {}
    if args.config:
        cfg = tandem.load_config(args.config)  # ValueError / OSError naming file:line:col
    if args.model:
        model, source = args.model, "--model"
    elif cfg.get("model", {}).get("path"):
        model, source = cfg["model"]["path"], f"model.path of {args.config}"
    else:
        model, source = None, "the built-in demo model"
    config = args.config
    if model is None and config is None:
        from tandem import demo

        config = str(demo.demo_config_path())
        cfg = tandem.load_config(config)
    if model is not None:
        p = Path(model)
        from tandem.gguf_checkpoint import is_gguf

        if not p.exists():
            raise InputError(f"{source}: {model}: no such directory (no config.json)")
        if p.is_file() and p.suffix == ".gguf":
            pass  # a GGUF model (tandem.gguf_checkpoint)
        elif not p.is_dir():
            raise InputError(f"{source}: {model}: not a directory (tandem needs a transformers checkpoint "
                             "directory: config.json, tokenizer, *.safetensors; or a .gguf file)")
        elif not (p / "config.json").is_file() and not is_gguf(p):
            raise InputError(f"{source}: {model}: no config.json (expected a transformers checkpoint directory "
                             "or a GGUF model)")
    return Selection(model, source, config, cfg)


# ---- arguments the generating commands (run, chat, bench) share ----------------------------

def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --config, --device: which model, placed how (select_model_and_config, check_device)."""
    p.add_argument("--model", help="checkpoint directory or .gguf file (default: the config's model.path, else the built-in "
                                   "demo model)")
    p.add_argument("--config", help="placement YAML (default: configs/demo.yaml for the demo model, else the "
                                    "defaults)")
    p.add_argument("--device", help="device of the non-expert weights (default: from the config)")
    p.add_argument("--store", metavar="DIR", help="load the routed experts from this store (tandem convert) "
                   "instead of packing the checkpoint (default: the config's cpu.store)")


def check_store_argument(args: argparse.Namespace) -> None:
    """--store names a finished store (the manifest is there); the model check comes at load."""
    store = getattr(args, "store", None)
    if store is None:
        return
    if not Path(store).is_dir():
        raise InputError(f"--store {store}: not a directory (make a store with tandem convert)")
    if not (Path(store) / "manifest.json").is_file():
        raise InputError(f"--store {store}: no manifest.json there (an unfinished conversion, or not a store: "
                         "run tandem convert)")
    if getattr(args, "adapter", None) is not None:
        raise InputError("--store and --adapter: an adapter changes the experts the store holds packed; merge it "
                         "into a checkpoint (tandem merge) and convert that")


def add_generation_arguments(p: argparse.ArgumentParser, max_new_tokens: int, what: str = "") -> None:
    """--max-new-tokens, --sample, --temperature, --top-p, --seed (check_generation_arguments)."""
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help=what or None)
    p.add_argument("--sample", action="store_true", help="sample (default: greedy)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0, help="sampling seed")


def add_adapter_argument(p: argparse.ArgumentParser) -> None:
    """--adapter DIR (check_adapter_argument), merged by load_model."""
    p.add_argument("--adapter", metavar="DIR", help="a PEFT LoRA adapter directory (save_pretrained's output) for "
                   "this model: merged into the weights at load (expert layers packed with it)")


def check_generation_arguments(args: argparse.Namespace) -> None:
    import math

    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.sample:
        if not (args.temperature > 0 and math.isfinite(args.temperature)):
            raise InputError(f"--temperature must be a positive number, got {args.temperature}")
        if not 0 < args.top_p <= 1:
            raise InputError(f"--top-p must be in (0, 1], got {args.top_p}")


def check_adapter_argument(args: argparse.Namespace) -> None:
    if args.adapter is not None and not (Path(args.adapter) / "adapter_config.json").is_file():
        raise InputError(f"--adapter {args.adapter}: no adapter_config.json there (expected a PEFT adapter "
                         "directory, as save_pretrained writes it)")


def check_device(device: str | None, sel: Selection, train: bool) -> None:
    """--device names a device torch has; a config asking for a GPU gets one."""
    import torch

    if device is not None:
        try:
            d = torch.device(device)
        except (RuntimeError, ValueError):
            raise InputError(f"--device {device}: not a torch device (cpu, cuda, cuda:N)") from None
        if d.type == "cuda":
            if not torch.cuda.is_available():
                raise InputError(f"--device {device}: torch sees no CUDA device")
            if d.index is not None and d.index >= torch.cuda.device_count():
                raise InputError(f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s)")
        elif d.type != "cpu":
            raise InputError(f"--device {device}: tandem runs models on cpu or cuda devices")
        return
    gpu = (sel.cfg.get("gpu") or {}).get("device", "auto")
    if gpu not in ("auto", "none") and not torch.cuda.is_available():
        hint = "set gpu.device: auto or none" + (", or pass --device cpu" if train else "")
        raise InputError(f"{sel.config}: gpu.device is {gpu!r} but torch sees no CUDA device ({hint})")


def describe(sel: Selection, model_dir: str) -> str:
    """The two lines `tandem run` / `tandem train` print before loading."""
    config = sel.config or "(none: the defaults)"
    return f"model: {model_dir} ({sel.model_source})\nconfig: {config}"


# ---- tandem train ----------------------------------------------------------------------

RUN_FILES = ("checkpoint", "checkpoint.old", "adapter", "adapter.old", "loss.csv", "loss.png")


def existing_run(out: Path) -> list[str]:
    """The files of an earlier `tandem train` run in `out`."""
    return [f for f in RUN_FILES if (out / f).exists()] if out.is_dir() else []


def check_train_out(out: Path, resume: bool, overwrite: bool) -> None:
    """--out can hold this run: writable; no earlier run there unless --resume (continue it)
    or --overwrite (replace it)."""
    if resume and overwrite:
        raise InputError("--resume and --overwrite exclude each other (continue the run in --out, or replace it)")
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: exists and is not a directory")
    base = out.absolute()
    while not base.exists():
        base = base.parent
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        raise InputError(f"--out {out}: {base} is not a writable directory")
    found = existing_run(out)
    if found and not resume and not overwrite:
        raise InputError(f"--out {out} already holds a run ({', '.join(found)}); pass --overwrite to replace it "
                         "or --resume to continue it")


def check_resume(ckpt: Path, rank: int, alpha: float) -> None:
    """`ckpt` is a complete tandem training checkpoint made with this LoRA rank and alpha."""
    if not ckpt.exists():
        raise InputError(f"--resume: {ckpt} does not exist")
    missing = [f for f in ("adapter_config.json", "adapter_model.safetensors", "training_state.pt")
               if not (ckpt / f).is_file()]
    if missing:
        raise InputError(f"--resume: {ckpt} is not a tandem training checkpoint (missing {', '.join(missing)})")
    try:
        adapter = json.loads((ckpt / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"--resume: {ckpt / 'adapter_config.json'}: cannot read it ({e})") from None
    r, a = adapter.get("r"), adapter.get("lora_alpha")
    if r != rank or (a is not None and float(a) != float(alpha)):
        raise InputError(f"--resume: {ckpt} was trained with --rank {r} --alpha {a}; this run asks for "
                         f"--rank {rank} --alpha {alpha}")
