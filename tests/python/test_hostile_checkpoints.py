"""Checkpoints that are wrong in ways stock from_pretrained only warns about (or misses):
each is refused by tandem.load_model with a one-line message naming the file and the problem,
before a model is half built (issue 25: checkpoint integrity)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import tandem

from hf_models import build
from test_hf_inference import cfg, rewrite


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(kind, "fp32") -> (checkpoint dir, None): one tiny fp32 checkpoint per kind for the module."""
    cache = {}

    def get(kind: str, dtype: str):
        if kind not in cache:
            cache[kind] = tmp_path_factory.mktemp(kind)
            build(kind, 1, torch.float32, cache[kind])
        return cache[kind], None

    return get


def edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    c = json.loads((dst / "config.json").read_text())
    c.update(changes)
    (dst / "config.json").write_text(json.dumps(c))
    return dst


@pytest.mark.parametrize("key", ["model.layers.1.self_attn.q_proj.weight", "model.embed_tokens.weight",
                                 "model.layers.2.mlp.experts.3.gate_proj.weight"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_on_every_path(models, tmp_path, key, value):
    from safetensors.torch import load_file

    path, _ = models("qwen3_moe", "fp32")
    t = load_file(path / "model.safetensors")[key].clone()
    t.view(-1)[7] = value
    bad = rewrite(path, tmp_path / "m", add={key: t})
    with pytest.raises(ValueError, match=rf"{key}.* non-finite weights are refused") as e:
        tandem.load_model(bad, cfg(), progress=False)
    assert "model.safetensors" in str(e.value)


def test_a_tied_tensor_the_checkpoint_holds_must_match(models, tmp_path):
    """With tie_word_embeddings the checkpoint's lm_head would be replaced by the embedding: a
    NaN (or any other value) there must not vanish silently."""
    from safetensors.torch import load_file

    path, _ = models("qwen3_moe", "fp32")
    sd = load_file(path / "model.safetensors")
    tied = edit_config(path, tmp_path / "tied", tie_word_embeddings=True)
    with pytest.raises(ValueError, match="ties 'lm_head.weight' to another weight.*holds different values"):
        tandem.load_model(tied, cfg(), progress=False)
    nan = sd["lm_head.weight"].clone()
    nan[0, 0] = float("nan")
    with pytest.raises(ValueError, match="lm_head.weight.*non-finite"):
        tandem.load_model(rewrite(tied, tmp_path / "nan", add={"lm_head.weight": nan}), cfg(), progress=False)
    same = rewrite(tied, tmp_path / "same", add={"lm_head.weight": sd["model.embed_tokens.weight"].clone()})
    tandem.load_model(same, cfg(), progress=False)  # equal values: nothing is lost


def test_fp8_weights_without_their_scales_are_refused(models, tmp_path):
    path, _ = models("qwen3_moe", "fp32")
    from safetensors.torch import load_file

    sd = load_file(path / "model.safetensors")
    for key in ("model.layers.1.self_attn.o_proj.weight", "model.layers.0.mlp.experts.2.down_proj.weight"):
        bad = rewrite(path, tmp_path / key.replace(".", "_"), add={key: sd[key].to(torch.float8_e4m3fn)})
        with pytest.raises(ValueError, match=rf"{key}.*F8_E4M3 but .*has no '?{key}_scale_inv"):
            tandem.load_model(bad, cfg(), progress=False)


def test_config_json_must_describe_the_checkpoint(models, tmp_path):
    path, _ = models("qwen3_moe", "fp32")
    with pytest.raises(ValueError, match=r"num_hidden_layers = 2, but the checkpoint holds layers up to 2"):
        tandem.load_model(edit_config(path, tmp_path / "fewer", num_hidden_layers=2), cfg(), progress=False)
    with pytest.raises(ValueError, match=r"num_hidden_layers = 5, but the checkpoint has no tensors of layer 3, 4"):
        tandem.load_model(edit_config(path, tmp_path / "more", num_hidden_layers=5), cfg(), progress=False)


# (config.json key, value, what the message names: transformers maps num_local_experts to num_experts)
ABSURD = [("num_hidden_layers", 3_000_000_000, "num_hidden_layers"), ("num_local_experts", 2_000_000_000, "num_experts"),
          ("hidden_size", 10**12, "hidden_size"), ("vocab_size", -5, "vocab_size"),
          ("num_attention_heads", "four", "num_attention_heads"), ("num_experts_per_tok", 9, "num_experts_per_tok")]


def test_absurd_config_values_fail_fast(models, tmp_path):
    """Each in a child process with a deadline: before the bounds, a layer or expert count in the
    billions made transformers build for minutes (a hang, not an error)."""
    import subprocess
    import sys

    path, _ = models("qwen3_moe", "fp32")
    dirs = [str(edit_config(path, tmp_path / f"m{i}", **{k: v})) for i, (k, v, _) in enumerate(ABSURD)]
    code = ("import sys, tandem\n"
            "for d in sys.argv[1:]:\n"
            "    try:\n"
            "        tandem.load_model(d, {'version': 1, 'cpu': {'threads': 1}}, progress=False)\n"
            "        print('LOADED', d)\n"
            "    except ValueError as e:\n"
            "        print('ERROR', str(e).splitlines()[0])\n")
    out = subprocess.run([sys.executable, "-c", code, *dirs], capture_output=True, text=True, timeout=180)
    lines = [l for l in out.stdout.splitlines() if l.startswith(("ERROR", "LOADED"))]
    assert len(lines) == len(ABSURD), out.stdout + out.stderr
    for (key, value, named), line in zip(ABSURD, lines):
        assert line.startswith("ERROR") and "config.json" in line and named in line, (key, value, line)


def test_config_json_that_is_not_json_names_the_file(models, tmp_path):
    path, _ = models("qwen3_moe", "fp32")
    shutil.copytree(path, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_bytes(b'{"model_type": "qwen3_moe", \xff\xfe}')
    with pytest.raises(ValueError, match=r"config.json"):
        tandem.load_model(tmp_path / "m", cfg(), progress=False)


def test_quantized_non_expert_weights_without_their_scheme_are_refused(models, tmp_path):
    """An INT8 attention weight was cast to float as it stood (values -128..127, no scales)."""
    from safetensors.torch import load_file

    path, _ = models("qwen3_moe", "fp32")
    key = "model.layers.1.self_attn.o_proj.weight"
    w = load_file(path / "model.safetensors")[key]
    bad = rewrite(path, tmp_path / "int8", add={key: (w * 100).round().clamp(-128, 127).to(torch.int8)})
    with pytest.raises(ValueError, match=rf"model.safetensors: tensor '{key}' is int8: quantized non-expert weights "
                                         r"are not supported"):
        tandem.load_model(bad, cfg(), progress=False)


def test_fp8_scales_are_checked_and_applied_as_the_expert_loader_does(models, tmp_path):
    """FP8 E5M2 needs its scales as E4M3 does; a scale grid no block size fits is refused; and
    a 300-row weight with a 3-row grid uses 128-row blocks (the C++ rule), not 100."""
    from safetensors.torch import load_file

    from tandem.checkpoint_reader import block_size, dequantize_fp8

    path, _ = models("qwen3_moe", "fp32")
    sd = load_file(path / "model.safetensors")
    key = "model.layers.1.self_attn.o_proj.weight"
    bad = rewrite(path, tmp_path / "e5m2", add={key: sd[key].to(torch.float8_e5m2)})
    with pytest.raises(ValueError, match=rf"'{key}' is F8_E5M2 but the checkpoint has no '{key}_scale_inv'"):
        tandem.load_model(bad, cfg(), progress=False)
    rows, cols = sd[key].shape
    wrong = rewrite(path, tmp_path / "grid", add={key: sd[key].to(torch.float8_e4m3fn),
                                                  f"{key}_scale_inv": torch.ones(rows + 1, 1)})
    with pytest.raises(ValueError, match=rf"{key}_scale_inv has shape \[{rows + 1}, 1\].*at most one per element"):
        tandem.load_model(wrong, cfg(), progress=False)
    assert block_size(300, 3) == 128 and block_size(256, 2) == 128 and block_size(100, 3) == 34
    w = torch.ones(300, 4, dtype=torch.float8_e4m3fn)
    scales = torch.tensor([[1.0], [2.0], [3.0]])
    d = dequantize_fp8(w, scales)
    assert d[127, 0] == 1 and d[128, 0] == 2 and d[255, 0] == 2 and d[256, 0] == 3
