"""Fine-tuned LoRA adapters on tandem's inference engine (tandem.adapters): merged at load
(``load_model(adapter=)``), merged / unmerged through PEFT on a loaded model, refused
where they would be dropped or cannot be merged.

Reference: stock PEFT (unmerged: base output + s B A x) on the unmodified transformers
model, the adapter saved by it with random lora_A and lora_B (PEFT's zero lora_B would
make the adapter a no-op and these tests unable to fail).

Bounds (largest |logit difference| over tokens whose routing matched, relative to the
reference's largest |logit|, as in test_hf_inference): tandem packs W + s B A rounded once
to bf16 (relative error <= u/2 = 2^-9 per weight) where the reference adds s B A x in
fp32, which is the same class of error as the base weights'
rounding there, so the same bounds: 1.5e-2 for fp32 models, 4e-2 for bf16 ones (measured
<= 3.6e-3 and 1.8e-2). INT8 packs add per-row weight and activation quantization
(<= max|w|/254 and max|x|/254 per row, two roundings of u_8 = 2^-8 relative to the row's
largest value, carried through 2-3 MoE layers): bound 6e-2, the per-layer INT8 bound of
test_hf_inference (measured <= 1.9e-2). The adapter moves the logits by more than 3x
every bound (asserted, in the same measure).
"""
from __future__ import annotations

import json

import pytest
import torch
from hf_models import KINDS, VOCAB, build, clean_tokens, max_rel, record_routing

import tandem

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ATTENTION = {"qwen3_moe": ["q_proj", "v_proj"], "mixtral": ["q_proj", "v_proj"],
             "deepseek_v3": ["q_b_proj", "kv_b_proj"]}
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
BOUND = {("bf16", "fp32"): 1.5e-2, ("bf16", "bf16"): 4e-2, ("int8", "fp32"): 6e-2, ("int8", "bf16"): 6e-2}


def cfg(fmt: str = "bf16", **gpu) -> dict:
    return {"version": 1, "cpu": {"threads": 2, "format": fmt}, "gpu": {"device": "none", **gpu}}


def tokens(seed: int) -> torch.Tensor:
    # Short rows: a near-tie in a router (int8 activations, bf16 models) spoils the rest of
    # its row for the comparison (hf_models.clean_tokens), so many rows keep enough tokens.
    return torch.randint(0, VOCAB, (8, 8), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """(kind, dtype) -> (checkpoint dir, adapter dir, stock PEFT model with that adapter), built once."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(kind: str, dtype: str = "fp32"):
        if (kind, dtype) not in cache:
            root = tmp_path_factory.mktemp(f"{kind}-{dtype}")
            build(kind, 1, DTYPES[dtype], root / "model")
            stock = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "model", dtype=DTYPES[dtype]),
                                   LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION[kind],
                                              target_parameters=EXPERT_PARAMS))
            g = torch.Generator().manual_seed(3)
            lora = {k: (torch.randn(v.shape, generator=g) * 0.05).to(v.dtype)
                    for k, v in sorted(stock.state_dict().items()) if "lora_" in k}
            assert any(".experts." in k for k in lora) and any("attn" in k for k in lora)
            stock.load_state_dict(lora, strict=False)
            stock.save_pretrained(root / "adapter")
            cache[kind, dtype] = root
        root = cache[kind, dtype]
        stock = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "model", dtype=DTYPES[dtype]),
                                          root / "adapter").eval()
        return root / "model", root / "adapter", stock

    return get


def compare(ours, stock, seed: int, bound: float, what: str) -> float:
    ids = tokens(seed)
    ra = record_routing(stock.get_base_model())
    rb = record_routing(ours.get_base_model() if hasattr(ours, "get_base_model") else ours)
    with torch.no_grad():
        want, got = stock(input_ids=ids).logits, ours(input_ids=ids).logits
        with stock.disable_adapter():
            base = stock(input_ids=ids).logits
    clean = clean_tokens(ra[: len(rb)], rb, *ids.shape)
    assert clean.float().mean() >= 0.25, f"routing differs for most tokens ({(~clean).sum().item()})"
    err = max_rel(got, want, clean)
    effect = max_rel(base, want, clean)
    print(f"{what}: clean {clean.sum().item()}/{clean.numel()}, max rel err {err:.2e}, adapter effect {effect:.2f}")
    assert effect > 3 * bound, "the adapter must change the logits (else this test cannot fail)"
    assert err <= bound, f"{what}: {err:.2e} > {bound}"
    return err


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_load_model_with_adapter_matches_stock_peft(adapted, kind, dtype, fmt):
    path, adapter, stock = adapted(kind, dtype)
    model = tandem.load_model(path, cfg(fmt), adapter=adapter, progress=False)
    assert type(model).__name__ == type(stock.get_base_model()).__name__, "a plain transformers model"
    assert model.tandem_adapter == str(adapter)
    assert not any("lora_" in k for k in model.state_dict()), "everything merged"
    compare(model, stock, 6, BOUND[fmt, dtype], f"{kind} {dtype} {fmt} load_model(adapter=)")


def test_adapter_with_hot_experts_on_the_host_stream(adapted):
    path, adapter, stock = adapted("qwen3_moe")
    hot = {0: [1, 2], 2: [0, 5, 7]}
    model = tandem.load_model(path, cfg(hot_experts={"layers": hot}), adapter=adapter, progress=False)
    e = model.tandem_engine
    assert [e.hot(i) for i in range(3)] == [[1, 2], [], [0, 5, 7]]
    compare(model, stock, 6, BOUND["bf16", "fp32"], "hot experts merged too")


def test_peft_on_a_loaded_inference_model_merges_into_the_packs(adapted):
    from peft import PeftModel

    path, adapter, stock = adapted("qwen3_moe")
    plain = tandem.load_model(path, cfg(), progress=False)
    ours = PeftModel.from_pretrained(plain, adapter)
    # Unmerged, the engine would run without the expert LoRA: refused, not dropped.
    with pytest.raises(ValueError, match=r"model layer 0\): a LoRA adapter is active on these experts.*"
                                         r"merge_and_unload\(\).*adapter=DIR"):
        with torch.no_grad():
            ours(input_ids=tokens(1))
    ours.merge_adapter()  # no forward before it in layers 1 and 2: merged all the same
    compare(ours, stock, 6, BOUND["bf16", "fp32"], "merge_adapter()")
    ours.unmerge_adapter()  # the base packed again
    ids = tokens(7)
    with torch.no_grad(), ours.disable_adapter():
        unmerged = ours(input_ids=ids).logits
    with torch.no_grad():
        fresh = tandem.load_model(path, cfg(), progress=False)(input_ids=ids).logits
    # The experts are packed again from the same weights (bit for bit); attention LoRA was
    # merged and unmerged by PEFT in fp32 (W + D - D: a few fp32 ulps), which can move the
    # bf16 rounding of an expert input by one ulp (2^-8 relative) here and there: 1e-3.
    assert (unmerged - fresh).abs().max() <= 1e-3 * fresh.abs().max()
    merged = ours.merge_and_unload()
    assert type(merged).__name__ == "Qwen3MoeForCausalLM"
    assert type(merged.model.layers[0].mlp.experts).__name__ == "TandemExperts"
    compare(merged, stock, 6, BOUND["bf16", "fp32"], "merge_and_unload()")


def test_disabled_adapter_runs_the_base(adapted):
    from peft import PeftModel

    path, adapter, _ = adapted("qwen3_moe")
    ids = tokens(2)
    with torch.no_grad():
        want = tandem.load_model(path, cfg(), progress=False)(input_ids=ids).logits
    ours = PeftModel.from_pretrained(tandem.load_model(path, cfg(), progress=False), adapter)
    with torch.no_grad(), ours.disable_adapter():
        got = ours(input_ids=ids).logits
    assert torch.equal(got, want)


def test_merging_into_an_offloaded_model_is_refused(adapted):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, adapter, _ = adapted("qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(path)
    tandem.offload(model, cfg(), progress=False)
    ours = PeftModel.from_pretrained(model, adapter)
    with pytest.raises(ValueError, match=r"offloaded from memory \(tandem.offload\).*Merge before offloading"):
        ours.merge_and_unload()


def test_adapter_that_trains_on(adapted):
    path, adapter, stock = adapted("qwen3_moe")
    ours = tandem.load_model(path, cfg(), train=True, adapter=adapter, progress=False)
    assert type(ours).__name__ == "PeftModel"
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable) and any(".experts." in n for n in trainable)
    compare(ours, stock, 6, BOUND["bf16", "fp32"], "train=True with an adapter")


def write_adapter(dst, src, edit_cfg=None, edit_weights=None):
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    conf = json.loads((src / "adapter_config.json").read_text())
    if edit_cfg:
        edit_cfg(conf)
    (dst / "adapter_config.json").write_text(json.dumps(conf))
    w = load_file(src / "adapter_model.safetensors")
    if edit_weights:
        edit_weights(w)
    save_file(w, dst / "adapter_model.safetensors")
    return dst


def test_adapters_that_do_not_fit_are_refused(adapted, tmp_path):
    path, adapter, _ = adapted("qwen3_moe")

    def load(a):
        return tandem.load_model(path, cfg(), adapter=a, progress=False)

    with pytest.raises(ValueError, match=r"no adapter_config.json"):
        load(tmp_path)
    with pytest.raises(ValueError, match=r"peft_type 'IA3' is not supported"):
        load(write_adapter(tmp_path / "ia3", adapter, lambda c: c.update(peft_type="IA3")))
    with pytest.raises(ValueError, match=r"use_dora is set"):
        load(write_adapter(tmp_path / "dora", adapter, lambda c: c.update(use_dora=True)))

    def extra(w):
        k = next(k for k in w if "q_proj.lora_A" in k)
        w[k.replace("layers.0.", "layers.9.")] = w[k].clone()
    with pytest.raises(ValueError, match=r"1 adapter tensor\(s\) match no module of this model.*layers\.9\."):
        load(write_adapter(tmp_path / "extra", adapter, edit_weights=extra))

    def drop(w):
        del w[next(k for k in w if "experts" in k and "lora_B" in k)]
    with pytest.raises(ValueError, match=r"LoRA tensor\(s\) the adapter config asks for are not in the file"):
        load(write_adapter(tmp_path / "missing", adapter, edit_weights=drop))

    def nan(w):
        k = next(k for k in w if "experts" in k and "lora_B" in k)
        w[k][0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"not finite after merging the adapter"):
        load(write_adapter(tmp_path / "nan", adapter, edit_weights=nan))


# ---- tandem merge: a merged checkpoint on disk ----------------------------------------------

def read_checkpoint(d) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_merged_checkpoint_is_what_peft_merges(adapted, kind, dtype, tmp_path):
    """Every tensor of `tandem merge`'s output is stock PEFT's merge_and_unload of the same
    adapter (W + s B A in fp32, rounded to the tensor's dtype; PEFT sums the experts' rank-r
    products in another order, so the two may round apart: one ulp, <= eps |w|, after a few
    fp32 roundings of the sum; bound 4 eps max|w| per tensor), every other tensor the
    input's bytes; tandem runs the merged checkpoint exactly as it runs base + adapter."""
    from tandem.merge import merge_checkpoint

    path, adapter, stock = adapted(kind, dtype)
    out = merge_checkpoint(path, adapter, tmp_path / "merged", progress=False)
    assert json.loads((out / "tandem_merge.json").read_text())["tensors_changed"] > 0
    got, base = read_checkpoint(out), read_checkpoint(path)
    assert got.keys() == base.keys()
    want = stock.merge_and_unload().state_dict()
    eps = torch.finfo(DTYPES[dtype]).eps
    changed = 0
    for k, v in got.items():
        assert v.dtype == base[k].dtype and v.shape == base[k].shape, k
        if torch.equal(v, base[k]):
            continue
        changed += 1
        ref = want[k] if k in want else None
        if ref is None:  # per-expert tensor: PEFT's model holds the fused one
            layer, e, proj = k.split(".")[2], int(k.split(".")[-3]), k.split(".")[-2]
            fused = want[f"model.layers.{layer}.mlp.experts.{'down_proj' if proj in ('down_proj', 'w2') else 'gate_up_proj'}"]
            I = fused.shape[1] // 2
            ref = {"gate_proj": fused[e, :I], "w1": fused[e, :I], "up_proj": fused[e, I:], "w3": fused[e, I:]}.get(
                proj, fused[e])
        err = ((v.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
        assert err <= 4 * eps, f"{k}: {err:.2e} > 4 eps = {4 * eps:.1e}"
    assert changed > 0
    ids = tokens(4)
    with torch.no_grad():
        a = tandem.load_model(out, cfg(), progress=False)(input_ids=ids).logits
        b = tandem.load_model(path, cfg(), adapter=adapter, progress=False)(input_ids=ids).logits
    assert torch.equal(a, b), "load_model(merged) and load_model(base, adapter=) pack the same bits"


def test_tandem_merge_command_and_its_refusals(adapted, tmp_path):
    import subprocess
    import sys

    path, adapter, stock = adapted("qwen3_moe")
    out = tmp_path / "merged"
    r = subprocess.run([sys.executable, "-m", "tandem", "merge", "--model", str(path), "--adapter", str(adapter),
                        "--out", str(out), "--no-progress"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert f"-> {out} (" in r.stdout and "tensors changed" in r.stdout
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tokens(5)
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, stock(input_ids=ids).logits
    # fp32: merged weights are W + s B A rounded once to fp32; carried through the model a
    # few hundred fp32 roundings (u = 6e-8) at most: 1e-5 relative (measured < 1e-6).
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()

    r = subprocess.run([sys.executable, "-m", "tandem", "merge", "--model", str(path), "--adapter", str(adapter),
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and f"{out} exists; tandem merge writes a new directory" in r.stderr

    def nan(w):
        k = next(k for k in w if "experts" in k and "lora_B" in k)
        w[k][0, 0] = float("nan")
    from tandem.merge import merge_checkpoint

    with pytest.raises(ValueError, match="not finite after merging the adapter"):
        merge_checkpoint(path, write_adapter(tmp_path / "nan", adapter, edit_weights=nan), tmp_path / "m2",
                         progress=False)
    assert not (tmp_path / "m2").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name], "no temporary directory left behind"


# ---- tandem train's LoRA targets --------------------------------------------------------------

EXPECTED_REPORT = {
    "qwen3_moe": [("attention", 12, ["k_proj", "o_proj", "q_proj", "v_proj"], 4),
                  ("routed experts", 3, ["down_proj+gate_up_proj"], 4)],
    "mixtral": [("attention", 12, ["k_proj", "o_proj", "q_proj", "v_proj"], 4),
                ("routed experts", 3, ["down_proj+gate_up_proj"], 4)],
    # layer 0 is dense; layers 1-2 have a shared expert each
    "deepseek_v3": [("attention", 15, ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"], 4),
                    ("MLP", 3, ["down_proj", "gate_proj", "up_proj"], 4),
                    ("shared experts", 6, ["down_proj", "gate_proj", "up_proj"], 4),
                    ("routed experts", 2, ["down_proj+gate_up_proj"], 4)],
}


@pytest.mark.parametrize("kind", KINDS)
def test_train_targets_every_linear_layer_with_one_rank(adapted, kind, tmp_path):
    """tandem train's LoraConfig: LoRA on attention, dense MLPs, shared experts (which PEFT
    0.21's v4-to-v5 conversion would move onto the fused experts when named in
    target_modules) and the routed experts, every one with rank r (gate_up too, which that
    conversion doubles), no PEFT warning; the adapter it saves loads into stock PEFT on the
    stock model with every tensor landing, and runs the same model there."""
    import warnings

    from peft import PeftConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from tandem.adapters import check_load_result
    from tandem.train import lora_report, peft_config

    path, _, _ = adapted(kind)
    model = tandem.load_model(path, cfg(), train=True, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = get_peft_model(model, peft_config(model, 4, 8.0))
    peft_warnings = [str(w.message) for w in caught if "peft" in str(w.filename)]
    assert not peft_warnings, peft_warnings
    assert lora_report(model) == EXPECTED_REPORT[kind]
    E = model.get_base_model().config.num_local_experts if kind == "mixtral" else (
        model.get_base_model().config.num_experts if kind == "qwen3_moe" else model.get_base_model().config.n_routed_experts)
    for n, p in model.named_parameters():
        if ".experts." in n and "lora_A" in n:
            assert p.shape[0] == 4 * E, f"{n}: rank {p.shape[0] // E}, not 4"
    g = torch.Generator().manual_seed(9)
    model.load_state_dict({k: torch.randn(v.shape, generator=g) * 0.05 for k, v in model.state_dict().items()
                           if "lora_" in k}, strict=False)
    model.save_pretrained(tmp_path / "adapter")
    stock = PeftModel(AutoModelForCausalLM.from_pretrained(path), PeftConfig.from_pretrained(tmp_path / "adapter"))
    check_load_result(tmp_path / "adapter", stock.load_adapter(str(tmp_path / "adapter"), "default"))
    stock.eval()
    compare(model.eval(), stock, 6, BOUND["bf16", "fp32"], f"{kind} tandem-trained adapter in stock PEFT")
    # ... and through both merges (dense and shared-expert LoRA included)
    from tandem.merge import merge_checkpoint

    merged = merge_checkpoint(path, tmp_path / "adapter", tmp_path / "merged", progress=False)
    compare(AutoModelForCausalLM.from_pretrained(merged).eval(), stock, 6, 1e-5, f"{kind} tandem merge")
    compare(tandem.load_model(path, cfg(), adapter=tmp_path / "adapter", progress=False), stock, 6,
            BOUND["bf16", "fp32"], f"{kind} load_model(adapter=)")

    fresh = AutoModelForCausalLM.from_pretrained(path)
    q = "q_b_proj" if kind == "deepseek_v3" else "q_proj"
    only = peft_config(fresh, 4, 8.0, [q], expert_lora=False)
    assert only.target_parameters is None and only.target_modules == {q}
    if kind == "deepseek_v3":
        mlp = peft_config(fresh, 4, 8.0, ["gate_proj"], expert_lora=False)
        assert mlp.target_modules is None
        assert set(mlp.target_parameters) == {"mlp.gate_proj.weight", "shared_experts.gate_proj.weight"}
    with pytest.raises(ValueError, match=r"--target-modules: nope name no linear layer of this model"):
        peft_config(fresh, 4, 8.0, ["nope"])


def test_merge_of_a_sharded_checkpoint(adapted, tmp_path):
    """Shards and their index survive the merge: same file names, same index, every shard's
    header byte for byte; the merged model loads with from_pretrained and with tandem."""
    from transformers import AutoModelForCausalLM

    from tandem.merge import merge_checkpoint

    path, adapter, stock = adapted("qwen3_moe")
    AutoModelForCausalLM.from_pretrained(path).save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 3 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    out = merge_checkpoint(tmp_path / "sharded", adapter, tmp_path / "merged", progress=False)
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    assert (out / "model.safetensors.index.json").read_bytes() == \
        (tmp_path / "sharded" / "model.safetensors.index.json").read_bytes()
    for name in shards:
        a, b = (out / name).read_bytes(), (tmp_path / "sharded" / name).read_bytes()
        n = 8 + int.from_bytes(a[:8], "little")
        assert len(a) == len(b) and a[:n] == b[:n], name
    compare(AutoModelForCausalLM.from_pretrained(out).eval(), stock, 6, 1e-5, "sharded merge")
    compare(tandem.load_model(out, cfg(), progress=False), stock, 6, BOUND["bf16", "fp32"], "sharded merge in tandem")


def test_disabling_a_merged_adapter_runs_the_base(adapted):
    """PEFT unmerges a merged adapter when it is disabled; so do tandem's experts (they kept
    running merged while attention went back to its base: half an adapter)."""
    from peft import PeftModel

    path, adapter, _ = adapted("qwen3_moe")
    ids = tokens(2)
    with torch.no_grad():
        base = tandem.load_model(path, cfg(), progress=False)(input_ids=ids).logits
    ours = PeftModel.from_pretrained(tandem.load_model(path, cfg(), progress=False), adapter)
    ours.merge_adapter()
    with torch.no_grad(), ours.disable_adapter():
        got = ours(input_ids=ids).logits
    # attention was merged and unmerged in fp32 by PEFT (W + D - D): as in the test above, 1e-3
    # (measured 2e-4; the experts merged would be 0.6 off)
    assert (got - base).abs().max() <= 1e-3 * base.abs().max()


def test_a_merge_that_fails_leaves_the_base_packed(tmp_path):
    """LoRA values that overflow fp16 once merged: the merge is refused naming the expert, and
    every layer still holds its base weights (it used to stay unloaded: every later forward
    failed, and unmerge skipped it)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    build("qwen3_moe", 1, torch.float16, tmp_path / "model")
    stock = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float16),
                           LoraConfig(r=4, lora_alpha=8, target_parameters=EXPERT_PARAMS))
    with torch.no_grad():
        for n, p in stock.named_parameters():
            if "lora_" in n:
                p.fill_(100.0 if "layers.2." in n else 0.01)
    stock.save_pretrained(tmp_path / "adapter")
    ids = tokens(3)
    with torch.no_grad():
        base = tandem.load_model(tmp_path / "model", cfg(), progress=False)(input_ids=ids).logits
    ours = PeftModel.from_pretrained(tandem.load_model(tmp_path / "model", cfg(), progress=False), tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"model layer 2\): expert 0's gate weight is not finite after merging the "
                                         r"adapter and rounding to float16"):
        ours.merge_adapter()
    engine = ours.get_base_model().tandem_engine
    assert all(engine.layer_loaded(i) for i in range(engine.moe_layers))
    ours.unmerge_adapter()  # layers 0 and 1 merged before layer 2 refused: back to the base
    with torch.no_grad(), ours.disable_adapter():
        got = ours(input_ids=ids).logits
    assert (got - base).abs().max() <= 1e-3 * base.abs().max()


def test_adapters_on_fused_expert_checkpoints_are_refused(adapted, tmp_path):
    """A checkpoint that stores the experts fused (transformers v5's save_original_format=False)
    loads (tests/python/test_model_zoo.py), but merging an adapter into its experts, by
    load_model(adapter=) or tandem merge, is refused naming the fused tensor."""
    from transformers import AutoModelForCausalLM

    from tandem.merge import merge_checkpoint

    path, adapter, _ = adapted("qwen3_moe")
    AutoModelForCausalLM.from_pretrained(path).save_pretrained(tmp_path / "fused", save_original_format=False)
    assert tandem.load_model(tmp_path / "fused", cfg(), progress=False).tandem_engine.moe_layers > 0
    with pytest.raises(ValueError, match=r"stores these experts fused \(model\.layers\.\d+\.mlp\.experts\.gate_up_proj\)"):
        tandem.load_model(tmp_path / "fused", cfg(), adapter=adapter, progress=False)
    with pytest.raises(ValueError, match="merging an adapter into fused experts is not supported"):
        merge_checkpoint(tmp_path / "fused", adapter, tmp_path / "merged", progress=False)
    assert not (tmp_path / "merged").exists()
