"""Tiny random-weight transformers MoE checkpoints for the tests, and reference helpers.

Models are built with transformers (fixed seeds), saved with save_pretrained as real
safetensors checkpoints, and loaded back unmodified as the reference.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

KINDS = ("qwen3_moe", "mixtral", "deepseek_v3")
# Also built on request (not in every KINDS test): DeepSeek-V2 (MLA with latents and values
# in whole 64-wide panels, so its one-token attention runs on the pool; softmax router,
# group-limited and scaled; two shared experts; a dense first layer), with the query
# direct (V2-Lite) or through a low rank ("deepseek_v2_qlora").
MORE_KINDS = ("deepseek_v2", "deepseek_v2_qlora")
VOCAB = 200


def hf_config(kind: str):
    from transformers import DeepseekV2Config, DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

    # initializer_range 0.08: activations large enough that logits are not all near-ties.
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  initializer_range=0.08, max_position_embeddings=512)
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=3,
                              head_dim=16, norm_topk_prob=True, **common)
    if kind == "mixtral":
        return MixtralConfig(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, **common)
    if kind == "deepseek_v3":  # dense first layer, shared expert, grouped sigmoid routing with bias
        common["num_key_value_heads"] = 4
        return DeepseekV3Config(intermediate_size=128, moe_intermediate_size=64, first_k_dense_replace=1,
                                n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                                q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                routed_scaling_factor=2.5, **common)
    if kind in ("deepseek_v2", "deepseek_v2_qlora"):
        common["num_key_value_heads"] = 4
        return DeepseekV2Config(intermediate_size=128, moe_intermediate_size=64, first_k_dense_replace=1,
                                n_routed_experts=16, n_shared_experts=2, num_experts_per_tok=4, n_group=4,
                                topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=2.5,
                                q_lora_rank=32 if kind == "deepseek_v2_qlora" else None, kv_lora_rank=64,
                                qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=64, **common)
    raise ValueError(kind)


def build(kind: str, seed: int, dtype: torch.dtype, out: Path) -> nn.Module:
    """Builds, saves to `out` and returns the reference model (loaded back from `out`)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind)).to(dtype)
    if kind == "deepseek_v3":  # a non-zero correction bias, so routing uses it
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(out)
    return AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()


def checkpoint_cache(tmp_path_factory, prefix: str = ""):
    """A function (kind, dtype "fp32" / "bf16") -> checkpoint directory, each built once
    (seed 1) under pytest's tmp_path_factory: the body of a module-scoped fixture."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    cache: dict = {}

    def get(kind: str, dtype: str) -> Path:
        if (kind, dtype) not in cache:
            out = tmp_path_factory.mktemp(f"{prefix}{kind}-{dtype}")
            build(kind, 1, dtypes[dtype], out)
            cache[kind, dtype] = out
        return cache[kind, dtype]
    return get


def moe_experts(model: nn.Module) -> list[nn.Module]:
    return [l.mlp.experts for l in model.model.layers if hasattr(l.mlp, "experts")]


def record_routing(model: nn.Module) -> list[torch.Tensor]:
    """Hooks every experts module; the list fills with each call's sorted top_k_index."""
    rec: list[torch.Tensor] = []
    for ex in moe_experts(model):
        ex.register_forward_hook(lambda mod, args, out: rec.append(args[1].sort(-1).values.clone()))
    return rec


def clean_tokens(ra: list[torch.Tensor], rb: list[torch.Tensor], batch: int, seq: int) -> torch.Tensor:
    """[batch, seq] mask of tokens whose causal past (itself and earlier tokens of its row) got
    the same experts at every MoE layer in both runs. A near-tie in a router can pick a
    different expert under any rounding difference (transformers' own grouped_mm and eager
    paths do this too); such a token and everything attending to it are compared by count,
    not by value."""
    assert len(ra) == len(rb)
    bad = torch.zeros(batch * seq, dtype=torch.bool)
    for x, y in zip(ra, rb):
        bad |= (x != y).any(-1)
    return ~bad.view(batch, seq).cummax(1).values


def expert_fp64(experts: nn.Module) -> nn.Module:
    """An fp64 copy of a transformers experts module run by its eager loop (the reference)."""
    m = copy.deepcopy(experts).double()
    m.config = copy.copy(m.config)
    m.config._experts_implementation = "eager"
    return m


class DeferralReference:
    """Replaces a model's experts forwards by fp64 ones that apply tandem's deferral:
    per token, the `deferred` lowest-weighted CPU (not hot) experts of MoE layer i (ties:
    the later slot) are added to MoE layer i+1's output; the last MoE layer defers nothing."""

    def __init__(self, model: nn.Module, deferred: int, hot: dict[int, list[int]] | None = None):
        self.deferred, self.hot, self.pending = deferred, hot or {}, None
        mods = moe_experts(model)
        for i, ex in enumerate(mods):
            ref = expert_fp64(ex)
            ex.forward = self._forward(i, len(mods), ref)

    def _forward(self, i: int, n: int, ref: nn.Module):
        def forward(x, idx, w):
            T, K = idx.shape
            contrib = torch.zeros(T, K, x.shape[1], dtype=torch.float64)
            for k in range(K):  # each slot's weighted expert output
                one = torch.zeros_like(w, dtype=torch.float64)
                one[:, k] = w[:, k].double()
                contrib[:, k] = ref(x.double(), idx, one)
            defer = torch.zeros(T, K, dtype=torch.bool)
            if i < n - 1:
                hot = torch.zeros(ref.num_experts, dtype=torch.bool)
                hot[self.hot.get(i, [])] = True
                for t in range(T):
                    cold = [k for k in range(K) if not hot[idx[t, k]]]
                    for _ in range(min(self.deferred, len(cold))):
                        pick = cold[0]
                        for k in cold:
                            if w[t, k] <= w[t, pick]:
                                pick = k
                        defer[t, pick] = True
                        cold.remove(pick)
            out = (contrib * (~defer)[..., None]).sum(1)
            if i == 0:
                self.pending = None
            if self.pending is not None:
                out = out + self.pending
            self.pending = (contrib * defer[..., None]).sum(1)
            return out.to(x.dtype)

        return forward


class V4Expert(nn.Module):
    """One expert of a transformers v4 MoE block: gate_proj / up_proj / down_proj linears."""

    def __init__(self, h: int, i: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class V4Block(nn.Module):
    """transformers v4's Qwen3-MoE sparse block: a gate Linear, a ModuleList of per-expert MLPs,
    renormalized softmax top-k and its own loop; returns (out, router_logits) like v4."""

    def __init__(self, h: int = 64, i: int = 64, e: int = 8, k: int = 2):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = e, k, True
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(V4Expert(h, i) for _ in range(e))

    @classmethod
    def from_v5(cls, v5_block: nn.Module, top_k: int) -> "V4Block":
        """The same weights as a transformers v5 block (fused gate_up_proj / down_proj)."""
        gu, dn = v5_block.experts.gate_up_proj.data, v5_block.experts.down_proj.data
        E, two_i, H = gu.shape
        I = two_i // 2
        block = cls(H, I, E, top_k).to(gu.dtype)
        with torch.no_grad():
            block.gate.weight.copy_(v5_block.gate.weight)
            for e, ex in enumerate(block.experts):
                ex.gate_proj.weight.copy_(gu[e, :I])
                ex.up_proj.weight.copy_(gu[e, I:])
                ex.down_proj.weight.copy_(dn[e])
        return block

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


def experts_gradients(model: nn.Module, x0: torch.Tensor, idx: torch.Tensor, w0: torch.Tensor,
                      r: torch.Tensor, layer: int = 1) -> dict[str, torch.Tensor]:
    """One call of a PEFT model's experts module in model layer `layer` on (x0, idx, w0), the
    loss sum(out * r): the gradients of its trainable tensors, of the input (``x``) and of the
    routing weights (``weights``)."""
    experts = model.get_base_model().model.layers[layer].mlp.experts
    x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    (experts(x, idx, w) * r).sum().backward()
    grads = {n: p.grad.clone() for n, p in experts.named_parameters() if p.requires_grad}
    assert grads and all(v is not None for v in grads.values())
    grads.update(x=x.grad.clone(), weights=w.grad.clone())
    return grads


def stock_bf16_experts(path) -> nn.Module:
    """The stock fp32 model of checkpoint `path` with its fused routed experts' weights (3-d;
    not their biases) on the bf16 grid: what tandem's BF16 packs hold."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if ".experts." in name and p.dim() == 3:
                p.copy_(p.bfloat16().float())
    return ref


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}


def load_lora(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    assert sd and set(sd) <= set(model.state_dict()), sorted(set(sd) - set(model.state_dict()))[:4]
    model.load_state_dict(sd, strict=False)


def random_lora(model: nn.Module, seed: int) -> None:
    """Every LoRA tensor of `model` (lora_A and lora_B) drawn from N(0, 0.05^2)."""
    g = torch.Generator().manual_seed(seed)
    load_lora(model, {k: (torch.randn(v.shape, generator=g) * 0.05).to(v.dtype)
                      for k, v in sorted(lora_state(model).items())})


def rel_errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(||got - want|| / ||want||, max |got - want| / max |want|)."""
    g, w = got.double(), want.double()
    assert w.abs().max() > 0
    return ((g - w).norm() / w.norm()).item(), ((g - w).abs().max() / w.abs().max()).item()


def max_rel(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """The largest |a - b| over the positions in `mask` (all when None), relative to max |b|."""
    d = (a.double() - b.double()).abs().amax(-1)
    if mask is not None:
        d = d[mask]
    return (d.max() / b.double().abs().max()).item()


def greedy_logits(model: nn.Module, cache_cls, n: int = 12, seed: int = 0, prompt: int = 9,
                  **kw) -> list[torch.Tensor]:
    """Logits of a random `prompt`-token prompt (seeded) on a fresh `cache_cls` cache, then of
    n greedy one-token steps (kw: extra arguments of those steps' forward)."""
    ids = torch.randint(0, VOCAB, (1, prompt), generator=torch.Generator().manual_seed(seed))
    cache = cache_cls(config=model.config)
    logits = []
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
        logits.append(out.logits)
        for _ in range(n):
            tok = out.logits[:, -1:].argmax(-1)
            out = model(tok, past_key_values=cache, use_cache=True, **kw)
            logits.append(out.logits)
    return logits
