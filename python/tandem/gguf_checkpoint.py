"""GGUF files (llama.cpp's format) as checkpoints: the model a ``.gguf`` describes, its
routed experts read in place by the C++ loader, its other tensors dequantized into torch.

    model = tandem.load_model("/models/Qwen3-235B-A22B-Q4_0-00001-of-00003.gguf", config)

The file is read with the ``gguf`` package (llama.cpp's own reader) and transformers' GGUF
support: the configuration from the file's metadata (``load_gguf_checkpoint``), the names of
the model's tensors from transformers' GGUF name map (``get_gguf_hf_weights_map``). tandem
hands the C++ side a table of every tensor (name as the model calls it, type, shape, byte
range), and the C++ ``Checkpoint`` maps the files and checks each range.

Routed experts (``blk.N.ffn_{gate,up,down}_exps``, [experts, rows, k] each) are packed in place
from their blocks: Q4_0 into int4 with groups of 32 keeps its numbers (nibbles and fp16
scales copied, as for GPTQ); Q8_0 and Q4_1 are decoded exactly and quantized into the
configured format; F32 / F16 / BF16 as any checkpoint's. Other types (the K-quants, IQ types)
are refused for experts, naming the tensor and its type. Non-expert tensors of any type the
``gguf`` package dequantizes are read into the model's dtype, as transformers reads them.

Architectures: those whose GGUF tensors are the transformers model's without reordering
(qwen3moe, qwen2moe). Others (llama-family GGUFs permute q / k rows; DeepSeek's split kv_b)
are refused naming the architecture. A split model (``name-00001-of-00003.gguf``) is opened
from any of its files.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import _C

# GGUF architecture -> transformers model_type, for the architectures whose tensors load
# without reordering (transformers' Qwen2MoeTensorProcessor only renames their experts).
ARCHITECTURES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}
# GGUF metadata transformers' config mapping misses for these (GGUF key suffix -> config key).
_EXTRA_CONFIG = {
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "qwen2moe": {"expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
}
# What llama.cpp computes for these architectures whatever the metadata says (its graphs:
# qwen3moe renormalizes the top-k routing weights, qwen2moe does not); set here rather than
# left to the transformers version's GGUF defaults.
_FIXED_CONFIG = {"qwen3moe": {"norm_topk_prob": True}, "qwen2moe": {"norm_topk_prob": False}}
# Types the C++ table knows by name; any other is "GGML" (bytes only).
_TABLE_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
EXPERT_TYPES = _TABLE_TYPES
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


def _gguf():
    try:
        import gguf
    except ImportError:  # pragma: no cover (a dependency of tandem)
        raise ImportError("reading GGUF files needs the gguf package: pip install gguf") from None
    return gguf


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF model: a ``.gguf`` file, or a directory without config.json
    that holds one (or one split set)."""
    p = Path(path)
    if p.suffix == ".gguf":
        return True
    return p.is_dir() and not (p / "config.json").exists() and any(p.glob("*.gguf"))


def gguf_files(path: str | Path) -> list[Path]:
    """The files of the GGUF model at `path` (a file, any file of a split set, or a directory
    holding one model), in split order; ValueError naming what is missing or ambiguous."""
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("*.gguf"))
        firsts = [f for f in found if not _SPLIT.match(f.name) or _SPLIT.match(f.name)["i"] == "00001"]
        if len(firsts) != 1:
            raise ValueError(f"{p}: {len(firsts)} GGUF models in the directory ({', '.join(f.name for f in firsts[:4])});"
                             " name the .gguf file to load")
        p = firsts[0]
    if not p.is_file():
        raise ValueError(f"{p}: no such GGUF file")
    m = _SPLIT.match(p.name)
    if not m:
        return [p]
    n, i = int(m["n"]), int(m["i"])
    if not 1 <= i <= n:
        raise ValueError(f"{p}: a split GGUF file's name says part {i} of {n}")
    files = [p.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{p}: part of a model split into {n} files, but {', '.join(missing[:3])} "
                         f"{'is' if len(missing) == 1 else 'are'} missing from {p.parent}")
    return files


class GGUFModel:
    """The files of one GGUF model, read with the ``gguf`` package (see the module doc)."""

    def __init__(self, path: str | Path):
        gguf = _gguf()
        self.files = gguf_files(path)
        self.path = self.files[0]
        self.readers = []
        for f in self.files:
            try:
                self.readers.append(gguf.GGUFReader(str(f)))
            except Exception as e:  # noqa: BLE001 (any failure to parse is about the file: one line naming it)
                raise ValueError(f"{f}: not a readable GGUF file ({type(e).__name__}: {e})") from None
        for f, r in zip(self.files, self.readers):
            if r.byte_order != "I":  # the C++ side reads the experts' bytes as they are: little-endian
                raise ValueError(f"{f}: a big-endian GGUF file; tandem reads little-endian ones (convert it again "
                                 "without --bigendian)")
        self.arch = self._field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"{self.path}: GGUF architecture {self.arch!r} is not supported (tandem reads "
                             f"{', '.join(sorted(ARCHITECTURES))}: GGUF files whose tensors are the transformers "
                             "model's as they are; convert the original checkpoint's safetensors instead)")
        count = self._field("split.count", None)
        if count is not None and int(count) != len(self.files):
            raise ValueError(f"{self.path}: its metadata says the model is split into {count} files, the file name "
                             f"says {len(self.files)}")
        self.tensors: dict[str, Any] = {}   # GGUF name -> the gguf package's ReaderTensor
        self.file_of: dict[str, int] = {}
        for i, r in enumerate(self.readers):
            for t in r.tensors:
                if t.name in self.tensors:
                    raise ValueError(f"{self.files[i]}: tensor {t.name!r} is also in {self.files[self.file_of[t.name]]}")
                self.tensors[t.name] = t
                self.file_of[t.name] = i
        self.hf_names: dict[str, str] = {}  # model (table) name -> GGUF name, set by checkpoint()

    def _field(self, key: str, default: Any = ...) -> Any:
        f = self.readers[0].fields.get(key)
        if f is None:
            if default is ...:
                raise ValueError(f"{self.path}: GGUF metadata has no {key!r}")
            return default
        v = f.contents()
        return v

    def config(self) -> Any:
        """The transformers config of the model: transformers' own reading of the metadata, plus
        the sizes its mapping misses for this architecture (the experts' width)."""
        from transformers import AutoConfig
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        try:
            cfg = dict(load_gguf_checkpoint(str(self.path), return_tensors=False)["config"])
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{self.path}: transformers cannot read the GGUF metadata: {type(e).__name__}: {e}") from None
        for suffix, key in _EXTRA_CONFIG[self.arch].items():
            v = self._field(f"{self.arch}.{suffix}", None)
            if v is not None:
                cfg[key] = int(v)
        cfg.update(_FIXED_CONFIG[self.arch])
        # transformers looks for output.weight in the first file only; a split model may hold
        # it in another (then tying lm_head to the embeddings would drop it).
        cfg["tie_word_embeddings"] = "output.weight" not in self.tensors
        cfg["model_type"] = ARCHITECTURES[self.arch]
        cfg.pop("_model_name_or_path", None)
        emb = self.tensors.get("token_embd.weight")
        cfg.setdefault("dtype", "float32" if emb is not None and emb.tensor_type.name == "F32" else "bfloat16")
        try:
            return AutoConfig.for_model(**cfg)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{self.path}: the GGUF metadata gives no valid {cfg['model_type']} config: "
                             f"{type(e).__name__}: {e}") from None

    def checkpoint(self, model: nn.Module) -> _C.Checkpoint:
        """The C++ checkpoint of these files, tensors named as `model` (built from config())
        calls them; routed experts as [experts, rows, k] tensors ``<experts>.gate_proj``,
        ``.up_proj``, ``.down_proj`` (the loader's separate fused layout); a tensor transformers
        does not map keeps its GGUF name (and the loader refuses it as unused)."""
        from transformers.modeling_gguf_pytorch_utils import Qwen2MoeTensorProcessor, get_gguf_hf_weights_map

        mapping = get_gguf_hf_weights_map(model, Qwen2MoeTensorProcessor(config=model.config.to_dict()))
        shapes = {n: tuple(t.shape) for n, t in list(model.named_parameters()) + list(model.named_buffers())}
        tables: list[list[tuple]] = [[] for _ in self.files]
        for name, t in self.tensors.items():
            hf = mapping.get(name, name)
            if m := _EXPERTS.fullmatch(name):
                stem = hf.rsplit(".", 1)[0] if name in mapping else f"model.layers.{m[1]}.mlp.experts"
                hf = f"{stem}.{m[2]}_proj"
            shape = [int(d) for d in reversed(list(t.shape))]  # GGUF lists dimensions innermost first
            want = shapes.get(hf)
            if want is not None and len(shape) == 1 and list(want) == [1, shape[0]]:
                shape = [1, shape[0]]  # qwen2moe's shared-expert gate: [H] in GGUF, [1, H] in the model
            kind = t.tensor_type.name if t.tensor_type.name in _TABLE_TYPES else "GGML"
            begin = int(t.data_offset)
            tables[self.file_of[name]].append((hf, kind, shape, begin, begin + int(t.n_bytes)))
            self.hf_names[hf] = name
        return _C.Checkpoint.from_tables(str(self.path), [str(f) for f in self.files], tables, "GGUF")

    def read(self, hf_name: str, shape: list[int]) -> torch.Tensor:
        """Tensor `hf_name` dequantized by the gguf package (fp32, or the file's float type)."""
        gguf = _gguf()
        name = self.hf_names[hf_name]
        t = self.tensors[name]
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ValueError(f"{self.files[self.file_of[name]]}: tensor {name!r} has GGUF type {t.tensor_type.name}, "
                             "which the gguf package cannot dequantize") from None
        return torch.from_numpy(w.copy()).reshape(shape)


def check_expert_types(g: GGUFModel) -> None:
    """Refuses expert tensors of a type the C++ packers do not read, naming the first."""
    for name, t in g.tensors.items():
        if _EXPERTS.fullmatch(name) and t.tensor_type.name not in EXPERT_TYPES:
            raise ValueError(f"{g.files[g.file_of[name]]}: routed-expert tensor {name!r} is GGUF type "
                             f"{t.tensor_type.name}; tandem packs experts from {', '.join(EXPERT_TYPES)} (Q4_0 kept as "
                             "int4 groups of 32; Q8_0 / Q4_1 decoded and quantized into cpu.format); use a GGUF "
                             "quantized to one of those, or the original checkpoint")


def check_experts_present(g: GGUFModel, layers: list[int]) -> None:
    """Every MoE layer's three expert tensors are in the files (else ValueError naming the first
    missing one by its GGUF name)."""
    for L in layers:
        for p in ("gate", "up", "down"):
            name = f"blk.{L}.ffn_{p}_exps.weight"
            if name not in g.tensors:
                raise ValueError(f"{g.path}: model layer {L} is a MoE layer, but the GGUF model has no {name!r}")


def load_tokenizer(model: str | Path):
    """The tokenizer of checkpoint directory or GGUF model `model` (a GGUF file's own
    vocabulary, converted by transformers)."""
    from transformers import AutoTokenizer

    if not is_gguf(model):
        return AutoTokenizer.from_pretrained(model)
    path = gguf_files(model)[0]
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{path}: transformers cannot build a tokenizer from the GGUF file's vocabulary "
                         f"({type(e).__name__}: {e})") from None


def load_config(model: str | Path) -> Any:
    """The transformers config of checkpoint directory or GGUF model `model`."""
    from transformers import AutoConfig

    return GGUFModel(model).config() if is_gguf(model) else AutoConfig.from_pretrained(model)


# The cpu.format that holds a GGUF expert type's values at about its size.
_KEEPS = {"Q4_0": "int4 with group_size 32 keeps their values exactly",
          "Q4_1": "int4 with group_size 32 and zero_point holds them at their size (quantized again)",
          "Q8_0": "int8 holds them at their size (quantized again, one scale per row)",
          "F16": "bf16 holds them at their size", "BF16": "bf16 keeps them", "F32": "bf16 holds them at half their size"}
_BITS = {"Q4_0": 4.5, "Q4_1": 5.0, "Q8_0": 8.5, "F16": 16, "BF16": 16, "F32": 32}
_FORMAT_BITS = {"bf16": 16, "int8": 8, "mxfp4": 4.25}


def expert_size_note(g: GGUFModel, cpu: dict) -> str | None:
    """A warning when cpu.format packs the file's experts much larger than the file holds them
    (a Q4_0 model packed as bf16 needs 3.6x the memory), naming the format that keeps them."""
    types = {t.tensor_type.name for n, t in g.tensors.items() if _EXPERTS.fullmatch(n)}
    if not types:
        return None
    fmt = cpu.get("format", "bf16")
    bits = _FORMAT_BITS.get(fmt) or 4 + 16 / int(cpu.get("group_size", 128))
    src = max(_BITS.get(t, 16) for t in types)
    if bits <= 1.5 * src:
        return None
    kind = sorted(types, key=lambda t: _BITS.get(t, 16))[-1]
    if kind == "Q4_1" and fmt == "int8":
        return None  # the accurate choice for Q4_1 (int4's integer zero points cannot hold its offsets)
    return (f"{g.path}: its experts are {kind} ({src:g} bits a weight) and cpu.format {fmt} packs them at {bits:g} "
            f"bits ({bits / src:.1f}x the memory); cpu.format {_KEEPS.get(kind, 'int8 holds them at their size')}")
