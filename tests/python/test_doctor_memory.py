"""`tandem doctor --config F` sizes the model before saying it fits (issue 16, item 7).

The estimate is checked against what the real loader builds: the engine's packed bytes
(CPU experts, per format and subpool split, padding included), its hot experts, and the
non-expert weights torch holds; a config.json claiming a model no machine holds reports
"does not fit" with the shortfall; without a model, memory is "not checked", never "fits".
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import tandem


def doctor(config, *extra):
    r = subprocess.run([sys.executable, "-m", "tandem", "doctor", "--config", str(config), "--no-gpu-kernel", *extra],
                       capture_output=True, text=True, env=dict(os.environ), timeout=120)
    return r


@pytest.mark.parametrize("cpu", [
    "{format: bf16, virtual_subpools: 2, threads: 1}",
    "{format: int8, virtual_subpools: 3, threads: 1}",
])
def test_estimate_equals_what_load_model_packs(tiny_qwen3_moe_dir, tmp_path, cpu):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model:\n  path: {tiny_qwen3_moe_dir}\ncpu: {cpu}\ngpu: {{device: none, hot_experts: 2}}\n")
    r = doctor(cfg, "--json")
    mem = json.loads(r.stdout)["config"]["memory"]
    assert mem["checked"], mem

    model = tandem.load_model(tiny_qwen3_moe_dir, str(cfg), progress=False)
    engine = model.tandem_engine
    # The non-expert weights as transformers holds them: tandem.dense's layers by their
    # source tensors (packed bf16 they are the same bytes but for panel padding; int8 /
    # int4 dense layers are smaller than the estimate, which stays an upper bound).
    torch_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    torch_bytes += sum(m.source_bytes for m in model.modules() if hasattr(m, "source_bytes"))
    print(f"estimate: cpu experts {mem['cpu_expert_bytes']} (engine {engine.cpu_bytes}), hot {mem['hot_expert_bytes']} "
          f"(engine {engine.device_bytes}), non-expert {mem['model']['non_expert_bytes']} (torch {torch_bytes})")
    assert mem["cpu_expert_bytes"] == engine.cpu_bytes
    assert mem["hot_expert_bytes"] == engine.device_bytes
    assert mem["model"]["non_expert_exact"] is True
    assert mem["model"]["non_expert_bytes"] == torch_bytes
    assert mem["model"]["moe_layers"] == engine.moe_layers
    ram = {p["what"]: p["bytes"] for p in mem["ram"]["parts"]}
    assert ram["cpu experts"] == engine.cpu_bytes and ram["hot experts"] == engine.device_bytes
    assert mem["ram"]["needed_bytes"] == sum(ram.values())
    assert r.returncode == (0 if mem["fits"] else 1), r.stdout


@pytest.fixture(scope="module")
def tiny_ernie_dir(tmp_path_factory):
    """An ERNIE-4.5-MoE checkpoint: its own config keys (moe_num_experts, moe_k,
    moe_layer_start_index: layer 0 dense), unlike the Qwen / DeepSeek / Mixtral ones."""
    from transformers import AutoModelForCausalLM, Ernie4_5_MoeConfig

    cfg = Ernie4_5_MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, moe_num_experts=8,
                             moe_k=2, moe_layer_start_index=1, moe_layer_end_index=2, moe_num_shared_experts=1,
                             tie_word_embeddings=False)
    torch.manual_seed(3)
    out = tmp_path_factory.mktemp("ernie")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def test_estimate_reads_the_experts_from_the_checkpoint(tiny_ernie_dir, tmp_path):
    """Which layers route, how many experts and their width come from the checkpoint's
    expert tensors, whatever a family's config.json calls them."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model:\n  path: {tiny_ernie_dir}\ncpu: {{format: bf16, threads: 1}}\ngpu: {{device: none}}\n")
    r = doctor(cfg, "--json")
    mem = json.loads(r.stdout)["config"]["memory"]
    model = tandem.load_model(tiny_ernie_dir, str(cfg), progress=False)
    engine = model.tandem_engine
    assert mem["model"]["moe_layers"] == engine.moe_layers == 2  # layers 1 and 2; the config pattern said 3
    assert mem["cpu_expert_bytes"] == engine.cpu_bytes
    assert mem["model"]["non_expert_bytes"] == sum(p.numel() * p.element_size() for p in model.parameters())


def test_config_json_claiming_a_huge_model_does_not_fit(tmp_path):
    model = tmp_path / "huge"
    model.mkdir()
    # Qwen3-235B-A22B's shapes with 42x its layers (4000): far beyond any machine's RAM. No
    # safetensors: the experts come from config.json alone, the rest is estimated.
    (model / "config.json").write_text(json.dumps(dict(
        model_type="qwen3_moe", num_hidden_layers=4000, hidden_size=4096, moe_intermediate_size=1536,
        intermediate_size=12288, num_experts=128, num_experts_per_tok=8, vocab_size=151936, num_attention_heads=64,
        num_key_value_heads=4, head_dim=128, torch_dtype="bfloat16")))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  path: huge\ngpu:\n  device: none\n")
    r = doctor(cfg)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "valid, but cannot run here" in r.stdout
    line = next(l for l in r.stdout.splitlines() if "does not fit" in l)
    assert "of RAM for cpu experts" in line and "this machine has" in line and "(short by" in line, line
    data = json.loads(doctor(cfg, "--json").stdout)["config"]["memory"]
    assert data["fits"] is False and data["model"]["non_expert_exact"] is False
    assert data["cpu_expert_bytes"] == 4000 * 128 * 3 * 4096 * 1536 * 2
    assert data["ram"]["needed_bytes"] > data["ram"]["available_bytes"]


def test_without_a_model_memory_is_not_checked(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cpu:\n  format: int8\ngpu:\n  device: none\n")
    r = doctor(cfg)
    assert r.returncode == 0, r.stdout
    assert "memory not checked: no model.path" in r.stdout
    assert "fits" not in r.stdout


@pytest.mark.parametrize("key, value, message", [
    ("hidden_size", 2**32 + 1, "hidden_size = 4294967297 is not a valid size (expected an integer in [1, 262144])"),
    ("num_hidden_layers", 3_000_000_000, "num_hidden_layers = 3000000000 is not a valid size"),
    ("num_experts", -1, "num_experts = -1 is not a valid size"),
    ("vocab_size", 2**64 + 7, "vocab_size = 1.8446744073709552e+19 is not a valid size"),  # JSON reads it as a double
    ("num_experts_per_tok", 9, "num_experts_per_tok = 9 is more than the 8 experts"),
])
def test_absurd_config_json_is_a_problem_not_a_fit(tmp_path, key, value, message):
    """The doctor sizes a model with the loader's bounds (one table, tandem._C.config_size_bounds):
    a hidden size of 2^32 + 1 was read as 1 and the model reported to fit."""
    model = tmp_path / "m"
    model.mkdir()
    cfg_json = dict(model_type="qwen3_moe", num_hidden_layers=4, hidden_size=64, moe_intermediate_size=64,
                    intermediate_size=128, num_experts=8, num_experts_per_tok=2, vocab_size=200,
                    num_attention_heads=4, torch_dtype="bfloat16")
    cfg_json[key] = value
    (model / "config.json").write_text(json.dumps(cfg_json))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  path: m\ngpu:\n  device: none\n")
    r = doctor(cfg)
    assert r.returncode == 1, r.stdout
    assert f"{model / 'config.json'}: {message}" in r.stdout, r.stdout
    assert "fits" not in r.stdout.replace("does not fit", "")
    assert tandem._C.config_size_bounds()["hidden_size"] == (1, 1 << 18)
