"""MoE routers on tandem's kernels for CPU inference: ``TandemRouter``, ``replace_routers``.

transformers' routers of the softmax-then-top-k form (Qwen2-MoE, Qwen3-MoE, Qwen3-Next,
Mixtral, OLMoE, MiniMax) run six to eight torch operations per call: a bf16 linear on
torch's one thread (on the 2-core AMX Xeon ~150 us for Qwen3-30B-A3B's 128 x 2048 weight,
3.5 GB/s), then softmax, topk, sum, divide and casts at 5-25 us each. A decode token pays
that once per MoE layer. ``TandemRouter`` runs the same math in one call: the logits on
tandem's bf16 kernels and pool (fp32 sums, rounded once to bf16 as torch rounds its bf16
linear), the softmax in fp32, the top k (largest first, selected as torch.topk selects on
the CPU, so equal probabilities keep the same expert) and the optional division by their
sum on the calling thread. DeepSeek-V2's router (``topk_method`` greedy or
group_limited_greedy) is the same form with fp32 logits (its fp32 linear of the same bf16
values: tandem's fp32 sums, not rounded), torch.topk(sorted=False)'s order, the
probabilities of all but the ``topk_group`` best groups set to 0 first (group-limited),
and every score times ``routed_scaling_factor``: its fp32 copy of the weight made at every
call (~100-200 us per MoE layer) goes too.

``replace_routers`` swaps a MoE block's router only after a probe shows that this math is
the module's: the probe's inputs have one or two non-zero features, a power of two each,
so the logits are exact in any summation order and both sides must agree on them bit for
bit; the expert indices must then be the same (or tied), and the scores the same within
one rounding of their dtype. The probe also decides whether the module divides by the top
k's sum, whether its order is torch.topk's sorted one, and in which dtypes it returns the
logits and scores. Routers of other forms (DeepSeek-V3's sigmoid with groups and a bias,
gpt-oss's top-k-then-softmax in bf16 with a bias, fp32 weights) fail it and stay in torch.
Inference only: inputs that need a gradient, other dtypes or devices go to the module
replaced.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class TandemRouter(nn.Module):
    """A softmax-then-top-k router on tandem's kernels (see the module docstring).

    ``replace_routers`` makes each one an instance of ``router_class(type(router))``, a
    subclass of both this class and the router's own: transformers finds the modules whose
    outputs ``output_router_logits`` records by their class, and would otherwise record
    nothing (its auxiliary loss then failed with an IndexError on an empty tuple).
    Attributes this class does not have (the router's config, ``norm_topk_prob``, ...) are
    the replaced router's."""

    def __init__(self, engine: Any, router: nn.Module, top_k: int, renorm: bool, scores_dtype: torch.dtype,
                 name: str, logits_dtype: torch.dtype = torch.bfloat16, scale: float = 1.0, groups: int = 1,
                 top_groups: int = 1, sorted: bool = True) -> None:
        nn.Module.__init__(self)  # (not the router class's __init__, in a subclass of both)
        w = router.weight
        # The module's own Parameter under the same name (state_dict keys and .to() see it);
        # the module itself is kept for other inputs, not registered (no second copy).
        self.weight = w
        object.__setattr__(self, "_inner", router)
        self.num_experts, self.hidden_dim = int(w.shape[0]), int(w.shape[1])
        self.top_k = int(top_k)
        self.renorm = bool(renorm)
        self.scores_dtype = scores_dtype
        self.logits_dtype = logits_dtype
        self.scale = float(scale)
        self.groups, self.top_groups = int(groups), int(top_groups)
        self.sorted = bool(sorted)
        self.name = name
        wc = w.detach().contiguous()
        self._dense = engine.dense_linear(wc.data_ptr(), self.num_experts, self.hidden_dim, "bfloat16", "bf16",
                                          name=name)

    @property
    def inner(self) -> nn.Module:
        """The router this one replaced (runs every input the kernels do not take)."""
        return self._inner

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_inner")
            if inner is None or name.startswith("__"):
                raise
            return getattr(inner, name)

    def forward(self, hidden_states: torch.Tensor):
        x = hidden_states
        if (x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] != self.hidden_dim
                or (torch.is_grad_enabled() and x.requires_grad)):
            return self._inner(hidden_states)
        x2 = x.reshape(-1, self.hidden_dim).contiguous()
        m = x2.shape[0]
        logits = torch.empty(m, self.num_experts, dtype=self.logits_dtype)
        scores = torch.empty(m, self.top_k, dtype=self.scores_dtype)
        index = torch.empty(m, self.top_k, dtype=torch.int64)
        self._dense.route(x2.data_ptr(), True, m, self.hidden_dim, self.top_k, self.renorm, logits.data_ptr(),
                          scores.data_ptr(), self.scores_dtype == torch.float32, index.data_ptr(), sorted=self.sorted,
                          logits_f32=self.logits_dtype == torch.float32, scale=self.scale, groups=self.groups,
                          top_groups=self.top_groups)
        return logits, scores, index

    def extra_repr(self) -> str:
        extra = "" if self.groups == 1 else f", groups={self.top_groups} of {self.groups}"
        extra += "" if self.scale == 1.0 else f", scale={self.scale:g}"
        return (f"experts={self.num_experts}, hidden={self.hidden_dim}, top_k={self.top_k}, renorm={self.renorm}, "
                f"logits={str(self.logits_dtype).removeprefix('torch.')}, "
                f"scores={str(self.scores_dtype).removeprefix('torch.')}{extra} (tandem)")


_CLASSES: dict[type, type] = {}


def router_class(kind: type) -> type:
    """``TandemRouter`` as a subclass of the router class `kind` too (one per class)."""
    if issubclass(kind, TandemRouter):
        return kind
    cls = _CLASSES.get(kind)
    if cls is None:
        cls = type(f"Tandem{kind.__name__}", (TandemRouter, kind),
                   {"__module__": __name__, "__doc__": TandemRouter.__doc__})
        _CLASSES[kind] = cls
    return cls


def _probe(hidden: int, n: int, seed: int) -> torch.Tensor:
    """n bf16 rows with one or two non-zero features, powers of two (exact logits)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(n, hidden, dtype=torch.bfloat16)
    cols = torch.randint(0, hidden, (n, 2), generator=g)
    powers = torch.randint(-3, 6, (n, 2), generator=g).float()
    signs = torch.randint(0, 2, (n, 2), generator=g).float() * 2 - 1
    vals = (signs * torch.exp2(powers)).to(torch.bfloat16)
    for i in range(n):
        x[i, cols[i, 0]] = vals[i, 0]
        if i % 2:
            x[i, cols[i, 1]] = vals[i, 1]
    return x


def _agrees(want, got) -> bool:
    """Whether a TandemRouter's (logits, scores, index) are the module's (three tensors; see
    the module docstring)."""
    (wl, ws, wi), (gl, gs, gi) = want, got
    if wl.dtype != gl.dtype or ws.dtype != gs.dtype or wi.dtype != gi.dtype:
        return False
    if wl.shape != gl.shape or ws.shape != gs.shape or wi.shape != gi.shape or not torch.equal(wl, gl):
        return False
    # The same experts, or tied ones (equal logits: either is the module's answer).
    lw, lg = torch.gather(wl.float(), 1, wi), torch.gather(gl.float(), 1, gi)
    if not torch.equal(lw, lg):
        return False
    tol = 2.0 ** -7 if ws.dtype == torch.bfloat16 else 2.0 ** -18
    return bool(((gs.float() - ws.float()).abs() <= ws.float().abs() * tol + 1e-30).all())


def replace_routers(model: nn.Module, engine: Any, blocks: list[nn.Module]) -> list[str]:
    """Swaps the router of each MoE block in `blocks` for a ``TandemRouter`` where the probe
    (module docstring) shows it computes what the router does. A candidate is a child of
    the block, other than its experts, with a 2-D bf16 CPU ``weight`` [experts x hidden] and
    an integer ``top_k``. Returns the names replaced."""
    names = {id(m): n for n, m in model.named_modules()}
    done: list[str] = []
    for bi, block in enumerate(blocks):
        for attr, child in list(block.named_children()):
            w = getattr(child, "weight", None)
            k = getattr(child, "top_k", None)
            if (isinstance(child, TandemRouter) or attr == "experts" or not isinstance(w, torch.Tensor)
                    or w.dim() != 2 or w.dtype != torch.bfloat16 or w.device.type != "cpu"
                    or not isinstance(k, int) or not 1 <= k <= w.shape[0]):
                continue
            # The weight must be all the module holds: a bias or a correction buffer
            # (gpt-oss, DeepSeek) is math this form does not have, even when it is zero.
            held = [t for _, t in child.named_parameters()] + [t for _, t in child.named_buffers()]
            if len(held) != 1 or held[0] is not w:
                continue
            head = names.get(id(block), "?")
            full = f"{head}.{attr}" if head else attr
            fast = _checked(engine, child, k, full, seed=bi)
            if fast is not None:
                setattr(block, attr, fast)
                done.append(full)
    return done


def _checked(engine: Any, router: nn.Module, k: int, name: str, seed: int) -> TandemRouter | None:
    """A TandemRouter (its renorm and scores dtype found by the probe) that gives what
    `router` gives on a probe of its own weight, or None."""
    probe = _probe(router.weight.shape[1], 24, seed)
    with torch.no_grad():
        want = router(probe)
    if not (isinstance(want, tuple) and len(want) == 3 and all(isinstance(t, torch.Tensor) for t in want)):
        return None
    sd, ld = want[1].dtype, want[0].dtype
    if sd not in (torch.bfloat16, torch.float32) or ld not in (torch.bfloat16, torch.float32):
        return None
    # DeepSeek-V2's router (fp32 logits of the same bf16 values, greedy or group-limited,
    # scaled, torch.topk(sorted=False)) names its settings; the probe still decides.
    method = getattr(router, "topk_method", "greedy")
    groups, top_groups = 1, 1
    if method == "group_limited_greedy":
        groups, top_groups = getattr(router, "num_group", None), getattr(router, "topk_group", None)
        if not (isinstance(groups, int) and isinstance(top_groups, int)):
            return None
    elif method != "greedy":
        return None
    scale = getattr(router, "routed_scaling_factor", 1.0)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        return None
    try:  # the weight packed once, for the probe and after
        cand = router_class(type(router))(engine, router, k, True, sd, name, logits_dtype=ld, scale=float(scale),
                                          groups=groups, top_groups=top_groups)
        for sorted_ in (True, False):
            for renorm in (True, False):
                cand.sorted, cand.renorm = sorted_, renorm
                with torch.no_grad():
                    if _agrees(want, cand(probe)):
                        return cand
    except RuntimeError:  # settings the kernel refuses (groups that do not divide the experts, ...)
        return None
    return None
