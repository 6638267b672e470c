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
        assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape, n
        g, w = got[n].double(), want[n].double()
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


@pytest.mark.parametrize("config", [CFG, CFG_SPLIT], ids=["one_subpool", "two_subpools"])
@pytest.mark.parametrize("how", ["load_model", "offload"])
@pytest.mark.parametrize("kind", list(ATTENTION))
def test_peft_after_offload_matches_peft_before(checkpoint, kind, how, config):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    path = checkpoint(kind, "fp32")
    _, before = peft_pair(checkpoint, kind, "fp32", config)
    if how == "load_model":
        base = tandem.load_model(path, config, train=True, progress=False)
    else:
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tandem.offload(base, config, train=True, progress=False)
    assert not any(".mlp.experts." in k for k in base.state_dict())
    after = get_peft_model(base, lora_config(kind))
    load_lora(after, {k: v for k, v in before.state_dict().items() if "lora_" in k})
    train_routers(after)
    assert not any(".mlp.experts." in k and "lora_" not in k for k in after.state_dict())
    ids = tokens(5)
    ra, rb = record_routing(before), record_routing(after)
    a, la = gradients(before, ids)
    b, lb = gradients(after, ids)
    assert len(ra) == len(rb) and all(torch.equal(x, y) for x, y in zip(ra, rb))
    errs = errors(b, a)
    print(f"MEASURE after-vs-before {kind} {how} {config['cpu']}: {worst(errs)} logits {(lb - la).abs().max().item()}")


def strip_router_logits(module, args, out):
    """v4 sparse blocks return (hidden, router_logits); the v5 decoder layer wants hidden."""
    return out[0] if isinstance(out, tuple) else out


class V4Expert(nn.Module):
    def __init__(self, h: int, i: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class V4Block(nn.Module):
    """transformers v4's Qwen3MoeSparseMoeBlock: a gate Linear, a ModuleList of per-expert MLPs,
    softmax top-k routing (renormalized) and its own loop over experts."""

    def __init__(self, v5_block: nn.Module, top_k: int):
        super().__init__()
        gu, dn = v5_block.experts.gate_up_proj.data, v5_block.experts.down_proj.data
        E, two_i, H = gu.shape
        I = two_i // 2
        self.num_experts, self.top_k, self.norm_topk_prob = E, top_k, True
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(V4Expert(H, I) for _ in range(E))
        with torch.no_grad():
            self.gate.weight.copy_(v5_block.gate.weight)
            for e, ex in enumerate(self.experts):
                ex.gate_proj.weight.copy_(gu[e, :I])
                ex.up_proj.weight.copy_(gu[e, I:])
                ex.down_proj.weight.copy_(dn[e])
        self.register_forward_hook(strip_router_logits)

    def forward(self, hidden):
        b, s, h = hidden.shape
        x = hidden.view(-1, h)
        logits = self.gate(x)
        w, idx = torch.topk(torch.softmax(logits, -1, dtype=torch.float), self.top_k, -1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e, ex in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            if len(tok):
                out = out.index_add(0, tok, ex(x[tok]) * w[tok, slot, None])
        return out.view(b, s, h), logits


def test_v4_per_expert_layout_matches_stock_peft(checkpoint):
    from peft import LoraConfig, get_peft_model

    v5 = stock_model(checkpoint("qwen3_moe", "fp32"), "fp32")
    model = copy.deepcopy(v5)
    top_k = model.config.num_experts_per_tok
    for layer in model.model.layers:
        layer.mlp = V4Block(layer.mlp, top_k)
    ids = tokens(5)
    with torch.no_grad():
        conv = (model(ids).logits - v5(ids).logits).abs().max() / v5(ids).logits.abs().max()
    print(f"MEASURE v4 conversion {conv.item():.2e}")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"])
    ref = get_peft_model(model, cfg)
    random_lora(ref, 3)
    train_routers(ref)
    ours = copy.deepcopy(ref)
    tandem.offload(ours, CFG, progress=False)
    assert not any(k.endswith("_proj.base_layer.weight") and ".experts." in k for k in ours.state_dict())
    ra, rb = record_routing(ref, top_k), record_routing(ours, top_k)
    want, _ = gradients(ref, ids)
    got, _ = gradients(ours, ids)
    assert len(ra) == len(rb) == 3 and all(torch.equal(x, y) for x, y in zip(ra, rb))
    errs = errors(got, want)
    print(f"MEASURE v4 grads: {worst(errs)} n={len(errs)}")


def logits_of(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def logit_errors(got, want):
    g, w = got.double(), want.double()
    return ((g - w).norm() / w.norm()).item(), ((g - w).abs().max() / w.abs().max()).item()


def test_adapter_trained_in_tandem_loads_in_stock_peft(checkpoint, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    path = checkpoint("qwen3_moe", "fp32")
    stock, ours = peft_pair(checkpoint, "qwen3_moe", "fp32", routers=False)
    start = {k: v.clone() for k, v in ours.state_dict().items() if "lora_" in k}
    opt = torch.optim.SGD([p for p in ours.parameters() if p.requires_grad], lr=1.0)
    for step in range(2):
        gradients(ours, tokens(10 + step))
        opt.step()
    moved = max((ours.state_dict()[k] - v).abs().max().item() for k, v in start.items())
    print(f"MEASURE sgd moved {moved:.2e}")
    ours.save_pretrained(tmp_path / "ours")
    stock.save_pretrained(tmp_path / "stock")
    saved = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    assert saved.keys() == load_file(tmp_path / "stock" / "adapter_model.safetensors").keys()
    sd = ours.state_dict()
    for k, v in saved.items():
        key = k.replace(".weight", ".default.weight")
        assert torch.equal(v, sd[key]), k
    fresh = PeftModel.from_pretrained(stock_model(path, "fp32"), tmp_path / "ours")
    ids = tokens(6)
    ra, rb = record_routing(fresh), record_routing(ours)
    a, b = logits_of(fresh, ids), logits_of(ours, ids)
    assert len(ra) == len(rb) and all(torch.equal(x, y) for x, y in zip(ra, rb))
    print(f"MEASURE roundtrip ours->stock logits {logit_errors(b, a)}")


@pytest.mark.parametrize("how", ["offload", "load_model"])
def test_adapter_saved_by_stock_peft_runs_in_tandem(checkpoint, tmp_path, how):
    from peft import PeftModel, get_peft_model

    path = checkpoint("qwen3_moe", "fp32")
    stock = get_peft_model(stock_model(path, "fp32"), lora_config("qwen3_moe"))
    random_lora(stock, 8)
    stock.save_pretrained(tmp_path)
    if how == "offload":
        ours = PeftModel.from_pretrained(stock_model(path, "fp32"), tmp_path)
        tandem.offload(ours, CFG, progress=False)
    else:
        ours = PeftModel.from_pretrained(tandem.load_model(path, CFG, train=True, progress=False), tmp_path)
    ids = tokens(6)
    ra, rb = record_routing(stock), record_routing(ours)
    a, b = logits_of(stock, ids), logits_of(ours, ids)
    assert len(ra) == len(rb) and all(torch.equal(x, y) for x, y in zip(ra, rb))
    print(f"MEASURE stock adapter -> tandem ({how}) logits {logit_errors(b, a)}")


def test_autocast_bf16(checkpoint):
    stock, ours = peft_pair(checkpoint, "qwen3_moe", "fp32")
    ids = tokens(5)
    plain, _ = gradients(ours, ids)
    ra, rb = record_routing(stock), record_routing(ours)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto, _ = gradients(ours, ids)
        sauto, _ = gradients(stock, ids)
    print("routing same", len(ra) == len(rb) and all(torch.equal(x, y) for x, y in zip(ra, rb)))
    print(f"MEASURE autocast vs plain {worst(errors(auto, plain))}; vs stock autocast {worst(errors(auto, sauto))}")


class Spy:
    """Stands in for a _C.LoraLayer: records every context its forward makes and which ones its
    backward consumes (weak references: the spy must not keep them alive)."""

    def __init__(self, layer):
        self.layer, self.made, self.used = layer, [], []

    def __getattr__(self, name):
        return getattr(self.layer, name)

    def forward(self, *args, **kwargs):
        c = self.layer.forward(*args, **kwargs)
        self.made.append((weakref.ref(c), args[-1]))
        return c

    def backward(self, c, *args, **kwargs):
        self.used.append(next(i for i, (r, _) in enumerate(self.made) if r() is c))
        return self.layer.backward(c, *args, **kwargs)


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
def test_contexts_are_freed(checkpoint, checkpointing):
    import gc
    _, ours = peft_pair(checkpoint, "qwen3_moe", "fp32")
    spies = []
    for layer in hf_of(ours).model.layers:
        te = layer.mlp.experts
        while not isinstance(te, tandem.engine.TandemLoraExperts):
            te = te.base_layer
        te.lora_layer = Spy(te.lora_layer)
        spies.append(te.lora_layer)
    set_checkpointing(ours, checkpointing)
    ours.train()
    out = ours(input_ids=tokens(5), labels=tokens(5), use_cache=False)
    gc.collect()
    print(checkpointing, "after forward", [[(r() is not None, t) for r, t in s.made] for s in spies])
    out.loss.backward()
    print(checkpointing, "after backward", [[(r() is not None, t) for r, t in s.made] for s in spies], [s.used for s in spies])
