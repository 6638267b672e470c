"""`tandem merge`: a checkpoint with a LoRA adapter merged in, written shard by shard.

    tandem merge --model /models/Qwen3-30B-A3B --adapter adapter/ --out /models/Qwen3-30B-A3B-tuned

The output is the input checkpoint with the same shards, tensor names, dtypes, shapes and
byte offsets (each shard's header is copied as it is), so ``from_pretrained`` and
``tandem.load_model`` read it like the original. Every tensor the adapter changes is
written as W + s B A (computed in fp32, rounded to the tensor's dtype: the arithmetic of
PEFT's ``merge_and_unload`` and of ``load_model(adapter=)``, which pack the same bits);
every other tensor is copied byte for byte. Memory stays near one tensor at a time (the
largest tensor the adapter changes, in fp32, plus its delta, computed when that tensor is
written) and the adapter's own tensors: nothing holds a shard.

What the adapter changes is what PEFT makes of it: the model is built on the meta device,
PEFT attaches the adapter there (``rank_pattern``, ``alpha_pattern``, rsLoRA, the v5
``ParamWrapper`` layout on fused experts, ``modules_to_save``), and every tensor of the
adapter file must land (a key that matches no module, or a LoRA tensor the config asks for
and the file lacks, is an error). Fused-expert LoRA is written into the checkpoint's
per-expert tensors. Refused, naming the tensor or option: FP8 (or other quantized)
weights the adapter would change, DoRA, LoRA biases, an output directory that exists.
The output appears atomically (written to a temporary sibling, renamed into place).
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Callable

import torch

from . import _C
from .adapters import LORA_PARTS, attach_adapter, merge_expert, read_adapter_config
from .discovery import find_moe_blocks
from .lora import is_param_wrapper, param_wrapper_lora
from .progress import progress_bar

_TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}

# What a planned tensor becomes: f(original tensor as read, in its own dtype) -> fp32 or own-dtype tensor.
Change = Callable[[torch.Tensor], torch.Tensor]


def _header(path: Path) -> tuple[bytes, dict, int]:
    """(the 8-byte length and JSON header bytes, the parsed header, where the data starts)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        (n,) = struct.unpack("<Q", raw)
        head = f.read(n)
    return raw + head, json.loads(head), 8 + n


def _meta_peft_model(model_dir: Path, adapter: Path, cfg):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(model_dir)
    dtype = getattr(hf_config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    pm = attach_adapter(model, adapter, cfg, on_meta=True)
    return pm, hf_config


def _delta(m, adapter_name: str, name: str, key: str, shape, adapter: Path) -> torch.Tensor:
    """PEFT's delta weight of LoRA layer m, fp32 on the CPU, checked against the tensor's shape."""
    from peft.tuners.lora.layer import Linear

    if is_param_wrapper(m):
        # What ParamWrapper.get_delta_weight computes for one matrix, before it moves the
        # delta to the parameter's device (meta here) and dtype (rounding it).
        d = Linear.get_delta_weight(m, adapter_name)
    else:
        d = m.get_delta_weight(adapter_name)
    d = d.detach().to("cpu", torch.float32)
    if tuple(d.shape) != tuple(shape):
        raise ValueError(f"{adapter}: the LoRA delta of {name} has shape {list(d.shape)}, but {key!r} is "
                         f"{list(shape)}")
    return d


def plan(model_dir: Path, adapter: Path, ckpt: _C.Checkpoint) -> dict[str, Change]:
    """Checkpoint tensor name -> how the adapter changes it."""
    from peft.tuners.lora import LoraLayer

    from .checkpoint_names import CheckpointNames

    cfg = read_adapter_config(adapter)
    if getattr(cfg, "lora_bias", False):
        raise ValueError(f"{adapter / 'adapter_config.json'}: lora_bias is set; tandem merge writes weights only")
    pm, hf_config = _meta_peft_model(model_dir, adapter, cfg)
    hf = pm.get_base_model()
    changes: dict[str, Change] = {}
    names = CheckpointNames(hf_config.model_type, ckpt, str(model_dir))

    def key_of(name: str) -> str:
        key = names.key(name)
        if key is None:
            raise ValueError(f"{adapter}: the adapter changes {name!r}, which {model_dir} does not hold (a weight "
                             "tied to another one?); tandem merge writes the checkpoint's own tensors")
        return key

    # Routed experts (v5 fused in the model, per expert in the checkpoint).
    wrapped = set()
    for b in find_moe_blocks(hf):
        if not is_param_wrapper(b.block.experts):
            continue
        inner = b.block.experts
        while is_param_wrapper(inner):
            wrapped.add(id(inner))
            inner = inner.base_layer
        E, H, I = (getattr(inner, a) for a in ("num_experts", "hidden_dim", "intermediate_dim"))
        where = f"model layer {b.layer} experts"
        lora = param_wrapper_lora(b.block.experts, E, H, I, where)
        if lora is None:
            continue
        naming = names.experts(b.path, b.layer)
        if "{E}" not in naming[0]:
            raise ValueError(f"{where}: the checkpoint stores these experts fused "
                             f"({_C.expert_key(naming[0], b.layer, 0)}); merging an adapter into fused experts is "
                             "not supported yet (save the base model with one tensor per expert)")
        for e in range(E):
            for j, pattern in enumerate(naming):
                changes[_C.expert_key(pattern, b.layer, e)] = (
                    lambda w, lora=lora, e=e, j=j: merge_expert(w, lora, e, j))

    # Other LoRA layers: PEFT's own delta (fan_in_fan_out, embeddings, scaling rules), for
    # modules (lora.Linear, ...) and for parameters PEFT wraps (ParamWrapper on a weight).
    for name, m in hf.named_modules():
        if not isinstance(m, LoraLayer) or id(m) in wrapped:
            continue
        active = [a for a in m.active_adapters if a in getattr(m, "lora_A", {}) or a in getattr(m, "lora_embedding_A", {})]
        if not active:
            continue
        if is_param_wrapper(m) and getattr(m, "num_experts", 1) != 1:
            raise ValueError(f"{adapter}: LoRA on the stacked parameter {name}.{m.parameter_name} is not one "
                             "tandem merges (it merges the routed experts of MoE blocks and 2-d weights)")
        path = ".".join(p for p in name.split(".") if p != "base_layer")
        key = key_of(f"{path}.{m.parameter_name}" if is_param_wrapper(m) else f"{path}.weight")
        # The delta is computed when its tensor is written (one at a time, not all held).
        changes[key] = (lambda w, m=m, a=active[0], name=name, key=key, f=changes.get(key):
                        (f(w) if f else w.float()) + _delta(m, a, name, key, w.shape, adapter))

    # Whole tensors the adapter carries (modules_to_save, saved embedding layers).
    for name, p in list(hf.named_parameters()) + list(hf.named_buffers()):
        if p.device.type == "meta" or any(s in name for s in LORA_PARTS) or ".original_module." in name:
            continue
        plain = name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        key = key_of(plain)
        value = p.detach().to("cpu")
        before = changes.get(key)
        changes[key] = (lambda w, v=value, f=before: f(v.to(w.dtype)) if f else v)
    return changes


def merge_checkpoint(model_dir: str | os.PathLike, adapter: str | os.PathLike, out: str | os.PathLike,
                     progress: bool = True) -> Path:
    """Writes `model_dir` with `adapter` merged to `out` (see the module docstring)."""
    from .train import atomic_dir

    model_dir, adapter, out = Path(model_dir), Path(adapter), Path(out)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir}: no config.json (expected a transformers checkpoint directory)")
    if out.exists():
        raise ValueError(f"{out} exists; tandem merge writes a new directory (remove it or choose another --out)")
    if out.resolve() == model_dir.resolve():
        raise ValueError(f"--out {out} is the model directory itself")
    ckpt = _C.Checkpoint(str(model_dir))  # every shard's header checked here
    changes = plan(model_dir, adapter, ckpt)
    files = sorted({Path(ckpt.info(n)[2]) for n in ckpt.names()})
    for name in changes:
        dtype = ckpt.info(name)[0]
        if dtype not in _TORCH_DTYPES:
            raise ValueError(f"{ckpt.info(name)[2]}: tensor {name!r} is {dtype}; tandem merge writes merged "
                             "weights in bf16 / fp16 / fp32 only (run the adapter with tandem.load_model(..., "
                             "adapter=DIR), which merges at load)")
    total = sum(f.stat().st_size for f in files)
    bar = progress_bar(progress, total, "merging")

    def write(tmp: Path) -> None:
        done = 0
        for src in files:
            done = _write_shard(src, tmp / src.name, changes, bar, done)
        for f in model_dir.iterdir():  # config, tokenizer, index (same names, sizes, offsets), ...
            if f.is_file() and f not in files and not (tmp / f.name).exists():
                shutil.copy2(f, tmp / f.name)
        (tmp / "tandem_merge.json").write_text(json.dumps(
            {"base": str(model_dir.resolve()), "adapter": str(adapter.resolve()), "tensors_changed": len(changes)},
            indent=2) + "\n")

    atomic_dir(out, write)
    if bar:
        bar(None)
    return out


def _write_shard(src: Path, dst: Path, changes: dict[str, Change], bar, done: int) -> int:
    head_bytes, header, start = _header(src)
    entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0])
    chunk = 64 << 20
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fout.write(head_bytes)
        done += start
        pos = start
        for name, info in entries:
            begin, end = (start + o for o in info["data_offsets"])
            if begin > pos:  # bytes between tensors (none in a valid file; copied all the same)
                fin.seek(pos)
                fout.write(fin.read(begin - pos))
            fin.seek(begin)
            change = changes.get(name)
            if change is None:
                left = end - begin
                while left:
                    buf = fin.read(min(chunk, left))
                    fout.write(buf)
                    left -= len(buf)
                    done += len(buf)
                    if bar:
                        bar(done)
            else:
                dtype = _TORCH_DTYPES[info["dtype"]]
                w = torch.frombuffer(bytearray(fin.read(end - begin)), dtype=dtype).reshape(info["shape"])
                merged = change(w).to(dtype).contiguous()
                if not bool(torch.isfinite(merged).all()):
                    raise ValueError(f"{src}: tensor {name!r} is not finite after merging the adapter")
                data = merged.view(torch.uint8).numpy().tobytes()
                assert len(data) == end - begin, name
                fout.write(data)
                done += end - begin
                if bar:
                    bar(done)
            pos = end
        fin.seek(pos)
        rest = fin.read()
        fout.write(rest)
        done += len(rest)
    return done


def run(args) -> int:
    import time

    t0 = time.perf_counter()
    out = merge_checkpoint(args.model, args.adapter, args.out, progress=not args.no_progress)
    info = json.loads((out / "tandem_merge.json").read_text())
    print(f"merged: {args.adapter} into {args.model} -> {out} ({info['tensors_changed']} tensors changed) in "
          f"{time.perf_counter() - t0:.1f} s")
    return 0

