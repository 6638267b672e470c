"""Shared fixtures: a replayable seed and small checkpoints built with transformers."""
from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture
def seed(request) -> int:
    """TANDEM_TEST_SEED when set (to replay a failure), else a fixed default; printed."""
    s = int(os.environ.get("TANDEM_TEST_SEED", "20261121"))
    print(f"[seed] TANDEM_TEST_SEED={s} ({request.node.nodeid})")
    torch.manual_seed(s)
    return s


@pytest.fixture
def cli_refuses(tmp_path, monkeypatch, capsys):
    """refuses(command, argv, message): `tandem COMMAND --no-progress ARGV` exits 2 with the
    one line "tandem: error: MESSAGE..." ({tmp} in argv and message is tmp_path), before the
    demo model is built (TANDEM_CACHE points at an empty folder that must stay absent)."""
    from tandem import cli

    def refuses(command: str, argv: list[str], message: str) -> None:
        monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
        argv = [a.format(tmp=tmp_path) for a in argv]
        assert cli.main([command, "--no-progress", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tandem: error: " + message.format(tmp=tmp_path)) and err.count("\n") == 1, err
        assert not (tmp_path / "cache").exists(), "checked before the demo model was built"

    return refuses


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory) -> str:
    """A random-weight Qwen3-MoE checkpoint saved by transformers in 10 shards + index."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                         num_experts_per_tok=2, head_dim=8)
    torch.manual_seed(1234)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    out = tmp_path_factory.mktemp("tiny_qwen3_moe")
    model.save_pretrained(out, max_shard_size="20KB")
    return str(out)
