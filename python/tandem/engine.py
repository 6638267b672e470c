"""The routed experts of a transformers MoE model, run by tandem.

``TandemExperts`` takes the place of a model's ``mlp.experts`` module: HF's router (so
router logits and the aux loss still work) and shared experts stay as they are, in
torch, on the model's device; the routed experts run in the C++ engine (hot ones on the
stream's device, the rest in the CPU pools). The module holds no parameters or buffers,
so ``.to()``, ``state_dict()`` and ``Accelerator.prepare`` see only the rest of the model.

    import tandem
    model = AutoModelForCausalLM.from_pretrained(...)      # or tandem.load_model(dir, cfg)
    tandem.offload(model, "configs/qwen3-30b-a3b.yaml")    # experts now run in tandem
"""
from __future__ import annotations

import os
import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from . import _C

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "mixtral", "deepseek_v3")

ConfigLike = str | os.PathLike | Mapping[str, Any] | None


def _config_args(config: ConfigLike) -> dict[str, str]:
    """The engine's config_path / config_text arguments for a path, a dict or None."""
    if config is None:
        return {"config_text": "version: 1\n"}
    if isinstance(config, Mapping):
        import yaml

        return {"config_text": yaml.safe_dump(dict(config), sort_keys=False)}
    return {"config_path": os.fspath(config)}


def config_json(config: ConfigLike) -> dict[str, Any]:
    """The validated placement (the C++ parser's JSON) of a path, a dict or None."""
    import json

    args = _config_args(config)
    text = _C.parse_config_json(args["config_text"]) if "config_text" in args else _C.load_config_json(args["config_path"])
    return json.loads(text)


@dataclass(frozen=True)
class MoeBlock:
    """Where one MoE layer's routed experts live in a transformers model."""
    layer: int             # model layer index
    block: nn.Module       # the MoE block (mlp / block_sparse_moe)
    attr: str              # its attribute name on the decoder layer
    experts: nn.Module     # the experts module (fused v5) or ModuleList (v4 layout)


def find_moe_blocks(model: nn.Module) -> list[MoeBlock]:
    """The MoE blocks of a decoder-only transformers model, in layer order."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (expected model.model.layers)")
    found = []
    for i, layer in enumerate(layers):
        for attr in ("mlp", "block_sparse_moe"):
            block = getattr(layer, attr, None)
            experts = getattr(block, "experts", None) if block is not None else None
            if experts is not None:
                found.append(MoeBlock(i, block, attr, experts))
                break
    if not found:
        raise ValueError(f"{type(model).__name__}: no layer has routed experts (mlp.experts)")
    return found


def expert_shape(experts: nn.Module) -> tuple[int, int, int]:
    """(experts, hidden, intermediate) of a fused v5 experts module or a v4 ModuleList."""
    if isinstance(experts, TandemExperts):
        return experts.num_experts, experts.hidden_dim, experts.intermediate_dim
    if isinstance(experts, nn.ModuleList):
        g = _unwrap_linear(_v4_modules(experts[0])[0])
        return len(experts), g.in_features, g.out_features
    gu, dn = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(dn, torch.Tensor) or gu.dim() != 3:
        raise ValueError(f"{type(experts).__name__}: expected fused gate_up_proj [E, 2I, H] and down_proj [E, H, I] "
                         "(transformers v5) or a ModuleList of per-expert MLPs (v4)")
    if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
        raise ValueError(f"{type(experts).__name__}: transposed or interleaved gate/up layouts are not supported")
    if getattr(experts, "has_bias", False):
        raise ValueError(f"{type(experts).__name__}: experts with biases are not supported")
    E, two_i, H = gu.shape
    if tuple(dn.shape) != (E, H, two_i // 2):
        raise ValueError(f"{type(experts).__name__}: down_proj has shape {tuple(dn.shape)}, "
                         f"gate_up_proj {tuple(gu.shape)} needs {(E, H, two_i // 2)}")
    return E, H, two_i // 2


def _v4_modules(expert: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """gate / up / down of a v4 per-expert MLP as they sit in the tree (nn.Linear or PEFT lora.Linear)."""
    for names in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
        mods = [getattr(expert, n, None) for n in names]
        if all(isinstance(_unwrap_linear(m), (nn.Linear, _FrozenLinear)) for m in mods):
            return mods[0], mods[1], mods[2]
    raise ValueError(f"{type(expert).__name__}: a per-expert module needs gate_proj/up_proj/down_proj "
                     "or w1/w3/w2 linear layers")


def _unwrap_linear(m: nn.Module | None) -> nn.Module | None:
    while m is not None and hasattr(m, "base_layer") and hasattr(m, "lora_A"):
        m = m.base_layer
    return m


def _v4_projections(expert: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
    mods = tuple(_unwrap_linear(m) for m in _v4_modules(expert))
    if all(isinstance(m, nn.Linear) for m in mods):
        return mods[0], mods[1], mods[2]
    raise ValueError(f"{type(expert).__name__}: a per-expert module needs gate_proj/up_proj/down_proj "
                     "or w1/w3/w2 linear layers")


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def make_engine(config: ConfigLike, shape: tuple[int, int, int], layers: list[int],
                device: torch.device | str | None = None) -> _C.Engine:
    """An engine for MoE layers `layers` of shape (experts, hidden, intermediate).

    ``device`` is where the rest of the model (and so the experts' inputs) lives: a CUDA
    device makes tandem enqueue on torch's current stream of that device (ordered with
    torch's work, capturable in torch's CUDA graphs) unless the config's gpu.device is
    "none"; a CPU device uses the host stream (a config asking for a GPU is an error).
    """
    args = _config_args(config)
    gpu = config_json(config)["gpu"]["device"]
    device = torch.device(device) if device is not None else torch.device("cpu")
    E, H, I = shape
    kw = dict(experts=E, hidden=H, inter=I, layers=list(layers), **args)
    if device.type == "cuda":
        if gpu == "none":
            return _C.Engine(stream="host", **kw)
        index = device.index if device.index is not None else torch.cuda.current_device()
        if gpu not in ("auto", f"cuda:{index}", str(index)):
            raise ValueError(f"config gpu.device is {gpu!r} but the model is on {device}; move the model "
                             "or change gpu.device")
        return _C.Engine(stream="cuda", cuda_device=index, cuda_stream=torch.cuda.current_stream(index).cuda_stream,
                         **kw)
    if device.type != "cpu":
        raise ValueError(f"tandem runs models on cpu or cuda devices, not {device}")
    if gpu not in ("auto", "none"):
        raise ValueError(f"config gpu.device is {gpu!r} but the model is on the CPU; move the model to {gpu} "
                         "or set gpu.device: none")
    return _C.Engine(stream="host", **kw)


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


def _check_inputs(where: str, hidden: int, x: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> int:
    """Validates an experts call (hidden [T, H], top_k_index [T, K] int, top_k_weights [T, K] float); returns T."""
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"{where}: hidden_states has shape {tuple(x.shape)}, expected [tokens, {hidden}]")
    T = x.shape[0]
    if top_k_index.dim() != 2 or top_k_index.shape[0] != T:
        raise ValueError(f"{where}: top_k_index has shape {tuple(top_k_index.shape)}, expected [{T}, top_k]")
    if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(f"{where}: top_k_weights has shape {tuple(top_k_weights.shape)}, "
                         f"top_k_index {tuple(top_k_index.shape)}")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
        raise ValueError(f"{where}: top_k_index must be an integer tensor, got {top_k_index.dtype}")
    if not top_k_weights.dtype.is_floating_point:
        raise ValueError(f"{where}: top_k_weights must be floating point, got {top_k_weights.dtype}")
    for name, t in (("top_k_index", top_k_index), ("top_k_weights", top_k_weights)):
        if t.device != x.device:
            raise ValueError(f"{where}: {name} is on {t.device}, hidden_states on {x.device}")
    return T


class TandemExperts(nn.Module):
    """Drop-in for a transformers experts module: forward(hidden [T, H], top_k_index [T, K],
    top_k_weights [T, K]) -> [T, H] in hidden's dtype. No parameters: the weights live in
    the engine (``self.engine``), shared by every layer of the model."""

    def __init__(self, engine: _C.Engine, index: int, layer: int, act: str = "silu"):
        super().__init__()
        if act not in ("silu", "swish"):
            raise ValueError(f"model layer {layer}: expert activation {act!r} is not supported (silu only)")
        self.engine = engine
        self.index = index          # MoE index in the engine
        self.layer = layer          # model layer
        self.num_experts = engine.experts
        self.hidden_dim = engine.hidden
        self.intermediate_dim = engine.inter

    def extra_repr(self) -> str:
        e = self.engine
        hot = len(e.hot(self.index))
        return (f"layer={self.layer}, experts={self.num_experts}, hidden={self.hidden_dim}, "
                f"intermediate={self.intermediate_dim}, format={e.format}, hot={hot} on {e.stream}, "
                f"cpu={self.num_experts - hot}")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        where = f"tandem experts (model layer {self.layer})"
        x = hidden_states
        T = _check_inputs(where, self.hidden_dim, x, top_k_index, top_k_weights)
        if torch.is_grad_enabled() and (x.requires_grad or top_k_weights.requires_grad):
            raise RuntimeError(f"{where}: this model was offloaded for inference; for training offload it with "
                               "train=True (tandem.offload(model, config, train=True), or apply PEFT first), or run "
                               "inference under torch.no_grad() / torch.inference_mode() (model.generate does)")
        if T == 0:
            return torch.zeros_like(x)
        dev = x.device
        if self.engine.is_cuda:
            if dev.type != "cuda":
                raise ValueError(f"{where}: the engine runs on {self.engine.stream} but hidden_states is on {dev}")
        elif dev.type != "cpu":  # host stream with a GPU model (gpu.device: none): round trip through the CPU
            out = self.forward(x.cpu(), top_k_index.cpu(), top_k_weights.cpu())
            return out.to(dev)
        xin = x if x.dtype in (torch.bfloat16, torch.float32) else x.float()
        xin = xin.contiguous()
        ids = top_k_index.to(torch.int64).contiguous()
        w = top_k_weights.to(torch.float32).contiguous()
        out = torch.empty((T, self.hidden_dim), dtype=torch.float32, device=dev)
        self.engine.forward(self.index, xin.data_ptr(), xin.dtype == torch.bfloat16, T, ids.data_ptr(), w.data_ptr(),
                            ids.shape[1], out.data_ptr(), synchronize=not self.engine.is_cuda)
        return out if x.dtype == torch.float32 else out.to(x.dtype)


class TandemLoraExperts(nn.Module):
    """The training counterpart of ``TandemExperts``: one layer's routed experts held by a
    ``_C.LoraLayer`` (frozen base in the CPU pools, LoRA on gate/up/down of every expert),
    differentiable in the hidden states, the routing weights and the LoRA tensors.

    forward(hidden, top_k_index, top_k_weights, lora=None): ``lora`` is a
    ``tandem.lora.LoraTensors`` (PEFT's wrappers pass theirs; None runs the frozen base).
    The module holds no parameters; for fused (v5) experts it answers ``gate_up_proj`` and
    ``down_proj`` with storage-free placeholders of the right shape, dtype and device, so
    that PEFT's ``target_parameters`` can wrap it after offloading."""

    def __init__(self, lora_layer: _C.LoraLayer, layer: int, fused: bool, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.lora_layer = lora_layer
        self.layer = layer
        self.fused = fused
        self.num_experts = lora_layer.experts
        self.hidden_dim = lora_layer.hidden
        self.intermediate_dim = lora_layer.inter
        # One element that .to() moves and casts like the model: the placeholders' dtype/device.
        self.register_buffer("tandem_probe", torch.zeros(1, dtype=dtype, device=device), persistent=False)

    def _placeholders(self) -> dict[str, torch.Tensor]:
        E, H, I = self.num_experts, self.hidden_dim, self.intermediate_dim
        p = self._buffers["tandem_probe"]
        return {"gate_up_proj": nn.Parameter(p.expand(E, 2 * I, H), requires_grad=False),
                "down_proj": nn.Parameter(p.expand(E, H, I), requires_grad=False)}

    def __getattr__(self, name: str):
        if name in ("gate_up_proj", "down_proj") and self.__dict__.get("fused"):
            return self._placeholders()[name]
        return super().__getattr__(name)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        # Only direct calls see the placeholders (PEFT's target_parameters matching); a parent's
        # parameters() / state_dict() / DDP / optimizers walk _parameters and never do.
        yield from super().named_parameters(prefix, recurse, remove_duplicate)
        if self.fused:
            for n, p in self._placeholders().items():
                yield (f"{prefix}.{n}" if prefix else n), p

    def extra_repr(self) -> str:
        return (f"layer={self.layer}, experts={self.num_experts}, hidden={self.hidden_dim}, "
                f"intermediate={self.intermediate_dim}, train=True, cpu threads={self.lora_layer.threads}")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                lora=None) -> torch.Tensor:
        from .lora import run_experts

        where = f"tandem experts (model layer {self.layer})"
        T = _check_inputs(where, self.hidden_dim, hidden_states, top_k_index, top_k_weights)
        if T == 0:
            return hidden_states.new_zeros(hidden_states.shape)
        return run_experts(self.lora_layer, hidden_states, top_k_index, top_k_weights, lora, where)


class _FrozenLinear(nn.Module):
    """Stands in for the nn.Linear inside a v4 per-expert PEFT lora.Linear once tandem holds its
    weight: in/out features and a storage-free ``weight`` placeholder for PEFT's bookkeeping."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("tandem_probe", torch.zeros(1, dtype=linear.weight.dtype, device=linear.weight.device),
                             persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self._buffers["tandem_probe"].expand(self.out_features, self.in_features)

    bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this expert's base weight lives in tandem; the expert runs as part of its MoE layer")


def _layer_pointers(experts: nn.Module) -> tuple[list[int], list[int], list[int], str, list[torch.Tensor]]:
    """Per-expert gate / up / down data pointers (row-major, CPU) and the tensors that hold them."""
    if isinstance(experts, nn.ModuleList):
        keep, gate, up, down = [], [], [], []
        for ex in experts:
            g, u, d = (m.weight.detach().cpu().contiguous() for m in _v4_projections(ex))
            keep += [g, u, d]
            gate.append(g.data_ptr())
            up.append(u.data_ptr())
            down.append(d.data_ptr())
        return gate, up, down, str(keep[0].dtype).removeprefix("torch."), keep
    gu = experts.gate_up_proj.detach().cpu().contiguous()
    dn = experts.down_proj.detach().cpu().contiguous()
    if gu.dtype != dn.dtype:
        raise ValueError(f"{type(experts).__name__}: gate_up_proj is {gu.dtype}, down_proj {dn.dtype}")
    E, two_i, H = gu.shape
    I, es = two_i // 2, gu.element_size()
    gate = [gu.data_ptr() + e * two_i * H * es for e in range(E)]
    up = [p + I * H * es for p in gate]
    down = [dn.data_ptr() + e * H * I * es for e in range(E)]
    return gate, up, down, str(gu.dtype).removeprefix("torch."), [gu, dn]


def _activation(model: nn.Module) -> str:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "hidden_act", "silu") if cfg is not None else "silu"


def _hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT model (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _innermost(experts: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """(the experts module under any PEFT ParamWrappers, the innermost wrapper or None)."""
    from .lora import _is_param_wrapper

    wrapper = None
    while _is_param_wrapper(experts):
        wrapper, experts = experts, experts.base_layer
    return experts, wrapper


def _has_v4_lora(experts: nn.Module) -> bool:
    return isinstance(experts, nn.ModuleList) and any(hasattr(m, "lora_A") for m in _v4_modules(experts[0]))


def offload(model: nn.Module, config: ConfigLike = None, *, train: bool | None = None,
            backward_format: str = "bf16", progress: bool = True) -> _C.Engine | LoraEngine:
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
    path's transposed packs, "bf16" or "int8" (half the memory). Returns the engine (also
    ``tandem_engine`` on the transformers model).
    """
    hf = _hf_model(model)
    if getattr(hf, "tandem_engine", None) is not None:
        raise ValueError("this model's experts are already offloaded to tandem")
    blocks = find_moe_blocks(hf)
    inner = [_innermost(b.experts) for b in blocks]
    peft_experts = any(w is not None or _has_v4_lora(e) for e, w in inner)
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
    shapes = {expert_shape(e) for e, _ in inner}
    if len(shapes) != 1:
        raise ValueError(f"MoE layers have different expert shapes {sorted(shapes)}; tandem needs one")
    shape = shapes.pop()
    for (e, _), b in zip(inner, blocks):
        if isinstance(e, nn.ModuleList):
            _check_v4_block(b.block)
    act = _activation(hf)
    if act not in ("silu", "swish"):
        raise ValueError(f"expert activation {act!r} is not supported (silu only)")
    device = _model_device(hf)
    if train:
        engine = make_lora_layers(config, shape, [b.layer for b in blocks], backward_format)
        layers = engine.layers
    else:
        engine = make_engine(config, shape, [b.layer for b in blocks], device)
    bar = _progress_bar(progress, shape[0] * len(blocks), "packing experts")
    for i, (b, (experts, wrapper)) in enumerate(zip(blocks, inner)):
        gate, up, down, dtype, keep = _layer_pointers(experts)
        base = i * shape[0]
        step = (lambda d, t, base=base: bar(base + d)) if bar else None
        if not train:
            engine.load_layer(i, gate, up, down, dtype, progress=step)
            if isinstance(experts, nn.ModuleList):
                _patch_v4_block(b.block, hf)
            b.block.experts = TandemExperts(engine, i, b.layer, act)
            continue
        layers[i].load(gate, up, down, dtype, progress=step)
        te = TandemLoraExperts(layers[i], b.layer, not isinstance(experts, nn.ModuleList), keep[0].dtype, device)
        del keep
        if isinstance(experts, nn.ModuleList) and _has_v4_lora(experts):
            _attach_v4_lora(b.block, hf, experts, te)
        elif isinstance(experts, nn.ModuleList):
            _patch_v4_block(b.block, hf)
            b.block.experts = te
        elif wrapper is not None:
            wrapper.base_layer = te
        else:
            b.block.experts = te
        if te.fused:
            b.block.register_forward_pre_hook(_route_peft_wrappers)
            if wrapper is not None:
                _claim_wrappers(b.block.experts, te)
    if bar:
        bar(None)
    share_cpu_with_torch(engine, device)
    hf.tandem_engine = engine
    return engine


@dataclass
class LoraEngine:
    """The training side of a model: the CPU pool and one ``_C.LoraLayer`` per MoE layer."""
    pool: _C.Pool
    layers: list[_C.LoraLayer]
    is_cuda = False

    @property
    def threads(self) -> int:
        return self.pool.threads

    def prepare_backward(self) -> None:
        """Builds every layer's backward packs now (otherwise each layer's first backward does)."""
        for layer in self.layers:
            layer.prepare_backward()


def make_lora_layers(config: ConfigLike, shape: tuple[int, int, int], layers: list[int],
                     backward_format: str = "bf16") -> LoraEngine:
    """A pool from ``config``'s cpu section and one ``_C.LoraLayer`` per MoE layer on it, in
    the config's weight format; rank / scaling follow the adapters at each call. Training
    runs every routed expert on the CPU pools."""
    import warnings

    cfg = config_json(config)
    gpu = cfg["gpu"]
    if gpu["hot_experts"]["policy"] != "none" or gpu["deferred_experts"]:
        warnings.warn("tandem training runs every routed expert on the CPU pools; the config's gpu.hot_experts and "
                      "gpu.deferred_experts apply to inference only", stacklevel=3)
    pool = _C.Pool(**_config_args(config))
    cpu = cfg["cpu"]
    E, H, I = shape
    return LoraEngine(pool, [_C.LoraLayer(pool, E, H, I, format=cpu["format"], group=cpu["group_size"],
                                          zero_point=cpu["zero_point"], backward_format=backward_format, layer=L)
                             for L in layers])


def _route_peft_wrappers(block: nn.Module, args) -> None:
    """Forward pre-hook of a MoE block whose experts are tandem's: when PEFT has wrapped them
    (ParamWrapper on gate_up_proj / down_proj, before or after offloading), the outermost
    wrapper's forward becomes tandem's LoRA path instead of PEFT's weight parametrization
    (which would materialize every expert's W + BA)."""
    from .lora import _is_param_wrapper

    ex = block.experts
    if _is_param_wrapper(ex) and "forward" not in ex.__dict__:
        te, _ = _innermost(ex)
        if isinstance(te, TandemLoraExperts):
            _claim_wrappers(ex, te)


def _claim_wrappers(outer: nn.Module, te: "TandemLoraExperts") -> None:
    """Routes a PEFT ParamWrapper chain over tandem's experts to tandem: the outermost
    wrapper's forward calls tandem with the adapters; merging (which would fold B A into
    every expert's weight, here frozen in the CPU packs) is refused before anything is done."""
    from .lora import _is_param_wrapper

    outer.forward = functools.partial(_peft_experts_forward, outer, te)
    m = outer
    while _is_param_wrapper(m):
        m.merge = functools.partial(_refuse_merge, te.layer)
        m = m.base_layer


def _refuse_merge(layer: int, *args, **kwargs) -> None:
    raise ValueError(f"tandem experts (model layer {layer}): merging LoRA into the experts is not supported: their "
                     "base is frozen in tandem's CPU packs. Layers merged before this one are merged now: call "
                     "model.unmerge_adapter() to undo them. To get merged weights, load the adapter onto the stock "
                     "model: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(...), dir)"
                     ".merge_and_unload()")


def _peft_experts_forward(wrapper: nn.Module, te: "TandemLoraExperts", hidden_states: torch.Tensor,
                          top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    from .lora import param_wrapper_lora

    where = f"tandem experts (model layer {te.layer})"
    if args or kwargs.get("adapter_names"):
        raise ValueError(f"{where}: unexpected arguments to the experts (mixed-adapter batches are not supported)")
    lora = param_wrapper_lora(wrapper, te.num_experts, te.hidden_dim, te.intermediate_dim, where)
    return te(hidden_states, top_k_index, top_k_weights, lora=lora)


def _progress_bar(enabled: bool, total: int, desc: str) -> Callable[[int | None], None] | None:
    """A callback setting a tqdm bar's position (None closes it); None when disabled."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, unit="expert", leave=False)

    def update(done: int | None) -> None:
        if done is None:
            bar.close()
        else:
            bar.update(done - bar.n)

    return update


# ---- v4 layout: per-expert ModuleList, the block does its own routing ----------------

def _check_v4_block(block: nn.Module) -> None:
    if not isinstance(getattr(block, "gate", None), nn.Linear):
        raise ValueError(f"{type(block).__name__}: a v4 per-expert MoE block needs a gate nn.Linear router "
                         "(softmax top-k); grouped/sigmoid v4 routers are not supported, use transformers v5")
    if hasattr(block, "shared_expert") or hasattr(block, "shared_experts"):
        raise ValueError(f"{type(block).__name__}: v4 blocks with shared experts are not supported, use transformers v5")


def _patch_v4_block(block: nn.Module, model: nn.Module, run: Callable | None = None) -> None:
    """Gives a v4-style softmax-top-k MoE block (gate: nn.Linear, experts: ModuleList; Qwen3-MoE
    and Mixtral in transformers v4) a forward that routes like v4 and calls the experts
    module (or `run`) with (hidden, top_k_index, top_k_weights), returning (out, router_logits)."""
    cfg = getattr(model, "config", None)
    top_k = getattr(block, "top_k", None) or getattr(cfg, "num_experts_per_tok", None)
    if not top_k:
        raise ValueError(f"{type(block).__name__}: cannot tell top_k (no block.top_k or config.num_experts_per_tok)")
    norm = getattr(block, "norm_topk_prob", getattr(cfg, "norm_topk_prob", True))
    if getattr(cfg, "model_type", "") == "mixtral":
        norm = True

    def forward(hidden_states: torch.Tensor):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        logits = block.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        w, idx = torch.topk(probs, top_k, dim=-1)
        if norm:
            w = w / w.sum(dim=-1, keepdim=True)
        out = (run or block.experts)(x, idx, w.to(x.dtype))
        return out.view(b, s, h), logits

    block.forward = forward


def _attach_v4_lora(block: nn.Module, model: nn.Module, experts: nn.ModuleList, te: TandemLoraExperts) -> None:
    """A v4 block whose per-expert projections carry PEFT lora.Linear layers: the ModuleList
    stays where PEFT put it (adapter names, save_pretrained, load_adapter unchanged), each
    wrapped nn.Linear gives way to a storage-free stand-in, and the block runs its experts in
    tandem with the per-expert adapters stacked per projection."""
    from .lora import linear_lora

    for ex in experts:  # projections PEFT left alone give up their weights too
        for name, child in list(ex.named_children()):
            if type(child) is nn.Linear:
                setattr(ex, name, _FrozenLinear(child))
    mods = [_v4_modules(ex) for ex in experts]
    for triple in mods:
        for m in triple:
            holder = m
            while hasattr(holder, "lora_A") and hasattr(holder.base_layer, "lora_A"):
                holder = holder.base_layer
            if hasattr(holder, "lora_A") and isinstance(holder.base_layer, nn.Linear):
                holder.base_layer = _FrozenLinear(holder.base_layer)
    where = f"tandem experts (model layer {te.layer})"
    E, H, I = te.num_experts, te.hidden_dim, te.intermediate_dim
    # not a submodule: the ModuleList keeps the tree PEFT knows
    object.__setattr__(block, "tandem_experts", te)

    def run(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return te(x, idx, w, lora=linear_lora(experts, mods, E, H, I, where))

    _patch_v4_block(block, model, run)
