"""LoRA fine-tuning through tandem inside transformers + PEFT: gradients, adapters, errors.

DRAFT (measurement run).
"""
from __future__ import annotations

import copy
import weakref

import pytest
import torch
from hf_models import VOCAB, build
from torch import nn

import tandem

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CFG = {"version": 1, "cpu": {"threads": 2}, "gpu": {"device": "none"}}
CFG_SPLIT = {"version": 1, "cpu": {"threads": 2, "virtual_subpools": 2}, "gpu": {"device": "none"}}
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTENTION = {"qwen3_moe": ["q_proj", "v_proj"], "deepseek_v3": ["q_b_proj", "kv_b_proj"]}
CHECKPOINTING = ["none", "reentrant", "non_reentrant"]
BATCH, SEQ = 2, 16


def lora_config(kind: str):
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION[kind], target_parameters=EXPERT_PARAMS)


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(kind, dtype) -> checkpoint dir, built once per module."""
    cache = {}

    def get(kind: str, dtype: str):
        if (kind, dtype) not in cache:
            out = tmp_path_factory.mktemp(f"{kind}-{dtype}")
            build(kind, 1, DTYPES[dtype], out)
            cache[kind, dtype] = out
        return cache[kind, dtype]

    return get


def stock_model(path, dtype: str) -> nn.Module:
    """The transformers model of `path` with its expert weights rounded to bf16 values (what
    tandem's BF16 packs hold), so that both sides compute with the same weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".mlp.experts." in n:
                p.copy_(p.bfloat16().to(p.dtype))
    return model


def random_lora(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Every LoRA tensor of `model` set to N(0, 0.05^2) (lora_B too: PEFT's zero init would leave
    lora_A without gradient); returns the state dict so another model can load the same."""
    g = torch.Generator().manual_seed(seed)
    sd = {k: (torch.randn(v.shape, generator=g) * 0.05).to(v.dtype)
          for k, v in sorted(model.state_dict().items()) if "lora_" in k}
    assert sd
    load_lora(model, sd)
    return sd


def load_lora(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    missing = set(sd) - set(model.state_dict())
    assert not missing, sorted(missing)[:4]
    model.load_state_dict(sd, strict=False)


def train_routers(model: nn.Module) -> None:
    n = 0
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            p.requires_grad_(True)
            n += 1
    assert n > 0


def hf_of(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def record_routing(model: nn.Module, top_k: int | None = None) -> list[torch.Tensor]:
    """Each router call's sorted expert ids (v5 routers return them; v4 gate Linears give logits)."""
    rec = []

    def hook(mod, args, out):
        idx = out[2] if isinstance(out, tuple) else out.topk(top_k, -1).indices
        rec.append(idx.detach().sort(-1).values.clone())

    for layer in hf_of(model).model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and not hasattr(layer.mlp, "gate_proj"):
            gate.register_forward_hook(hook)
    return rec


def set_checkpointing(model: nn.Module, mode: str) -> None:
    hf = hf_of(model)
    if mode == "none":
        hf.gradient_checkpointing_disable() if hasattr(hf, "gradient_checkpointing_disable") else None
        return
    hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
    hf.config.use_cache = False


def gradients(model: nn.Module, ids: torch.Tensor, checkpointing: str = "none") -> tuple[dict, torch.Tensor]:
    """Runs forward + backward (cross entropy on ids) from inputs_embeds that require grad; returns
    {name: grad} of every trainable parameter and of the input embeddings, and the logits."""
    set_checkpointing(model, checkpointing)
    model.train()
    model.zero_grad(set_to_none=True)
    emb = hf_of(model).get_input_embeddings()(ids).detach().requires_grad_(True)
    out = model(inputs_embeds=emb, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    missing = [n for n, g in grads.items() if g is None]
    assert not missing, missing
    grads["inputs_embeds"] = emb.grad.clone()
    return grads, out.logits.detach()


def errors(got: dict, want: dict) -> dict[str, tuple[float, float]]:
    """name -> (relative L2 error, max abs error / max |want|)."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))[:6]
    out = {}
    for n in want:
        g, w = got[n].double(), want[n].double()
        assert g.dtype == w.dtype and g.shape == w.shape
        assert w.norm() > 0, f"{n}: zero reference gradient"
        out[n] = (((g - w).norm() / w.norm()).item(), ((g - w).abs().max() / w.abs().max()).item())
    return out


def worst(errs: dict[str, tuple[float, float]]) -> tuple[float, float]:
    return max(e[0] for e in errs.values()), max(e[1] for e in errs.values())


def peft_pair(checkpoint, kind: str, dtype: str, config=CFG, routers=True):
    """(stock PEFT model, its deepcopy with the experts offloaded to tandem), same random LoRA."""
    from peft import get_peft_model

    ref = get_peft_model(stock_model(checkpoint(kind, dtype), dtype), lora_config(kind))
    random_lora(ref, 3)
    if routers:
        train_routers(ref)
    ours = copy.deepcopy(ref)
    tandem.offload(ours, config, progress=False)
    return ref, ours


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", list(ATTENTION))
def test_gradients_match_stock_peft(checkpoint, kind, dtype, checkpointing):
    ref, ours = peft_pair(checkpoint, kind, dtype)
    ids = tokens(5)
    ra, rb = record_routing(ref), record_routing(ours)
    want, want_logits = gradients(ref, ids, checkpointing)
    plain, _ = gradients(ours, ids, "none")
    rb.clear()
    got, got_logits = gradients(ours, ids, checkpointing)
    print(len(ra), len(rb))
    assert len(ra) == len(rb) and all(torch.equal(a, b) for a, b in zip(ra, rb))
    errs = errors(got, want)
    l2, mx = worst(errs)
    for n, e in sorted(errs.items(), key=lambda x: -x[1][0])[:3]:
        print(f"  {n}: {e[0]:.2e} {e[1]:.2e}")
    print(f"MEASURE grads {kind} {dtype} {checkpointing}: rel L2 {l2:.2e}, max {mx:.2e}, n={len(errs)}")
    if checkpointing != "none":
        e2 = worst(errors(got, plain))
        print(f"MEASURE ckpt-vs-none {kind} {dtype} {checkpointing}: {e2}")
