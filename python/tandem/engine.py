"""Engines for a model's routed experts, and ``offload``, which moves an existing transformers
MoE model's experts into one.

``make_engine`` builds the inference engine (``_C.Engine``, bound to torch's current CUDA
stream for a model on a GPU); ``make_lora_layers`` the training side (``_C.LoraEngine``: a pool
and one ``_C.LoraLayer`` per MoE layer); ``share_cpu_with_torch`` sets torch's threads beside the
CPU pool.

    import tandem
    model = AutoModelForCausalLM.from_pretrained(...)      # or tandem.load_model(dir, cfg)
    tandem.offload(model, "configs/qwen3-30b-a3b.yaml")    # experts now run in tandem
"""
from __future__ import annotations

import os

import torch
from torch import nn

from . import _C
from .config import ConfigLike, config_args, config_json
from .distributed import ExpertExchange, machine_group, sync_generation, warn_partial_pool
from .discovery import (PLAIN, ExpertMath, check_v4_block, expert_shape, find_moe_blocks, oai_math, oai_weights,
                        patch_v4_block, v4_projections)
from .experts_check import check_experts
from .modules import CUDA_BINDINGS, CudaBinding, TandemExperts, TandemLoraExperts
from .oai_checkpoint import expert_pointers
from .peft_glue import attach_v4_lora, claim_wrappers, has_v4_lora, hf_model, innermost, watch_block
from .progress import progress_bar
from .tracing import apply_config


def make_engine(config: ConfigLike, shape: tuple[int, int, int], layers: list[int],
                device: torch.device | str | None = None, hot_budget: int | None = None,
                math: ExpertMath = PLAIN) -> _C.Engine:
    """An engine for MoE layers `layers` of shape (experts, hidden, intermediate).

    ``device`` is where the rest of the model (and so the experts' inputs) lives: a CUDA
    device makes tandem enqueue each call on torch's current stream of that device at the
    time of the call (ordered with torch's work, capturable in torch's CUDA graphs) unless
    the config's gpu.device is "none"; a CPU device uses the host stream (a config asking
    for a GPU is an error).

    ``hot_budget``: device bytes a ``gpu.hot_experts`` count of ``auto`` may fill (a loader
    that knows what else will land on the device passes it); None: the device's free memory
    less ``_C.hot_auto_reserve`` of its total.

    ``math``: what the experts compute (``discovery.ExpertMath``; gpt-oss's experts run on
    the CPU pools only: a config with hot experts is refused, ``auto`` places none).
    """
    args = config_args(config)
    gpu = config_json(config)["gpu"]["device"]
    device = torch.device(device) if device is not None else torch.device("cpu")
    E, H, I = shape
    kw = dict(experts=E, hidden=H, inter=I, layers=list(layers), **math.engine_args(), **args)
    if device.type == "cuda":
        if gpu == "none":
            return _C.Engine(stream="host", **kw)
        index = device.index if device.index is not None else torch.cuda.current_device()
        if gpu not in ("auto", f"cuda:{index}", str(index)):
            raise ValueError(f"config gpu.device is {gpu!r} but the model is on {device}; move the model "
                             "or change gpu.device")
        handle = torch.cuda.current_stream(index).cuda_stream
        engine = _C.Engine(stream="cuda", cuda_device=index, cuda_stream=handle, hot_budget=hot_budget, **kw)
        CUDA_BINDINGS[engine] = CudaBinding(index)
        return engine
    if device.type != "cpu":
        raise ValueError(f"tandem runs models on cpu or cuda devices, not {device}")
    if gpu not in ("auto", "none"):
        raise ValueError(f"config gpu.device is {gpu!r} but the model is on the CPU; move the model to {gpu} "
                         "or set gpu.device: none")
    return _C.Engine(stream="host", hot_budget=hot_budget, **kw)


# The training side of a model (tandem/lora_engine.h): the CPU pool from the config and one
# ``_C.LoraLayer`` per MoE layer (``.layers``), loaded from a checkpoint or from memory.
LoraEngine = _C.LoraEngine


def make_lora_layers(config: ConfigLike, shape: tuple[int, int, int], layers: list[int],
                     backward_format: str = "bf16", math: ExpertMath = PLAIN) -> LoraEngine:
    """The training engine for MoE layers `layers` of shape (experts, hidden, intermediate):
    a pool from ``config``'s cpu section and one ``_C.LoraLayer`` per MoE layer on it, in the
    config's weight format at its cpu.isa; rank / scaling follow the adapters at each call.
    Training runs every routed expert on the CPU pools."""
    import warnings

    gpu = config_json(config)["gpu"]
    if gpu["hot_experts"]["policy"] != "none" or gpu["deferred_experts"]:
        warnings.warn("tandem training runs every routed expert on the CPU pools; the config's gpu.hot_experts and "
                      "gpu.deferred_experts apply to inference only", stacklevel=3)
    E, H, I = shape
    return _C.LoraEngine(experts=E, hidden=H, inter=I, layers=list(layers), backward_format=backward_format,
                         **math.engine_args(), **config_args(config))


def share_cpu_with_torch(engine: _C.Engine | LoraEngine, device: torch.device) -> int:
    """Sets torch's intra-op threads for a model whose experts run on the CPU pool.

    On the host stream torch (attention, router) and the pool take turns on the same
    cores. torch's OpenMP workers spin after each parallel region and would steal the
    pool's cores (measured on the 2-core demo: decode 60 tokens/s with 2 torch threads vs
    256 with 1). So torch gets the cores the pool does not use, at least 1;
    TANDEM_TORCH_THREADS overrides. Returns the thread count in effect."""
    want = os.environ.get("TANDEM_TORCH_THREADS")
    if want:
        n = int(want)
    elif getattr(engine, "is_cuda", False) or device.type != "cpu":
        return torch.get_num_threads()
    else:
        n = max(1, (os.cpu_count() or 1) - engine.threads)
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
    return n


def offload(model: nn.Module, config: ConfigLike = None, *, train: bool | None = None,
            backward_format: str | None = None, progress: bool = True) -> _C.Engine | LoraEngine:
    """Moves the routed experts of a transformers MoE model into tandem, in place.

    Each MoE layer's experts (v5 fused experts, or a v4 ModuleList of per-expert MLPs) now
    run in tandem with the placement of ``config`` (a YAML path, a dict of the same keys,
    or None for the defaults); their torch tensors are released.

    train=False: the inference engine (``TandemExperts``: hot experts on the GPU, deferred
    experts), no gradients. train=True: the LoRA fine-tuning path (``TandemLoraExperts``:
    every routed expert on the CPU pools, differentiable in hidden states, routing weights
    and LoRA tensors). The default (None) trains when ``model`` is a PEFT model or has
    PEFT LoRA on its experts. PEFT may be applied before or after offloading (fused
    experts); for v4 per-expert modules apply it before. backward_format: the training
    path's transposed packs, "bf16" or "int8" (half the memory; default: the config's
    train.backward_format, bf16). Returns the engine (also
    ``tandem_engine`` on the transformers model); under torch.distributed with the config's
    ``distributed.cpu_experts`` shared (the default when a machine runs several ranks), only
    the machine's first rank packs the experts and the others get None (``tandem.distributed``).
    """
    hf = hf_model(model)
    if getattr(hf, "tandem_engine", None) is not None or getattr(hf, "tandem_experts_group", None) is not None:
        raise ValueError("this model's experts are already offloaded to tandem")
    blocks = find_moe_blocks(hf)
    inner = [innermost(b.experts) for b in blocks]
    peft_experts = any(w is not None or has_v4_lora(e) for e, w in inner)
    merged = [n for n, m in model.named_modules() if getattr(m, "merged", False) is True and hasattr(m, "lora_A")]
    if merged:
        raise ValueError(f"the PEFT adapter is merged into the base weights ({merged[0]}"
                         f"{f' and {len(merged) - 1} more' if len(merged) > 1 else ''}); call model.unmerge_adapter() "
                         "before offloading (tandem keeps the experts' base frozen and applies LoRA itself)")
    if train is None:
        train = peft_experts or hasattr(model, "peft_config")
    elif not train and peft_experts:
        raise ValueError("the experts carry PEFT LoRA adapters, which the inference engine cannot apply; "
                         "offload with train=True (the default for PEFT models)")
    checked: dict = {}  # what the experts compute: structure per layer, forward once per kind
    maths = {check_experts(e, f"model layer {b.layer}", checked) for (e, _), b in zip(inner, blocks)}
    shapes = {expert_shape(e) for e, _ in inner}
    if len(shapes) != 1:
        raise ValueError(f"MoE layers have different expert shapes {sorted(shapes)}; tandem needs one")
    shape = shapes.pop()
    if len(maths) != 1:
        raise ValueError(f"MoE layers compute different expert math ({', '.join(sorted(m.describe() for m in maths))}); "
                         "tandem needs one")
    math = maths.pop()
    if train and math.bias and hasattr(model, "peft_config"):
        # PEFT froze the base; a bias made trainable since would be frozen here without a word.
        for (e, _), b in zip(inner, blocks):
            trained = [n for n, p in e.named_parameters(recurse=False) if p.requires_grad and "bias" in n]
            if trained:
                raise ValueError(f"model layer {b.layer} experts: {', '.join(trained)} require grad; tandem keeps the "
                                 "routed experts' biases frozen in its CPU packs and trains LoRA on them "
                                 "(requires_grad_(False) on the biases)")
    for (e, _), b in zip(inner, blocks):
        if isinstance(e, nn.ModuleList):
            check_v4_block(b.block)
    act = _activation(hf)
    if math.plain and act not in ("silu", "swish"):
        raise ValueError(f"expert activation {act!r} is not supported (silu only)")
    device = _model_device(hf)
    # Several ranks on this machine: one of them holds the CPU experts (tandem.distributed).
    cfg_json = config_json(config)
    mg = machine_group(cfg_json)
    warn_partial_pool(mg, cfg_json)
    if mg is not None and not mg.is_owner:
        engine = None
    elif train:
        engine = make_lora_layers(config, shape, [b.layer for b in blocks],
                                  backward_format or cfg_json.get("train", {}).get("backward_format", "bf16"),
                                  math)
    else:
        engine = make_engine(config, shape, [b.layer for b in blocks], device, math=math)
    bar = progress_bar(progress and engine is not None, shape[0] * len(blocks), "packing experts")
    for i, (b, (experts, wrapper)) in enumerate(zip(blocks, inner)):
        gate, up, down, dtype, keep, biases = _layer_pointers(experts)
        interleaved = oai_math(experts) is not None  # gpt-oss's layout: its placeholders and adapters
        base = i * shape[0]
        step = (lambda d, t, base=base: bar(base + d)) if bar else None
        shared = {"exchange": ExpertExchange(mg, shape[0]), "shape": shape} if mg is not None else {}
        if engine is not None:
            engine.load_layer(i, gate, up, down, dtype, progress=step, **biases)
        if not train:
            if isinstance(experts, nn.ModuleList):
                patch_v4_block(b.block, hf)
            fused = not isinstance(experts, nn.ModuleList)
            b.block.experts = TandemExperts(engine, i, b.layer, act, fused=fused, dtype=keep[0].dtype, device=device,
                                            math=math, interleaved=interleaved, **shared)
            if fused:
                watch_block(b.block, b.block.experts)
            continue
        te = TandemLoraExperts(engine.layers[i] if engine is not None else None, b.layer,
                               not isinstance(experts, nn.ModuleList), keep[0].dtype, device,
                               interleaved=interleaved, **shared)
        del keep
        if isinstance(experts, nn.ModuleList) and has_v4_lora(experts):
            attach_v4_lora(b.block, hf, experts, te)
        elif isinstance(experts, nn.ModuleList):
            patch_v4_block(b.block, hf)
            b.block.experts = te
        elif wrapper is not None:
            wrapper.base_layer = te
        else:
            b.block.experts = te
        if te.fused:
            watch_block(b.block, te)
            if wrapper is not None:
                claim_wrappers(b.block.experts, te)
    if bar:
        bar(None)
    if engine is not None:
        share_cpu_with_torch(engine, device)
    apply_config(cfg_json)  # trace.enabled: record from now on, write trace.path at exit
    hf.tandem_engine = engine  # None on a rank whose machine's experts another rank holds
    hf.tandem_experts_group = mg
    if mg is not None:
        sync_generation(hf)
    return engine


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def _activation(model: nn.Module) -> str:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "hidden_act", "silu") if cfg is not None else "silu"


def _layer_pointers(experts: nn.Module) -> tuple[list[int], list[int], list[int], str, list[torch.Tensor], dict]:
    """Per-expert gate / up / down data pointers (row-major, CPU), the tensors that hold them,
    and load_layer's bias arguments (fp32 pointers per expert; empty without biases)."""
    if oai_math(experts) is not None:  # gpt-oss: [E, H, 2I] interleaved gate/up: copied into the kernels' layout
        return expert_pointers(oai_weights(experts))
    if isinstance(experts, nn.ModuleList):
        keep, gate, up, down = [], [], [], []
        for ex in experts:
            g, u, d = (m.weight.detach().cpu().contiguous() for m in v4_projections(ex))
            keep += [g, u, d]
            gate.append(g.data_ptr())
            up.append(u.data_ptr())
            down.append(d.data_ptr())
        return gate, up, down, str(keep[0].dtype).removeprefix("torch."), keep, {}
    gu = experts.gate_up_proj.detach().cpu().contiguous()
    dn = experts.down_proj.detach().cpu().contiguous()
    if gu.dtype != dn.dtype:
        raise ValueError(f"{type(experts).__name__}: gate_up_proj is {gu.dtype}, down_proj {dn.dtype}")
    E, two_i, H = gu.shape
    I, es = two_i // 2, gu.element_size()
    gate = [gu.data_ptr() + e * two_i * H * es for e in range(E)]
    up = [p + I * H * es for p in gate]
    down = [dn.data_ptr() + e * H * I * es for e in range(E)]
    return gate, up, down, str(gu.dtype).removeprefix("torch."), [gu, dn], {}
