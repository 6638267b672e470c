"""Whether an experts module computes what tandem's kernels compute (silu(gate) * up experts):
``check_experts_structure`` (class, act_fn, gating, tensors, layout), ``check_experts_numerics``
(its own forward on a small test input against the formula) and ``check_experts`` (both, the
numeric check once per kind of module).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .discovery import clamped_candidates, expert_shape, oai_math, oai_weights, v4_projections
from .expert_math import PLAIN, ExpertMath


# ---- what an experts module computes ---------------------------------------------------
# tandem's kernels (CPU packs, GPU hot experts, LoRA path) compute, per token t,
#   out[t] = sum_k w[t, k] * down_e(silu(gate_e x_t) * up_e x_t),  e = ids[t, k]
# with no biases, no clamp, no other activation; the CPU inference engine also computes
# gpt-oss's experts (discovery.ExpertMath: biases, clamped SwiGLU). An experts module is
# accepted only when its structure says which of the two it is (class, act_fn, gating,
# tensors) and, once per distinct kind of module, its own forward agrees with that
# formula on a small test input.

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


def _check_gating(module: nn.Module, name: str, where: str, own_gate_ok: bool = False) -> None:
    """Class-level checks shared by fused and per-expert modules: activation and gating.
    own_gate_ok: a class's own _apply_gate is left to the numeric check (fused modules,
    whose candidates include clamped SwiGLUs)."""
    act = getattr(module, "act_fn", None)
    if act is not None and not _is_silu(act):
        raise ValueError(f"{name} ({where}): its activation act_fn is {_act_name(act)}; tandem's kernels compute "
                         "silu(gate) * up (only SiLU experts are supported)")
    if "_apply_gate" in vars(module):
        raise ValueError(f"{name} ({where}): its _apply_gate is replaced on the instance; tandem's kernels compute "
                         "silu(gate) * up (custom gating such as a clamped or softcapped SwiGLU is not supported)")
    if _own_gate(type(module)) and not own_gate_ok:
        owner = next(c for c in type(module).__mro__ if "_apply_gate" in vars(c))
        raise ValueError(f"{name} ({where}): it gates with its own {owner.__name__}._apply_gate (e.g. a clamped or "
                         "softcapped SwiGLU), not silu(gate) * up; tandem's kernels compute silu(gate) * up only")


def _own_gate(cls: type) -> bool:
    """Whether `cls` has an _apply_gate other than transformers' default one."""
    gate_fn = getattr(cls, "_apply_gate", None)
    if gate_fn is None:
        return False
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # pragma: no cover
        return True
    return gate_fn is not _default_apply_gate


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
            for proj in v4_projections(ex):
                if proj.bias is not None:
                    raise ValueError(f"{name} ({where}): its projections have biases; tandem's kernels compute "
                                     "bias-free silu(gate) * up experts")
        return
    name = type(experts).__name__
    if oai_math(experts) is not None:  # gpt-oss's layout: its own _apply_gate, checked numerically
        if "_apply_gate" in vars(experts):
            raise ValueError(f"{name} ({where}): its _apply_gate is replaced on the instance; tandem computes "
                             "gpt-oss's clamped SwiGLU as its class defines it")
        return
    _check_gating(experts, name, where, own_gate_ok=True)
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


def _reference_math(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, ids: torch.Tensor,
                    w: torch.Tensor, math: ExpertMath, bg: torch.Tensor | None = None, bu: torch.Tensor | None = None,
                    bd: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k w[t, k] * (wd_e h + bd_e) in fp64, h = math's activation of (wg_e x + bg_e,
    wu_e x + bu_e) (no biases: 0); weights in the kernels' layout ([n, I, H], [n, H, I])."""
    g = torch.einsum("th,eih->tei", x, wg.double())
    u = torch.einsum("th,eih->tei", x, wu.double())
    if bg is not None:
        g, u = g + bg.double(), u + bu.double()
    h = _activation(math, g, u)
    y = torch.einsum("tei,ehi->teh", h, wd.double())
    if bd is not None:
        y = y + bd.double()
    return (y[torch.arange(x.shape[0])[:, None], ids] * w[..., None]).sum(1)


def _activation(math: ExpertMath, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """math's activation of pre-activations g, u (fp64)."""
    g, u = g.double(), u.double()
    if math.activation == "silu":
        return nn.functional.silu(g) * u
    g = g.clamp(max=math.limit)
    u = u.clamp(-math.limit, math.limit)
    return g * torch.sigmoid(math.alpha * g) * (u + math.up_offset)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.double()
    if got.shape != want.shape:
        return float("inf")
    rel = (got - want).abs().amax(1) / want.abs().amax(1).clamp_min(1e-30)
    return float(rel.max()) if torch.isfinite(rel).all() else float("inf")


def _compare(name: str, where: str, got: torch.Tensor, want: torch.Tensor, what: str = "silu(gate) * up") -> None:
    got = got.double()
    if got.shape != want.shape:
        raise ValueError(f"{name} ({where}): its forward returned shape {tuple(got.shape)} on a test input, "
                         f"expected {tuple(want.shape)}")
    err = _rel_err(got, want)
    if not err <= _PROBE_TOLERANCE:
        if what == "silu(gate) * up":
            raise ValueError(f"{name} ({where}): its forward differs from {what} experts (max rel diff "
                             f"{err:.2g} on a test input of {got.shape[0]} tokens): tandem's kernels compute "
                             "out = sum_k w_k * down(silu(gate x) * up x) for this layout; other activations and "
                             "biases are not supported")
        raise ValueError(f"{name} ({where}): its structure says {what}, but its forward differs from that (max rel "
                         f"diff {err:.2g} on a test input of {got.shape[0]} tokens)")


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


def _fused_probe(experts: nn.Module, params: dict[str, torch.Tensor]) -> nn.Module:
    """A shallow copy of a fused experts module holding `params` (its parameters' probe
    copies), running transformers' eager path (the class's own code)."""
    import copy

    probe = copy.copy(experts)
    probe._modules, probe._buffers = dict(experts._modules), dict(experts._buffers)
    probe._parameters = {k: nn.Parameter(v, requires_grad=False) for k, v in params.items()}
    cfg = getattr(experts, "config", None)
    if cfg is not None and hasattr(cfg, "_experts_implementation"):
        probe.config = copy.copy(cfg)
        probe.config._experts_implementation = "eager"
    return probe


def check_experts_numerics(experts: nn.Module, where: str) -> ExpertMath:
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
        for attr, lin in zip(names, v4_projections(ex)):
            m = nn.Linear(lin.in_features, lin.out_features, bias=False)
            m.weight = nn.Parameter(_probe_tensor(lin.weight, None, gen), requires_grad=False)
            probe._modules[attr] = m
            mats.append(m.weight[None])
        x, ids, w = _probe_inputs(mats[0], 1, 1, gen)
        out = _run_probe(fn, probe, name, where, x.float())
        _compare(name, where, out, _reference_math(x, *mats, torch.zeros_like(ids), torch.ones_like(w), PLAIN))
        return PLAIN
    name = type(experts).__name__
    fn = _own_forward(experts)
    if fn is None:
        raise ValueError(f"{name} ({where}): its forward was replaced on the instance "
                         f"({experts.__dict__.get('forward')!r}); tandem cannot check that it computes silu(gate) * up")
    E, H, I = expert_shape(experts)
    n = min(E, _PROBE_EXPERTS)
    math = oai_math(experts)
    if math is not None:
        probe = _fused_probe(experts, {k: _probe_tensor(getattr(experts, k), n, gen)
                                       for k in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")})
        wg, wu, wd, bg, bu, bd = oai_weights(probe)
        x, ids, w = _probe_inputs(wg, n, n, gen)
        out = _run_probe(fn, probe, name, where, x.float(), ids, w.float())
        _compare(name, where, out, _reference_math(x, wg, wu, wd, ids, w, math, bg, bu, bd), math.describe())
        return math
    gu = _probe_tensor(experts.gate_up_proj, n, gen)
    dn = _probe_tensor(experts.down_proj, n, gen)
    probe = _fused_probe(experts, {"gate_up_proj": gu, "down_proj": dn})
    x, ids, w = _probe_inputs(gu[:, :I], n, n, gen)
    out = _run_probe(fn, probe, name, where, x.float(), ids, w.float())
    if not _own_gate(type(experts)):
        _compare(name, where, out, _reference_math(x, gu[:, :I], gu[:, I:], dn, ids, w, PLAIN))
        return PLAIN
    # Its class's own gate: the first candidate (clamped SwiGLUs from its settings, then
    # plain) that both its forward (eager) and its _apply_gate itself (what transformers'
    # grouped / batched backends call on the pre-activations) match.
    pre = torch.einsum("th,eoh->teo", x, gu.double())  # [T, n, 2I]: gate then up
    try:
        with torch.no_grad():
            gated = type(experts)._apply_gate(probe, pre.float())
    except Exception as e:  # noqa: BLE001 (any failure means: cannot verify)
        raise ValueError(f"{name} ({where}): tandem could not run its _apply_gate on a test input ({type(e).__name__}: "
                         f"{e})") from e
    tried = []
    for cand in clamped_candidates(experts):
        err = _rel_err(out, _reference_math(x, gu[:, :I], gu[:, I:], dn, ids, w, cand))
        err_gate = _rel_err(gated.reshape(-1, I), _activation(cand, pre[..., :I], pre[..., I:]).reshape(-1, I)) \
            if isinstance(gated, torch.Tensor) else float("inf")
        if max(err, err_gate) <= _PROBE_TOLERANCE:
            return cand
        tried.append(f"{cand.describe()}: forward {err:.2g}, _apply_gate {err_gate:.2g}")
    owner = next(c for c in type(experts).__mro__ if "_apply_gate" in vars(c))
    raise ValueError(f"{name} ({where}): it gates with its own {owner.__name__}._apply_gate, and its forward and gate "
                     f"match none of the experts tandem computes on a test input (max rel diff: {'; '.join(tried)}); "
                     "tandem's kernels compute silu(gate) * up and clamped SwiGLUs")


def _experts_kind(experts: nn.Module) -> tuple:
    """What decides an experts module's computation, for checking each kind once: class, own
    forward, activation and gating, and the module's plain scalar settings (a clamp limit
    differing between layers makes a different kind)."""
    mod = experts[0] if isinstance(experts, nn.ModuleList) and len(experts) else experts
    scalars = tuple(sorted((k, v) for k, v in vars(mod).items()
                           if not k.startswith("_") and isinstance(v, (bool, int, float, str))))
    act = getattr(mod, "act_fn", None)
    return (type(experts), type(mod), _own_forward(mod), type(act), mod.__dict__.get("_apply_gate"), scalars)


def check_experts(experts: nn.Module, where: str, checked: dict | None = None) -> ExpertMath:
    """check_experts_structure, then check_experts_numerics once per kind of module
    (``checked`` maps the kinds already verified, across the layers of one model, to their
    math); returns what the module computes."""
    check_experts_structure(experts, where)
    kind = _experts_kind(experts)
    if checked is not None and kind in checked:
        return checked[kind]
    math = check_experts_numerics(experts, where)
    if checked is not None:
        checked[kind] = math
    return math
