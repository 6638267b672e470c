"""The CPU's other linear layers on tandem's kernels: ``TandemLinear`` and ``replace_dense``;
and their RMSNorms fused (``TandemRMSNorm``, ``replace_norms``).

A model whose non-expert weights sit on the CPU runs its attention projections, shared
experts, dense MLPs and lm_head through torch, on torch's threads, beside tandem's pool.
``replace_dense`` swaps each such ``nn.Linear`` for a ``TandemLinear``: the weight packed
once (tandem's bf16, int8 or int4 formats, as the experts), each forward one task on the
engine's pool (the pool's cores, the kernel level of the engine: AMX, VNNI, AVX-512).
Config ``cpu.dense_format`` chooses:

- ``auto`` (default): tandem's bf16 kernels for bf16 weights (the same products,
  accumulated in fp32, the output rounded to the input's dtype as torch rounds it), torch
  for weights of any other dtype (so fp32 / fp16 models keep their own arithmetic);
- ``torch``: every layer stays transformers' own;
- ``bf16`` / ``int8`` / ``int4``: every layer packed in that format (fp32 and fp16 weights
  are rounded; int8 is per output row, int4 uses ``cpu.group_size`` / ``cpu.zero_point``).

Linear layers that are direct children of a MoE block (its router, a shared-expert gate)
stay in torch: they choose which experts run (transformers' router modules of the
softmax-then-top-k form run on tandem's kernels in bf16 instead, whatever the format:
``tandem.router``). Inference only: a ``TandemLinear`` has no
gradient, and training (``train=True``) leaves every layer to torch.

``use_gated_mlps`` then gives each gated MLP whose three layers are tandem's (gate and up
fused, SiLU: shared experts, dense MLPs) a one-call path, ``_C.gated_mlp_bf16``: gate/up
on the pool, ``bf16(bf16(silu(g)) * u)`` on the calling thread with the kernel table's
exponential (torch's rounding points; the exponential within an fp32 rounding of torch's),
down on the pool: four torch operations and three module calls fewer per call.
"""
from __future__ import annotations

import inspect
import re
from collections import Counter
from typing import Any

import torch
from torch import nn


DENSE_FORMATS = ("auto", "torch", "bf16", "int8", "int4")
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class _Packed:
    """One packed weight on tandem's kernels: a single layer's, or several layers' stacked
    by output rows (a fused group, e.g. q/k/v). ``run(x, member)`` returns the whole
    output [..., N] in x's dtype. For a group it remembers the last input and output: the
    group's other members, called with the same tensor (the same object, unmodified), take
    their columns from it instead of running the kernels again."""

    def __init__(self, dense: Any, in_features: int, out_features: int, members: int) -> None:
        self.dense = dense
        self.in_features = in_features
        self.out_features = out_features
        self.members = members
        self.biases: list[nn.Parameter] = []  # the members' own (state_dict, .to()), read at each run
        self._bias = (None, None)  # (what they were, their fp32 concatenation)
        self._last = None  # (x, version, y, members served): one reference, read and replaced whole
        self.runs = 0      # kernel runs (a group's members share one run per input)
        self.bf16_on_pool = True  # bf16 inputs: the output rounded to bf16 on the pool (False: in torch)

    @staticmethod
    def _version(x: torch.Tensor) -> int | None:
        return None if x.is_inference() else x._version  # inference tensors keep no version counter

    def cached(self, x: torch.Tensor, member: int) -> torch.Tensor | None:
        """The output of the group's last run if it was on x (the same tensor, unmodified)
        and this member has not taken it yet; else None."""
        last = self._last
        if last is None or last[0] is not x or member in last[3] or last[1] != self._version(x):
            return None
        last[3].add(member)
        if len(last[3]) == self.members:
            self._last = None  # every member served: drop the input and output
        return last[2]

    def _bias_fp32(self) -> torch.Tensor:
        if len(self.biases) == 1:
            return self.biases[0].float()
        key = tuple((b.data_ptr(), b._version, b.dtype) for b in self.biases)
        if self._bias[0] != key:
            self._bias = (key, torch.cat([b.detach().float() for b in self.biases]))
        return self._bias[1]

    def run(self, x: torch.Tensor, member: int) -> torch.Tensor:
        """Runs the kernels on x (checked by the caller); a group remembers x and the output."""
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype not in (torch.bfloat16, torch.float32):
            x2 = x2.float()
        x2 = x2.contiguous()
        m = x2.shape[0]
        if x.dtype == torch.bfloat16 and not self.biases and self.bf16_on_pool:  # no fp32 copy in torch
            y = torch.empty(m, self.out_features, dtype=torch.bfloat16)
            self.dense.forward_bf16(x2.data_ptr(), True, m, self.in_features, y.data_ptr(), self.out_features)
        else:
            y = torch.empty(m, self.out_features, dtype=torch.float32)
            self.dense.forward(x2.data_ptr(), x2.dtype == torch.bfloat16, m, self.in_features, y.data_ptr(),
                               self.out_features)
            if self.biases:
                y += self._bias_fp32()
            y = y.to(x.dtype)
        self.runs += 1
        y = y.reshape(*x.shape[:-1], self.out_features)
        if self.members > 1:
            self._last = (x, self._version(x), y, {member})
        return y


class TandemLinear(nn.Module):
    """``nn.Linear``'s forward (``x @ W.T + b``) on tandem's packed kernels and pool.

    The weight lives packed in C++ (``weight`` is not kept; a NaN or Inf in it is refused,
    naming the element); the bias stays a torch tensor and is added in fp32 before the
    output is rounded to the input's dtype.

    Layers that a module calls on the same input (q/k/v, gate/up) can share one packed
    weight (``TandemLinear.fused``): the first call runs the kernels once for all of them
    (one pool task, the input quantized once, the weights read in one stream) and each
    member returns its columns of that output. Every output column is the same dot product
    either way, so a member's output has the bits it would have alone."""

    def __init__(self, engine: Any, linear: nn.Linear, fmt: str, *, name: str,
                 group_size: int = 128, zero_point: bool = False) -> None:
        super().__init__()
        w = _checked_weight(linear, name)
        self._setup(linear, fmt, name, w.dtype)
        dense = engine.dense_linear(w.data_ptr(), self.out_features, self.in_features, _DTYPES[w.dtype], fmt,
                                    group_size=group_size, zero_point=zero_point, name=name)
        self._packed = _Packed(dense, self.in_features, self.out_features, 1)
        if self.bias is not None:
            self._packed.biases = [self.bias]
        self._columns = None
        self._member = 0

    def _setup(self, linear: nn.Linear, fmt: str, name: str, dtype: torch.dtype) -> None:
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.format = fmt
        self.name = name
        self.source_dtype = dtype
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def fused(cls, engine: Any, layers: list[tuple[str, nn.Linear]], fmt: str, *, group_size: int = 128,
              zero_point: bool = False) -> list[TandemLinear]:
        """One TandemLinear per (name, layer), all on one packed weight (their weights stacked
        by output rows). The layers must share in_features and weight dtype, and all or none
        have a bias."""
        ws = [_checked_weight(lin, name) for name, lin in layers]
        k, dtype = layers[0][1].in_features, ws[0].dtype
        if any(lin.in_features != k for _, lin in layers) or any(w.dtype != dtype for w in ws):
            raise ValueError(f"{', '.join(n for n, _ in layers)}: a fused group needs one input width and weight dtype")
        if len({lin.bias is None for _, lin in layers}) != 1:
            raise ValueError(f"{', '.join(n for n, _ in layers)}: a fused group needs a bias on all layers or none")
        names = [n for n, _ in layers]
        joined = _joined_name(names)
        stacked = torch.cat(ws)
        try:
            dense = engine.dense_linear(stacked.data_ptr(), stacked.shape[0], k, _DTYPES[dtype], fmt,
                                        group_size=group_size, zero_point=zero_point, name=joined)
        except ValueError:
            for (name, _), w in zip(layers, ws):  # name the member and its element, as alone
                bad = (~torch.isfinite(w)).nonzero()
                if len(bad):
                    r, c = bad[0].tolist()
                    v = w[r, c].item()
                    raise ValueError(f"{name}: weight element ({r}, {c}) is "
                                     f"{'nan' if v != v else 'inf' if v > 0 else '-inf'}: not finite") from None
            raise
        del stacked
        packed = _Packed(dense, k, sum(lin.out_features for _, lin in layers), len(layers))
        out, c0 = [], 0
        for i, (name, lin) in enumerate(layers):
            m = cls.__new__(cls)
            nn.Module.__init__(m)
            m._setup(lin, fmt, name, dtype)
            m._packed, m._columns, m._member = packed, (c0, c0 + lin.out_features), i
            if m.bias is not None:
                packed.biases.append(m.bias)
            c0 += lin.out_features
            out.append(m)
        return out

    @property
    def fused_with(self) -> int:
        """How many layers share this one's packed weight (1: not fused)."""
        return self._packed.members

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed weight (what a forward reads); a fused member counts its
        share (its rows), so that the members' sum is the group's."""
        total = self._packed.dense.bytes
        if self._columns is None:
            return total
        c0, c1 = self._columns
        N = self._packed.out_features
        return total * c1 // N - total * c0 // N

    def dequantized(self) -> torch.Tensor:
        """This layer's packed weight as fp32 [out_features, in_features]: what forward
        multiplies by (a fused member's rows of the group's weight)."""
        w = torch.from_numpy(self._packed.dense.dequantized())
        return w if self._columns is None else w[self._columns[0]:self._columns[1]].clone()

    @property
    def source_bytes(self) -> int:
        """Bytes the weight had as a torch tensor (what ``tandem doctor`` counts for it)."""
        return self.in_features * self.out_features * self.source_dtype.itemsize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A member before this one ran on x (checked then): its columns of that output.
        y = None if self._columns is None else self._packed.cached(x, self._member)
        if y is None:
            y = self._run(x)
        if self._columns is None:
            return y
        c0, c1 = self._columns
        return y[..., c0:c1]

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.name}: input has {x.shape[-1]} features, the layer takes {self.in_features}")
        if x.device.type != "cpu":
            raise ValueError(f"{self.name}: input is on {x.device}; this layer runs on the CPU")
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(f"{self.name}: tandem's dense layers are inference only (no gradient); load the "
                               "model with train=True, or set cpu.dense_format: torch, to train through it")
        return self._packed.run(x, self._member)

    def extra_repr(self) -> str:
        fused = "" if self._columns is None else f", fused with {self._packed.members - 1} more (one packed weight)"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={self.format} (from {str(self.source_dtype).removeprefix('torch.')}){fused}")


def _checked_weight(linear: nn.Linear, name: str) -> torch.Tensor:
    w = linear.weight.detach()
    if w.device.type != "cpu":
        raise ValueError(f"{name}: weight is on {w.device}; tandem's dense kernels run on the CPU")
    if w.dtype not in _DTYPES:
        raise ValueError(f"{name}: weight dtype {w.dtype} is not supported (float32, bfloat16, float16)")
    return w.contiguous()


def _joined_name(names: list[str]) -> str:
    """"a.b.q_proj", "a.b.k_proj" -> "a.b.{q_proj,k_proj}"."""
    heads = {n.rpartition(".")[0] for n in names}
    if len(heads) == 1:
        head = heads.pop()
        return f"{head + '.' if head else ''}{{{','.join(n.rpartition('.')[2] for n in names)}}}"
    return "+".join(names)


_CALLS: dict[type, dict[str, str]] = {}


def _call_arguments(parent: nn.Module) -> dict[str, str]:
    """{child attribute: the one variable name its parent's forward passes it} for every
    ``self.<child>(<name>)`` call in the source of ``type(parent).forward`` whose child is
    always called with that same variable; {} when the source cannot be read."""
    cls = type(parent)
    if cls not in _CALLS:
        args: dict[str, set[str]] = {}
        try:
            src = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            src = ""
        for m in re.finditer(r"self\.([A-Za-z_][A-Za-z_0-9]*)\(\s*([^()]*?)\s*\)", src):
            args.setdefault(m.group(1), set()).add(m.group(2))
        _CALLS[cls] = {c: a.pop() for c, a in args.items()
                       if len(a) == 1 and re.fullmatch(r"[A-Za-z_][A-Za-z_0-9]*", next(iter(a)))}
    return _CALLS[cls]


def _fusable_groups(parent: nn.Module, children: list[tuple[str, nn.Linear, str]]) -> list[list[int]]:
    """Indices into `children` (attribute, layer, format) of the groups to pack as one: the
    parent's forward calls each member with the same variable (read from its source), and
    the members share the input width, weight dtype, format and bias presence."""
    calls = _call_arguments(parent)
    by_key: dict[tuple, list[int]] = {}
    for i, (attr, lin, f) in enumerate(children):
        if attr in calls:
            key = (calls[attr], lin.in_features, lin.weight.dtype, f, lin.bias is None)
            by_key.setdefault(key, []).append(i)
    return [g for g in by_key.values() if len(g) > 1]


class TandemRMSNorm(nn.Module):
    """A transformers RMSNorm (the Llama-family form: ``weight * (x / rms(x)).to(bf16)``) on
    tandem's fused kernel (``_C.rms_norm_bf16``: one pass per row instead of torch's six ops
    and two casts) for bf16 CPU inputs; any other input goes to the module it replaces.
    ``replace_norms`` swaps a norm only after checking on a probe that this kernel computes
    what that module computes."""

    def __init__(self, norm: nn.Module, eps: float, name: str) -> None:
        super().__init__()
        # The module's own weight Parameter, under the same name: state_dict keys, .to() and
        # the module kept for other inputs (not registered, so not a second copy) all see it.
        self.weight = norm.weight
        object.__setattr__(self, "_inner", norm)
        self.eps = float(eps)
        self.name = name

    @property
    def inner(self) -> nn.Module:
        """The module this one replaced (runs every input the fused kernel does not take)."""
        return self._inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.device.type != "cpu" or x.numel() == 0
                or x.shape[-1] != w.shape[0] or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return self.inner(x)
        from . import _C

        x = x.contiguous()
        y = torch.empty_like(x)
        w = w.contiguous()
        _C.rms_norm_bf16(x.data_ptr(), w.data_ptr(), self.eps, x.numel() // x.shape[-1], x.shape[-1], y.data_ptr())
        return y

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, fused (tandem)"


def _norm_eps(mod: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(mod, attr, None)
        if isinstance(v, float):
            return v
    return None


def replace_norms(model: nn.Module) -> list[str]:
    """Swaps the model's bf16 CPU RMSNorm modules for ``TandemRMSNorm`` where the fused kernel
    computes what the module does: each candidate (a module whose class name ends in
    "RMSNorm", with a 1-D bf16 ``weight`` and an epsilon) is run on a probe of random rows
    (several magnitudes) both ways, and replaced only if every output agrees within one bf16
    rounding (the kernel sums the squares in another order than torch). Other forms (Gemma's
    ``1 + weight``, norms in fp32, LayerNorms) fail the probe and stay in torch. Returns the
    names replaced."""
    todo = []
    for name, mod in model.named_modules():
        for child_name, child in mod.named_children():
            if not type(child).__name__.endswith("RMSNorm") or isinstance(child, TandemRMSNorm):
                continue
            w = getattr(child, "weight", None)
            eps = _norm_eps(child)
            if (not isinstance(w, torch.Tensor) or w.dim() != 1 or w.dtype != torch.bfloat16
                    or w.device.type != "cpu" or eps is None):
                continue
            todo.append((mod, child_name, f"{name}.{child_name}" if name else child_name, child, eps))
    done: list[str] = []
    checked: dict[tuple, bool] = {}
    g = torch.Generator().manual_seed(0)
    for parent, attr, full, child, eps in todo:
        fused = TandemRMSNorm(child, eps, full)
        n = child.weight.shape[0]
        key = (type(child), n, eps)  # one probe per kind and size (the weight is the module's own)
        if key not in checked:
            probe = torch.randn(4, n, generator=g) * torch.tensor([[1e-3], [1.0], [30.0], [1.0]])
            probe = probe.to(torch.bfloat16)
            with torch.no_grad():
                want, got = child(probe), fused(probe)
            ok = want.dtype == got.dtype and want.shape == got.shape
            if ok:
                diff = (got.float() - want.float()).abs()
                ok = bool((diff <= want.float().abs() * 2.0 ** -7 + 1e-30).all())
            checked[key] = ok
        if checked[key]:
            setattr(parent, attr, fused)
            done.append(full)
    return done


def dense_choice(fmt: str, weight_dtype: torch.dtype) -> str | None:
    """The format a layer with weights of `weight_dtype` gets under ``cpu.dense_format``
    `fmt`, or None for torch."""
    if fmt not in DENSE_FORMATS:
        raise ValueError(f"cpu.dense_format: {fmt!r} is not one of: {', '.join(DENSE_FORMATS)}")
    if fmt == "torch":
        return None
    if fmt == "auto":
        return "bf16" if weight_dtype == torch.bfloat16 else None
    return fmt


def replace_dense(model: nn.Module, engine: Any, cpu_cfg: dict, keep: set[int] | None = None,
                  fuse: bool = True) -> dict[str, str]:
    """Swaps the model's CPU ``nn.Linear`` layers for ``TandemLinear`` under
    ``cpu_cfg['dense_format']``; `keep`: ids of modules left alone (routers). Returns
    {module name: format} of the layers replaced. Tied weights (lm_head tied to the
    embeddings) are packed like any other: the embedding keeps its own tensor.

    Sibling layers that their module's forward calls on the same variable (q/k/v, an MLP's
    gate and up, MLA's q_a / kv_a projections; read from the forward's source) share one
    packed weight (``TandemLinear.fused``), unless `fuse` is False."""
    fmt = cpu_cfg.get("dense_format", "auto")
    keep = keep or set()
    todo = []
    for name, mod in model.named_modules():
        children = []
        for child_name, child in mod.named_children():
            if type(child) is not nn.Linear or id(child) in keep:
                continue
            if child.weight.device.type != "cpu":
                continue
            f = dense_choice(fmt, child.weight.dtype)
            if f is not None:
                children.append((child_name, child, f))
        groups = _fusable_groups(mod, children) if fuse else []
        grouped = {i for g in groups for i in g}
        full = lambda c: f"{name}.{c}" if name else c  # noqa: E731
        todo += [(mod, [(children[i][0], full(children[i][0]), children[i][1]) for i in g], children[g[0]][2])
                 for g in groups]
        todo += [(mod, [(c, full(c), lin)], f) for i, (c, lin, f) in enumerate(children) if i not in grouped]
    done: dict[str, str] = {}
    opts = dict(group_size=int(cpu_cfg.get("group_size", 128)), zero_point=bool(cpu_cfg.get("zero_point", False)))
    for parent, members, f in todo:
        if len(members) == 1:
            attr, full, child = members[0]
            layers = [TandemLinear(engine, child, f, name=full, **opts)]
        else:
            layers = TandemLinear.fused(engine, [(full, child) for _, full, child in members], f, **opts)
        for (attr, full, _), layer in zip(members, layers):
            setattr(parent, attr, layer)
            done[full] = f
    return done


def describe_dense(model: nn.Module) -> str:
    """One line for the CLI: which linear layers run on tandem's kernels, in which formats."""
    done = getattr(model, "tandem_dense", None)
    if done is None:
        return "dense layers: transformers' own (not CPU inference)"
    if not done:
        return "dense layers: transformers' own (cpu.dense_format torch, or no bf16 weights for auto)"
    counts = Counter(done.values())
    packed = sum(m.packed_bytes for m in model.modules() if isinstance(m, TandemLinear))
    formats = ", ".join(f"{n} {f}" for f, n in sorted(counts.items()))
    norms = getattr(model, "tandem_norms", None)
    fused = f"; {len(norms)} RMSNorms fused" if norms else ""
    routers = getattr(model, "tandem_routers", None)
    fused += f"; {len(routers)} routers" if routers else ""
    return f"dense layers: {len(done)} on tandem's kernels ({formats}; {packed / 2**20:.1f} MiB packed){fused}"


# The activations the gated-MLP path computes (transformers' ACT2FN["silu"] / ["swish"]).
_SILU = frozenset({"SiLU", "SiLUActivation"})


class _GatedMlp:
    """One gated MLP's one-call path (``use_gated_mlps``) and what a call checks first."""

    def __init__(self, mod: nn.Module, gate: TandemLinear, up: TandemLinear, down: TandemLinear, name: str) -> None:
        self.mod, self.name = mod, name
        self.parts = (("gate_proj", gate), ("up_proj", up), ("down_proj", down))
        self.packs = (gate._packed, down._packed)
        self.hidden, self.intermediate = gate.in_features, gate.out_features
        self.enabled = True  # (bench/ab_decode.py turns it off to compare)

    @property
    def dense(self) -> tuple:
        """(gate/up, down): the two packed layers, for tandem.decode_step."""
        return self.packs[0].dense, self.packs[1].dense

    def takes(self, x: torch.Tensor) -> bool:
        from torch.nn.modules import module as torch_module

        if (not self.enabled or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() < 1
                or x.shape[-1] != self.hidden or (torch.is_grad_enabled() and x.requires_grad)):
            return False
        if not all(pk.bf16_on_pool for pk in self.packs):
            return False
        if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
            return False
        mods = self.mod._modules
        return all(mods.get(a) is m and not m._forward_hooks and not m._forward_pre_hooks for a, m in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from . import _C

        x2 = x.reshape(-1, self.hidden).contiguous()
        y = torch.empty_like(x2)
        if x2.shape[0]:
            _C.gated_mlp_bf16(*self.dense, x2.data_ptr(), x2.shape[0], y.data_ptr())
        return y.view(x.shape)


def fused_pair(a: TandemLinear, b: TandemLinear) -> bool:
    """a and b are the two members of one packed weight without biases, a's rows first."""
    pk = a._packed
    return (b._packed is pk and pk.members == 2 and not pk.biases and a._columns == (0, a.out_features)
            and b._columns == (a.out_features, a.out_features + b.out_features))


def _gated_mlp_parts(mod: nn.Module) -> tuple | None:
    gate, up, down = (getattr(mod, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
    if not all(isinstance(t, TandemLinear) for t in (gate, up, down)):
        return None
    n = gate.out_features
    if not (fused_pair(gate, up) and up.out_features == n and down._columns is None and down.bias is None
            and down.in_features == n and down.out_features == gate.in_features):
        return None
    if type(getattr(mod, "act_fn", None)).__name__ not in _SILU:
        return None
    return gate, up, down


def use_gated_mlps(model: nn.Module) -> list[str]:
    """Gives the model's gated MLPs (gate, up, down all ``TandemLinear``, gate and up one
    packed weight, SiLU, no bias) the one-call path of the module docstring, where a probe
    agrees: random rows of several magnitudes through the module's own forward and the path
    must match within 2^-8 of their norm (the path differs from torch only in the
    exponential's last fp32 bit; another activation or form fails by far). One probe per
    class and shape. Returns the names of the MLPs given it."""
    done: list[str] = []
    checked: dict[tuple, bool] = {}
    g = torch.Generator().manual_seed(0)
    for name, mod in model.named_modules():
        if "tandem_mlp" in mod.__dict__:
            continue
        parts = _gated_mlp_parts(mod)
        if parts is None:
            continue
        fast = _GatedMlp(mod, *parts, name)
        module_forward = mod.forward
        key = (type(mod), fast.hidden, fast.intermediate, type(mod.act_fn))
        if key not in checked:
            x = (torch.randn(4, fast.hidden, generator=g) * torch.tensor([[0.1], [1.0], [4.0], [1.0]])).to(torch.bfloat16)
            with torch.no_grad():
                want, got = module_forward(x), fast(x)
            ok = isinstance(want, torch.Tensor) and want.shape == got.shape and want.dtype == got.dtype
            if ok:
                err = (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)
                ok = bool(err <= 2.0 ** -8)
            checked[key] = ok
        if not checked[key]:
            continue

        def forward(x, fast=fast, module_forward=module_forward):
            return fast(x) if fast.takes(x) else module_forward(x)

        mod.forward = forward
        mod.tandem_module_forward = module_forward
        mod.tandem_mlp = fast
        done.append(name)
    return done
