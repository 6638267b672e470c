"""Build a transformers MoE model from a checkpoint directory without its experts in torch.

    model = tandem.load_model("/models/Qwen3-30B-A3B", "configs/qwen3-30b-a3b.yaml")
    out = model.generate(**tok("Hello", return_tensors="pt").to(model.device), max_new_tokens=32)

The model is created on the meta device; its experts modules are replaced by
``TandemExperts`` before anything is allocated. The C++ loader streams the expert
tensors from the mapped safetensors files into the pools (and the hot ones to the GPU),
giving the source pages back layer by layer; every other tensor is read into torch on
the model's device. So peak host memory stays near the final footprint: the packed CPU
experts plus (on a CPU-only machine) the non-expert weights.

Every checkpoint tensor must be used: a missing key, an unexpected key, a wrong shape
or an unsupported model type is a ValueError naming it.
"""
from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from . import _C
from .adapters import merge_for_inference, peft_for_training, read_adapter_config
from .checkpoint_reader import TensorReader
from .config import ConfigLike, config_json
from .checkpoint_names import CheckpointNames
from .attention import is_mla, use_mla_absorption, use_pool_attention
from .decode_step import use_decoder_steps, use_head_step, use_model_step
from .dense import replace_dense, replace_norms, use_gated_mlps
from .router import replace_routers
from .discovery import PLAIN, ExpertMath, expert_shape, find_moe_blocks, oai_math
from .distributed import ExpertExchange, machine_group, sync_generation, warn_partial_pool
from .kv_cache import use_growing_cache
from .engine import make_engine, make_lora_layers, share_cpu_with_torch
from .experts_check import check_experts
from .gguf_checkpoint import GGUFModel, check_expert_types, check_experts_present, expert_size_note, is_gguf
from .modules import ExpertsSource, TandemExperts, TandemLoraExperts
from .oai_checkpoint import OaiExpertsReader, load_oai_layer
from .peft_glue import watch_block
from .progress import progress_bar
from .tracing import apply_config

def _pick_device(config_json: dict[str, Any], device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    gpu = config_json["gpu"]["device"]
    if gpu == "none" or not torch.cuda.is_available():
        if gpu not in ("none", "auto"):
            raise ValueError(f"config gpu.device is {gpu!r} but torch sees no CUDA device")
        return torch.device("cpu")
    return torch.device("cuda", 0 if gpu == "auto" else int(gpu.removeprefix("cuda:")))


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor, is_param: bool) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if is_param:
        setattr(mod, attr, nn.Parameter(value, requires_grad=False))
    else:
        mod._buffers[attr] = value


@dataclass
class ModelExperts:
    """A checkpoint directory opened for its routed experts: the transformers model built on
    the meta device, its MoE blocks, and where the experts sit in the checkpoint."""
    path: Path
    hf_config: Any
    ckpt: _C.Checkpoint
    model: nn.Module
    blocks: list
    shape: tuple[int, int, int]   # experts, hidden, intermediate
    layers: list[int]             # model layer of each MoE block
    names: CheckpointNames
    naming: tuple[str, str, str] | None  # gate, up, down patterns ({L}, {E}); None: gpt-oss (math)
    math: ExpertMath = PLAIN             # what the experts compute
    gguf: GGUFModel | None = None        # a GGUF model's files (ckpt is their table)


def open_model_experts(path: str | os.PathLike, dtype: torch.dtype | None = None) -> ModelExperts:
    """Opens checkpoint directory `path` and finds its routed experts (ValueError naming the
    file and the problem otherwise). dtype: of the meta model (default: config.json's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    g = None
    if is_gguf(path):  # llama.cpp's format: config and names from the file (tandem.gguf_checkpoint)
        g = GGUFModel(path)
        path, where, hf_config = g.path, g.path, g.config()
        check_expert_types(g)
        _check_config_sizes(where, hf_config)
    else:
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: no config.json (expected a transformers checkpoint directory or a .gguf file)")
        where = path / "config.json"
        try:
            hf_config = AutoConfig.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 (any failure to read it is about config.json: one line naming it)
            raise ValueError(f"{path / 'config.json'}: {type(e).__name__}: {_first_line(e)}") from e
        _check_quantization(path, hf_config)
        ckpt = _C.Checkpoint(str(path))
        _check_config_against_checkpoint(path, hf_config, ckpt)
    if dtype is None:
        dtype = _config_dtype(hf_config)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RuntimeError) as e:
        raise ValueError(f"{where}: transformers cannot build the model from it: "
                         f"{type(e).__name__}: {_first_line(e)}") from e
    if g is not None:
        ckpt = g.checkpoint(model)
        _check_config_against_checkpoint(path, hf_config, ckpt, where)
    try:
        blocks = find_moe_blocks(model)
    except ValueError as e:
        raise ValueError(f"{path}: model_type {hf_config.model_type!r} is not supported: {e}") from None
    # What the experts classes compute: their structure, and their own forward run on
    # random weights (the meta model has none; the checkpoint's go straight to C++).
    checked: dict = {}
    maths = {check_experts(b.experts, f"model layer {b.layer}", checked) for b in blocks}  # (not config.hidden_act)
    if len(maths) != 1:
        raise ValueError(f"{path}: the MoE layers' experts compute different math "
                         f"({', '.join(sorted(m.describe() for m in maths))}); tandem needs one")
    math = maths.pop()
    _check_mxfp4(path, hf_config, math)
    E, H, I = expert_shape(blocks[0].experts)
    layers = [b.layer for b in blocks]
    if g is not None:
        check_experts_present(g, layers)
    names = CheckpointNames(hf_config.model_type, ckpt, str(path))
    # gpt-oss's experts are read layer by layer in Python (oai_checkpoint), not by pattern.
    oai = oai_math(blocks[0].experts) is not None
    naming = None if oai else tuple(names.experts(blocks[0].path, layers[0]))
    return ModelExperts(path, hf_config, ckpt, model, blocks, (E, H, I), layers, names, naming, math, g)


def _check_mxfp4(path: Path, hf_config: Any, math: ExpertMath) -> None:
    """MXFP4 (quant_method mxfp4) is read for gpt-oss's routed experts only."""
    q = getattr(hf_config, "quantization_config", None)
    q = q if q is None or isinstance(q, dict) else q.to_dict()
    if q and q.get("quant_method") == "mxfp4" and not math.bias:
        raise ValueError(f"{path / 'config.json'}: quantization_config: quant_method 'mxfp4' is read for gpt-oss's "
                         "routed experts only, and this model's experts are not gpt-oss's")


def _check_quantization(path: Path, hf_config: Any) -> None:
    """config.json's quantization_config is one tandem reads (FP8 with block scales; 4-bit GPTQ in
    the original format, AWQ GEMM, compressed-tensors pack-quantized), or a ValueError naming
    what is not. (Act-order is decided per tensor, from its group index: groups permuted along k
    are refused for the experts.)"""
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return
    q = q if isinstance(q, dict) else q.to_dict()
    method = q.get("quant_method")
    where = path / "config.json"
    if method in ("fp8", "mxfp4"):  # mxfp4: gpt-oss's experts only (_check_mxfp4)
        return
    if method == "gptq":
        if q.get("bits") != 4:
            raise ValueError(f"{where}: quantization_config: GPTQ with bits = {q.get('bits')!r}; tandem reads 4-bit "
                             "GPTQ only")
        fmt = q.get("checkpoint_format", "gptq")
        if fmt != "gptq":
            raise ValueError(f"{where}: quantization_config: GPTQ checkpoint_format {fmt!r}; tandem reads the "
                             "original 'gptq' format (zero points stored minus one)")
        return
    if method == "awq":
        if q.get("bits", q.get("w_bit")) != 4 or str(q.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"{where}: quantization_config: AWQ bits {q.get('bits', q.get('w_bit'))!r}, version "
                             f"{q.get('version')!r}; tandem reads 4-bit AWQ in the GEMM layout")
        return
    if method == "compressed-tensors":
        groups = q.get("config_groups") or {}
        for gname, grp in groups.items():
            w, fmt = grp.get("weights") or {}, grp.get("format") or q.get("format")
            bad = ("format", fmt) if fmt != "pack-quantized" else ("num_bits", w.get("num_bits")) \
                if w.get("num_bits") != 4 else ("type", w.get("type")) if w.get("type") != "int" \
                else ("strategy", w.get("strategy")) if w.get("strategy") != "group" \
                else ("input_activations", grp.get("input_activations")) if grp.get("input_activations") else None
            if bad:
                raise ValueError(f"{where}: quantization_config.config_groups.{gname}: {bad[0]} = {bad[1]!r}; tandem "
                                 "reads compressed-tensors pack-quantized 4-bit integer weights in groups (W4A16)")
        return
    raise ValueError(f"{where}: quantization_config: quant_method {method!r} is not supported (tandem reads bf16 / "
                     "fp16 / fp32 checkpoints, FP8 with block scales, 4-bit GPTQ, AWQ or compressed-tensors, and "
                     "gpt-oss's MXFP4 experts)")


def _config_dtype(hf_config: Any) -> torch.dtype:
    dtype = getattr(hf_config, "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def open_store(store: str | os.PathLike, me: ModelExperts, cpu: dict[str, Any], progress: bool = True) -> _C.ExpertStore:
    """The expert store at `store`, checked against the model's experts and the config's cpu
    format (ValueError naming the field otherwise; OSError for a store that is not there or
    unfinished). A source whose files' times changed has its experts hashed again."""
    s = _C.ExpertStore(str(store))
    E, H, I = me.shape
    bar = progress_bar(progress, len(me.layers), "checking the store's source")
    try:
        s.check(me.ckpt, me.naming, E, H, I, me.layers, cpu["format"], cpu["group_size"], cpu["zero_point"],
                progress=(lambda d, t: bar(d)) if bar else None)
    finally:
        if bar:
            bar(None)
    return s


def _auto_hot_budget(cfg_json: dict, model, blocks, dtype: torch.dtype, device: torch.device) -> int | None:
    """For gpu.hot_experts count: auto on a CUDA device: its free memory less what the rest of
    the model will take there (every parameter and buffer outside the routed experts, in the
    dtype it is loaded in) and less the reserve for the KV cache and activations. None
    otherwise (the engine then decides: the host stream holds no hot experts)."""
    if cfg_json["gpu"]["hot_experts"].get("count") != "auto" or torch.device(device).type != "cuda":
        return None
    skip = {id(t) for b in blocks for t in b.block.experts.parameters()}
    rest = sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
               for t in list(model.parameters()) + list(model.buffers()) if id(t) not in skip)
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return max(0, free - rest - _C.hot_auto_reserve(total))


def load_model(path: str | os.PathLike | None = None, config: ConfigLike = None, *,
               device: str | torch.device | None = None, dtype: torch.dtype | None = None,
               train: bool = False, backward_format: str | None = None, progress: bool = True,
               adapter: str | os.PathLike | None = None, store: str | os.PathLike | None = None) -> nn.Module:
    """A transformers causal LM from checkpoint directory `path`, its routed experts in tandem.

    config: placement (YAML path, dict, or None for defaults); its model.path is used when
    `path` is None. device: where the non-expert weights go (default: the config's GPU when
    torch sees one, else the CPU). dtype: of the non-expert weights (default: the
    checkpoint's config dtype). train: load the experts for LoRA fine-tuning
    (``TandemLoraExperts`` on the CPU pools; apply PEFT to the returned model, e.g.
    ``target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``) instead of
    the inference engine; backward_format "int8" halves the training path's transposed
    packs; default: the config's train.backward_format, bf16). The model is returned in
    eval mode, with ``model.tandem_engine``
    holding the engine (a ``LoraEngine`` when training). For inference on the CPU, the
    model's other linear layers run on tandem's kernels too (``tandem.dense``: config
    ``cpu.dense_format``, by default bf16 weights only; ``model.tandem_dense`` lists them).

    adapter: a PEFT LoRA adapter directory (``save_pretrained``'s output) for this
    checkpoint. For inference it is merged (``tandem.adapters``: the expert layers it
    changes are packed with W + s B A, the rest merged by PEFT) and a plain transformers
    model is returned; with train=True the returned model is a ``PeftModel`` whose adapter
    trains on (tandem's LoRA path). Every tensor of the adapter must fit the model.

    store: a directory ``tandem convert`` wrote for this checkpoint and the config's
    cpu.format (default: the config's cpu.store): the CPU experts are read from it instead of
    packed from the checkpoint. A store for other experts, another format or a changed
    checkpoint is refused, naming the field. Inference only (training packs its own layouts).
    """
    cfg_json = config_json(config)
    if path is None:
        path = cfg_json["model"].get("path") or None
        if not path:
            raise ValueError("no checkpoint given: pass a directory or set model.path in the config")
    if store is None and cfg_json["cpu"].get("store"):
        store = cfg_json["cpu"]["store"]
    if store is not None and train:
        raise ValueError(f"store {store}: an expert store holds inference packs; training packs its experts from "
                         "the checkpoint (load without store=, or remove cpu.store from the config)")
    if store is not None and adapter is not None:
        raise ValueError(f"store {store}: an adapter changes the experts the store holds packed; merge it into a "
                         "checkpoint first (tandem merge) and convert that, or load without the store")
    adapter_cfg = read_adapter_config(adapter) if adapter is not None else None
    device = _pick_device(cfg_json, device)
    me = open_model_experts(path, dtype)
    path, hf_config, ckpt, model, blocks = me.path, me.hf_config, me.ckpt, me.model, me.blocks
    if me.gguf is not None and (train or adapter is not None):
        raise ValueError(f"{path}: a GGUF model loads for inference only: LoRA training and adapters need a "
                         "safetensors checkpoint (the original model's)")
    if me.gguf is not None and store is None and (note := expert_size_note(me.gguf, cfg_json["cpu"])):
        warnings.warn(note, stacklevel=2)
    dtype = dtype if dtype is not None else _config_dtype(hf_config)
    (E, H, I), layers, names, naming = me.shape, me.layers, me.names, me.naming
    what = f"{path}: this model's experts compute {me.math.describe()}"
    if store is not None and me.math.bias:
        raise ValueError(f"{what}; a packed expert store holds experts without biases only (load without store=, or "
                         "remove cpu.store from the config)")
    if adapter is not None and naming is None:
        raise ValueError(f"{what}; adapters are merged into experts in transformers' standard layouts only")
    expert_store = open_store(store, me, cfg_json["cpu"], progress) if store is not None else None

    # Several ranks on this machine: one of them holds the CPU experts (tandem.distributed).
    mg = machine_group(cfg_json)
    warn_partial_pool(mg, cfg_json)
    if mg is not None and adapter is not None and not train:
        raise ValueError(f"adapter {adapter}: merging an adapter into experts shared by this machine's ranks "
                         f"({mg.describe()}) is not supported; merge it into a checkpoint first (tandem merge) and "
                         "load that, or set distributed.cpu_experts: per_rank")
    holds = mg is None or mg.is_owner
    exchange = [ExpertExchange(mg, E) for _ in blocks] if mg is not None else [None] * len(blocks)
    if mg is not None and not holds:
        expert_store = None  # read by the owner

    # Routed experts: the C++ loader, straight from the mapped files (or the store).
    bar = progress_bar(progress and holds, E * len(layers),
                       "loading experts" + (" from the store" if expert_store else ""))
    if not holds:
        engine = None
    elif train:
        engine = make_lora_layers(config, (E, H, I), layers,
                                  backward_format or cfg_json.get("train", {}).get("backward_format", "bf16"), me.math)
    else:
        engine = make_engine(config, (E, H, I), layers, device, _auto_hot_budget(cfg_json, model, blocks, dtype, device),
                             math=me.math)
    # Both engines check every expert tensor first, then pack layer by layer, giving each
    # layer's checkpoint pages back once it is packed. With an adapter, inference packs
    # wait for it (below): the layers it changes are packed merged, once.
    if naming is None:  # gpt-oss: each layer read (dequantized from MXFP4) and packed in turn
        oai = OaiExpertsReader(TensorReader(ckpt), str(path), (E, H, I))
        oai_keys = set()
        for i, b in enumerate(blocks):
            prefix = names.key(b.path + ".gate_up_proj_bias")
            prefix = prefix.removesuffix(".gate_up_proj_bias") if prefix else b.path
            oai_keys.update(oai.keys(prefix))
            if engine is not None and expert_store is None:
                load_oai_layer(engine, i, oai.layer(prefix),
                               progress=(lambda d, t, base=i * E: bar(base + d)) if bar else None)
    if engine is None:
        pass
    elif expert_store is not None:
        engine.load_store(expert_store, ckpt, naming, progress=(lambda d, t: bar(d)) if bar else None)
    elif naming is not None and (train or adapter is None):
        engine.load_checkpoint(ckpt, naming, progress=(lambda d, t: bar(d)) if bar else None)
    if bar:
        bar(None)
    if train:
        for i, b in enumerate(blocks):
            layer = engine.layers[i] if engine is not None else None
            b.block.experts = TandemLoraExperts(layer, b.layer, True, dtype, device, interleaved=naming is None,
                                                exchange=exchange[i], shape=(E, H, I))
            watch_block(b.block, b.block.experts)
    else:
        # (what merging an adapter re-reads: a safetensors checkpoint; GGUF models refuse adapters)
        source = ExpertsSource(str(path), tuple(naming)) if naming and me.gguf is None else None
        for i, b in enumerate(blocks):
            b.block.experts = TandemExperts(engine, i, b.layer, "silu", fused=True, dtype=dtype,
                                            device=device, source=source, math=me.math, interleaved=naming is None,
                                            exchange=exchange[i], shape=(E, H, I))
            watch_block(b.block, b.block.experts)
    if naming:
        expert_keys = {_C.expert_key(p, L, e) for L in layers for e in range(E) for p in naming}
        expert_keys |= {t for k in list(expert_keys) for t in _C.expert_tensor_names(ckpt, k)}
    else:
        expert_keys = oai_keys

    # Everything else: torch tensors on `device`.
    reader = TensorReader(ckpt, me.gguf)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    used: set[str] = set()
    params = dict(model.named_parameters())
    keep_fp32 = _keep_in_fp32(model, dtype)
    named = list(params.items()) + [(n, b) for n, b in model.named_buffers() if n not in _non_persistent(model)]
    try:
        from tqdm.auto import tqdm
        it = tqdm(named, desc="loading weights", unit="tensor", leave=False, disable=not progress)
    except ImportError:  # pragma: no cover
        it = named
    for name, t in it:
        key = names.key(name)
        quantized = None
        if key is None and name.endswith(".weight"):  # a 4-bit quantized linear layer: dequantized here
            quantized = next((c for c in names.candidates(name) if reader.quantized_parts(c)), None)
        if quantized is not None:
            value = reader.get_quantized(quantized)
            if tuple(value.shape) != tuple(t.shape):
                raise ValueError(f"{path}: the 4-bit quantized {quantized!r} holds a weight of shape "
                                 f"{list(value.shape)}, the model needs {list(t.shape)}")
            used.update(reader.quantized_parts(quantized))
            target = torch.float32 if keep_fp32(name) else t.dtype
            _set_tensor(model, name, value.to(device=device, dtype=target), name in params)
            continue
        # Its checkpoint tensor, or the parts transformers' Concatenate converter joins into it.
        parts, dim = ([key], 0) if key is not None else names.concatenated(name) or (None, 0)
        if parts is None:
            if name in tied:
                continue
            raise ValueError(f"{path}: checkpoint has no tensor {name!r} (shape {list(t.shape)}) that the "
                             f"{type(model).__name__} needs")
        pieces = [reader.get(k) for k in parts]
        try:
            value = torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]
        except RuntimeError:
            raise ValueError(f"{path}: {name!r} joins {', '.join(repr(k) for k in parts)} along dimension {dim} "
                             f"(transformers' conversion rule), but their shapes "
                             f"{', '.join(str(list(p.shape)) for p in pieces)} do not fit together") from None
        key = " + ".join(parts)
        if t.dtype.is_floating_point and not value.dtype.is_floating_point:
            # An integer weight (INT8 / INT4 / packed) means nothing without its quantization
            # scheme's scales and zero points, which tandem does not read for these weights.
            raise ValueError(f"{reader.file(parts[0])}: tensor {key!r} is {str(value.dtype).removeprefix('torch.')}: "
                             "quantized non-expert weights are not supported (tandem reads bf16 / fp16 / fp32, or "
                             "FP8 with block scales; dequantize the checkpoint first)")
        if tuple(value.shape) != tuple(t.shape):
            raise ValueError(f"{path}: tensor {key!r} has shape {list(value.shape)}, the model needs {list(t.shape)}")
        used.update(k for p in parts for k in (p, p + "_scale_inv"))
        # transformers' rule: the meta model's dtype (built under `dtype`), fp32 where kept.
        target = torch.float32 if t.dtype.is_floating_point and keep_fp32(name) else t.dtype
        _set_tensor(model, name, value.to(device=device, dtype=target), name in params)
    _init_non_persistent_buffers(model, device)
    if tied:
        model.tie_weights()
        # A tied tensor the checkpoint also holds is the one it is tied to: it must hold the
        # same values, or the checkpoint's would be silently dropped.
        for name in sorted(tied):
            key = names.key(name)
            if key is None or key in used:
                continue
            now = model.get_parameter(name)
            if not torch.equal(reader.get(key).to(device=now.device, dtype=now.dtype), now.detach()):
                raise ValueError(f"{path}: config.json ties {name!r} to another weight (tie_word_embeddings), but "
                                 f"the checkpoint's {key!r} holds different values; fix config.json or the checkpoint")
            used.update((key, key + "_scale_inv"))
    skip = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    extra, ignored = [], []
    for k in ckpt.names():
        if k not in used and k not in expert_keys:
            (ignored if _ignored(k, hf_config, skip) else extra).append(k)
    skipped = _skipped_groups(k for k in ignored if not k.endswith("rotary_emb.inv_freq"))
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise ValueError(f"{path}: checkpoint has tensors the model does not use: "
                         f"{', '.join(repr(k) for k in extra[:5])}{more}")
    meta = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.device.type == "meta"]
    if meta:
        raise ValueError(f"{path}: these tensors were not loaded: {', '.join(meta[:5])}")
    if adapter is not None:
        if train:
            model = peft_for_training(model, adapter, adapter_cfg)
        else:
            model = merge_for_inference(model, engine, adapter, adapter_cfg, ckpt, naming, bar)
    if not train and device.type == "cpu" and engine is not None:
        # The other linear layers on tandem's kernels (cpu.dense_format); nn.Linear routers and
        # shared-expert gates (direct children of a MoE block) stay in torch (the routers of
        # transformers' softmax-then-top-k form move to tandem.router below, in bf16).
        keep = {id(m) for b in blocks for m in b.block.children() if isinstance(m, nn.Linear)}
        # MLA's kv_b_proj stays a torch bf16 layer: one-token steps use its rows directly
        # (tandem.attention.use_mla_absorption), prefill expands the latents with it.
        mla = [m for m in model.modules() if is_mla(m)] if cfg_json["cpu"].get("dense_format", "auto") != "torch" else []
        keep |= {id(m.kv_b_proj) for m in mla}
        model.tandem_dense = replace_dense(model, engine, cfg_json["cpu"], keep)
        # Their RMSNorms too, where the fused kernel computes what they do (checked per kind).
        if cfg_json["cpu"].get("dense_format", "auto") != "torch":
            model.tandem_norms = replace_norms(model)
            # Gated MLPs (shared experts, dense MLPs) in one call each where a probe agrees.
            model.tandem_mlps = use_gated_mlps(model)
            # The routers of the softmax-then-top-k form too (checked per module, tandem.router).
            model.tandem_routers = replace_routers(model, engine, [b.block for b in blocks])
            # One-token attention (generation) on the pool too: tandem.attention.
            model.tandem_attention = use_pool_attention(model, engine)
            model.tandem_mla = use_mla_absorption(model) if model.tandem_attention else 0
            # Whole decoder layers' one-token steps in C++ where every part is tandem's (tandem.decode_step).
            model.tandem_decoder_steps = use_decoder_steps(model, engine) if model.tandem_attention else 0
            # And all of them in one C++ call per token where every layer has its step.
            model.tandem_model_step = use_model_step(model) if model.tandem_decoder_steps else False
            # And the embedding, final norm and lm_head around that call too (one path per token).
            model.tandem_head_step = use_head_step(model) if model.tandem_model_step else False
    if not train and device.type == "cpu":
        # generate appends to the KV cache in place (tandem.kv_cache), not by torch.cat.
        use_growing_cache(model)
    if engine is not None:
        share_cpu_with_torch(engine, device)
    apply_config(cfg_json)  # trace.enabled: record from now on, write trace.path at exit
    model.tandem_engine = engine  # None on a rank whose machine's experts another rank holds
    model.tandem_experts_group = mg
    if mg is not None:
        sync_generation(model)
    model.tandem_checkpoint = str(path)
    model.tandem_skipped = skipped  # checkpoint tensors transformers does not run either (MTP layers)
    model.tandem_store = expert_store.path if expert_store is not None else None
    if adapter is not None:
        model.tandem_adapter = str(adapter)
    return model.eval()


def _keep_in_fp32(model: nn.Module, dtype: torch.dtype) -> Callable[[str], bool]:
    """Whether a tensor stays fp32 under `dtype`, by the rule transformers' from_pretrained
    applies (``PreTrainedModel._get_dtype_plan``): ``_keep_in_fp32_modules_strict`` for fp16
    and bf16 (DeepSeek-V3's ``e_score_correction_bias``: rounded to bf16 it flips routing),
    ``_keep_in_fp32_modules`` for fp16 only; each entry is a glob (``*`` any text) searched
    anywhere in the tensor's name. post_init gathers both lists from the submodels."""
    names: set[str] = set()
    if dtype == torch.float16:
        names |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if dtype in (torch.float16, torch.bfloat16):
        names |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if not names:
        return lambda name: False
    pattern = re.compile("|".join(f"(?:{n.replace('*', '.*')})" for n in sorted(names)))
    return lambda name: pattern.search(name) is not None


def _non_persistent(model: nn.Module) -> set[str]:
    out = set()
    for mod_name, mod in model.named_modules():
        for b in getattr(mod, "_non_persistent_buffers_set", ()):
            out.add(f"{mod_name}.{b}" if mod_name else b)
    return out


def _init_non_persistent_buffers(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary inv_freq) are computed, not stored: materialize them and
    let the model's own initializer compute them, as transformers' from_pretrained does."""
    for mod in model.modules():
        names = list(getattr(mod, "_non_persistent_buffers_set", ()))
        if not names:
            continue
        for b in names:
            buf = mod._buffers.get(b)
            if buf is not None and buf.device.type == "meta":
                mod._buffers[b] = torch.empty_like(buf, device=device)
        with torch.no_grad():
            model._init_weights(mod)


def _ignored(key: str, hf_config: Any, patterns: set[str] = frozenset()) -> bool:
    """Checkpoint tensors transformers also ignores: rotary caches of old checkpoints, what the
    model class's ``_keys_to_ignore_on_load_unexpected`` patterns match (searched as
    transformers does: the multi-token-prediction modules, ``mtp.*``, ``model.mtp_layers.*``),
    and the multi-token-prediction layers DeepSeek-V3 and GLM-4.5 store right after their
    num_hidden_layers (num_nextn_predict_layers of them). Any other layer past
    num_hidden_layers is not ignored: a config.json naming fewer layers than the checkpoint
    holds is an error."""
    if key.endswith("rotary_emb.inv_freq") or any(re.search(p, key) for p in patterns):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", key)
    if not m:
        return False
    n = hf_config.num_hidden_layers
    return n <= int(m.group(1)) < n + int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)


def _skipped_groups(keys) -> dict[str, int]:
    """Skipped tensor names grouped by their module: a decoder layer ("model.layers.61"), else
    the path to the first part naming MTP ("mtp", "model.mtp_layers"), else the first part."""
    groups: dict[str, int] = {}
    for k in keys:
        m = re.match(r"(model\.layers\.\d+)\.", k) or re.match(r"((?:[^.]+\.)*?[^.]*mtp[^.]*)\.", k)
        g = m.group(1) if m else k.split(".")[0]
        groups[g] = groups.get(g, 0) + 1
    return dict(sorted(groups.items()))


def skipped_summary(model: nn.Module) -> str | None:
    """The load summary's line for the checkpoint tensors load_model skipped, or None."""
    groups = getattr(model, "tandem_skipped", None)
    if not groups:
        return None
    return (f"skipped: {sum(groups.values())} checkpoint tensors that transformers does not run either "
            f"(multi-token prediction): " + ", ".join(f"{g}.* ({n})" for g, n in groups.items()))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# Sane upper bounds for config.json's sizes, checked before anything is built: a value in
# the billions would otherwise make transformers build (or try to) a model that size.


def _check_config_against_checkpoint(path: Path, hf_config: Any, ckpt: _C.Checkpoint, where: Path | None = None) -> None:
    """config.json's sizes within sane bounds, and its layer count the checkpoint's. where:
    what the config came from (default: config.json in `path`)."""
    where = where or path / "config.json"
    _check_config_sizes(where, hf_config)
    _check_layers(path, where, hf_config, ckpt)


def _check_config_sizes(where: Path, hf_config: Any) -> None:
    for key, (lo, hi) in _C.config_size_bounds().items():  # the bounds tandem doctor applies too
        try:
            v = getattr(hf_config, key, None)
        except Exception as e:  # noqa: BLE001 (e.g. a per-layer value transformers will not give globally)
            raise ValueError(f"{where}: {key}: {_first_line(e)} (tandem reads one value for the whole model)") from None
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not (lo <= v <= hi):
            raise ValueError(f"{where}: {key} = {v!r} is not a valid size (expected an integer in [{lo}, {hi}])")
    experts = [getattr(hf_config, k, None) for k in ("num_experts", "n_routed_experts", "num_local_experts",
                                                     "moe_num_experts")]
    top_k = getattr(hf_config, "num_experts_per_tok", None)
    for e in experts:
        if e is not None and top_k is not None and top_k > e:
            raise ValueError(f"{where}: num_experts_per_tok = {top_k} is more than the {e} experts")


def _check_layers(path: Path, where: Path, hf_config: Any, ckpt: _C.Checkpoint) -> None:
    layers = {int(m.group(1)) for k in ckpt.names() if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    if not layers:
        first = min(ckpt.names(), default="(none)")
        raise ValueError(f"{path}: the checkpoint has no model.layers.N tensors (e.g. {first!r}): tandem loads "
                         "models whose decoder layers are model.layers.N")
    n = hf_config.num_hidden_layers
    missing = sorted(set(range(n)) - layers)
    if missing:
        shown = ", ".join(map(str, missing[:5])) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"{where}: num_hidden_layers = {n}, but the checkpoint has no tensors of layer {shown}")
    nextn = int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)
    extra = sorted(i for i in layers if i >= n + nextn)
    if extra:
        raise ValueError(f"{where}: num_hidden_layers = {n}"
                         f"{f' (+ {nextn} multi-token-prediction layers)' if nextn else ''}, but the checkpoint "
                         f"holds layers up to {extra[-1]}: config.json describes a smaller model than the checkpoint")
