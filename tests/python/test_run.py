"""`tandem run` and the built-in demo model (built here, cached, loaded by the real loader)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tandem
from tandem import demo

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("tandem-cache")
    old = os.environ.get("TANDEM_CACHE")
    os.environ["TANDEM_CACHE"] = str(d)
    yield d
    if old is None:
        del os.environ["TANDEM_CACHE"]
    else:
        os.environ["TANDEM_CACHE"] = old


def test_embedded_demo_config_is_configs_demo_yaml():
    assert demo.DEMO_CONFIG_YAML == (ROOT / "configs" / "demo.yaml").read_text()
    tandem.parse_config(demo.DEMO_CONFIG_YAML)  # and it is valid


def test_byte_level_tokenizer_round_trips_any_text():
    tok = demo.build_tokenizer()
    assert len(tok) == 256 + len(demo.SPECIAL_TOKENS)
    for text in ["The quick brown fox", "  leading spaces\tand\ttabs\n", "naïve café ☕ 数学 🦊", "\x00\x01\xff"]:
        ids = tok(text)["input_ids"]
        assert len(ids) == len(text.encode("utf-8")), "one token per byte"
        assert tok.decode(ids) == text
    assert tok.decode([tok.eos_token_id], skip_special_tokens=True) == ""


def test_demo_model_is_built_once_and_matches_transformers(cache):
    path = demo.ensure_demo_model(progress=False)
    assert path.parent == cache and (path / "model.safetensors").is_file()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    (cache / ".demo-leftover").mkdir()  # an interrupted build elsewhere must not matter
    assert demo.ensure_demo_model(progress=False) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp, "the cache was rebuilt"

    from transformers import AutoModelForCausalLM
    from hf_models import clean_tokens, record_routing

    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    model = tandem.load_model(path, demo.demo_config_path(), device="cpu", progress=False)
    assert model.tandem_engine.moe_layers == demo.DEMO_SHAPE["num_hidden_layers"]
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(4))
    ra, rb = record_routing(ref), record_routing(model)
    with torch.no_grad():
        a, b = ref(ids).logits.double(), model(ids).logits.double()
    clean = clean_tokens(ra, rb, *ids.shape)
    assert clean.float().mean() >= 0.25
    err = ((a - b).abs().amax(-1)[clean].max() / a.abs().max()).item()
    assert err <= 4e-2, err  # bf16 model: the bound of test_hf_inference.LOGIT_BOUND["bf16"]


def run_cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "tandem", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_tandem_run_on_the_demo_model(cache, tmp_path):
    trace = tmp_path / "trace.json"
    r = run_cli("run", "--max-new-tokens", "6", "--no-progress", "--trace", str(trace))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for want in ("qwen3_moe", "prefill:", "decode:", "tokens/s", "format bf16", "device stream"):
        assert want in out, f"{want!r} missing from:\n{out}"
    rows = [l.split() for l in out.splitlines() if l.strip() and l.split()[0].isdigit()]
    assert len(rows) == demo.DEMO_SHAPE["num_hidden_layers"]
    # hot + cpu pairs per layer = every routed (token, expert) pair: tokens x top_k.
    prompt_tokens = len("The quick brown fox".encode())
    tokens_seen = prompt_tokens + 6 - 1
    for row in rows:
        assert int(row[1]) + int(row[2]) + int(row[3]) == tokens_seen * demo.DEMO_SHAPE["num_experts_per_tok"], row
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"gate_up", "down"} <= names, sorted(n for n in names if n)


def test_tandem_run_sampling_and_errors(cache, tmp_path):
    r = run_cli("run", "--max-new-tokens", "3", "--sample", "--seed", "3", "--no-progress")
    assert r.returncode == 0, r.stderr
    r = run_cli("run", "--model", str(tmp_path / "nowhere"), "--no-progress")
    assert r.returncode == 2 and "tandem: error:" in r.stderr and "no config.json" in r.stderr
    r = run_cli("run", "--max-new-tokens", "0", "--no-progress")
    assert r.returncode == 2 and "--max-new-tokens" in r.stderr
