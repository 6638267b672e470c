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


def test_generation_on_cuda_runs_sdpa_without_cudnn(monkeypatch):
    """tandem's generation commands keep SDPA off cuDNN on CUDA (a plan per new key length made
    every step of a first generation ~60 ms on an H200) and restore torch's flags afterwards;
    CPU generation and TANDEM_SDPA_CUDNN=1 leave torch's choice alone."""
    from torch.nn.attention import SDPBackend

    from tandem.attention import generation_attention, generation_sdpa_backends

    monkeypatch.delenv("TANDEM_SDPA_CUDNN", raising=False)
    got = generation_sdpa_backends("cuda:0")
    assert SDPBackend.CUDNN_ATTENTION not in got and SDPBackend.FLASH_ATTENTION in got and SDPBackend.MATH in got
    assert generation_sdpa_backends("cpu") is None
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with generation_attention(torch.device("cuda", 0)):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    monkeypatch.setenv("TANDEM_SDPA_CUDNN", "1")
    assert generation_sdpa_backends("cuda:0") is None
    with generation_attention("cuda:0"):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before


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


def test_tandem_run_with_an_adapter(cache, tmp_path):
    """--adapter reaches load_model: the command's greedy text is what load_model(adapter=)
    generates in process, and not the base model's (the adapter is strong: lora_A and
    lora_B random, so this cannot pass with the adapter dropped)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = demo.ensure_demo_model(progress=False)
    stock = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    g = torch.Generator().manual_seed(1)
    stock.load_state_dict({k: torch.randn(v.shape, generator=g).to(v.dtype) * 0.2
                           for k, v in stock.state_dict().items() if "lora_" in k}, strict=False)
    stock.save_pretrained(tmp_path / "adapter")
    texts = {}
    for name, extra in (("base", []), ("adapter", ["--adapter", str(tmp_path / "adapter")])):
        r = run_cli("run", "--max-new-tokens", "8", "--no-progress", *extra)
        assert r.returncode == 0, r.stderr
        texts[name] = next(l for l in r.stdout.splitlines() if l.startswith("output: "))
    assert f"adapter: {tmp_path / 'adapter'} (merged)" in r.stdout
    model = tandem.load_model(path, ROOT / "configs" / "demo.yaml", adapter=tmp_path / "adapter", progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("The quick brown fox", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    want = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert texts["adapter"] == f"output: {want!r}"
    assert texts["adapter"] != texts["base"]


# ---- inputs checked before the model loads ---------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--prompt", ""], "--prompt is empty"),
    (["--trace", "{tmp}/no-dir/trace.json"], "--trace {tmp}/no-dir/trace.json: the directory {tmp}/no-dir does not exist"),
    (["--record-routing", "{tmp}/no-dir/s.json"], "--record-routing {tmp}/no-dir/s.json: the directory"),
    (["--model", "{tmp}/nowhere"], "--model: {tmp}/nowhere: no such directory"),
    (["--config", "{tmp}/cfg/with-model-path.yaml"], "model.path of {tmp}/cfg/with-model-path.yaml: {tmp}/cfg/missing"),
    (["--device", "cuda"], "--device cuda: torch sees no CUDA device"),
    (["--config", "{tmp}/cfg/cuda.yaml"], "{tmp}/cfg/cuda.yaml: gpu.device is 'cuda:0' but torch sees no CUDA device"),
    (["--adapter", "{tmp}/nowhere"], "--adapter {tmp}/nowhere: no adapter_config.json there"),
])
def test_run_checks_its_inputs_before_loading_a_model(argv, message, tmp_path, monkeypatch, cli_refuses):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "with-model-path.yaml").write_text("model:\n  path: missing\n")
    (tmp_path / "cfg" / "cuda.yaml").write_text("gpu:\n  device: cuda:0\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU
    cli_refuses("run", argv, message)


# ---- model.path and trace.* from the config, --record-routing ---------------------------

def _demo_copy(tmp_path: Path) -> Path:
    """The demo checkpoint under another name, so output names which one was loaded."""
    import shutil

    return Path(shutil.copytree(demo.ensure_demo_model(progress=False), tmp_path / "cfg" / "mymodel"))


def test_run_uses_the_configs_model_path_and_trace_section(cache, tmp_path, monkeypatch, capsys):
    from tandem import cli, tracing

    copy = _demo_copy(tmp_path)
    cfg = tmp_path / "cfg" / "run.yaml"  # model.path resolves against the config's directory,
    cfg.write_text(demo.DEMO_CONFIG_YAML.replace("enabled: false", "enabled: true")  # trace.path against the cwd
                   .replace("path: tandem_trace.json", "path: run_trace.json") + "model:\n  path: mymodel\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert cli.main(["run", "--config", str(cfg), "--max-new-tokens", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"model: {copy} (model.path of {cfg})", out
    assert out[1] == f"config: {cfg}", out
    assert out[2].startswith("loaded: qwen3_moe"), out
    assert out[3].startswith("dense layers: ") and "on tandem's kernels (" in out[3], out  # bf16 demo: auto
    events = json.loads((work / "run_trace.json").read_text())["traceEvents"]
    assert {"gate_up", "down"} <= {e.get("name") for e in events}
    assert tracing.pending() == [] and not tandem.trace.enabled(), "the CLI wrote the trace itself"
    # An explicit --model wins over model.path.
    assert cli.main(["run", "--model", str(demo.ensure_demo_model(progress=False)), "--config", str(cfg),
                     "--max-new-tokens", "2", "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"model: {demo.ensure_demo_model(progress=False)} (--model)"


def test_recorded_routing_statistics_choose_the_hot_experts(cache, tmp_path, capsys):
    from tandem import cli

    stats = tmp_path / "stats.json"
    assert cli.main(["run", "--max-new-tokens", "8", "--no-progress", "--record-routing", str(stats),
                     "--prompt", "Mixture-of-Experts models route each token to a few experts."]) == 0
    capsys.readouterr()
    data = json.loads(stats.read_text())
    E, k, L = demo.DEMO_SHAPE["num_experts"], demo.DEMO_SHAPE["num_experts_per_tok"], demo.DEMO_SHAPE["num_hidden_layers"]
    assert data["format"] == "tandem.routing_statistics" and data["experts"] == E
    assert sorted(map(int, data["layers"])) == list(range(L))
    tokens = len(b"Mixture-of-Experts models route each token to a few experts.") + 8 - 1
    assert all(sum(c) == tokens * k for c in data["layers"].values())

    # The file, named relative to a config, picks each layer's most-routed experts (ties: lower id).
    cfg = tmp_path / "hot.yaml"
    cfg.write_text("gpu:\n  device: none\n  hot_experts:\n    count: 4\n    statistics: stats.json\n")
    assert tandem.load_config(cfg)["gpu"]["hot_experts"]["statistics"] == str(stats)
    path = demo.ensure_demo_model(progress=False)
    engine = tandem.load_model(path, cfg, device="cpu", progress=False).tandem_engine
    uniform = tandem.load_model(path, {"gpu": {"device": "none", "hot_experts": 4}}, device="cpu",
                                progress=False).tandem_engine
    chosen = []
    for i in range(L):
        c = data["layers"][str(engine.layers[i])]
        want = sorted(sorted(range(E), key=lambda e: (-c[e], e))[:4])
        assert engine.hot(i) == want, (i, c)
        chosen.append(engine.hot(i))
    assert chosen != [uniform.hot(i) for i in range(L)], "statistics chose the same experts as count alone"


# ---- trace.* through the Python API -------------------------------------------------------

def test_config_trace_in_load_model_is_written_at_exit(cache, tmp_path):
    # load_model with trace.enabled: recording starts, trace.path (relative to the cwd) is
    # written when the interpreter exits.
    script = (
        "import sys, torch, tandem\n"
        "cfg = {'gpu': {'device': 'none'}, 'trace': {'enabled': True, 'path': 'api_trace.json'}}\n"
        "m = tandem.load_model(sys.argv[1], cfg, device='cpu', progress=False)\n"
        "assert tandem.trace.enabled()\n"
        "with torch.no_grad():\n"
        "    m(torch.tensor([[1, 2, 3, 4, 5]]))\n")
    r = subprocess.run([sys.executable, "-c", script, str(demo.ensure_demo_model(progress=False))], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    events = json.loads((tmp_path / "api_trace.json").read_text())["traceEvents"]
    assert {"gate_up", "down"} <= {e.get("name") for e in events}


def test_config_trace_in_offload(tiny_qwen3_moe_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from tandem import tracing

    monkeypatch.chdir(tmp_path)
    off = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir).eval()
    tandem.offload(off, {"gpu": {"device": "none"}}, progress=False)
    assert not tandem.trace.enabled() and tracing.pending() == [], "trace.enabled defaults to false"
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir).eval()
    try:
        tandem.offload(model, {"gpu": {"device": "none"}, "trace": {"enabled": True, "path": "off.json"}},
                       progress=False)
        assert tandem.trace.enabled()
        assert tracing.pending() == [tmp_path / "off.json"], "relative to the working directory"
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
        assert tracing.write_pending() == [tmp_path / "off.json"]
        events = json.loads((tmp_path / "off.json").read_text())["traceEvents"]
        assert {"gate_up", "down"} <= {e.get("name") for e in events}
    finally:
        tracing.cancel_pending()
        tandem.trace.enable(False)
