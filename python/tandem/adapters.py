"""Fine-tuned LoRA adapters on tandem's inference engine.

The inference engine runs no LoRA: an adapter's expert LoRA is merged into the layer's
weights and the layer is packed again. Per expert and projection, W' = W + s B A is
computed in fp32 from the checkpoint's base weight (FP8 dequantized first) and rounded
to the checkpoint's dtype (bf16 stays bf16, fp32 and fp16 stay what they are, FP8
becomes bf16), then packed in the engine's format like any weight; the hot experts are
loaded from the same merged weights, so the GPU side and the CPU side run one model.
This is PEFT's own ``merge_and_unload`` arithmetic; everything that is not a routed
expert (attention, dense MLPs, shared experts, lm_head, ``modules_to_save``) is merged
by PEFT itself.

Two ways in, one arithmetic:

* ``tandem.load_model(path, config, adapter=DIR)`` (and ``tandem run --adapter DIR``):
  PEFT reads the adapter (every key must land: a missing or unexpected one is an error
  naming it), layers with expert LoRA are packed merged and the others straight from the
  checkpoint (each layer packed once), and the rest is merged by PEFT. Peak extra memory:
  one MoE layer's expert weights in the checkpoint's dtype.
* ``PeftModel.from_pretrained(tandem.load_model(path, config), DIR)``: PEFT wraps the
  experts' placeholders; running it unmerged is refused (the engine would silently drop
  the LoRA), ``merge_adapter()`` / ``merge_and_unload()`` re-pack the layers merged (the
  base weights are read again from the checkpoint) and ``unmerge_adapter()`` re-packs them
  from the base. A model offloaded from memory (``tandem.offload``) keeps no base copy:
  merging there is refused with the way to do it before offloading.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from . import _C
from .checkpoint_reader import TensorReader
from .lora import LoraTensors, is_param_wrapper, param_wrapper_lora

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def read_adapter_config(adapter: str | os.PathLike):
    """The adapter's PEFT config (a LoraConfig), or a ValueError naming the file."""
    from peft import PeftConfig

    path = Path(adapter)
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path}: no adapter_config.json (expected a PEFT adapter directory, as save_pretrained "
                         "writes it)")
    try:
        with open(cfg_file, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg_file}: cannot read it: {e}") from e
    if not isinstance(raw, dict) or raw.get("peft_type") != "LORA":
        kind = raw.get("peft_type") if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"{cfg_file}: peft_type {kind!r} is not supported (tandem runs LoRA adapters)")
    try:
        cfg = PeftConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 (any failure is about this file: one line naming it)
        raise ValueError(f"{cfg_file}: PEFT cannot read it: {type(e).__name__}: {e}") from e
    if getattr(cfg, "use_dora", False):
        raise ValueError(f"{cfg_file}: use_dora is set; tandem merges plain LoRA only (DoRA's magnitude vector "
                         "rescales each merged weight: not supported)")
    return cfg


def check_load_result(adapter: str | os.PathLike, result) -> None:
    """Refuses an adapter whose weights did not all land (PEFT only warns)."""
    missing = [k for k in result.missing_keys if "lora_" in k]
    unexpected = list(result.unexpected_keys)
    if unexpected or missing:
        parts = []
        if unexpected:
            parts.append(f"{len(unexpected)} adapter tensor(s) match no module of this model "
                         f"({', '.join(unexpected[:4])}{' ...' if len(unexpected) > 4 else ''})")
        if missing:
            parts.append(f"{len(missing)} LoRA tensor(s) the adapter config asks for are not in the file "
                         f"({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''})")
        raise ValueError(f"{adapter}: the adapter does not fit this model: {'; '.join(parts)}. Was it trained on "
                         "another model?")


def merged_layer_weights(ckpt: _C.Checkpoint, naming: tuple[str, str, str], layer: int, shape: tuple[int, int, int],
                         lora: LoraTensors | None, where: str) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                                         list[torch.Tensor], str]:
    """One model layer's expert weights from the checkpoint, W + s B A where `lora` is
    given, in one dtype the engine packs from: (gate, up, down lists, dtype name)."""
    E, H, I = shape
    if "{E}" not in naming[0]:
        raise ValueError(f"{where}: the checkpoint stores these experts fused ({_C.expert_key(naming[0], layer, 0)}); "
                         "merging an adapter into fused experts is not supported yet (save the base model with one "
                         "tensor per expert: save_pretrained's default, save_original_format=True)")
    reader = TensorReader(ckpt)
    names = [[_C.expert_key(p, layer, e) for p in naming] for e in range(E)]
    dtypes = {ckpt.info(k)[0] for row in names for k in row}
    # One dtype for the layer: the checkpoint's, or bf16 for FP8 (what the engine packs it from).
    out_dtype = torch.float32 if dtypes == {"F32"} else torch.float16 if dtypes == {"F16"} else torch.bfloat16
    shapes = ((I, H), (I, H), (H, I))
    lists: tuple[list[torch.Tensor], ...] = ([], [], [])
    for e in range(E):
        for j in range(3):
            w = reader.get(names[e][j])
            if tuple(w.shape) != shapes[j]:
                raise ValueError(f"{ckpt.info(names[e][j])[2]}: tensor {names[e][j]!r} has shape {list(w.shape)}, "
                                 f"{where} needs {list(shapes[j])}")
            if lora is not None:
                w = merge_expert(w, lora, e, j).to(out_dtype)
                if not bool(torch.isfinite(w).all()):  # e.g. past fp16's 65504 once rounded
                    raise ValueError(f"{where}: expert {e}'s {PROJECTIONS[j]} weight is not finite after merging the "
                                     f"adapter and rounding to {str(out_dtype).removeprefix('torch.')} (its LoRA "
                                     "tensors hold inf / NaN or huge values)")
            lists[j].append(w.to(out_dtype).contiguous())
    return lists[0], lists[1], lists[2], _DTYPE_NAMES[out_dtype]


PROJECTIONS = ("gate", "up", "down")


def merge_expert(w: torch.Tensor, lora: LoraTensors, e: int, j: int) -> torch.Tensor:
    """Expert e's projection j (0 gate, 1 up, 2 down) with its LoRA merged: W + s B A in fp32
    (the one formula of every merge tandem does, so they agree bit for bit). Callers check
    the result is finite once rounded to the dtype they keep."""
    a, b = ((lora.a_gate, lora.b_gate), (lora.a_up, lora.b_up), (lora.a_down, lora.b_down))[j]
    delta = lora.scaling * (b[e].detach().to("cpu", torch.float32) @ a[e].detach().to("cpu", torch.float32))
    return w.float() + delta


def pack_layer(engine: _C.Engine, index: int, tensors, progress: Callable[[int, int], None] | None = None) -> None:
    gate, up, down, dtype = tensors
    engine.load_layer(index, [t.data_ptr() for t in gate], [t.data_ptr() for t in up], [t.data_ptr() for t in down],
                      dtype, progress=progress)


def repack(te: nn.Module, lora: LoraTensors | None) -> None:
    """Packs `te`'s layer again from its checkpoint, with `lora` merged (None: the base)."""
    where = f"tandem experts (model layer {te.layer})"
    if te.math.bias:
        raise ValueError(f"{where}: these experts compute {te.math.describe()}; adapters are merged into experts "
                         "without biases only")
    if te.source is None:
        raise ValueError(f"{where}: merging an adapter into tandem's packs re-reads the base weights from their "
                         "checkpoint, and this model's experts were offloaded from memory (tandem.offload) or "
                         "loaded from a GGUF file, which keep no safetensors checkpoint to re-read. Merge before "
                         "offloading (PeftModel.merge_and_unload() on the transformers model, then tandem.offload), "
                         "or load the safetensors checkpoint with tandem.load_model(path, config, adapter=DIR)")
    ckpt = _C.Checkpoint(te.source.checkpoint)
    tensors = merged_layer_weights(ckpt, te.source.naming, te.layer, (te.num_experts, te.hidden_dim,
                                                                       te.intermediate_dim), lora, where)
    te.engine.unload_layer(te.index)
    try:
        pack_layer(te.engine, te.index, tensors)
    except BaseException:
        # The layer must not stay without weights: back to its base packs, then the error.
        if not te.engine.layer_loaded(te.index):
            pack_layer(te.engine, te.index, merged_layer_weights(ckpt, te.source.naming, te.layer, (
                te.num_experts, te.hidden_dim, te.intermediate_dim), None, where))
        raise


LORA_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.")


def attach_adapter(model: nn.Module, adapter: str | os.PathLike, cfg, trainable: bool = False, on_meta: bool = False):
    """A PeftModel over `model` with the adapter's weights, every tensor checked to land.
    on_meta: `model` is on the meta device (tandem merge), and the adapter's tensors are
    loaded onto the CPU instead of its layers' device."""
    from peft import PeftModel

    cfg.inference_mode = not trainable
    try:
        pm = PeftModel(model, cfg, low_cpu_mem_usage=on_meta)
    except ValueError as e:  # e.g. target modules that match nothing
        raise ValueError(f"{Path(adapter) / 'adapter_config.json'}: PEFT cannot apply it to this model: {e}") from e
    # PEFT moves loaded adapter tensors to their base layer's device, on a meta model meta
    # (where they would hold no values): kept on the CPU instead, for this load only.
    keep = [m for m in pm.modules() if hasattr(m, "_move_adapter_to_device_of_base_layer")] if on_meta else []
    for m in keep:
        m.__dict__["_move_adapter_to_device_of_base_layer"] = lambda *a, **k: None
    try:
        extra = dict(low_cpu_mem_usage=True, torch_device="cpu") if on_meta else {}
        check_load_result(adapter, pm.load_adapter(str(adapter), "default", is_trainable=trainable, **extra))
    finally:
        for m in keep:
            m.__dict__.pop("_move_adapter_to_device_of_base_layer", None)
    if on_meta:
        still = [n for n, p in pm.named_parameters() if p.device.type == "meta" and any(s in n for s in LORA_PARTS)]
        if still:
            raise ValueError(f"{adapter}: PEFT left {len(still)} adapter tensor(s) without values ({still[0]}, ...)")
    return pm


def peft_for_training(model: nn.Module, adapter: str | os.PathLike, cfg) -> nn.Module:
    """`model` (tandem's training experts) with the adapter attached and trainable."""
    return attach_adapter(model, adapter, cfg, trainable=True)


def merge_for_inference(model: nn.Module, engine: _C.Engine, adapter: str | os.PathLike, cfg, ckpt: _C.Checkpoint,
                        naming: tuple[str, str, str], bar: Callable[[int | None], None] | None) -> nn.Module:
    """Packs `model`'s (not yet loaded) inference engine with the adapter merged into the
    expert layers it changes and straight from the checkpoint elsewhere, merges the rest
    with PEFT, and returns the plain transformers model."""
    pm = attach_adapter(model, adapter, cfg)
    merged: dict[int, tuple[nn.Module, LoraTensors]] = {}
    for block in (m for m in model.modules() if is_param_wrapper(getattr(m, "experts", None))):
        te = block.experts
        while is_param_wrapper(te):
            te = te.base_layer
        where = f"tandem experts (model layer {te.layer})"
        lora = param_wrapper_lora(block.experts, te.num_experts, te.hidden_dim, te.intermediate_dim, where)
        block.experts = te  # unwrapped: PEFT's merge below never sees the experts
        if lora is not None:
            merged[te.index] = (te, lora)
    E = engine.experts
    rest = [i for i in range(engine.moe_layers) if i not in merged]
    if rest:
        engine.load_checkpoint(ckpt, naming, progress=(lambda d, t: bar(d)) if bar else None, layers=rest)
    done = len(rest) * E
    for n, (i, (te, lora)) in enumerate(sorted(merged.items())):
        step = (lambda d, t, base=done + n * E: bar(base + d * E // max(t, 1))) if bar else None
        tensors = merged_layer_weights(ckpt, naming, te.layer, (E, te.hidden_dim, te.intermediate_dim), lora,
                                       f"tandem experts (model layer {te.layer})")
        pack_layer(engine, i, tensors, progress=step)
        del tensors
    if bar:
        bar(None)
    return pm.merge_and_unload()
