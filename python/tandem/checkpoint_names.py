"""Which checkpoint tensor holds which model tensor, by transformers' own conversion rules.

transformers v5 models keep names that checkpoints do not always have: a module renamed
(Mixtral's ``block_sparse_moe`` is the model's ``mlp``, PhiMoE's ``gate`` its ``router``) and
routed experts fused into ``experts.gate_up_proj`` / ``experts.down_proj`` where checkpoints
hold one tensor per expert. ``transformers.conversion_mapping`` lists those rules per model
type (``WeightRenaming``: checkpoint pattern -> model name; ``WeightConverter``: per-expert
patterns -> a fused tensor). `CheckpointNames` runs them backwards:

- ``key(model_name)``: the checkpoint's name of a model tensor (its own name first, then the
  renamings undone), or None;
- ``concatenated(model_name)``: for a tensor transformers builds by concatenating several
  checkpoint tensors (a ``WeightConverter`` with one ``Concatenate`` operation, e.g.
  Kimi-Linear's ``conv1d`` from ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``), their keys and
  the dimension, or None;
- ``experts(module_path, layer)``: the (gate, up, down) per-expert name patterns of one MoE
  layer's routed experts, with ``{L}`` for the layer and ``{E}`` for the expert, as the C++
  loader takes them (the converters' per-expert patterns, else the common ``gate_proj /
  up_proj / down_proj`` and ``w1 / w3 / w2`` namings), checked against the checkpoint; or,
  for experts stored fused (transformers v5's ``experts.gate_up_proj`` / ``down_proj``),
  (gate_up, gate_up, down) patterns without ``{E}`` (``is_fused``), or (gate, up, down)
  without ``{E}`` for one tensor per projection of all experts (a GGUF model's).

No hand list per family: a model type transformers has rules for gets them.
"""
from __future__ import annotations

import re
from itertools import combinations

from . import _C

# Per-expert projection names tried when transformers gives no converter for the type.
_COMMON_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
# Names of fused experts tensors (transformers v5 saved with save_original_format=False,
# or families that store them fused).
_FUSED = ("gate_up_proj", "down_proj")
# All experts' gate, up and down, one tensor each (a GGUF file's, as gguf_checkpoint names them).
_SEPARATE = ("gate_proj", "up_proj", "down_proj")


def _literal(pattern: str) -> str | None:
    """A rename pattern as the plain text it matches, or None when it is a real regex."""
    text = re.sub(r"\\(.)", r"\1", pattern)
    return None if re.search(r"[*+?\[\]()^$|{}]", text) else text


def _mapping(model_type: str) -> list:
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # pragma: no cover (older transformers: no rules, exact names only)
        return []
    try:
        return list(get_checkpoint_conversion_mapping(model_type) or [])
    except Exception:  # noqa: BLE001 (a type without rules)
        return []


def _present(ckpt: _C.Checkpoint, name: str) -> bool:
    """The checkpoint holds weight `name`, as it is or 4-bit quantized (GPTQ / AWQ / compressed-tensors)."""
    return name in ckpt or bool(_C.expert_tensor_names(ckpt, name))


def is_fused(naming: tuple[str, str, str]) -> bool:
    """Whether expert name patterns (from ``CheckpointNames.experts``) name fused tensors."""
    return "{E}" not in naming[0]


class CheckpointNames:
    """Checkpoint names for a model of `model_type` loaded from `ckpt` (see the module doc)."""

    def __init__(self, model_type: str, ckpt: _C.Checkpoint, where: str = "the checkpoint"):
        self.model_type, self.ckpt, self.where = model_type, ckpt, where
        self.renames: list[tuple[str, str]] = []   # (model text, checkpoint text)
        self._renamed: dict[str, str] | None = None  # model name -> checkpoint key (_forward)
        self.expert_suffixes: list[tuple[str, str, str]] = []
        self.concats: list[tuple[str, list[str], int]] = []  # (model suffix, checkpoint suffixes, dim)
        gate_up = down = None
        for rule in _mapping(model_type):
            kind = type(rule).__name__
            src, dst = list(getattr(rule, "source_patterns", [])), list(getattr(rule, "target_patterns", []))
            if kind == "WeightRenaming" and len(src) == 1 and len(dst) == 1:
                s, d = _literal(src[0]), _literal(dst[0])
                if s is not None and d is not None and s != d:
                    self.renames.append((d, s))
            elif kind == "WeightConverter" and len(dst) == 1:
                ops = list(getattr(rule, "operations", []))
                literal = [_literal(p) for p in src]
                if (len(ops) == 1 and type(ops[0]).__name__ == "Concatenate" and isinstance(getattr(ops[0], "dim", None), int)
                        and getattr(ops[0], "num_shards_attribute", None) is None and None not in literal
                        and _literal(dst[0]) is not None and len(src) > 1):
                    self.concats.append((_literal(dst[0]), literal, ops[0].dim))
                    continue
                per_expert = [p.split("experts.*.", 1)[1] for p in src if "experts.*." in p]
                if len(per_expert) != len(src):
                    continue
                if dst[0].endswith("experts.gate_up_proj") and len(per_expert) == 2:
                    gate_up = per_expert
                elif dst[0].endswith("experts.down_proj") and len(per_expert) == 1:
                    down = per_expert[0]
        if gate_up and down:
            self.expert_suffixes.append((gate_up[0], gate_up[1], down))
        for g, u, d in _COMMON_EXPERT_NAMES:
            names = (f"{g}.weight", f"{u}.weight", f"{d}.weight")
            if names not in self.expert_suffixes:
                self.expert_suffixes.append(names)

    def candidates(self, name: str) -> list[str]:
        """`name`, then `name` with each applicable renaming undone, then with several."""
        out = [name]
        applicable = [(m, c) for m, c in self.renames if m in name]
        for n in range(1, len(applicable) + 1):
            for combo in combinations(applicable, n):
                alt = name
                for m, c in combo:
                    alt = alt.replace(m, c)
                if alt not in out:
                    out.append(alt)
        return out

    def key(self, name: str) -> str | None:
        """The checkpoint's name of model tensor `name` (None when it holds none): its own
        name or a literal renaming undone, else the checkpoint key that transformers' own
        renaming rules (applied in order, regexes and anchors included) turn into `name`."""
        for alt in self.candidates(name):
            if alt in self.ckpt:
                return alt
        return self._forward().get(name)

    def concatenated(self, name: str) -> tuple[list[str], int] | None:
        """(checkpoint keys, dim) of the tensors transformers concatenates into model tensor
        `name`, each found under its own name or a renaming undone; None when no converter
        builds `name` or the checkpoint lacks a part."""
        for target, parts, dim in self.concats:
            if not name.endswith(target):
                continue
            stem = name[: len(name) - len(target)]
            keys = [self.key(stem + p) for p in parts]
            if None not in keys:
                return keys, dim
        return None

    def _forward(self) -> dict[str, str]:
        """{model name: checkpoint key} for every checkpoint key transformers' renamings change
        (``core_model_loading.apply_renamings``), built once, when first needed."""
        if self._renamed is None:
            self._renamed = {}
            rules = [r for r in _mapping(self.model_type) if type(r).__name__ == "WeightRenaming"]
            try:
                from transformers.core_model_loading import apply_renamings
            except ImportError:  # pragma: no cover (older transformers: the literal renamings only)
                rules = []
            for k in self.ckpt.names() if rules else ():
                try:
                    m = apply_renamings(k, rules)
                except Exception:  # noqa: BLE001 (a rule that cannot take this key: it keeps its name)
                    continue
                if m != k:
                    self._renamed.setdefault(m, k)
        return self._renamed

    def experts(self, module_path: str, layer: int) -> tuple[str, str, str]:
        """(gate, up, down) name patterns of the routed experts at `module_path` (the experts
        module's name in the model, e.g. ``model.layers.3.mlp.experts``) in layer `layer`."""
        marker = f"layers.{layer}."
        if marker not in module_path:
            raise ValueError(f"{module_path}: expected a decoder layer's module (…layers.{layer}.…)")
        pattern = module_path.replace(marker, "layers.{L}.", 1)
        tried = []
        for suffixes in self.expert_suffixes:
            names = tuple(f"{pattern}.{{E}}.{s}" for s in suffixes)
            for alts in zip(*(self.candidates(n) for n in names)):
                if all(_present(self.ckpt, _C.expert_key(a, layer, 0)) for a in alts):
                    return alts
                tried.append(_C.expert_key(alts[0], layer, 0))
        # A gate, an up and a down tensor of all experts ([experts, rows, k]: GGUF's layout,
        # named so by tandem.gguf_checkpoint).
        separate = [f"{module_path}.{p}" for p in _SEPARATE]
        if all(n in self.ckpt for n in separate):
            return tuple(n.replace(marker, "layers.{L}.", 1) for n in separate)
        # Fused: transformers v5's layout (save_original_format=False; some families store it).
        gate_up, down = (self.candidates(f"{module_path}.{part}") for part in _FUSED)
        for gu, dn in zip(gate_up, down):
            if gu in self.ckpt and dn in self.ckpt:
                gu_p, dn_p = (n.replace(marker, "layers.{L}.", 1) for n in (gu, dn))
                return gu_p, gu_p, dn_p
        fused = [a for a in gate_up + down if a in self.ckpt]
        if fused:
            raise ValueError(f"{self.where} holds layer {layer}'s routed experts fused ({fused[0]}) but not both "
                             f"fused tensors ({_FUSED[0]} and {_FUSED[1]} under {module_path})")
        shown = ", ".join(tried[:4]) + (f" and {len(tried) - 4} more" if len(tried) > 4 else "")
        raise ValueError(f"{self.where} has no routed experts for layer {layer} under the names "
                         f"transformers gives {self.model_type} (tried {shown})")
