"""The built-in demo model: a small random-weight Qwen3-MoE checkpoint with a byte-level
tokenizer, both built here (no download), cached under $TANDEM_CACHE or ~/.cache/tandem.

    path = tandem.demo.ensure_demo_model()     # created once; later calls reuse it
    model = tandem.load_model(path, tandem.demo.DEMO_CONFIG)

It goes through the same loader as a real checkpoint (safetensors files written by
transformers' save_pretrained), so `tandem run` exercises the real path end to end.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# Kept equal to configs/demo.yaml (a test checks it); embedded so an installed package has it.
DEMO_CONFIG_YAML = """\
# The built-in demo: a small random-weight Qwen3-MoE model that tandem generates
# itself (no download). CPU experts only, so it runs on any machine.
version: 1
cpu:
  format: bf16
  virtual_subpools: 2     # exercise the NUMA split/merge path even on one node
  threads: auto
  isa: auto
gpu:
  device: auto            # uses a GPU when one is present
  hot_experts: 0
  deferred_experts: 0
trace:
  path: tandem_trace.json
  enabled: false
"""

# Version of the recipe below: bump it when the model changes so caches are rebuilt.
DEMO_VERSION = 1
DEMO_SEED = 20261121
DEMO_SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, intermediate_size=512,
                  max_position_embeddings=4096, norm_topk_prob=True, tie_word_embeddings=False)
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>")


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE") or Path.home() / ".cache" / "tandem")


def demo_config_path() -> Path:
    """configs/demo.yaml of the source tree when present, else a cached copy of the embedded text."""
    src = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
    if src.is_file():
        return src
    out = cache_dir() / "demo.yaml"
    if not out.is_file() or out.read_text() != DEMO_CONFIG_YAML:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(DEMO_CONFIG_YAML)
        tmp.replace(out)
    return out


def build_tokenizer():
    """A byte-level tokenizer: one token per byte (256), then pad / bos / eos. Any text
    round-trips exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(alphabet)}
    for t in SPECIAL_TOKENS:
        vocab[t] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>",
                                   eos_token="<|eos|>", clean_up_tokenization_spaces=False)


def _byte_of(c: str) -> int:
    """The byte that GPT-2's byte-level alphabet maps to character c."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return bs[cs.index(ord(c))]


def build_demo_model(out: str | os.PathLike, *, seed: int = DEMO_SEED, dtype=None) -> Path:
    """Writes the demo checkpoint (config.json, model.safetensors, tokenizer) to `out`."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    dtype = dtype or torch.bfloat16
    tok = build_tokenizer()
    cfg = Qwen3MoeConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, **DEMO_SHAPE)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).to(dtype)
    model.generation_config.pad_token_id = tok.pad_token_id
    out = Path(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def ensure_demo_model(progress: bool = True) -> Path:
    """The cached demo checkpoint, built on first use (atomically: a half-written cache is
    never picked up)."""
    final = cache_dir() / f"demo-qwen3-moe-v{DEMO_VERSION}"
    if (final / "config.json").is_file() and (final / "model.safetensors").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"tandem: building the demo model (once) in {final}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=final.parent))
    try:
        build_demo_model(tmp)
        try:
            tmp.rename(final)
        except OSError:  # another process won the race: use its copy
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
