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
import weakref
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


# ---- what an experts module computes ---------------------------------------------------
# tandem's kernels (CPU packs, GPU hot experts, LoRA path) compute, per token t,
#   out[t] = sum_k w[t, k] * down_e(silu(gate_e x_t) * up_e x_t),  e = ids[t, k]
# with no biases, no clamp, no other activation. An experts module is accepted only when
# its structure says so (class, act_fn, gating, tensors) and, once per distinct kind of
# module, its own forward agrees with that formula on a small test input.

_PROBE_EXPERTS = 2        # experts of a fused module the numeric check copies (fp32, CPU)
# token norms, in units of rms(gate pre-activation) = 1: a clamp or softcap at any limit
# up to ~400 (gpt-oss and DeepSeek-V4 clamp at 7 and 10) changes the largest tokens' output
_PROBE_SCALES = (0.25, 1.0, 4.0, 16.0, 64.0, 256.0)
_PROBE_TOLERANCE = 1e-3   # max |forward - reference| / max |reference| per token (fp32 vs fp64: ~1e-6)


def _silu_types() -> tuple[type, ...]:
    types: tuple[type, ...] = (nn.SiLU,)
    try:
        from transformers.activations import SiLUActivation
        types += (SiLUActivation,)
    except ImportError:  # pragma: no cover
        pass
    return types


def _is_silu(act: Any) -> bool:
    if act is nn.functional.silu:
        return True
    return type(act) in _silu_types() and "forward" not in vars(act)


def _act_name(act: Any) -> str:
    return getattr(act, "__name__", None) or type(act).__name__


def _own_forward(module: nn.Module) -> Callable | None:
    """The function a module's forward runs, as an unbound function of the module (so it can
    run on a copy); None when its instance forward was replaced by something else."""
    f = module.__dict__.get("forward")
    if f is None:
        return type(module).forward
    if hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__:  # accelerate's hook wraps the own forward
        f = module.__dict__["_old_forward"]
    if getattr(f, "__self__", None) is module and hasattr(f, "__func__"):
        return f.__func__
    return None


def _check_gating(module: nn.Module, name: str, where: str) -> None:
    """Class-level checks shared by fused and per-expert modules: activation and gating."""
    act = getattr(module, "act_fn", None)
    if act is not None and not _is_silu(act):
        raise ValueError(f"{name} ({where}): its activation act_fn is {_act_name(act)}; tandem's kernels compute "
                         "silu(gate) * up (only SiLU experts are supported)")
    if "_apply_gate" in vars(module):
        raise ValueError(f"{name} ({where}): its _apply_gate is replaced on the instance; tandem's kernels compute "
                         "silu(gate) * up (custom gating such as a clamped or softcapped SwiGLU is not supported)")
    gate_fn = getattr(type(module), "_apply_gate", None)
    if gate_fn is not None:
        try:
            from transformers.integrations.moe import _default_apply_gate
        except ImportError:  # pragma: no cover
            _default_apply_gate = None
        if gate_fn is not _default_apply_gate:
            owner = next(c for c in type(module).__mro__ if "_apply_gate" in vars(c))
            raise ValueError(f"{name} ({where}): it gates with its own {owner.__name__}._apply_gate (e.g. a clamped or "
                             "softcapped SwiGLU), not silu(gate) * up; tandem's kernels compute silu(gate) * up only")


def check_experts_structure(experts: nn.Module, where: str) -> None:
    """Refuses (ValueError naming the class) an experts module whose structure is not the
    kernels' silu(gate) * up without biases: another act_fn, its own gating, extra tensors
    (biases, norms), no gate, transposed/interleaved layouts. Works on meta modules."""
    if isinstance(experts, nn.ModuleList):
        if len(experts) == 0:
            raise ValueError(f"{where}: the experts ModuleList is empty")
        kinds = {type(ex) for ex in experts}
        if len(kinds) != 1:
            raise ValueError(f"{where}: the experts are of different classes {sorted(k.__name__ for k in kinds)}")
        for ex in experts:
            name = type(ex).__name__
            _check_gating(ex, name, where)
            for proj in _v4_projections(ex):
                if proj.bias is not None:
                    raise ValueError(f"{name} ({where}): its projections have biases; tandem's kernels compute "
                                     "bias-free silu(gate) * up experts")
        return
    name = type(experts).__name__
    _check_gating(experts, name, where)
    if getattr(experts, "has_gate", True) is False:
        raise ValueError(f"{name} ({where}): experts without a gate projection are not supported (silu(gate) * up)")
    if getattr(experts, "has_post_expert_norm", False):
        raise ValueError(f"{name} ({where}): experts with a norm after each expert are not supported")
    extra = [n for n, _ in experts.named_parameters() if n not in ("gate_up_proj", "down_proj")]
    extra += [n for n, _ in experts.named_buffers()]
    if extra:
        raise ValueError(f"{name} ({where}): it has tensors tandem's kernels do not use ({', '.join(extra)}); only "
                         "gate_up_proj and down_proj of bias-free silu(gate) * up experts are supported")
    expert_shape(experts)  # layout: fused, concatenated, not transposed, matching shapes


def _probe_tensor(t: torch.Tensor, rows: int | None, gen: torch.Generator) -> torch.Tensor:
    """An fp32 CPU copy of t[:rows] (only those rows are copied), or random values of that
    shape for a meta tensor (std 1/sqrt(fan-in))."""
    if t.is_meta:
        shape = (rows, *t.shape[1:]) if rows is not None else tuple(t.shape)
        return torch.randn(shape, generator=gen) / (shape[-1] ** 0.5)
    src = t.detach()[:rows] if rows is not None else t.detach()
    return src.to(device="cpu", dtype=torch.float32, copy=True)


def _probe_inputs(wg: torch.Tensor, n: int, k: int, gen: torch.Generator):
    """Tokens spanning small to very large gate pre-activations (a clamp at any usual limit
    shows), ids routing each token to k of the first n experts, positive weights."""
    H = wg.shape[-1]
    T = len(_PROBE_SCALES)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True)
    rms = torch.einsum("th,...ih->...ti", x, wg.double()).pow(2).mean().sqrt().clamp_min(1e-30)
    x = x * torch.tensor(_PROBE_SCALES, dtype=torch.float64)[:, None] / rms
    ids = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen, dtype=torch.float64) * 0.8 + 0.2
    return x, ids, w


def _reference(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, ids: torch.Tensor,
               w: torch.Tensor) -> torch.Tensor:
    """sum_k w[t, k] * wd_e (silu(wg_e x_t) * wu_e x_t) in fp64; wg/wu [n, I, H], wd [n, H, I]."""
    g = torch.einsum("th,eih->tei", x, wg.double())
    u = torch.einsum("th,eih->tei", x, wu.double())
    y = torch.einsum("tei,ehi->teh", nn.functional.silu(g) * u, wd.double())  # [T, n, H]
    return (y[torch.arange(x.shape[0])[:, None], ids] * w[..., None]).sum(1)


def _compare(name: str, where: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got = got.double()
    if got.shape != want.shape:
        raise ValueError(f"{name} ({where}): its forward returned shape {tuple(got.shape)} on a test input, "
                         f"expected {tuple(want.shape)}")
    scale = want.abs().amax(1).clamp_min(1e-30)
    rel = ((got - want).abs().amax(1) / scale)
    err = float(rel.max()) if torch.isfinite(rel).all() else float("inf")
    if not err <= _PROBE_TOLERANCE:
        raise ValueError(f"{name} ({where}): its forward differs from silu(gate) * up experts (max rel diff "
                         f"{err:.2g} on a test input of {got.shape[0]} tokens): tandem's kernels compute "
                         "out = sum_k w_k * down(silu(gate x) * up x) only; clamped or softcapped SwiGLU, other "
                         "activations and biases are not supported")


def _run_probe(fn: Callable, module: nn.Module, name: str, where: str, *args) -> torch.Tensor:
    try:
        with torch.no_grad():
            out = fn(module, *args)
    except Exception as e:  # noqa: BLE001 (any failure means: cannot verify)
        raise ValueError(f"{name} ({where}): tandem could not run its forward on a test input to check that it "
                         f"computes silu(gate) * up experts ({type(e).__name__}: {e})") from e
    if isinstance(out, tuple):  # some experts modules return (out, extra)
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{name} ({where}): its forward returned {type(out).__name__} on a test input, not a tensor")
    return out


def check_experts_numerics(experts: nn.Module, where: str) -> None:
    """Runs the experts module's own forward once, in fp32 on a copy of the first
    _PROBE_EXPERTS experts' weights (random weights for a meta module), on a few tokens of
    very different norms, and refuses it when it differs from the kernels' formula.

    Only those experts are copied (a shallow copy of the module whose parameters are the fp32
    slices; the module itself and its other experts are not touched); the copy runs transformers'
    eager path (``config._experts_implementation = "eager"``), the class's own code."""
    import copy

    gen = torch.Generator().manual_seed(0x7A4D)
    if isinstance(experts, nn.ModuleList):
        ex = experts[0]
        name = type(ex).__name__
        fn = _own_forward(ex)
        if fn is None:
            raise ValueError(f"{name} ({where}): its forward was replaced on the instance "
                             f"({ex.__dict__.get('forward')!r}); tandem cannot check that it computes silu(gate) * up")
        names = next(n for n in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
                     if all(hasattr(ex, a) for a in n))
        probe = copy.copy(ex)
        probe._modules = dict(ex._modules)
        probe._parameters, probe._buffers = dict(ex._parameters), dict(ex._buffers)
        mats = []
        for attr, lin in zip(names, _v4_projections(ex)):
            m = nn.Linear(lin.in_features, lin.out_features, bias=False)
            m.weight = nn.Parameter(_probe_tensor(lin.weight, None, gen), requires_grad=False)
            probe._modules[attr] = m
            mats.append(m.weight[None])
        x, ids, w = _probe_inputs(mats[0], 1, 1, gen)
        out = _run_probe(fn, probe, name, where, x.float())
        _compare(name, where, out, _reference(x, *mats, torch.zeros_like(ids), torch.ones_like(w)))
        return
    name = type(experts).__name__
    fn = _own_forward(experts)
    if fn is None:
        raise ValueError(f"{name} ({where}): its forward was replaced on the instance "
                         f"({experts.__dict__.get('forward')!r}); tandem cannot check that it computes silu(gate) * up")
    E, H, I = expert_shape(experts)
    n = min(E, _PROBE_EXPERTS)
    gu = _probe_tensor(experts.gate_up_proj, n, gen)
    dn = _probe_tensor(experts.down_proj, n, gen)
    probe = copy.copy(experts)
    probe._modules, probe._buffers = dict(experts._modules), dict(experts._buffers)
    probe._parameters = {"gate_up_proj": nn.Parameter(gu, requires_grad=False),
                         "down_proj": nn.Parameter(dn, requires_grad=False)}
    cfg = getattr(experts, "config", None)
    if cfg is not None and hasattr(cfg, "_experts_implementation"):
        probe.config = copy.copy(cfg)
        probe.config._experts_implementation = "eager"
    x, ids, w = _probe_inputs(gu[:, :I], n, n, gen)
    out = _run_probe(fn, probe, name, where, x.float(), ids, w.float())
    _compare(name, where, out, _reference(x, gu[:, :I], gu[:, I:], dn, ids, w))


def _experts_kind(experts: nn.Module) -> tuple:
    """What decides an experts module's computation, for checking each kind once: class, own
    forward, activation and gating, and the module's plain scalar settings (a clamp limit
    differing between layers makes a different kind)."""
    mod = experts[0] if isinstance(experts, nn.ModuleList) and len(experts) else experts
    scalars = tuple(sorted((k, v) for k, v in vars(mod).items()
                           if not k.startswith("_") and isinstance(v, (bool, int, float, str))))
    act = getattr(mod, "act_fn", None)
    return (type(experts), type(mod), _own_forward(mod), type(act), mod.__dict__.get("_apply_gate"), scalars)


def check_experts(experts: nn.Module, where: str, checked: set | None = None) -> None:
    """check_experts_structure, then check_experts_numerics once per kind of module
    (``checked`` collects the kinds already verified, across the layers of one model)."""
    check_experts_structure(experts, where)
    kind = _experts_kind(experts)
    if checked is not None and kind in checked:
        return
    check_experts_numerics(experts, where)
    if checked is not None:
        checked.add(kind)


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


@dataclass(frozen=True)
class CudaBinding:
    """Where a CUDA engine enqueues: device index and the cudaStream_t handle (torch's
    ``Stream.cuda_stream``; 0 is the legacy default stream) current when it was built. The
    C++ stream wraps that one handle for the engine's life."""
    device: int
    stream: int


# CUDA engines made by make_engine -> their binding (the _C.Engine does not expose it).
_CUDA_BINDINGS: "weakref.WeakKeyDictionary[_C.Engine, CudaBinding]" = weakref.WeakKeyDictionary()


def _stream_name(handle: int) -> str:
    return "the default stream (0x0)" if handle == 0 else f"stream {handle:#x}"


def check_cuda_call(where: str, binding: CudaBinding, device: torch.device, current_stream: int) -> None:
    """Refuses a call whose hidden states are on another device than the engine's, or made
    while torch's current stream (``current_stream``, a cudaStream_t handle) is not the one
    the engine enqueues on: tandem's copies and kernels would run unordered with torch's
    work (reading inputs not yet written, writing outputs torch already reads)."""
    if device.index != binding.device:
        raise ValueError(f"{where}: hidden_states is on {device} but this model's tandem engine runs on "
                         f"cuda:{binding.device}; keep the model and its inputs on cuda:{binding.device} "
                         "(tandem's engine cannot move to another device)")
    if current_stream != binding.stream:
        raise ValueError(f"{where}: torch's current stream on cuda:{binding.device} is {_stream_name(current_stream)}, "
                         f"but this model's tandem engine enqueues on {_stream_name(binding.stream)} (the stream that "
                         "was current when the model was loaded / offloaded), so its work would not be ordered with "
                         "torch's. Call the model on that stream, or load / offload it under the stream you call it "
                         "on (with torch.cuda.stream(s): ...; for CUDA graphs capture on that same stream: "
                         "torch.cuda.graph(g, stream=s))")


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
        handle = torch.cuda.current_stream(index).cuda_stream
        engine = _C.Engine(stream="cuda", cuda_device=index, cuda_stream=handle, **kw)
        _CUDA_BINDINGS[engine] = CudaBinding(index, handle)
        return engine
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
        self._cuda_binding = _CUDA_BINDINGS.get(engine) if engine.is_cuda else None
        if engine.is_cuda and self._cuda_binding is None:
            raise ValueError(f"model layer {layer}: this CUDA engine was not made by tandem.engine.make_engine, so "
                             "tandem cannot tell which stream it enqueues on; build it with make_engine (it enqueues "
                             "on torch's current stream)")

    def extra_repr(self) -> str:
        e = self.engine
        hot = len(e.hot(self.index))
        return (f"layer={self.layer}, experts={self.num_experts}, hidden={self.hidden_dim}, "
                f"intermediate={self.intermediate_dim}, format={e.format}, hot={hot} on {e.stream}, "
                f"cpu={self.num_experts - hot}, isa={e.isa}")

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
            check_cuda_call(where, self._cuda_binding, dev, torch.cuda.current_stream(dev).cuda_stream)
        elif dev.type != "cpu":  # host stream with a GPU model (gpu.device: none): round trip through the CPU
            out = self.forward(x.cpu(), top_k_index.cpu(), top_k_weights.cpu())
            return out.to(dev)
        xin = x if x.dtype in (torch.bfloat16, torch.float32) else x.float()
        xin = xin.contiguous()
        ids = top_k_index.to(torch.int64).contiguous()
        w = top_k_weights.to(torch.float32).contiguous()
        out = torch.empty((T, self.hidden_dim), dtype=torch.float32, device=dev)
        args = (self.index, xin.data_ptr(), xin.dtype == torch.bfloat16, T, ids.data_ptr(), w.data_ptr(), ids.shape[1],
                out.data_ptr())
        if self.engine.is_cuda:
            # Inputs, temporaries and out were allocated on torch's current stream, which is the
            # engine's (checked above): the caching allocator reuses their blocks only for work
            # enqueued later on that stream, so after tandem's reads and writes. The device guard
            # restores torch's current device, which the C++ stream sets to the engine's.
            with torch.cuda.device(dev):
                self.engine.forward(*args, synchronize=False)
        else:
            try:  # host stream: enqueue, then wait until the stream ran it (x, ids, w, out are read/written there)
                self.engine.forward(*args, synchronize=True)
            except BaseException:
                # It may have failed after enqueueing part of the layer: let that work finish
                # before the temporaries it reads are freed.
                try:
                    self.engine.synchronize()
                except Exception:  # noqa: BLE001 (the first error is the one reported)
                    pass
                raise
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
                f"intermediate={self.intermediate_dim}, train=True, cpu threads={self.lora_layer.threads}, "
                f"isa={self.lora_layer.isa}")

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
    checked: set = set()  # what the experts compute: structure per layer, forward once per kind
    for (e, _), b in zip(inner, blocks):
        check_experts(e, f"model layer {b.layer}", checked)
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
    from .tracing import apply_config

    apply_config(config_json(config))  # trace.enabled: record from now on, write trace.path at exit
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

    @property
    def isa(self) -> str:
        """The kernel level the layers run (config cpu.isa, lowered by TANDEM_ISA)."""
        return self.layers[0].isa

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
                                          zero_point=cpu["zero_point"], backward_format=backward_format, layer=L,
                                          isa=cpu["isa"])
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
