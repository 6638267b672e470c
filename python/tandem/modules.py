"""The nn.Modules that stand in for a transformers model's routed experts.

``TandemExperts`` takes the place of a model's ``mlp.experts`` module: HF's router (so
router logits and the aux loss still work) and shared experts stay as they are, in
torch, on the model's device; the routed experts run in the C++ engine (hot ones on the
stream's device, the rest in the CPU pools). The module holds no parameters and no
persistent buffers (fused experts: one non-persistent element that gives PEFT's
placeholders their dtype and device), so ``state_dict()`` and ``Accelerator.prepare`` see
only the rest of the model.
``TandemLoraExperts`` is its training counterpart (a ``_C.LoraLayer``, LoRA through
``tandem.lora``). With several ranks on a machine sharing one copy of the CPU experts
(``tandem.distributed``), both run through an ``ExpertExchange``; on the ranks that hold no
experts they have no engine (``engine`` / ``lora_layer`` None) and only send their tokens.
``FrozenLinear`` stands in for a v4 per-expert linear whose weight tandem
holds. Also here: which device a CUDA engine runs on (``CudaBinding``, recorded by
``tandem.engine.make_engine`` in ``CUDA_BINDINGS``) and the check each CUDA call makes
against it (``check_cuda_call``). Each CUDA call enqueues on torch's current stream of that
device at the time of the call (the engine follows it, ordering its earlier work first).
"""
from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from . import _C
from .expert_math import PLAIN, ExpertMath
from .lora import run_experts


@dataclass(frozen=True)
class CudaBinding:
    """Where a CUDA engine runs: its device index (its streams follow torch's current one)."""
    device: int


# CUDA engines made by make_engine -> their binding (the _C.Engine does not expose it).
CUDA_BINDINGS: "weakref.WeakKeyDictionary[_C.Engine, CudaBinding]" = weakref.WeakKeyDictionary()


def check_cuda_call(where: str, binding: CudaBinding, device: torch.device) -> None:
    """Refuses a call whose hidden states are on another device than the engine's (its
    hot experts and buffers live there)."""
    if device.index != binding.device:
        raise ValueError(f"{where}: hidden_states is on {device} but this model's tandem engine runs on "
                         f"cuda:{binding.device}; keep the model and its inputs on cuda:{binding.device} "
                         "(tandem's engine cannot move to another device)")


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


def _peft_is_asking() -> bool:
    """Called from a parameter generator: whether the code iterating it (past torch's own
    Module.parameters wrappers) is PEFT's. (A generator's frame's caller is the frame that
    resumed it.)"""
    f = sys._getframe(2)
    while f is not None and f.f_globals.get("__name__") == "torch.nn.modules.module":
        f = f.f_back
    return f is not None and f.f_globals.get("__name__", "").partition(".")[0] == "peft"


class _FusedPlaceholders(nn.Module):
    """For fused (v5) experts: answers ``gate_up_proj`` and ``down_proj`` with storage-free
    placeholders of the right shape, dtype and device (those of the ``tandem_probe`` buffer,
    which ``.to()`` moves and casts like the model), so that PEFT's ``target_parameters``
    can wrap the module. Subclasses set num_experts, hidden_dim, intermediate_dim, fused.

    In gpt-oss's layout (``_set_layout(interleaved=True)``) the placeholders are its
    [E, H, 2I] (gate and up columns interleaved) and [E, I, H], with transformers' flags for
    it (is_transposed, not is_concatenated): PEFT and tandem then read an adapter's lora_B
    rows of gate_up_proj as the stock module does, so adapters move between the two."""

    is_transposed = False
    is_concatenated = True

    def _add_probe(self, dtype: torch.dtype, device: torch.device) -> None:
        self.register_buffer("tandem_probe", torch.zeros(1, dtype=dtype, device=device), persistent=False)

    def _set_layout(self, interleaved: bool) -> None:
        self.is_transposed = interleaved
        self.is_concatenated = not interleaved

    def _placeholders(self) -> dict[str, torch.Tensor]:
        E, H, I = self.num_experts, self.hidden_dim, self.intermediate_dim
        p = self._buffers["tandem_probe"]
        if self.is_transposed:
            return {"gate_up_proj": nn.Parameter(p.expand(E, H, 2 * I), requires_grad=False),
                    "down_proj": nn.Parameter(p.expand(E, I, H), requires_grad=False)}
        return {"gate_up_proj": nn.Parameter(p.expand(E, 2 * I, H), requires_grad=False),
                "down_proj": nn.Parameter(p.expand(E, H, I), requires_grad=False)}

    def __getattr__(self, name: str):
        if name in ("gate_up_proj", "down_proj") and self.__dict__.get("fused"):
            return self._placeholders()[name]
        return super().__getattr__(name)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        # Only PEFT sees the placeholders (its target_parameters matching calls this directly on
        # each module). A parent's parameters() / state_dict() / DDP / optimizers walk
        # _parameters and never call this; FSDP2 and DeepSpeed ZeRO-3 call it directly on each
        # module, and must not take storage-free views of [E, 2I, H] for weights to shard.
        yield from super().named_parameters(prefix, recurse, remove_duplicate)
        if self.fused and _peft_is_asking():
            for n, p in self._placeholders().items():
                yield (f"{prefix}.{n}" if prefix else n), p


@dataclass(frozen=True)
class ExpertsSource:
    """The checkpoint a layer's base expert weights were packed from (``tandem.load_model``):
    merging an adapter re-reads them from there (``tandem.adapters``)."""
    checkpoint: str
    naming: tuple[str, str, str]


class TandemExperts(_FusedPlaceholders):
    """Drop-in for a transformers experts module: forward(hidden [T, H], top_k_index [T, K],
    top_k_weights [T, K]) -> [T, H] in hidden's dtype. No parameters: the weights live in
    the engine (``self.engine``), shared by every layer of the model. Fused (v5) experts
    answer PEFT with placeholders (``_FusedPlaceholders``); the engine runs no LoRA, so an
    adapter PEFT puts on them is merged into the packs or refused (``tandem.peft_glue``)."""

    def __init__(self, engine: _C.Engine | None, index: int, layer: int, act: str = "silu", fused: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 source: "ExpertsSource | None" = None, math: ExpertMath | None = None,
                 interleaved: bool = False, exchange=None, shape: tuple[int, int, int] | None = None):
        super().__init__()
        if math is None:
            math = PLAIN
        if math.plain and act not in ("silu", "swish"):
            raise ValueError(f"model layer {layer}: expert activation {act!r} is not supported (silu only)")
        if engine is None and (exchange is None or shape is None):
            raise ValueError(f"model layer {layer}: experts without an engine need an exchange and their shape")
        self.engine = engine
        self.exchange = exchange    # tandem.distributed.ExpertExchange when the CPU experts are shared by ranks
        self.math = math            # what the experts compute (discovery.ExpertMath), as the engine does
        self.index = index          # MoE index in the engine
        self.layer = layer          # model layer
        E, H, I = shape if engine is None else (engine.experts, engine.hidden, engine.inter)
        self.num_experts, self.hidden_dim, self.intermediate_dim = E, H, I
        self.fused = fused
        self.source = source        # where the base weights can be read again (merging adapters)
        if fused:
            self._add_probe(dtype, torch.device(device))
            self._set_layout(interleaved)
        cuda = engine is not None and engine.is_cuda
        self._cuda_binding = CUDA_BINDINGS.get(engine) if cuda else None
        if cuda and self._cuda_binding is None:
            raise ValueError(f"model layer {layer}: this CUDA engine was not made by tandem.engine.make_engine, so "
                             "tandem cannot tell which stream it enqueues on; build it with make_engine (it enqueues "
                             "on torch's current stream)")

    def extra_repr(self) -> str:
        e = self.engine
        if e is None:
            return (f"layer={self.layer}, experts={self.num_experts}, hidden={self.hidden_dim}, "
                    f"intermediate={self.intermediate_dim}, held by {self.exchange.mg.describe()}")
        hot = len(e.hot(self.index))
        math = "" if self.math.plain else f"math={self.math.describe()}, "
        return (f"layer={self.layer}, experts={self.num_experts}, hidden={self.hidden_dim}, "
                f"intermediate={self.intermediate_dim}, {math}format={e.format}, hot={hot} on {e.stream}, "
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
        if self.exchange is not None:  # every rank of the machine takes part, with or without tokens
            local = None
            if self.engine is not None:
                def local(xs, ids, w):
                    return self._local(xs, ids, w, fp32=True)
            return self.exchange(x, top_k_index, top_k_weights, local)
        return self._local(x, top_k_index, top_k_weights)

    def _local(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
               fp32: bool = False) -> torch.Tensor:
        """The experts this process's engine holds, on [T, H] (ids of other ranks' experts are
        -1), in x's dtype (fp32: in the engine's fp32)."""
        where = f"tandem experts (model layer {self.layer})"
        T = x.shape[0]
        if T == 0:
            return torch.zeros_like(x)
        dev = x.device
        if self.engine.is_cuda:
            if dev.type != "cuda":
                raise ValueError(f"{where}: the engine runs on {self.engine.stream} but hidden_states is on {dev}")
            check_cuda_call(where, self._cuda_binding, dev)
        elif dev.type != "cpu":  # host stream with a GPU model (gpu.device: none): round trip through the CPU
            out = self._local(x.cpu(), top_k_index.cpu(), top_k_weights.cpu(), fp32)
            return out.to(dev)
        xin = x if x.dtype in (torch.bfloat16, torch.float32) else x.float()
        xin = xin.contiguous()
        ids = top_k_index.to(torch.int64).contiguous()
        w = top_k_weights.to(torch.float32).contiguous()
        out = torch.empty((T, self.hidden_dim), dtype=torch.float32, device=dev)
        args = (self.index, xin.data_ptr(), xin.dtype == torch.bfloat16, T, ids.data_ptr(), w.data_ptr(), ids.shape[1],
                out.data_ptr())
        if self.engine.is_cuda:
            # The engine enqueues on torch's current stream (after its own earlier work), where
            # the temporaries and out were allocated: the caching allocator reuses their blocks
            # only for work enqueued later on that stream, so after tandem's reads and writes.
            # Under a torch CUDA graph capture that stream is the capture stream, so the call
            # (CPU experts included, as host nodes) is recorded into the graph. The device
            # guard restores torch's current device, which the C++ stream sets to the engine's.
            with torch.cuda.device(dev):
                self.engine.forward(*args, synchronize=False, cuda_stream=torch.cuda.current_stream(dev).cuda_stream)
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
        return out if x.dtype == torch.float32 or fp32 else out.to(x.dtype)


class TandemLoraExperts(_FusedPlaceholders):
    """The training counterpart of ``TandemExperts``: one layer's routed experts held by a
    ``_C.LoraLayer`` (frozen base in the CPU pools, LoRA on gate/up/down of every expert),
    differentiable in the hidden states, the routing weights and the LoRA tensors.

    forward(hidden, top_k_index, top_k_weights, lora=None): ``lora`` is a
    ``tandem.lora.LoraTensors`` (PEFT's wrappers pass theirs; None runs the frozen base).
    The module holds no parameters; for fused (v5) experts it answers ``gate_up_proj`` and
    ``down_proj`` with storage-free placeholders of the right shape, dtype and device, so
    that PEFT's ``target_parameters`` can wrap it after offloading."""

    def __init__(self, lora_layer: _C.LoraLayer | None, layer: int, fused: bool, dtype: torch.dtype,
                 device: torch.device, interleaved: bool = False, exchange=None,
                 shape: tuple[int, int, int] | None = None):
        super().__init__()
        if lora_layer is None and (exchange is None or shape is None):
            raise ValueError(f"model layer {layer}: experts without a LoRA layer need an exchange and their shape")
        self.lora_layer = lora_layer
        self.exchange = exchange
        self.layer = layer
        self.fused = fused
        E, H, I = shape if lora_layer is None else (lora_layer.experts, lora_layer.hidden, lora_layer.inter)
        self.num_experts, self.hidden_dim, self.intermediate_dim = E, H, I
        self._add_probe(dtype, device)
        self._set_layout(interleaved)

    def extra_repr(self) -> str:
        if self.lora_layer is None:
            return (f"layer={self.layer}, experts={self.num_experts}, hidden={self.hidden_dim}, "
                    f"intermediate={self.intermediate_dim}, train=True, held by {self.exchange.mg.describe()}")
        return (f"layer={self.layer}, experts={self.num_experts}, hidden={self.hidden_dim}, "
                f"intermediate={self.intermediate_dim}, train=True, cpu threads={self.lora_layer.threads}, "
                f"isa={self.lora_layer.isa}")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                lora=None) -> torch.Tensor:
        where = f"tandem experts (model layer {self.layer})"
        T = _check_inputs(where, self.hidden_dim, hidden_states, top_k_index, top_k_weights)
        if self.exchange is not None:
            # This rank's LoRA tensors stay in the graph where it holds no experts (a zero
            # gradient), so data-parallel wrappers see them used on every rank.
            keep = list(lora.tensors()) if lora is not None else []
            local = None
            if self.lora_layer is not None:
                def local(x, ids, w):
                    return run_experts(self.lora_layer, x, ids, w, lora, where)
            return self.exchange(hidden_states, top_k_index, top_k_weights, local, keep)
        if T == 0:
            return hidden_states.new_zeros(hidden_states.shape)
        return run_experts(self.lora_layer, hidden_states, top_k_index, top_k_weights, lora, where)


class FrozenLinear(nn.Module):
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
