"""Every MoE model type of the installed transformers through `tandem.load_model` (issue 18).

For each causal-LM model type whose config has routed experts: build a tiny random model
(`tiny_config`: small sizes, fixed seed), save it with `save_pretrained` (the original
checkpoint format, one tensor per expert), load it with `tandem.load_model` and with
`from_pretrained`, and compare logits. The reference is the stock model with its expert
weights rounded to bf16, the format tandem packs them in: so the two compute the same
products and differ by accumulation order and tandem's bf16 activations (relative error
<= 2^-8 per product, observed 1e-5..3e-3 on the logits; bound 2e-2). Where the reference's
top two logits are further apart than twice the largest difference, the greedy token must
agree, and greedy generation with the KV cache gives next-token logits within the same bound
at every step both models routed alike;
`tandem doctor` on the same model and config plans the engine's MoE layers and expert
bytes exactly. The same model saved in transformers' v5 fused layout (``save_original_format=False``)
must load to the same logits bit for bit (the same weights packed), or be refused with a
ValueError; the table's fourth column says which.

Training, as `tandem train` sets it up (`tandem.train.peft_config`: LoRA on every linear layer
but the head, and on the routed experts wherever the type keeps them): every MoE layer's
experts and the attention carry LoRA, one backward gives every LoRA tensor a finite gradient
(nonzero on the experts'), and the adapter saved from tandem's model loads with stock PEFT onto
the stock model, whose logits then match tandem's (the inference bound above). The last column.

Outcomes: "supported" (load_model matches), "refused" (load_model raised a ValueError
naming what it lacks: a clean refusal), "not built" (this test could not make a tiny model
of the type: the table says so). Anything else (a wrong answer, another exception) fails.
docs/MODELS.md is the table this run makes; the test fails when it differs (run with
TANDEM_UPDATE_MODELS_MD=1 to rewrite it).
"""
from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest
import torch
from hf_models import clean_tokens, stock_bf16_experts

import tandem

ROOT = Path(__file__).resolve().parents[2]
MODELS_MD = ROOT / "docs" / "MODELS.md"
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
SMALL = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, expert_intermediate_size=32,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
             num_experts=8, num_local_experts=8, n_routed_experts=8, moe_num_experts=8, num_experts_per_tok=2,
             first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=16, index_head_dim=16, index_n_heads=4, index_topk=8,
             indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=2,
             moe_topk=2, num_expert_group=1, num_experts_per_token=2, expert_ffn_hidden_size=32, zero_expert_num=2, num_layers=2, max_position_embeddings=256, shared_expert_intermediate_size=32,
             n_shared_experts=1, num_shared_experts=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             initializer_range=0.08, tie_word_embeddings=False)
# What a type's config needs beyond SMALL: ZAYA routes to one expert only; LFM2-MoE has no
# default layer pattern (conv or attention per layer).
TYPE_SIZES = {"zaya": dict(num_experts_per_tok=1), "lfm2_moe": dict(layer_types=["conv", "full_attention"] * 2)}
RESULTS: dict[str, tuple[str, str, str, str]] = {}


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
    if "qk_rope_head_dim" in base:  # multi-head latent attention: rotary on qk_rope_head_dim, keys per head
        kw["head_dim"] = kw["qk_rope_head_dim"]
        if "num_key_value_heads" in kw:
            kw["num_key_value_heads"] = kw["num_attention_heads"]
    layers = base.get("num_hidden_layers")
    for k, v in base.items():
        if k == "layer_types" or k.endswith("_layer_types") or (k.endswith("_types") and isinstance(v, list)
                                                                and len(v) == layers):
            kw[k] = None  # derived again from num_hidden_layers
        elif k == "mlp_only_layers":
            kw[k] = []
        elif k in ("decoder_sparse_step", "moe_layer_freq"):
            kw[k] = 1
    kinds = base.get("layer_types") or []
    if "linear_attention" in kinds:
        # Hybrid models: their default pattern shortened to 4 layers may hold no attention layer
        # at all, which transformers' cache cannot run; alternate the two kinds.
        other = next((k for k in kinds if k != "linear_attention"), "full_attention")
        kw["layer_types"] = ["linear_attention", other] * (SMALL["num_hidden_layers"] // 2)
    if "attn_layer_period" in base:  # Jamba: an attention layer every second layer
        kw.update(attn_layer_period=2, attn_layer_offset=1)
    kw.update(TYPE_SIZES.get(model_type, {}))
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
        RESULTS[model_type] = ("not built", f"{type(e).__name__}: {_clean(str(e), tmp_path)}", "", "")
        pytest.skip(f"no tiny {model_type} model: {RESULTS[model_type][1]}")
    conf = {"version": 1, "cpu": {"format": "bf16"}, "gpu": {"device": "none"}}
    try:
        ours = tandem.load_model(tmp_path / "orig", conf, progress=False)
    except ValueError as e:
        RESULTS[model_type] = ("refused", _clean(str(e), tmp_path / "orig", tmp_path), "", "")
        assert str(e).strip(), "a refusal says why"
        return
    ref = stock_bf16_experts(tmp_path / "orig")
    routes = [routing(ref), routing(ours)]
    with torch.no_grad():
        want = ref(ids).logits
        got = ours(ids).logits
    # A router near-tie may pick another expert under any rounding difference: such a token
    # and the later ones attending to it are left out (most must remain).
    clean = routed_alike(*routes, *ids.shape)
    assert clean.sum() >= clean.numel() // 2, f"{model_type}: {int((~clean).sum())} of {clean.numel()} tokens " \
                                              "routed differently"
    err = logit_error(got, want, clean, model_type)
    doctor_check(model_type, tmp_path, ours.tandem_engine)
    diff = (got - want).abs().amax().item()
    top2 = want.topk(2, dim=-1).values
    sure = (top2[..., 0] - top2[..., 1]) > 2 * diff
    assert torch.equal(got.argmax(-1)[sure], want.argmax(-1)[sure]), f"{model_type}: greedy tokens differ"
    generate_check(model_type, ours, ref, ids[:1, :6])
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
    RESULTS[model_type] = ("supported", "", fused_layout, train_check(model_type, tmp_path, conf, ids))


def generate_check(model_type: str, ours, ref, prompt: torch.Tensor) -> int:
    """`tandem run`'s path: greedy generation with the KV cache, tandem's model against the
    stock model's own generate. At every step whose prefix both generated alike and whose
    experts both routed alike so far (``routed_alike``'s rule: ids, weights within 0.05),
    the next-token logits meet the forward's bound (relative L2 < 2e-2): a wrong cache,
    position or mask would not. Returns the number of steps compared (printed)."""
    steps = 6
    recs = []
    with torch.no_grad():
        for m in (ref, ours):
            rec = routing(m)
            g = m.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, output_logits=True,
                           return_dict_in_generate=True)
            recs.append((rec, g))
    (ra, a), (rb, b) = recs
    layers = len(ra) // steps
    assert layers * steps == len(ra) == len(rb), f"{model_type}: {len(ra)} / {len(rb)} experts calls in {steps} steps"
    n, compared = prompt.shape[1], 0
    for s in range(steps):
        calls = slice(s * layers, (s + 1) * layers)
        if not all(x.shape == y.shape and torch.equal(x, y) and (wx - wy).abs().max() <= 0.05
                   for (x, wx), (y, wy) in zip(ra[calls], rb[calls])):
            break
        want, got = a.logits[s][0], b.logits[s][0]
        err = ((got - want).norm() / want.norm()).item()
        assert err < 2e-2, f"{model_type}: generate step {s}: next-token logits relative error {err:.3g}"
        compared += 1
        if b.sequences[0, n + s] != a.sequences[0, n + s]:
            break  # a near-tie went the other way: the prefixes differ from here
    print(f"{model_type}: generate compared at {compared} of {steps} steps")
    return compared


def doctor_check(model_type: str, tmp_path: Path, engine) -> None:
    """`tandem doctor` on the same model and config: it reads the type's config.json and
    checkpoint, and plans the MoE layers and expert bytes the engine really packed."""
    cfg = tmp_path / "doctor.yaml"
    cfg.write_text(f"model:\n  path: {tmp_path / 'orig'}\ncpu: {{format: bf16}}\ngpu: {{device: none}}\n")
    report = tandem.doctor(cfg, gpu_kernel_check=False)
    mem = report.data["config"]["memory"]
    assert mem.get("checked"), f"{model_type}: doctor did not size the model: {mem.get('reason')}"
    assert mem["model"]["moe_layers"] == engine.moe_layers, f"{model_type}: doctor plans {mem['model']['moe_layers']} " \
                                                            f"MoE layers, the engine has {engine.moe_layers}"
    assert mem["cpu_expert_bytes"] == engine.cpu_bytes, f"{model_type}: doctor plans {mem['cpu_expert_bytes']} " \
                                                        f"bytes of CPU experts, the engine packed {engine.cpu_bytes}"


def logit_error(got: torch.Tensor, want: torch.Tensor, clean: torch.Tensor, model_type: str) -> float:
    got, want = got[clean], want[clean]
    err = ((got - want).norm() / want.norm()).item()
    assert err < 2e-2, f"{model_type}: logits relative error {err:.3g}"
    return err


def train_check(model_type: str, tmp_path: Path, conf: dict, ids: torch.Tensor) -> str:
    """`tandem train`'s LoRA on the type (module doc): "supported" (with a remark where stock
    PEFT itself loses part of an adapter of the type) or "refused: why"."""
    import copy
    import warnings

    from peft import PeftModel, get_peft_model

    from tandem.discovery import find_moe_blocks
    from tandem.lora import is_param_wrapper
    from tandem.train import peft_config

    try:
        model = tandem.load_model(tmp_path / "orig", conf, train=True, dtype=torch.float32, progress=False)
    except ValueError as e:
        return "refused: " + _clean(str(e), tmp_path / "orig", tmp_path)
    lora_cfg = peft_config(model, 4, 8.0)
    pm = get_peft_model(model, copy.deepcopy(lora_cfg))
    blocks = find_moe_blocks(pm.get_base_model())
    bare = [b.layer for b in blocks if not is_param_wrapper(b.block.experts)]
    assert blocks and not bare, f"{model_type}: the experts of layers {bare} carry no LoRA"
    attention = [n for n, m in pm.named_modules() if hasattr(m, "lora_A") and ("attn" in n or "attention" in n)]
    assert attention, f"{model_type}: no LoRA on the attention"
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # B = 0 (PEFT's start) would leave every A without gradient
        for n, p in pm.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    lora = {n: p.detach().clone() for n, p in pm.named_parameters() if p.requires_grad}
    # The same LoRA on the stock model, by name: every tensor lands on the same module.
    stock = get_peft_model(stock_bf16_experts(tmp_path / "orig"), copy.deepcopy(lora_cfg))
    stock_lora = {n for n, p in stock.named_parameters() if p.requires_grad}
    assert stock_lora == set(lora), f"{model_type}: LoRA tensors differ from stock PEFT's: " \
                                    f"{sorted(stock_lora ^ set(lora))[:4]}"
    stock.load_state_dict(lora, strict=False)
    # One backward (eval mode: routers with jitter noise draw none): every tensor that stock
    # PEFT gives a gradient gets a finite one, the experts' nonzero.
    grads = []
    for m in (pm, stock):
        m.eval()
        loss = m(ids, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss), f"{model_type}: training loss {loss.item()}"
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    ours, theirs = grads
    differ = [n for n in ours if (ours[n] is None) != (theirs[n] is None)]
    assert not differ, f"{model_type}: gradient given / not given unlike stock PEFT for {differ[:3]}"
    bad = [n for n, v in ours.items() if v is not None and not torch.isfinite(v).all()]
    assert not bad, f"{model_type}: non-finite gradient for {bad[:3]}"
    dead = [n for n, v in ours.items() if ".experts." in n and not (v is not None and v.abs().sum() > 0)]
    assert not dead, f"{model_type}: zero gradient for the experts' {dead[:3]}"
    # The adapter file tandem saves, loaded by stock PEFT onto the stock model.
    pm.save_pretrained(tmp_path / "adapter")
    remark = ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = PeftModel.from_pretrained(stock_bf16_experts(tmp_path / "orig"), tmp_path / "adapter").eval()
    lost = _missing_adapter_keys(caught)
    if lost:  # stock PEFT's own adapter of the type must lose the same tensors (its limit, not tandem's)
        stock.save_pretrained(tmp_path / "stock_adapter")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            PeftModel.from_pretrained(stock_bf16_experts(tmp_path / "orig"), tmp_path / "stock_adapter")
        assert _missing_adapter_keys(caught) == lost, f"{model_type}: stock PEFT loads its own adapter whole but " \
                                                      f"drops {sorted(lost)[:3]} of tandem's"
        mods = sorted({k.split(".lora_")[0].split(".")[-2] + "." + k.split(".lora_")[0].split(".")[-1] for k in lost})
        remark = (f" (stock PEFT's from_pretrained drops this type's {', '.join(mods)} LoRA, from its own "
                  "adapters too; with those tensors set by name, the stock model matches)")
        loaded = stock
    routes = [routing(loaded.get_base_model()), routing(pm.get_base_model())]
    with torch.no_grad():
        want, got = loaded(ids).logits, pm(ids).logits
    clean = routed_alike(*routes, *ids.shape)
    assert clean.sum() >= clean.numel() // 2, f"{model_type}: with the adapter, {int((~clean).sum())} of " \
                                              f"{clean.numel()} tokens routed differently"
    logit_error(got, want, clean, f"{model_type} with the trained adapter on the stock model")
    return "supported" + remark


def _missing_adapter_keys(caught) -> set[str]:
    for w in caught:
        m = re.search(r"Found missing adapter keys while loading the checkpoint: (\[.*\])", str(w.message))
        if m:
            return set(ast.literal_eval(m.group(1)))
    return set()


def routing(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Hooks every experts module; the list fills with each call's top_k_index and
    top_k_weights, both in the order of the sorted expert ids."""
    from tandem.discovery import find_moe_blocks

    rec: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(mod, args, out):
        ids, order = args[1].sort(-1)
        rec.append((ids.clone(), args[2].gather(-1, order).detach().float().clone()))

    for b in find_moe_blocks(model):
        b.block.experts.register_forward_hook(hook)
    return rec


def routed_alike(ra, rb, batch: int, seq: int) -> torch.Tensor:
    """hf_models.clean_tokens on the expert ids, and besides, a token whose routing weights
    differ by more than 0.05 counts as routed differently: PhiMoE's sparsemixer masks a
    weight by a threshold on the scores, a near-tie there moves a weight by far more than
    rounding does (observed: 1e-3 against 0.5)."""
    ids_a, ids_b = [a for a, _ in ra], [b for b, _ in rb]
    clean = clean_tokens(ids_a, ids_b, batch, seq)
    bad = torch.zeros(batch * seq, dtype=torch.bool)
    for (ia, wa), (ib, wb) in zip(ra, rb):
        if ia.shape == ib.shape:
            bad |= (wa - wb).abs().amax(-1) > 0.05
    return clean & ~bad.view(batch, seq).cummax(1).values


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
        "- supported: load_model's logits match from_pretrained's (experts rounded to bf16 in both), so do",
        "  greedy generation's next-token logits with the KV cache (`tandem run`'s path), and `tandem doctor`",
        "  plans the MoE layers and expert bytes the engine packs.",
        "- refused: load_model raises a ValueError naming what tandem lacks for the type.",
        "- not built: the test could not make a tiny model of the type (its config needs more than the",
        "  generic small sizes); load_model was not tried.",
        "",
        "The last column: the same model saved in transformers' v5 fused layout (`save_original_format=False`:",
        "`experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]) loaded by `tandem.load_model`",
        "(supported: the same logits bit for bit as the per-expert checkpoint).",
        "",
        "`tandem train`: `load_model(train=True)` with the LoRA `tandem train` sets up (every linear layer but",
        "the head, and the routed experts): the experts of every MoE layer and the attention carry LoRA, a",
        "backward gives every LoRA tensor a finite gradient, and the adapter saved from tandem's model loads",
        "with stock PEFT onto the stock model with the same logits (supported), or the reason it cannot.",
        "",
        "`gpt_oss` keeps its own layout in both (`gate_up_proj` [E, H, 2I] with gate and up interleaved, biases);",
        "its MXFP4 checkpoints (OpenAI's release format) are tested in `tests/python/test_gpt_oss.py`, on",
        "random-weight models as well. With `cpu.format: mxfp4` their experts keep their MXFP4 values exactly",
        "(4.5 bits a weight; the other formats pack the dequantized values).",
        "",
        "| model type | outcome | detail | v5 fused layout | `tandem train` |",
        "|---|---|---|---|---|",
    ]
    counts: dict[str, int] = {}
    for t in types:
        outcome, detail, fused, train = RESULTS[t]
        counts[outcome] = counts.get(outcome, 0) + 1
        lines.append(f"| `{t}` | {outcome} | {detail.replace('|', '/')} | {fused.replace('|', '/')} | "
                     f"{train.replace('|', '/')} |")
    lines += ["", ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f", of {len(types)} types.", ""]
    text = "\n".join(lines)
    if os.environ.get("TANDEM_UPDATE_MODELS_MD") == "1":
        MODELS_MD.write_text(text)
    assert MODELS_MD.is_file() and MODELS_MD.read_text() == text, (
        "docs/MODELS.md differs from this run's table: run pytest tests/python/test_model_zoo.py with "
        "TANDEM_UPDATE_MODELS_MD=1 and commit the file")


@pytest.mark.parametrize("model_type,mtp", [("deepseek_v3", "model.layers.4"), ("glm4_moe", "model.layers.4"),
                                            ("qwen3_next", "mtp")])
def test_multi_token_prediction_tensors_are_skipped_and_named(model_type, mtp, tmp_path):
    """A checkpoint with the multi-token-prediction (MTP / next-n) tensors real releases
    carry: DeepSeek-V3's and GLM-4.5's as the layer after num_hidden_layers
    (num_nextn_predict_layers = 1), Qwen3-Next's under ``mtp.``. transformers does not run
    them, and load_model skips them (transformers' own rules: the layer count, the class's
    ``_keys_to_ignore_on_load_unexpected``), names them in the load summary, and computes the
    same logits bit for bit as without them. A tensor of no such kind is still refused."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from tandem.loader import skipped_summary

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type)).float().eval()
    assert model.config.num_hidden_layers == 4
    model.save_pretrained(tmp_path / "plain")
    model.save_pretrained(tmp_path / "mtp")
    files = list((tmp_path / "mtp").glob("*.safetensors"))
    assert len(files) == 1
    sd = load_file(files[0])
    g = torch.Generator().manual_seed(3)
    names = ["eh_proj.weight", "enorm.weight", "hnorm.weight", "mlp.experts.0.gate_proj.weight",
             "self_attn.q_proj.weight", "shared_head.norm.weight"] if mtp.startswith("model.layers") else \
        ["fc.weight", "pre_fc_norm_hidden.weight", "layers.0.mlp.experts.1.up_proj.weight", "norm.weight"]
    added = {f"{mtp}.{n}": torch.randn(16, 8, generator=g) for n in names}
    save_file({**sd, **added}, files[0], metadata={"format": "pt"})
    conf = {"version": 1, "cpu": {"format": "bf16"}, "gpu": {"device": "none"}}
    ids = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    plain = tandem.load_model(tmp_path / "plain", conf, progress=False)
    ours = tandem.load_model(tmp_path / "mtp", conf, progress=False)
    assert ours.tandem_skipped == {mtp: len(added)} and plain.tandem_skipped == {}
    assert skipped_summary(ours) == (f"skipped: {len(added)} checkpoint tensors that transformers does not run either "
                                     f"(multi-token prediction): {mtp}.* ({len(added)})")
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, plain(ids).logits)
    save_file({**sd, **added, "vision.proj.weight": torch.zeros(2, 2)}, files[0], metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"checkpoint has tensors the model does not use: 'vision.proj.weight'"):
        tandem.load_model(tmp_path / "mtp", conf, progress=False)
