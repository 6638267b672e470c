"""Every MoE model type of the installed transformers through `tandem.load_model` (issue 18).

For each causal-LM model type whose config has routed experts: build a tiny random model
(`tiny_config`: small sizes, fixed seed), save it with `save_pretrained` (the original
checkpoint format, one tensor per expert), load it with `tandem.load_model` and with
`from_pretrained`, and compare logits. The reference is the stock model with its expert
weights rounded to bf16, the format tandem packs them in: so the two compute the same
products and differ by accumulation order and tandem's bf16 activations (relative error
<= 2^-8 per product, observed 1e-5..3e-3 on the logits; bound 2e-2). Where the reference's
top two logits are further apart than twice the largest difference, the greedy token must
agree. The same model saved in transformers' v5 fused layout (``save_original_format=False``)
must load to the same logits bit for bit (the same weights packed), or be refused with a
ValueError; the table's last column says which.

Outcomes: "supported" (load_model matches), "refused" (load_model raised a ValueError
naming what it lacks: a clean refusal), "not built" (this test could not make a tiny model
of the type: the table says so). Anything else (a wrong answer, another exception) fails.
docs/MODELS.md is the table this run makes; the test fails when it differs (run with
TANDEM_UPDATE_MODELS_MD=1 to rewrite it).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from hf_models import clean_tokens

import tandem

ROOT = Path(__file__).resolve().parents[2]
MODELS_MD = ROOT / "docs" / "MODELS.md"
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
SMALL = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, expert_intermediate_size=32,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
             num_experts=8, num_local_experts=8, n_routed_experts=8, moe_num_experts=8, num_experts_per_tok=2,
             first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=16, index_head_dim=16, index_n_heads=4, index_topk=8,
             moe_topk=2, expert_ffn_hidden_size=32, zero_expert_num=2, num_layers=2, max_position_embeddings=256, shared_expert_intermediate_size=32,
             n_shared_experts=1, num_shared_experts=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             initializer_range=0.08, tie_word_embeddings=False)
RESULTS: dict[str, tuple[str, str, str]] = {}


def moe_model_types() -> list[str]:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for mt, cls in CONFIG_MAPPING_NAMES.items():
        if mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or not hasattr(transformers, cls):
            continue
        try:
            fields = getattr(transformers, cls)().to_dict()
        except Exception:  # noqa: BLE001 (a config that cannot be built with defaults: not enumerable here)
            continue
        if any(k in fields for k in EXPERT_KEYS):
            out.append(mt)
    return sorted(out)


def tiny_config(model_type: str):
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    cls = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])
    base = cls().to_dict()
    kw = {k: v for k, v in SMALL.items() if k in base}
    if "qk_rope_head_dim" in base:  # multi-head latent attention: rotary on qk_rope_head_dim
        kw["head_dim"] = kw["qk_rope_head_dim"]
    layers = base.get("num_hidden_layers")
    for k, v in base.items():
        if k == "layer_types" or k.endswith("_layer_types") or (k.endswith("_types") and isinstance(v, list)
                                                                and len(v) == layers):
            kw[k] = None  # derived again from num_hidden_layers
        elif k == "mlp_only_layers":
            kw[k] = []
        elif k in ("decoder_sparse_step", "moe_layer_freq"):
            kw[k] = 1
    return cls(**kw)


def _clean(text: str, *paths: Path) -> str:
    for p in paths:
        text = text.replace(str(p), "<dir>")
    text = re.sub(r"/tmp/\S+", "<dir>", text)
    return text.splitlines()[0] if text else text


@pytest.mark.parametrize("model_type", moe_model_types())
def test_load_model_matches_from_pretrained(model_type, tmp_path):
    from transformers import AutoModelForCausalLM

    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(model_type)).float().eval()
        ids = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            model(ids)
        model.save_pretrained(tmp_path / "orig")
        model.save_pretrained(tmp_path / "fused", save_original_format=False)
    except Exception as e:  # noqa: BLE001 (this harness's tiny config does not fit the type)
        RESULTS[model_type] = ("not built", f"{type(e).__name__}: {_clean(str(e), tmp_path)}", "")
        pytest.skip(f"no tiny {model_type} model: {RESULTS[model_type][1]}")
    conf = {"version": 1, "cpu": {"format": "bf16"}, "gpu": {"device": "none"}}
    try:
        ours = tandem.load_model(tmp_path / "orig", conf, progress=False)
    except ValueError as e:
        RESULTS[model_type] = ("refused", _clean(str(e), tmp_path / "orig", tmp_path), "")
        assert str(e).strip(), "a refusal says why"
        return
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "orig", dtype=torch.float32).eval()
    routes = [routing(ref), routing(ours)]
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if ".experts." in name and p.dim() == 3:
                p.copy_(p.bfloat16().float())
        want = ref(ids).logits
        got = ours(ids).logits
    # A router near-tie may pick another expert under any rounding difference: such a token
    # and the later ones attending to it are left out (most must remain).
    clean = clean_tokens(*routes, *ids.shape)
    assert clean.sum() >= clean.numel() // 2, f"{model_type}: {int((~clean).sum())} of {clean.numel()} tokens " \
                                              "routed differently"
    got, want = got[clean], want[clean]
    err = ((got - want).norm() / want.norm()).item()
    assert err < 2e-2, f"{model_type}: logits relative error {err:.3g}"
    diff = (got - want).abs().amax().item()
    top2 = want.topk(2, dim=-1).values
    sure = (top2[..., 0] - top2[..., 1]) > 2 * diff
    assert torch.equal(got.argmax(-1)[sure], want.argmax(-1)[sure]), f"{model_type}: greedy tokens differ"
    # The v5 fused layout: the same weights, so the same logits bit for bit, or a refusal.
    fused_layout = "same checkpoint (no fused tensors)"
    if any(k.endswith("experts.gate_up_proj") for k in _names(tmp_path / "fused")):
        try:
            fused = tandem.load_model(tmp_path / "fused", conf, progress=False)
        except ValueError as e:
            fused_layout = "refused: " + _clean(str(e), tmp_path / "fused", tmp_path)
        else:
            with torch.no_grad():
                assert torch.equal(fused(ids).logits, ours(ids).logits), f"{model_type}: fused layout differs"
            fused_layout = "supported"
    RESULTS[model_type] = ("supported", "", fused_layout)


def routing(model) -> list[torch.Tensor]:
    """Hooks every experts module; the list fills with each call's sorted top_k_index."""
    from tandem.discovery import find_moe_blocks

    rec: list[torch.Tensor] = []
    for b in find_moe_blocks(model):
        b.block.experts.register_forward_hook(lambda mod, args, out: rec.append(args[1].sort(-1).values.clone()))
    return rec


def _names(d: Path) -> list[str]:
    from safetensors import safe_open

    out = []
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            out += list(s.keys())
    return out


def test_models_md_is_this_runs_table(request):
    """docs/MODELS.md is the table the zoo test above made (run in the same session)."""
    types = moe_model_types()
    if set(RESULTS) != set(types):
        pytest.skip("the zoo test did not run for every type in this session (-k?)")
    import transformers

    lines = [
        "# MoE model types through `tandem.load_model`",
        "",
        "Generated by `tests/python/test_model_zoo.py` (transformers "
        f"{transformers.__version__}); do not edit by hand: run the test with `TANDEM_UPDATE_MODELS_MD=1`.",
        "",
        "Every causal-LM model type of the installed transformers whose config has routed experts, as a tiny",
        "random-weight model (the test's `tiny_config`), saved with `save_pretrained` and loaded with",
        "`tandem.load_model` against `from_pretrained` (logits, greedy tokens). **Nothing here was tried on a",
        "real checkpoint**: none can be downloaded on the machines this project is built on.",
        "",
        "- supported: load_model's logits match from_pretrained's (experts rounded to bf16 in both).",
        "- refused: load_model raises a ValueError naming what tandem lacks for the type.",
        "- not built: the test could not make a tiny model of the type (its config needs more than the",
        "  generic small sizes); load_model was not tried.",
        "",
        "The last column: the same model saved in transformers' v5 fused layout (`save_original_format=False`:",
        "`experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]) loaded by `tandem.load_model`",
        "(supported: the same logits bit for bit as the per-expert checkpoint).",
        "",
        "`gpt_oss` keeps its own layout in both (`gate_up_proj` [E, H, 2I] with gate and up interleaved, biases);",
        "its MXFP4 checkpoints (OpenAI's release format) are tested in `tests/python/test_gpt_oss.py`, on",
        "random-weight models as well.",
        "",
        "| model type | outcome | detail | v5 fused layout |",
        "|---|---|---|---|",
    ]
    counts: dict[str, int] = {}
    for t in types:
        outcome, detail, fused = RESULTS[t]
        counts[outcome] = counts.get(outcome, 0) + 1
        lines.append(f"| `{t}` | {outcome} | {detail.replace('|', '/')} | {fused.replace('|', '/')} |")
    lines += ["", ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f", of {len(types)} types.", ""]
    text = "\n".join(lines)
    if os.environ.get("TANDEM_UPDATE_MODELS_MD") == "1":
        MODELS_MD.write_text(text)
    assert MODELS_MD.is_file() and MODELS_MD.read_text() == text, (
        "docs/MODELS.md differs from this run's table: run pytest tests/python/test_model_zoo.py with "
        "TANDEM_UPDATE_MODELS_MD=1 and commit the file")
