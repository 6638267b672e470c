"""4-bit GPTQ checkpoints through load_model (issue 19): the routed experts packed from their
nibbles, scales and zero points (int4 of the checkpoint's group keeps their exact values;
other formats re-quantize those values), every other GPTQ layer dequantized into torch.

The checkpoints are written here in the documented GPTQ layout (AutoGPTQ / GPTQModel's
original "gptq" format: int32 qweight [k/8, n], int32 qzeros [groups, n/8] holding zero - 1,
fp16 scales [groups, n], g_idx) from a random transformers model quantized round-to-nearest;
no GPTQ library is installable here (they need CUDA), so the layout's reader is checked
against that writer and against the formula. The reference is transformers running the
dequantized weights in fp32: what a GPTQ checkpoint means.
"""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

import tandem
from tandem.checkpoint_reader import dequantize_awq, dequantize_gptq, dequantize_packed

from hf_models import VOCAB, build, clean_tokens, max_rel, record_routing

QUANTIZED = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight$")
GROUP = 32


def quantize(w: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit in groups along k of w [n, k]: (q [n, k], zero [n, groups], fp16
    scale [n, groups], the dequantized weight)."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    if sym:
        scale = (g.abs().amax(-1) / 7).clamp_min(1e-8)
        zero = torch.full_like(scale, 8, dtype=torch.int32)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp_min(1e-8)
        zero = (-lo / scale).round().clamp(0, 15).to(torch.int32)
    scale = scale.half()
    q = ((g / scale.float().unsqueeze(-1)).round() + zero.unsqueeze(-1)).clamp(0, 15).to(torch.int32).view(n, k)
    deq = scale.float().repeat_interleave(GROUP, 1) * (q - zero.repeat_interleave(GROUP, 1)).float()
    return q, zero, scale, deq


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values in [0, 15] -> int32 [...] with value i in nibble i (two's complement)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    w = (nibbles.to(torch.int64) << shifts).sum(-1)
    return ((w + 2**31) % 2**32 - 2**31).to(torch.int32)


def write_layout(layout: str, name: str, q, zero, scale, sym: bool) -> dict[str, torch.Tensor]:
    """The tensors a `layout` checkpoint stores for weight `name` ("x.weight")."""
    n, k = q.shape
    base = name[: -len(".weight")]
    if layout == "gptq":  # qweight [k/8, n]; qzeros [groups, n/8] hold zero - 1
        return {f"{base}.qweight": _words(q.t().reshape(k // 8, 8, n).transpose(1, 2)),
                f"{base}.qzeros": _words(((zero - 1) & 15).t().reshape(k // GROUP, n // 8, 8)),
                f"{base}.scales": scale.t().contiguous(),
                f"{base}.g_idx": torch.arange(k, dtype=torch.int32) // GROUP}
    if layout == "awq":  # qweight [k, n/8], AWQ's nibble order; qzeros [groups, n/8]; scales [groups, n]
        order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
        return {f"{base}.qweight": _words(q.t().reshape(k, n // 8, 8)[..., order]),
                f"{base}.qzeros": _words(zero.t().reshape(k // GROUP, n // 8, 8)[..., order]),
                f"{base}.scales": scale.t().contiguous()}
    # compressed-tensors pack-quantized, packed by the library itself: signed values
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out = {f"{name}_packed": pack_to_int32((q - 8).to(torch.int8), 4),
           f"{name}_scale": scale.to(torch.bfloat16),
           f"{name}_shape": torch.tensor([n, k])}
    if not sym:
        out[f"{name}_zero_point"] = pack_to_int32((zero - 8).to(torch.int8), 4, packed_dim=0)
    return out


def quant_config(layout: str, sym: bool) -> dict:
    if layout == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": sym,
                "checkpoint_format": "gptq"}
    if layout == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group", "group_size": GROUP,
                "actorder": None}}}, "ignore": ["lm_head"]}


@pytest.fixture(scope="module")
def gptq(tmp_path_factory):
    """(layout, sym) -> (quantized checkpoint dir, reference dir of the dequantized fp32 weights).
    compressed-tensors scales are bf16: its reference uses the bf16-rounded scales."""
    from safetensors.torch import load_file, save_file

    cache = {}

    def get(sym: bool, layout: str = "gptq"):
        if (layout, sym) not in cache:
            root = tmp_path_factory.mktemp(f"{layout}-{'sym' if sym else 'asym'}")
            build("qwen3_moe", 1, torch.float32, root / "fp32")
            state = load_file(root / "fp32" / "model.safetensors")
            quant, ref = {}, {}
            for name, t in state.items():
                if QUANTIZED.search(name):
                    q, zero, scale, deq = quantize(t, sym)
                    if layout == "compressed-tensors":
                        s16 = scale.to(torch.bfloat16).float()
                        deq = s16.repeat_interleave(GROUP, 1) * (q - zero.repeat_interleave(GROUP, 1)).float()
                    quant.update(write_layout(layout, name, q, zero, scale, sym))
                    ref[name] = deq
                else:
                    quant[name] = ref[name] = t
            for d in ("q", "ref"):
                (root / d).mkdir()
                for f in ("config.json", "generation_config.json"):
                    if (root / "fp32" / f).exists():
                        shutil.copy(root / "fp32" / f, root / d / f)
            save_file(quant, root / "q" / "model.safetensors", metadata={"format": "pt"})
            save_file(ref, root / "ref" / "model.safetensors", metadata={"format": "pt"})
            cfg = json.loads((root / "q" / "config.json").read_text())
            cfg["quantization_config"] = quant_config(layout, sym)
            (root / "q" / "config.json").write_text(json.dumps(cfg))
            cache[layout, sym] = root
        return cache[layout, sym] / "q", cache[layout, sym] / "ref"

    return get


def cfg(fmt: str, zero_point: bool = False) -> dict:
    cpu = {"threads": 2, "format": fmt}
    if fmt == "int4":
        cpu.update(group_size=GROUP, zero_point=zero_point)
    return {"version": 1, "cpu": cpu, "gpu": {"device": "none"}}


def test_the_readers_match_the_writers(seed):
    w = torch.randn(48, 128)
    for sym in (True, False):
        q, zero, scale, deq = quantize(w, sym)
        p = write_layout("gptq", "w.weight", q, zero, scale, sym)
        assert torch.equal(dequantize_gptq(p["w.qweight"], p["w.qzeros"], p["w.scales"], p["w.g_idx"], "w"), deq)
        p = write_layout("awq", "w.weight", q, zero, scale, sym)
        assert torch.equal(dequantize_awq(p["w.qweight"], p["w.qzeros"], p["w.scales"], "w"), deq)
        p = write_layout("compressed-tensors", "w.weight", q, zero, scale, sym)
        s16 = scale.to(torch.bfloat16).float()
        want = s16.repeat_interleave(GROUP, 1) * (q - zero.repeat_interleave(GROUP, 1)).float()
        got = dequantize_packed(p["w.weight_packed"], p["w.weight_scale"], p.get("w.weight_zero_point"), "w")
        assert torch.equal(got, want)
        # ... and the library's own unpacking agrees with the layout read here.
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        assert torch.equal(unpack_from_int32(p["w.weight_packed"], 4, torch.Size(q.shape)).int() + 8, q)


# Bounds on the max relative logit error over tokens routed alike (as in test_adapters.py): the
# expert weights are the checkpoint's exactly in int4 (error from int8 activations), rounded
# to bf16 in bf16, re-quantized in int8 (plus int8 activations).
@pytest.mark.parametrize("layout,sym", [("gptq", True), ("gptq", False), ("awq", False),
                                        ("compressed-tensors", True), ("compressed-tensors", False)])
@pytest.mark.parametrize("fmt,bound", [("int4", 6e-2), ("bf16", 1.5e-2), ("int8", 6e-2)])
def test_a_quantized_checkpoint_computes_its_dequantized_weights(gptq, layout, sym, fmt, bound, seed):
    from transformers import AutoModelForCausalLM

    path, ref_path = gptq(sym, layout)
    ref = AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval()
    ours = tandem.load_model(path, cfg(fmt, zero_point=not sym), dtype=torch.float32, progress=False)
    ids = torch.randint(0, VOCAB, (8, 8), generator=torch.Generator().manual_seed(seed))
    ra, rb = record_routing(ref), record_routing(ours)
    with torch.no_grad():
        want, got = ref(input_ids=ids).logits, ours(input_ids=ids).logits
    clean = clean_tokens(ra, rb, *ids.shape)
    assert clean.float().mean() >= 0.25, f"routing differs for most tokens ({(~clean).sum().item()})"
    err = max_rel(got, want, clean)
    print(f"{layout} {'sym' if sym else 'zero points'} as {fmt}: clean {clean.sum().item()}/{clean.numel()}, "
          f"max rel err {err:.2e}")
    assert err <= bound
    # The attention weights are the dequantized ones, exactly as the reference holds them.
    assert torch.equal(ours.model.layers[1].self_attn.q_proj.weight, ref.model.layers[1].self_attn.q_proj.weight)


def test_a_gptq_store_holds_the_same_packs(gptq, tmp_path, seed):
    path, _ = gptq(False)
    c = cfg("int4", zero_point=True)
    tandem.convert(path, c, out=tmp_path / "s", progress=False)
    direct = tandem.load_model(path, c, progress=False)
    stored = tandem.load_model(path, c, store=tmp_path / "s", progress=False)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        assert torch.equal(direct(input_ids=ids).logits, stored(input_ids=ids).logits)


def test_what_cannot_be_read_is_refused(gptq, tmp_path):
    path, _ = gptq(False)
    with pytest.raises(ValueError, match=r"has zero point \d+; symmetric int4 holds zero point 8 only.*"
                                         r"cpu.zero_point: true"):
        tandem.load_model(path, cfg("int4", zero_point=False), progress=False)
    for edit, message in ((dict(bits=8), "GPTQ with bits = 8; tandem reads 4-bit GPTQ only"),
                          (dict(checkpoint_format="gptq_v2"), "checkpoint_format 'gptq_v2'"),
                          (dict(quant_method="bitsandbytes"), "quant_method 'bitsandbytes' is not supported")):
        d = tmp_path / next(iter(edit.values())).__str__()
        shutil.copytree(path, d)
        c = json.loads((d / "config.json").read_text())
        c["quantization_config"].update(edit)
        (d / "config.json").write_text(json.dumps(c))
        with pytest.raises(ValueError, match=message):
            tandem.load_model(d, cfg("bf16"), progress=False)
