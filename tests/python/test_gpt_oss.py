"""gpt-oss's experts in tandem: biases on gate, up and down, the clamped SwiGLU
(``min(g, limit) * sigmoid(alpha g) * (clamp(u, -limit, limit) + 1)``) and the [E, H, 2I]
interleaved gate/up layout, offloaded from a model transformers loaded, and loaded by
``tandem.load_model`` from a checkpoint in either layout gpt-oss ships: dense (what
``save_pretrained`` writes) and MXFP4 (OpenAI's release: e2m1 blocks of 32 with E8M0 scales).

Reference: the unmodified transformers model loaded from the same checkpoint (random
weights, fixed seed), and an fp64 copy of each experts module on the reference's own inputs.
The bounds are those of test_hf_inference (the same roundings: bf16 weights, input and
intermediate, fp32 sums; int8 / int4 quantization) and were measured here as stated.
"""
from __future__ import annotations


import json

import pytest
import torch
from hf_models import (clean_tokens, expert_fp64, experts_gradients, lora_state, random_lora, record_routing,
                       rel_errors, stock_bf16_experts)

import tandem

VOCAB = 128
FORMATS = {"bf16": {"format": "bf16"}, "int8": {"format": "int8"}, "int4": {"format": "int4", "group_size": 32}}
# One MoE layer on the reference's inputs vs fp64, relative to the largest |output|
# (test_hf_inference's LAYER_BOUND; measured here: bf16 <= 4.6e-3, int8 <= 1.9e-2, int4 <= 0.15).
LAYER_BOUND = {"bf16": 1.6e-2, "int8": 6e-2, "int4": 0.35}
# Whole-model logits on tokens whose routing matched (test_hf_inference's LOGIT_BOUND;
# measured here: fp32 <= 6.8e-3, bf16 <= 1.5e-2 (MXFP4 experts included)).
LOGIT_BOUND = {torch.float32: 1.5e-2, torch.bfloat16: 4e-2}
# The same with the experts' activations quantized to int8 per row (int4 / mxfp4 kernels:
# test_adapters' and test_gptq's integer-format bound; measured here 4.0e-2).
QUANT_ACT_LOGIT_BOUND = 6e-2
# LoRA: PEFT targets on the experts; one layer's gradients in fp32 against stock PEFT
# (test_lora_hf's GRAD_BOUND["fp32"]: relative L2, max relative; measured here <= 3.5e-3).
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
GRAD_BOUND = (1e-2, 1.2e-2)


def cfg(fmt: str = "bf16", **gpu) -> dict:
    return {"version": 1, "cpu": dict(FORMATS[fmt], virtual_subpools=2), "gpu": {"device": "none", **gpu}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random gpt-oss checkpoint per dtype: 2 layers (sliding and full attention), 8
    experts of 64 x 64, top 2; expert weights and biases large enough that the clamps at 7
    are reached (checked in the layer test)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cache = {}

    def get(dtype: torch.dtype):
        if dtype not in cache:
            torch.manual_seed(7)
            config = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                                  num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
                                  layer_types=["sliding_attention", "full_attention"],
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
            model = GptOssForCausalLM(config)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if ".experts." in name:
                        p.normal_(0, 0.5 if "bias" in name else 0.25)
            out = tmp_path_factory.mktemp(f"gpt-oss-{str(dtype).removeprefix('torch.')}")
            model.to(dtype).save_pretrained(out)
            cache[dtype] = out
        return cache[dtype]

    return get


def load(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def tokens(seed: int, batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def experts_of(model):
    return [layer.mlp.experts for layer in model.model.layers]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_gpt_oss_layer_matches_fp64(checkpoint, fmt):
    """Every MoE layer, fed the reference's own (hidden, top_k_index, top_k_weights), against
    an fp64 copy of the transformers experts module (its own eager code)."""
    path = checkpoint(torch.float32)
    ref, model = load(path, torch.float32), load(path, torch.float32)
    refs = [expert_fp64(e) for e in experts_of(ref)]
    inputs = []
    for ex in experts_of(ref):
        ex.register_forward_hook(lambda mod, args, out: inputs.append(tuple(a.detach().clone() for a in args)))
    with torch.no_grad():
        ref(tokens(1))
    engine = tandem.offload(model, cfg(fmt), progress=False)
    assert engine.activation == "a clamped SwiGLU (alpha 1.702, limit 7, up + 1) with biases"
    clamped = 0
    for i, (ex, fp64, (x, idx, w)) in enumerate(zip(experts_of(model), refs, inputs)):
        with torch.no_grad():
            want = fp64(x.double(), idx, w.double())
            got = ex(x, idx, w)
            g = torch.einsum("th,thi->ti", x.double(), fp64.gate_up_proj[idx[:, 0]]) + fp64.gate_up_proj_bias[idx[:, 0]]
            clamped += int((g[:, 0::2] > fp64.limit).sum() + (g[:, 1::2].abs() > fp64.limit).sum())
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        print(f"layer {i} {fmt}: max rel err {err:.2e}")
        assert err <= LAYER_BOUND[fmt]
    assert clamped > 0, "the test input never reached the clamps"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_logits_and_greedy_tokens_match_transformers(checkpoint, dtype):
    path = checkpoint(dtype)
    ref, model = load(path, dtype), load(path, dtype)
    tandem.offload(model, cfg(), progress=False)
    assert type(model.model.layers[0].mlp.experts).__name__ == "TandemExperts"
    assert not any(".mlp.experts." in k for k in model.state_dict()), "expert weights must not be torch state"
    ids = tokens(2)
    ra, rb = record_routing(ref), record_routing(model)
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    clean = clean_tokens(ra, rb, *ids.shape)
    assert clean.float().mean() >= 0.25, f"routing differs for most tokens ({(~clean).sum().item()} of {clean.numel()})"
    d = (b.double() - a.double()).abs().amax(-1)[clean]
    err = (d.max() / a.double().abs().max()).item()
    print(f"gpt-oss {dtype}: clean tokens {clean.sum().item()}/{clean.numel()}, max rel err {err:.2e}")
    assert err <= LOGIT_BOUND[dtype]
    if dtype == torch.float32:
        prompt = tokens(3, batch=1, seq=6)
        with torch.no_grad():
            want = ref.generate(prompt, max_new_tokens=8, do_sample=False)
            got = model.generate(prompt, max_new_tokens=8, do_sample=False)
        assert torch.equal(got, want)


def test_gpt_oss_refusals(checkpoint):
    """What does not compute gpt-oss's experts says so: training the experts' biases (made
    trainable in a PEFT model), hot experts (auto places none), a packed store; layers with
    different limits; an instance whose gating was replaced."""
    from peft import get_peft_model

    path = checkpoint(torch.float32)
    peft = get_peft_model(load(path, torch.float32), lora_config())
    peft.get_base_model().model.layers[0].mlp.experts.base_layer.base_layer.down_proj_bias.requires_grad_(True)
    with pytest.raises(ValueError, match=r"model layer 0 experts: down_proj_bias require grad; tandem keeps the "
                                         r"routed experts' biases frozen"):
        tandem.offload(peft, cfg(), progress=False)
    with pytest.raises(Exception, match=r"gpu.hot_experts: hot experts run silu\(gate\) \* up experts without biases "
                                        r"only; this model's experts are a clamped SwiGLU"):
        tandem.offload(load(path, torch.float32), {"version": 1, "gpu": {"device": "none", "hot_experts": {"count": 2}}},
                       progress=False)
    model = load(path, torch.float32)
    engine = tandem.offload(model, {"version": 1, "gpu": {"device": "none", "hot_experts": {"count": "auto"}}},
                            progress=False)
    assert all(len(engine.hot(i)) == 0 for i in range(2))
    with pytest.raises(ValueError, match=r"a packed expert store holds experts without biases only"):
        tandem.convert(path, cfg(), progress=False)
    model = load(path, torch.float32)
    model.model.layers[0].mlp.experts.limit = 3.0  # layer 0 now clamps at 3 (its class reads self.limit)
    with pytest.raises(ValueError, match=r"MoE layers compute different expert math \(a clamped SwiGLU \(alpha "
                                         r"1.702, limit 3, up \+ 1\) with biases, a clamped SwiGLU \(alpha 1.702, "
                                         r"limit 7, up \+ 1\) with biases\)"):
        tandem.offload(model, cfg(), progress=False)
    model = load(path, torch.float32)
    for ex in experts_of(model):
        ex.limit = 3.0
    tandem.offload(model, cfg(), progress=False)  # the numeric check runs the module's own clamp at 3
    assert "limit 3" in model.model.layers[0].mlp.experts.math.describe()
    model = load(path, torch.float32)
    model.model.layers[1].mlp.experts._apply_gate = lambda gate_up: gate_up[..., ::2]
    with pytest.raises(ValueError, match=r"GptOssExperts \(model layer 1\): its _apply_gate is replaced on the "
                                         r"instance"):
        tandem.offload(model, cfg(), progress=False)


def mxfp4_checkpoint(src, out, seed: int = 1):
    """`src` rewritten as OpenAI ships gpt-oss: each expert projection as MXFP4 blocks and
    scales (random codes, scales 2^-5..2^0) and quantization_config mxfp4."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    sd = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for k in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, K, R = sd.pop(k).shape  # [experts, in, out]
        sd[k + "_blocks"] = torch.randint(0, 256, (E, R, K // 32, 16), generator=g, dtype=torch.uint8)
        sd[k + "_scales"] = torch.randint(122, 128, (E, R, K // 32), generator=g, dtype=torch.uint8)
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    c = json.loads((out / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(c))
    return out


def logit_error(ref, model, label: str) -> float:
    """Max |logit difference| over tokens whose routing matched in every layer, relative to
    the reference's largest |logit| (at least a quarter of the tokens must match)."""
    ids = tokens(4)
    ra, rb = record_routing(ref), record_routing(model)
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    clean = clean_tokens(ra, rb, *ids.shape)
    assert clean.float().mean() >= 0.25
    err = ((b.double() - a.double()).abs().amax(-1)[clean].max() / a.double().abs().max()).item()
    print(f"{label}: clean tokens {clean.sum().item()}/{clean.numel()}, max rel err {err:.2e}")
    return err


@pytest.mark.parametrize("layout", ["dense-fp32", "dense-bf16", "mxfp4"])
def test_load_model_reads_gpt_oss_checkpoints(checkpoint, tmp_path, layout):
    """load_model on a gpt-oss checkpoint against from_pretrained on the same directory: the
    logits on tokens whose routing matched, and for MXFP4 the dequantized experts equal to
    transformers' own dequantization (it dequantizes to bf16 on a CPU)."""
    from tandem.oai_checkpoint import mxfp4_dequantize

    dtype = torch.float32 if layout == "dense-fp32" else torch.bfloat16
    path = checkpoint(dtype)
    if layout == "mxfp4":
        path = mxfp4_checkpoint(path, tmp_path / "mxfp4")
    ref = load(path, dtype)
    if layout == "mxfp4":
        from safetensors.torch import load_file

        sd = load_file(path / "model.safetensors")
        for i, ex in enumerate(experts_of(ref)):
            for proj in ("gate_up_proj", "down_proj"):
                key = f"model.layers.{i}.mlp.experts.{proj}"
                mine = mxfp4_dequantize(sd[key + "_blocks"], sd[key + "_scales"]).transpose(1, 2)
                assert torch.equal(mine, getattr(ex, proj).data), key
    model = tandem.load_model(path, cfg(), progress=False)
    assert model.model.layers[0].mlp.experts.math.activation == "clamped_swiglu"
    assert logit_error(ref, model, f"load_model {layout}") <= LOGIT_BOUND[dtype]


def test_mxfp4_experts_stay_mxfp4(checkpoint, tmp_path):
    """cpu.format mxfp4 on gpt-oss's MXFP4 checkpoint: every expert the engine computes with
    equals the checkpoint's own MXFP4 values exactly (E2M1 codes times 2^(scale - 127)), and
    the logits match transformers within the integer formats' bound (int8 activations)."""
    from safetensors.torch import load_file
    from tandem.oai_checkpoint import mxfp4_dequantize

    path = mxfp4_checkpoint(checkpoint(torch.bfloat16), tmp_path / "mxfp4")
    model = tandem.load_model(path, {"version": 1, "cpu": {"format": "mxfp4", "virtual_subpools": 2},
                                     "gpu": {"device": "none"}}, progress=False)
    engine = model.tandem_engine
    assert engine.format == "mxfp4"
    sd = load_file(path / "model.safetensors")
    experts, inter, hidden = sd["model.layers.0.mlp.experts.down_proj_blocks"].shape[0], *engine.expert_weights(0, 0)[0].shape
    # 4.25 bits a weight (nibbles and one fp16 scale per 32), not bf16's 16
    assert engine.cpu_bytes <= len(model.model.layers) * experts * 3 * hidden * inter * (4.5 / 8)
    for i in range(len(model.model.layers)):
        want = {proj: mxfp4_dequantize(sd[f"model.layers.{i}.mlp.experts.{proj}_blocks"],
                                       sd[f"model.layers.{i}.mlp.experts.{proj}_scales"]).float()
                for proj in ("gate_up_proj", "down_proj")}  # [E, out, in]
        for e in range(want["down_proj"].shape[0]):
            gate, up, down = (torch.from_numpy(a) for a in engine.expert_weights(i, e))
            gu = want["gate_up_proj"][e]  # gpt-oss interleaves gate and up rows
            assert torch.equal(gate, gu[0::2]) and torch.equal(up, gu[1::2]), (i, e)
            assert torch.equal(down, want["down_proj"][e]), (i, e)
    ref = load(path, torch.bfloat16)
    assert logit_error(ref, model, "load_model mxfp4 as mxfp4") <= QUANT_ACT_LOGIT_BOUND


def test_broken_gpt_oss_checkpoints_are_refused_naming_the_tensor(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    src = mxfp4_checkpoint(checkpoint(torch.bfloat16), tmp_path / "good")

    def broken(name, edit):
        out = tmp_path / name
        out.mkdir()
        for f in src.iterdir():
            if f.name != "model.safetensors":
                (out / f.name).write_bytes(f.read_bytes())
        sd = load_file(src / "model.safetensors")
        edit(sd)
        save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
        return out

    key = "model.layers.1.mlp.experts.down_proj"
    cases = [
        (lambda sd: sd.pop(key + "_bias"), rf"checkpoint has no tensor '{key}_bias' \(down bias"),
        (lambda sd: sd.update({key + "_scales": sd[key + "_scales"][:, :, :1].contiguous()}),
         rf"tensor '{key}_scales' has shape \[8, 64, 1\], gpt-oss's experts need \[8, 64, 2\]"),
        (lambda sd: sd.update({key + "_blocks": sd[key + "_blocks"].to(torch.int16)}),
         rf"tensor '{key}_blocks' is int16, MXFP4 stores uint8"),
        (lambda sd: sd.pop(key + "_blocks"), rf"checkpoint has no tensor '{key}_blocks'"),
        (lambda sd: sd.update({"model.layers.1.mlp.experts.extra": torch.zeros(3)}),
         r"checkpoint has tensors the model does not use: 'model.layers.1.mlp.experts.extra'"),
    ]
    for i, (edit, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            tandem.load_model(broken(f"case{i}", edit), cfg(), progress=False)


# ---- LoRA training ------------------------------------------------------------------------

def lora_config(r: int = 4):
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_PARAMS)


@pytest.mark.parametrize("when", ["peft_before_offload", "peft_after_load_model"])
def test_gpt_oss_lora_gradients_match_stock_peft(checkpoint, when):
    """PEFT LoRA on gpt-oss's experts (target_parameters gate_up_proj [E, H, 2I], gate and
    up interleaved, and down_proj) and attention: one MoE layer's gradients (every LoRA
    tensor, the input, the routing weights) in tandem against the stock PEFT module on the
    same input. The biases move every pre-activation and output, the clamps bind for part of
    them (asserted), and lora_B's rows of gate_up_proj alternate gate and up as in the stock
    module: reading them as [gate; up] fails this test. PEFT applied before offloading, or
    after load_model(train=True) with the adapter's tensors copied over by name."""
    from peft import get_peft_model

    path = checkpoint(torch.float32)
    ref = get_peft_model(stock_bf16_experts(path), lora_config())
    random_lora(ref, 3)
    if when == "peft_before_offload":
        import copy

        ours = copy.deepcopy(ref)
        tandem.offload(ours, cfg(), progress=False)
    else:
        ours = get_peft_model(tandem.load_model(path, cfg(), train=True, dtype=torch.float32, progress=False),
                              lora_config())
        sd = lora_state(ref)
        assert sd.keys() == lora_state(ours).keys()
        ours.load_state_dict(sd, strict=False)
        with torch.no_grad():  # PEFT wrapped tandem's experts: the block's first forward routes them to tandem
            ours(tokens(1, batch=1, seq=4))
    te = ours.get_base_model().model.layers[1].mlp.experts
    while hasattr(te, "base_layer"):
        te = te.base_layer
    assert type(te).__name__ == "TandemLoraExperts" and te.lora_layer.activation.endswith("with biases")
    stock = ref.get_base_model().model.layers[1].mlp.experts.base_layer.base_layer
    E, H, two_i = stock.gate_up_proj.shape
    gen = torch.Generator().manual_seed(11)
    x0 = (torch.randn(48, H, generator=gen) * 4).bfloat16().float()  # the clamps bind for part of the rows
    idx = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(48)])
    w0 = torch.rand(48, 2, generator=gen) + 0.1
    r = torch.randn(48, H, generator=gen)
    with torch.no_grad():
        gu = torch.einsum("th,thi->ti", x0, stock.gate_up_proj[idx[:, 0]]) + stock.gate_up_proj_bias[idx[:, 0]]
        share = ((gu[:, 0::2] > stock.limit).float().mean() + (gu[:, 1::2].abs() > stock.limit).float().mean()) / 2
    assert share > 0.02, f"the clamps bind for only {share:.1%} of the pre-activations"
    want, got = experts_gradients(ref, x0, idx, w0, r), experts_gradients(ours, x0, idx, w0, r)
    assert got.keys() == want.keys() and len(want) == 6
    errs = {n: rel_errors(got[n], want[n]) for n in want}
    print(f"gpt-oss LoRA ({when}): " + ", ".join(f"{'.'.join(n.split('.')[-4:])} {e[0]:.1e}/{e[1]:.1e}"
                                                  for n, e in errs.items()))
    for n, (l2, mx) in errs.items():
        assert l2 <= GRAD_BOUND[0] and mx <= GRAD_BOUND[1], f"{n}: relative L2 {l2:.2e}, max {mx:.2e}"


def test_gpt_oss_lora_training_matches_stock_peft_and_the_adapter_loads_on_the_stock_model(checkpoint, tmp_path):
    """Three AdamW steps of LoRA training on the whole gpt-oss model (attention and experts)
    in tandem and in stock PEFT from the same initial adapter: the losses agree step by
    step, and the adapter tandem saves loads with stock PEFT onto the stock model, whose
    logits then match tandem's trained model."""
    from peft import PeftModel, get_peft_model

    path = checkpoint(torch.float32)
    ref = get_peft_model(stock_bf16_experts(path), lora_config())
    random_lora(ref, 5)
    ours = get_peft_model(tandem.load_model(path, cfg(), train=True, dtype=torch.float32, progress=False),
                          lora_config())
    ours.load_state_dict(lora_state(ref), strict=False)
    ids = tokens(4, batch=2, seq=16)
    losses = {}
    for name, model in (("stock", ref), ("tandem", ours)):
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses[name] = []
        for _ in range(3):
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
    print(f"gpt-oss LoRA losses: stock {losses['stock']}, tandem {losses['tandem']}")
    assert losses["tandem"][-1] < losses["tandem"][0], "training did not lower the loss"
    for a, b in zip(losses["stock"], losses["tandem"]):
        assert abs(a - b) <= 2e-3 * abs(a), (losses["stock"], losses["tandem"])
    ours.save_pretrained(tmp_path / "adapter")
    stock = PeftModel.from_pretrained(stock_bf16_experts(path), tmp_path / "adapter").eval()
    ours.eval()
    probe = tokens(6, batch=1, seq=12)
    with torch.no_grad():
        want, got = stock(probe).logits, ours(probe).logits
    err = ((got - want).abs().max() / want.abs().max()).item()
    print(f"gpt-oss adapter on the stock model: max rel logit err {err:.2e}")
    assert err <= LOGIT_BOUND[torch.float32]


def test_doctor_sizes_gpt_oss_and_refuses_its_hot_experts(checkpoint, tmp_path):
    """`tandem doctor` knows gpt-oss's experts from config.json (swiglu_limit) and the
    checkpoint (expert biases): hot experts configured by count are the refusal the engine
    gives; with auto, every expert is planned on the CPU, as many bytes as the engine packs."""
    import os
    import subprocess
    import sys

    path = checkpoint(torch.float32)

    def doctor(hot: str):
        cfg = tmp_path / f"{hot}.yaml"
        cfg.write_text(f"model:\n  path: {path}\ncpu: {{format: bf16, virtual_subpools: 2, threads: 1}}\n"
                       f"gpu: {{device: none, hot_experts: {{count: {hot}}}}}\n")
        r = subprocess.run([sys.executable, "-m", "tandem", "doctor", "--config", str(cfg), "--no-gpu-kernel", "--json"],
                           capture_output=True, text=True, env=dict(os.environ), timeout=120)
        return cfg, json.loads(r.stdout)["config"]

    _, c = doctor("2")
    assert any("gpu.hot_experts: hot experts run silu(gate) * up experts without biases only; this model's experts "
               "are a clamped SwiGLU (config.json: swiglu_limit 7); experts with biases (checkpoint: model.layers."
               in p for p in c["problems"]), c["problems"]
    cfg, c = doctor("auto")
    mem = c["memory"]
    assert mem["checked"] and mem["hot_experts"] == 0, mem
    engine = tandem.load_model(path, str(cfg), progress=False).tandem_engine
    assert mem["cpu_expert_bytes"] == engine.cpu_bytes and engine.device_bytes == 0
