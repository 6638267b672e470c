"""`tandem train`: LoRA fine-tuning of a tandem-offloaded MoE model, and the pieces a
training script needs (atomic training-state checkpoints, a packed text dataset).

    tandem train                                   # the demo model on the bundled dataset
    tandem train --model DIR --data FILE --config FILE --steps 2000 --out runs/x
    tandem train --config FILE                     # the checkpoint named by FILE's model.path

Inputs that need no model (config, model directory, data file, --out, --resume checkpoint,
--trace path, device) are checked before the model is loaded. An --out that holds an earlier
run is refused unless --resume (continue it) or --overwrite (replace it) is given.

The model is loaded with ``tandem.load_model(..., train=True)`` (experts straight from the
checkpoint into the CPU pools), PEFT LoRA goes on every linear layer torch holds
(attention, shared experts; not the output head) and on the routed experts (``target_parameters`` on
``mlp.experts.gate_up_proj`` / ``down_proj``), and a plain torch loop trains it: AdamW,
gradient clipping, warmup. Written to ``--out``: ``adapter/`` (a stock PEFT adapter),
``checkpoint/`` (adapter + optimizer + step + RNG, for ``--resume``), ``loss.csv`` and
``loss.png``. Every save is atomic: a crash leaves the previous copy.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

DEMO_DATA = Path(__file__).resolve().parent / "data" / "demo_sft.jsonl"
STATE_FILE = "training_state.pt"


# ---- atomic saving ---------------------------------------------------------------------

def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_dir(final: str | os.PathLike, write) -> Path:
    """Calls write(tmp_dir), then puts tmp_dir in place of `final` so that `final` is always
    either the old complete copy or the new complete one (a crash in between leaves
    ``final.old`` complete, which ``resolve_dir`` picks up)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    old = final.with_name(f"{final.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_dir(path: str | os.PathLike) -> Path:
    """`path`, or its complete ``.old`` copy when a save was interrupted between renames."""
    path = Path(path)
    old = path.with_name(f"{path.name}.old")
    return old if not path.exists() and old.exists() else path


def save_adapter(model, path: str | os.PathLike) -> Path:
    """``model.save_pretrained(path)`` (a PEFT model), atomically."""
    return atomic_dir(path, lambda d: model.save_pretrained(d))


def save_training_state(path: str | os.PathLike, model, optimizer, step: int, scheduler=None,
                        extra: dict[str, Any] | None = None) -> Path:
    """Adapter (stock PEFT files), optimizer / scheduler state, step and RNG states in one
    directory, atomically. ``load_training_state`` restores them."""
    import torch

    def write(d: Path) -> None:
        model.save_pretrained(d)
        torch.save({"step": step, "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                    "rng": {"torch": torch.get_rng_state()}, "extra": extra or {}}, d / STATE_FILE)

    return atomic_dir(path, write)


def load_training_state(path: str | os.PathLike, model, optimizer=None, scheduler=None) -> tuple[int, dict]:
    """Restores what ``save_training_state`` wrote into a PEFT `model` (same adapter config)
    and `optimizer`; returns (step, extra)."""
    import torch
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = resolve_dir(path)
    weights, state = path / "adapter_model.safetensors", path / STATE_FILE
    for f in (weights, state):
        if not f.is_file():
            raise ValueError(f"{path}: not a tandem training checkpoint (missing {f.name})")
    result = set_peft_model_state_dict(model, load_file(weights))
    extra = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if extra:
        raise ValueError(f"{weights}: adapter tensors the model does not have: {extra[:5]}")
    missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
    if missing:
        raise ValueError(f"{weights}: has no values for these adapter tensors of the model: {missing[:5]}"
                         f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''} (a different LoRA config?)")
    st = torch.load(state, weights_only=False)
    if optimizer is not None:
        optimizer.load_state_dict(st["optimizer"])
    if scheduler is not None and st.get("scheduler") is not None:
        scheduler.load_state_dict(st["scheduler"])
    torch.set_rng_state(st["rng"]["torch"])
    return int(st["step"]), st.get("extra", {})


# ---- data ------------------------------------------------------------------------------

def read_texts(path: str | os.PathLike) -> list[str]:
    """Texts of a .jsonl file (one {"text": ...} per line; or "prompt" + "completion") or of a
    .txt file (paragraphs separated by blank lines)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such data file")
    if path.suffix == ".jsonl":
        texts = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            if isinstance(row, dict) and isinstance(row.get("text"), str):
                texts.append(row["text"])
            elif isinstance(row, dict) and isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
                texts.append(row["prompt"] + row["completion"])
            else:
                raise ValueError(f"{path}:{n}: expected an object with a string \"text\" (or \"prompt\" and "
                                 f"\"completion\"), got keys {sorted(row) if isinstance(row, dict) else type(row).__name__}")
    else:
        texts = [t.strip() for t in path.read_text(encoding="utf-8").split("\n\n") if t.strip()]
    if not texts:
        raise ValueError(f"{path}: no texts")
    return texts


class PackedDataset:
    """Texts tokenized, joined with EOS and cut into [seq] blocks; batch(step) is a pure
    function of (seed, step), so a resumed run sees the batches the first run would have."""

    def __init__(self, texts: list[str], tokenizer, seq: int, seed: int = 0):
        import torch

        ids: list[int] = []
        eos = tokenizer.eos_token_id
        for t in texts:
            ids += tokenizer(t, add_special_tokens=False)["input_ids"]
            if eos is not None:
                ids.append(eos)
        n = len(ids) // seq
        if n < 1:
            raise ValueError(f"the data has {len(ids)} tokens, fewer than one sequence of {seq}")
        self.blocks = torch.tensor(ids[: n * seq]).view(n, seq)
        self.seed, self.tokens = seed, len(ids)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def batch(self, step: int, size: int):
        import torch

        n = len(self)
        start = step * size
        rows = []
        for i in range(start, start + size):
            epoch, k = divmod(i, n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 100003 + epoch))
            rows.append(self.blocks[perm[k]])
        return torch.stack(rows)


# ---- the job ---------------------------------------------------------------------------

def peft_config(model, rank: int, alpha: float):
    """LoRA on every linear layer torch holds except the output head (attention, shared
    experts, dense MLPs) and on the routed experts (a PEFT LoraConfig)."""
    from peft import LoraConfig
    from torch import nn

    names = sorted({n.rpartition(".")[2] for n, m in model.named_modules()
                    if isinstance(m, nn.Linear) and not n.endswith("lm_head")})
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=names,
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], task_type="CAUSAL_LM")


def plot_loss(losses: list[float], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(losses) + 1)
    ax.plot(steps, losses, lw=0.8, alpha=0.4, label="loss")
    w = max(1, len(losses) // 20)
    if w > 1:
        smooth = [sum(losses[max(0, i - w + 1): i + 1]) / len(losses[max(0, i - w + 1): i + 1]) for i in range(len(losses))]
        ax.plot(steps, smooth, lw=2, label=f"mean of {w}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the config's model.path, else the built-in "
                                   "demo model)")
    p.add_argument("--data", help=".jsonl ({\"text\": ...} per line) or .txt file (default: the bundled demo dataset)")
    p.add_argument("--config", help="placement YAML (default: configs/demo.yaml for the demo model, else the "
                                    "defaults)")
    p.add_argument("--out", default="tandem-train", help="output directory (default: ./tandem-train)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier run in --out (its checkpoint, adapter and loss files are deleted "
                        "when training starts)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=100, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint (same --rank / --alpha)")
    p.add_argument("--trace", help="write a Chrome trace of the training steps here (default: the config's "
                                   "trace.path when its trace.enabled is true)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute layers in backward")
    p.add_argument("--device", help="device of the non-expert weights (default: from the config)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="non-expert weights (default: the checkpoint's; float32 for the demo model)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def check_arguments(args: argparse.Namespace):
    """Everything that can be checked without the model; returns (model / config selection,
    the data's texts, the trace path or None)."""
    from . import tracing
    from .cli_checks import (InputError, check_output_file, check_resume, check_train_out,
                             select_model_and_config)

    for name in ("steps", "batch", "seq", "rank"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise InputError(f"--lr must be a positive number, got {args.lr}")
    sel = select_model_and_config(args)
    texts = read_texts(Path(args.data) if args.data else DEMO_DATA)
    out = Path(args.out)
    check_train_out(out, args.resume, args.overwrite)
    if args.resume:
        check_resume(resolve_dir(out / "checkpoint"), args.rank, args.alpha)
    if args.trace:
        check_output_file(args.trace, "--trace")
    trace_path = args.trace or tracing.config_trace_path(sel.cfg)
    if trace_path and not args.trace:
        check_output_file(trace_path, f"{sel.config}: trace.path")
    return sel, texts, trace_path


def train(args: argparse.Namespace) -> int:
    sel, texts, trace_path = check_arguments(args)

    import resource

    import torch
    from peft import get_peft_model
    from transformers import AutoTokenizer

    import tandem
    from tandem import demo

    from . import tracing
    from .cli_checks import check_device, describe, existing_run

    check_device(args.device, sel, train=True)
    progress = not args.no_progress
    model_dir = sel.model or str(demo.ensure_demo_model(progress=progress))
    data = Path(args.data) if args.data else DEMO_DATA
    out = Path(args.out)
    print(describe(sel, model_dir), flush=True)

    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    if dtype is None and sel.is_demo:
        dtype = torch.float32  # the demo model is tiny: train its torch side in full precision
    was_tracing = tandem.trace.enabled()  # TANDEM_TRACE=path records everything
    model = tandem.load_model(model_dir, sel.config, device=args.device, dtype=dtype, train=True, progress=progress)
    tracing.cancel_pending()  # this command writes its trace itself, at its end: see below
    tandem.trace.enable(was_tracing)
    tok = AutoTokenizer.from_pretrained(model_dir)
    dataset = PackedDataset(texts, tok, args.seq, args.seed)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, peft_config(model, args.rank, args.alpha))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))
    trainable = sum(p.numel() for p in params)
    start, losses = 0, []
    if args.resume:
        ckpt = resolve_dir(out / "checkpoint")
        try:
            start, extra = load_training_state(ckpt, model, opt, sched)
        except (RuntimeError, KeyError) as e:  # torch's size mismatches: a checkpoint of another model
            first = str(e).strip().splitlines()
            raise ValueError(f"--resume: {ckpt} does not fit this model and LoRA config "
                             f"({first[0] if first else type(e).__name__}...)") from e
        losses = list(extra.get("losses", []))[:start]
    elif args.overwrite:
        for f in existing_run(out):
            (shutil.rmtree if (out / f).is_dir() else os.remove)(out / f)
    load_s = time.perf_counter() - t0
    dev = next(p.device for p in params)
    print(f"loaded: {model.config.model_type}, {model.config.num_hidden_layers} layers; "
          f"LoRA r={args.rank} alpha={args.alpha}: {trainable / 1e6:.2f} M trainable parameters; "
          f"data: {data} ({len(dataset)} sequences of {args.seq} tokens); in {load_s:.1f} s", flush=True)
    if start:
        print(f"resuming at step {start} from {out / 'checkpoint'}", flush=True)

    def checkpoint(step: int) -> None:
        save_training_state(out / "checkpoint", model, opt, step, sched, {"losses": losses})

    from tqdm.auto import tqdm

    if trace_path:
        tandem.trace.enable(True)
    bar = tqdm(total=args.steps, initial=start, desc="training", unit="step", disable=not progress)
    t_train, tokens = time.perf_counter(), 0
    for step in range(start, args.steps):
        batch = dataset.batch(step, args.batch).to(dev)
        loss = model(input_ids=batch, labels=batch).loss
        if not torch.isfinite(loss):
            raise RuntimeError(f"step {step + 1}: loss is {loss.item()} (lower --lr?)")
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tokens += batch.numel()
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens / (time.perf_counter() - t_train):.0f}")
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            checkpoint(step + 1)
    bar.close()
    train_s = time.perf_counter() - t_train
    if trace_path:
        tandem.trace.write(str(trace_path))
        tandem.trace.enable(was_tracing)
    checkpoint(args.steps)
    save_adapter(model, out / "adapter")
    tmp = out / ".loss.csv.tmp"
    tmp.write_text("step,loss\n" + "".join(f"{i + 1},{v:.6f}\n" for i, v in enumerate(losses)))
    tmp.replace(out / "loss.csv")
    plot_loss(losses, out / "loss.png", f"tandem LoRA: {Path(model_dir).name} on {data.name}")
    k = max(1, min(10, len(losses) // 4))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"loss: {sum(losses[:k]) / k:.3f} (first {k} steps) -> {sum(losses[-k:]) / k:.3f} (last {k})")
    if tokens:
        print(f"speed: {tokens} tokens in {train_s:.1f} s = {tokens / train_s:.0f} training tokens/s; "
              f"peak memory {rss:.2f} GiB")
    print(f"adapter: {out / 'adapter'} (load with peft.PeftModel.from_pretrained)\n"
          f"checkpoint: {out / 'checkpoint'} (tandem train --resume)\nplot: {out / 'loss.png'}")
    if trace_path:
        print(f"trace: {trace_path} (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0
