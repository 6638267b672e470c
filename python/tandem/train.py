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
(attention, dense MLPs, shared experts; not the output head; ``--target-modules`` names
others) and on the routed experts (``target_parameters`` on ``mlp.experts.gate_up_proj`` /
``down_proj``; ``--no-expert-lora`` leaves them out), all with the same rank and alpha
(``peft_config``; the banner reports what got LoRA, ``lora_report``), and a plain torch loop trains it: AdamW,
gradient clipping, warmup. Written to ``--out``: ``adapter/`` (a stock PEFT adapter),
``checkpoint/`` (adapter + optimizer + step + RNG, for ``--resume``), ``loss.csv`` and
``loss.png``. Every save is atomic: a crash leaves the previous copy, and the temporary
folders a killed save leaves (``.checkpoint.tmp-PID``, ``.adapter.tmp-PID``) are removed by
the next save or ``--resume`` (``remove_stale_temp_dirs``).

The data file is read as a stream (``tandem.data_reader``): a record (a .jsonl line, a .txt
paragraph) longer than ``--max-record-bytes`` (default 16 MiB), bytes that are not UTF-8 and
malformed lines are errors naming FILE:LINE, checked before the model is loaded. ``.json``,
``.csv`` and ``.parquet`` files and ``datasets.save_to_disk`` directories are read with the
``datasets`` library (memory-mapped), their rows checked the same way (FILE row N). Records
are TRL's forms: text, prompt / completion, ``messages`` chats (rendered with the model's chat
template) and conversational prompt / completion; as TRL does, the loss covers completions
and assistant turns only (``--loss-on-all``: every token), ``tokenize_record``.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Iterable

from .data_reader import (DEFAULT_MAX_RECORD_BYTES, TEXT_SUFFIXES, DataError, format_size, iter_records, parse_size,
                          record_of)
from .data_reader import read_texts  # noqa: F401 (tandem.train.read_texts, as before the reader had its module)

DEMO_DATA = Path(__file__).resolve().parent / "data" / "demo_sft.jsonl"
STATE_FILE = "training_state.pt"
RAISE_LIMIT = "--max-record-bytes N"  # how a data error tells the user to raise the record size limit


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


# Test hook: seconds to sleep after writing a save's temporary copy and again between its
# two renames, so that a test can kill `tandem train` in the middle of a save. Unset: no effect.
SAVE_DELAY_ENV = "TANDEM_TEST_SAVE_DELAY"


def _test_save_delay() -> None:
    delay = os.environ.get(SAVE_DELAY_ENV)
    if delay:
        time.sleep(float(delay))


def _process_start(pid: int) -> tuple[str, float] | None:
    """(state, start time as a Unix time) of process `pid` from /proc (Linux), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        btime = next(int(l.split()[1]) for l in Path("/proc/stat").read_text().splitlines() if l.startswith("btime "))
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3, starttime 22
        return fields[0], btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _writer_may_be_alive(pid: int, modified: float) -> bool:
    """Whether process `pid` may still be writing a temporary folder last modified at `modified`."""
    if pid <= 0 or pid == os.getpid():  # this process writes only the folder it is about to make
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        pass  # alive, another user's
    proc = _process_start(pid)
    if proc is None:
        return True
    state, started = proc
    # A zombie writes nothing; a process that started after the folder's last change is not
    # its writer but a later one given the same pid (containers reuse small pids on every run).
    # /proc's boot time is whole seconds: a second of margin.
    return state not in ("Z", "X") and started <= modified + 1.0


def remove_stale_temp_dirs(final: str | os.PathLike) -> list[Path]:
    """Removes the temporary folders that interrupted ``atomic_dir(final)`` calls left next to
    `final` (``.NAME.tmp-PID`` in its directory) and returns them.

    Only folders of exactly that name are candidates (nothing else in the directory is ever
    touched, nor anything outside it), and only those whose writer is gone: no live process
    has that pid, or the one that has it is a zombie or started after the folder was last
    modified (a reused pid). A live writer's folder is kept: another process saving the same
    directory at this moment (data-parallel ranks that all call save_training_state, a second
    job started on the same --out). Why the pid and not the age ("older than this save"): a
    concurrent save that began a moment earlier is older too, and its folder would be deleted
    under it; the pid is in the name already. The cost of the rule: a folder whose pid now
    belongs to a process that was already running when the folder was last changed is kept by
    mistake, which costs disk space until a later save, never data. Writers on another machine
    sharing the directory are not told apart (their pids mean nothing here)."""
    final = Path(final)
    pattern = re.compile(re.escape(f".{final.name}.tmp-") + r"(\d{1,10})")
    removed = []
    try:
        entries = list(os.scandir(final.parent))
    except FileNotFoundError:
        return removed
    for e in entries:
        m = pattern.fullmatch(e.name)
        if not m or not e.is_dir(follow_symlinks=False):
            continue
        try:
            modified = e.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue
        if not _writer_may_be_alive(int(m.group(1)), modified):
            shutil.rmtree(e.path, ignore_errors=True)
            removed.append(Path(e.path))
    return removed


def atomic_dir(final: str | os.PathLike, write) -> Path:
    """Calls write(tmp_dir), then puts tmp_dir in place of `final` so that `final` is always
    either the old complete copy or the new complete one (a crash in between leaves
    ``final.old`` complete, which ``resolve_dir`` picks up). Temporary folders of earlier,
    killed saves of `final` are removed first (``remove_stale_temp_dirs``)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    old = final.with_name(f"{final.name}.old")
    remove_stale_temp_dirs(final)  # ours included, if an earlier process had this pid
    tmp.mkdir()
    try:
        write(tmp)
        _test_save_delay()
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            _test_save_delay()
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

DATASETS_SUFFIXES = {".json": "json", ".csv": "csv", ".parquet": "parquet"}


def iter_data(path: str | os.PathLike, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
              raise_with: str = RAISE_LIMIT) -> Iterable[tuple[str, dict]]:
    """(where, record) of a training data file or directory: .jsonl and plain text through
    ``data_reader`` (streamed), .json / .csv / .parquet and ``save_to_disk`` directories
    through ``datasets``; every record checked (``data_reader.record_of``)."""
    path = Path(path)
    if path.is_dir() or path.suffix.lower() in DATASETS_SUFFIXES:
        yield from _dataset_rows(path)
        return
    if path.is_file() and path.suffix.lower() not in TEXT_SUFFIXES + (".jsonl",):
        raise DataError(f"{path}: not a training data format tandem reads (.jsonl; .txt, .text, .md or no suffix; "
                        f"{', '.join(DATASETS_SUFFIXES)} or a datasets.save_to_disk directory)")
    for line, rec in iter_records(path, max_record_bytes, raise_with):
        yield f"{path}:{line}", rec


def _dataset_rows(path: Path) -> Iterable[tuple[str, dict]]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: reading {path.suffix or 'a directory'} data needs the datasets library "
                        "(pip install datasets), or convert it to .jsonl") from None
    if path.is_dir() and not (path / "dataset_info.json").is_file() and not (path / "dataset_dict.json").is_file():
        raise DataError(f"{path}: a directory, but not one datasets.save_to_disk wrote (no dataset_info.json "
                        "or dataset_dict.json)")
    if not path.exists():
        raise DataError(f"{path}: no such data file")
    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
        else:
            ds = datasets.load_dataset(DATASETS_SUFFIXES[path.suffix.lower()], data_files=str(path), split="train")
    except Exception as e:  # noqa: BLE001 (whatever datasets raises: one line naming the file)
        raise DataError(f"{path}: datasets cannot read it: {type(e).__name__}: {str(e).strip().splitlines()[0]}") from e
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{path}: a dataset with splits {', '.join(ds)} and no \"train\" split")
        ds = ds["train"]
    n = 0
    for i, row in enumerate(ds):
        n += 1
        yield f"{path} row {i + 1}", record_of(path, f"row {i + 1}", row)
    if not n:
        raise DataError(f"{path}: no rows")


def count_data(path: str | os.PathLike, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> dict[str, int]:
    """Every record read and checked, none kept: how many of each form."""
    counts: dict[str, int] = {}
    for _, rec in iter_data(path, max_record_bytes):
        kind = "chat" if "messages" in rec or not isinstance(rec.get("prompt", ""), str) else (
            "prompt/completion" if "prompt" in rec else "text")
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def _render(tok, messages: list[dict], where: str, generation_prompt: bool = False) -> str:
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # noqa: BLE001 (the template's own error, e.g. a role it does not know)
        raise DataError(f"{where}: the chat template cannot render this chat: {type(e).__name__}: "
                        f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e


def _chat_pieces(tok, messages: list[dict], learn_from: int | None, where: str) -> list[tuple[str, bool]]:
    """The rendered chat as (text, learned) pieces: assistant turns learned (from message
    `learn_from` on, when given: a conversational completion), the rest not. Each assistant
    turn's text is what rendering it adds to the chat before it with the generation prompt,
    so the template's own turn markers stay where it puts them."""
    full = _render(tok, messages, where)
    pieces, pos = [], 0
    for i, m in enumerate(messages):
        learned = (i >= learn_from) if learn_from is not None else m["role"] == "assistant"
        if not learned or (learn_from is not None and i > learn_from):
            continue
        before = _render(tok, messages[:i], where, generation_prompt=True) if i else ""
        upto = full if learn_from is not None else _render(tok, messages[: i + 1], where)
        if not (len(before) >= pos and full.startswith(before) and full.startswith(upto) and len(upto) >= len(before)):
            raise DataError(f"{where}: the model's chat template does not render this chat turn by turn (the text "
                            f"up to message {i} is not a prefix of the whole), so tandem cannot tell the assistant "
                            "tokens apart; use --loss-on-all, or text / prompt-completion records")
        pieces += [(full[pos:len(before)], False), (full[len(before):len(upto)], True)]
        pos = len(upto)
    pieces.append((full[pos:], False))
    return [p for p in pieces if p[0]]


def tokenize_record(rec: dict | str, tok, where: str = "record", loss_on_all: bool = False
                    ) -> tuple[list[int], list[int]]:
    """(token ids, labels) of one record: labels are the ids where the loss applies and -100
    elsewhere. Text: every token, then EOS. Prompt / completion: the completion and EOS.
    Chats (``messages``, or conversational prompt / completion): the assistant turns (the
    completion's messages), rendered with the tokenizer's chat template. loss_on_all: every
    token of every form."""
    if isinstance(rec, str):
        rec = {"text": rec}
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    if "text" in rec:
        pieces = [(rec["text"], True)]
    elif isinstance(rec["prompt"] if "prompt" in rec else None, str):
        pieces = [(rec["prompt"], False), (rec["completion"], True)]
    else:
        if not getattr(tok, "chat_template", None):
            raise DataError(f"{where}: a chat record, but this model's tokenizer has no chat template to render it "
                            "with; use text or prompt / completion records")
        if loss_on_all:  # every token: the chat rendered whole
            pieces = [(_render(tok, rec["messages"] if "messages" in rec else rec["prompt"] + rec["completion"],
                               where), True)]
        elif "messages" in rec:
            pieces = _chat_pieces(tok, rec["messages"], None, where)
        else:
            pieces = _chat_pieces(tok, rec["prompt"] + rec["completion"], len(rec["prompt"]), where)
        eos = []  # the template ends the turns
    ids, labels = _encode_pieces(tok, pieces, loss_on_all)
    if eos:
        ids += eos
        labels += eos if (pieces[-1][1] or loss_on_all) else [-100]
    return ids, labels


def _encode_pieces(tok, pieces: list[tuple[str, bool]], loss_on_all: bool) -> tuple[list[int], list[int]]:
    """The pieces' text encoded as one string (as at inference: no token boundary is forced
    where a piece ends, no word-start marker added at a piece's start), each token labelled
    by the piece its first character is in. Without offsets (slow tokenizers), the text up to
    each piece's end is encoded and the tokens it adds belong to that piece (TRL's rule)."""
    text = "".join(t for t, _ in pieces)
    ends, learned, pos = [], [], 0
    for t, l in pieces:
        pos += len(t)
        ends.append(pos)
        learned.append(l or loss_on_all)
    if getattr(tok, "is_fast", False):
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        labels = []
        k = 0
        for tid, (start, _) in zip(ids, enc["offset_mapping"]):
            while k < len(ends) - 1 and start >= ends[k]:
                k += 1
            labels.append(tid if learned[k] else -100)
        return ids, labels
    ids, labels, done = [], [], 0
    for end, l in zip(ends, learned):
        upto = tok(text[:end], add_special_tokens=False)["input_ids"]
        new = upto[done:]
        ids, done = upto, len(upto)
        labels += new if l else [-100] * len(new)
    return ids, labels[: len(ids)]


class PackedDataset:
    """Records (texts, record dicts, or ``iter_data``'s (where, record) pairs, tokenized as
    they are read: ``tokenize_record``) joined and cut into [seq] blocks of ids and labels;
    blocks with no label (a prompt longer than a block) are dropped. batch(step) /
    labels(step) are pure functions of (seed, step), so a resumed run sees the batches the
    first run would have."""

    def __init__(self, records: Iterable, tokenizer, seq: int, seed: int = 0, loss_on_all: bool = False):
        import torch

        ids: list[int] = []
        labels: list[int] = []
        for n, r in enumerate(records):
            where, rec = r if isinstance(r, tuple) else (f"record {n + 1}", r)
            i, l = tokenize_record(rec, tokenizer, where, loss_on_all)
            ids += i
            labels += l
        n = len(ids) // seq
        if n < 1:
            raise ValueError(f"the data has {len(ids)} tokens, fewer than one sequence of {seq}")
        blocks = torch.tensor(ids[: n * seq]).view(n, seq)
        lab = torch.tensor(labels[: n * seq]).view(n, seq)
        keep = (lab[:, 1:] != -100).any(1)  # the loss scores labels 1.. of a block (it predicts them)
        if not bool(keep.any()):
            raise ValueError("no sequence of the data has a token to learn from (every token is prompt or user "
                             "turn); use --loss-on-all, or longer --seq")
        self.blocks, self.block_labels = blocks[keep], lab[keep]
        self.dropped = int((~keep).sum())
        self.seed, self.tokens = seed, len(ids)
        self.learned = int((self.block_labels[:, 1:] != -100).sum())

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def _rows(self, step: int, size: int) -> list[int]:
        import torch

        n = len(self)
        start = step * size
        rows = []
        for i in range(start, start + size):
            epoch, k = divmod(i, n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 100003 + epoch))
            rows.append(int(perm[k]))
        return rows

    def batch(self, step: int, size: int):
        return self.blocks[self._rows(step, size)]

    def labels(self, step: int, size: int):
        return self.block_labels[self._rows(step, size)]


# ---- the job ---------------------------------------------------------------------------

# Linear layers whose names PEFT's transformers-v5 MoE conversion rewrites into the fused
# experts' target_parameters when they appear in target_modules (PEFT 0.21: also dense MLPs and
# shared experts of those models, which would lose their LoRA, and gate_up would get rank 2r):
# they are targeted as parameters instead ("<parent>.<name>.weight"), which PEFT leaves alone.
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def expert_parameters(model) -> list[str]:
    """PEFT target_parameters for the routed experts of `model`, wherever its MoE blocks keep
    them (``mlp.experts``, ``block_sparse_moe.experts``, ``feed_forward.experts``, ...)."""
    from .discovery import find_moe_blocks
    from .peft_glue import hf_model

    where = sorted({".".join(b.path.split(".")[-2:]) for b in find_moe_blocks(hf_model(model))})
    return [f"{w}.{p}" for w in where for p in ("gate_up_proj", "down_proj")]


def peft_config(model, rank: int, alpha: float, targets: list[str] | None = None, expert_lora: bool = True):
    """A PEFT LoraConfig for LoRA of rank `rank` and alpha `alpha` on every linear layer torch
    holds (nn.Linear's own forward, which PEFT's LoRA adds to) except the output head
    (attention, shared experts, dense MLPs), or on those named in `targets` (leaf names, e.g.
    q_proj), and on the routed experts unless `expert_lora` is False. Every target gets the same rank and alpha (no rank or alpha patterns)."""
    from peft import LoraConfig
    from torch import nn

    # nn.Linear itself, or a subclass that keeps its forward: a subclass with its own forward
    # (DeepSeek-V4's grouped o_a_proj) computes something PEFT's LoRA does not add to.
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward
              and not n.endswith("lm_head")]
    leaves = sorted({n.rpartition(".")[2] for n in linear})
    if targets is not None:
        unknown = sorted(set(targets) - set(leaves))
        if unknown:
            raise ValueError(f"--target-modules: {', '.join(unknown)} name no linear layer of this model "
                             f"(it has: {', '.join(leaves)})")
    wanted = set(leaves if targets is None else targets)
    modules = sorted(n for n in wanted if n not in _MLP_NAMES)
    params = sorted({".".join(n.split(".")[-2:]) + ".weight" for n in linear if n.rpartition(".")[2] in wanted
                     and n.rpartition(".")[2] in _MLP_NAMES})
    if expert_lora:
        params += expert_parameters(model)
    if not modules and not params:
        raise ValueError("no LoRA targets: name some with --target-modules or leave expert LoRA on")
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=modules or None,
                      target_parameters=params or None, task_type="CAUSAL_LM")


def lora_report(model) -> list[tuple[str, int, list[str], int]]:
    """What PEFT put LoRA on, per kind of module: (kind, count, leaf names, rank)."""
    from .lora import is_param_wrapper

    kinds: dict[str, tuple[int, set[str], set[int]]] = {}
    for name, m in model.named_modules():
        if not hasattr(m, "lora_A") or not m.lora_A:
            continue
        leaf = name.rpartition(".")[2]
        if leaf == "base_layer":
            continue  # an inner wrapper of a chain: its outermost one is counted
        chain, inner = [m], m.base_layer
        while is_param_wrapper(inner):
            chain.append(inner)
            inner = inner.base_layer
        if leaf == "experts" and len(chain) > 0 and getattr(chain[0], "parameter_name", None) in ("gate_up_proj",
                                                                                                 "down_proj"):
            kind, label = "routed experts", "+".join(sorted(w.parameter_name for w in chain))
            num = inner.num_experts if hasattr(inner, "num_experts") else 1
            ranks = {next(iter(w.lora_A.values())).weight.shape[0] // num for w in chain}
        else:
            kind = ("shared experts" if "shared_expert" in name else "attention" if "attn" in name
                    else "MLP" if leaf in _MLP_NAMES else "other")
            label, ranks = leaf, {next(iter(m.lora_A.values())).weight.shape[0]}
        n, labels, rs = kinds.get(kind, (0, set(), set()))
        kinds[kind] = (n + 1, labels | {label}, rs | ranks)
    order = ["attention", "MLP", "shared experts", "routed experts", "other"]
    return [(k, kinds[k][0], sorted(kinds[k][1]), max(kinds[k][2])) for k in order if k in kinds]


def context_bytes_per_token(hidden: int, inter: int, top_k: int, rank: int) -> int:
    """What one MoE layer's LoRA forward saves for backward, per token (LoraContext::State in
    sft/lora.cpp): per routed (token, expert) row its routing weight (fp32), gathered input
    (bf16, H), x A^T of gate and up (fp32, 2r), h A_down^T (fp32, r) and the gate / up
    pre-activations (fp32, 2I)."""
    return top_k * (4 + 2 * hidden + 4 * 2 * rank + 4 * rank + 4 * 2 * inter)


def memory_report(model, sel, args) -> str:
    """The training path's memory, before the first step: forward packs (loaded), backward
    packs (built at the first backward) and the state one step saves, against what the
    machine has available; a warning when it does not fit."""
    from . import _C
    from .config import config_json

    engine = model.tandem_engine
    if engine is None:  # another rank of this machine holds the experts (tandem.distributed)
        return f"CPU experts: held by {model.tandem_experts_group.describe()}"
    cfg = config_json(sel.config)
    fmt = cfg["cpu"]["format"]
    bwd = engine.backward_format
    E, H, I = engine.experts, engine.hidden, engine.inter
    layers = len(engine.layers)
    base = engine.packed_bytes
    backward = layers * _C.moe_layer_cpu_bytes(E, I, H, bwd, subpools=engine.subpools)
    hf = model.get_base_model().config
    top_k = next((getattr(hf, a) for a in ("num_experts_per_tok", "moe_topk", "top_k") if hasattr(hf, a)), 1)
    per_token = layers * context_bytes_per_token(H, I, top_k, args.rank)
    step_tokens = args.batch * args.seq
    gib = 2**30
    avail = None
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    need = backward + per_token * step_tokens
    text = (f"memory: expert packs {base / gib:.2f} GiB ({fmt}, loaded); backward packs ~{backward / gib:.2f} GiB "
            f"({bwd}, built at the first backward); saved per step ~{per_token * step_tokens / gib:.2f} GiB "
            f"({per_token / 2**10:.0f} KiB per token x {step_tokens} tokens)")
    if avail is not None:
        text += f"; available now {avail / gib:.2f} GiB"
        if need > avail:
            text += (f"\nwarning: the backward packs and one step's saved state (~{need / gib:.2f} GiB) exceed the "
                     "memory available" + ("; --backward-format int8 halves the backward packs" if bwd == "bf16"
                                           else "; lower --batch or --seq"))
    return text


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


def _byte_count(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the config's model.path, else the built-in "
                                   "demo model)")
    p.add_argument("--data", help=".jsonl ({\"text\": ...}, {\"prompt\": ..., \"completion\": ...} or "
                                  "{\"messages\": [...]} per line), .txt file (paragraphs separated by empty lines), "
                                  "UTF-8; or .json / .csv / .parquet / a datasets.save_to_disk directory (read with "
                                  "datasets) (default: the bundled demo dataset)")
    p.add_argument("--loss-on-all", action="store_true",
                   help="train on every token (default: completions and assistant turns only, as TRL does)")
    p.add_argument("--max-record-bytes", type=_byte_count, default=DEFAULT_MAX_RECORD_BYTES, metavar="N",
                   help="the longest line of a .jsonl data file (paragraph of a .txt one) accepted, in bytes or "
                        "with a K, M or G suffix (1024-based); a longer one is an error naming its line, found "
                        "without reading that line whole (default: "
                        f"{format_size(DEFAULT_MAX_RECORD_BYTES).replace(' ', '')})")
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
    p.add_argument("--target-modules", metavar="NAMES",
                   help="comma-separated linear layers to put LoRA on, by name (e.g. q_proj,v_proj; default: "
                        "every linear layer but the output head: attention, dense MLPs, shared experts)")
    p.add_argument("--no-expert-lora", action="store_true", help="no LoRA on the routed experts")
    p.add_argument("--backward-format", choices=("bf16", "int8"),
                   help="the experts' transposed packs backward reads: int8 halves their memory (default: the "
                        "config's train.backward_format, else bf16)")
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
    the data file (read through once: every record checked, none kept), the trace path or
    None)."""
    from . import tracing
    from .cli_checks import (InputError, check_output_file, check_resume, check_train_out,
                             select_model_and_config)

    for name in ("steps", "batch", "seq", "rank"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise InputError(f"--lr must be a positive number, got {args.lr}")
    if args.max_record_bytes < 1:
        raise InputError(f"--max-record-bytes must be at least 1, got {args.max_record_bytes}")
    sel = select_model_and_config(args)
    data = Path(args.data) if args.data else DEMO_DATA
    args.data_counts = count_data(data, args.max_record_bytes)
    out = Path(args.out)
    check_train_out(out, args.resume, args.overwrite)
    if args.resume:
        check_resume(resolve_dir(out / "checkpoint"), args.rank, args.alpha)
    if args.trace:
        check_output_file(args.trace, "--trace")
    trace_path = args.trace or tracing.config_trace_path(sel.cfg)
    if trace_path and not args.trace:
        check_output_file(trace_path, f"{sel.config}: trace.path")
    return sel, data, trace_path


def train(args: argparse.Namespace) -> int:
    sel, data, trace_path = check_arguments(args)

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
    out = Path(args.out)
    print(describe(sel, model_dir), flush=True)

    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    if dtype is None and sel.is_demo:
        dtype = torch.float32  # the demo model is tiny: train its torch side in full precision
    was_tracing = tandem.trace.enabled()  # TANDEM_TRACE=path records everything
    model = tandem.load_model(model_dir, sel.config, device=args.device, dtype=dtype, train=True, progress=progress,
                              backward_format=args.backward_format)
    tracing.cancel_pending()  # this command writes its trace itself, at its end: see below
    tandem.trace.enable(was_tracing)
    tok = AutoTokenizer.from_pretrained(model_dir)
    dataset = PackedDataset(iter_data(data, args.max_record_bytes), tok, args.seq, args.seed, args.loss_on_all)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    targets = [t for t in args.target_modules.split(",") if t] if args.target_modules else None
    model = get_peft_model(model, peft_config(model, args.rank, args.alpha, targets, not args.no_expert_lora))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))
    trainable = sum(p.numel() for p in params)
    start, losses = 0, []
    if args.resume:
        for name in ("checkpoint", "adapter"):  # what killed saves of the run left
            remove_stale_temp_dirs(out / name)
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
          f"in {load_s:.1f} s", flush=True)
    forms = ", ".join(f"{k} {v}" for k, v in getattr(args, "data_counts", {}).items())
    print(f"data: {data} ({forms}): {len(dataset)} sequences of {args.seq} tokens"
          f"{f' ({dataset.dropped} without a token to learn dropped)' if dataset.dropped else ''}; loss on "
          f"{dataset.learned} of {len(dataset) * args.seq} tokens"
          f"{'' if args.loss_on_all else ' (completions and assistant turns; --loss-on-all: every token)'}", flush=True)
    print("LoRA on: " + "; ".join(f"{kind} {n} ({', '.join(labels)}, r={r})"
                                  for kind, n, labels, r in lora_report(model)), flush=True)
    print(memory_report(model, sel, args), flush=True)
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
        loss = model(input_ids=batch, labels=dataset.labels(step, args.batch).to(dev)).loss
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
