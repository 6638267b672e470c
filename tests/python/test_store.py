"""Expert stores from Python and the command line (issue 19): `tandem convert`, then
``load_model(..., store=)`` / ``--store`` / ``cpu.store``.

A model whose experts come from a store must compute exactly what the model that packs its
checkpoint computes (the store holds the same packs: tests/cpp/test_expert_store.cpp checks
them byte for byte), so the logits here are compared for equality, not within a bound. The
rest is refusal and recovery: a store for another format or a changed checkpoint, a store
whose conversion was killed (it never loads, and converting again finishes it), a disk too
small, options that cannot go together.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tandem
from tandem import _C, cli
from tandem.store import default_store

from hf_models import KINDS, checkpoint_cache


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, "store-")


def cfg(fmt: str = "bf16", **cpu):
    c = {"format": fmt, "threads": 1, "virtual_subpools": 2, **cpu}
    if fmt == "int4":
        c.setdefault("group_size", 32)
    return {"version": 1, "cpu": c, "gpu": {"device": "none"}}


def logits(model, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=g)
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_a_model_from_its_store_computes_what_the_packing_model_does(checkpoint, tmp_path, kind, fmt, seed):
    path = checkpoint(kind, "bf16")
    report = tandem.convert(path, cfg(fmt), out=tmp_path / "store", progress=False, verify=True)
    assert report["layers_written"] == len(tandem.load_model(path, cfg(fmt), progress=False).tandem_engine.layers)
    assert report["layers_kept"] == 0 and not report["up_to_date"]
    packed = tandem.load_model(path, cfg(fmt), progress=False)
    stored = tandem.load_model(path, cfg(fmt), store=tmp_path / "store", progress=False)
    assert stored.tandem_store == str(tmp_path / "store") and packed.tandem_store is None
    assert torch.equal(logits(packed, seed), logits(stored, seed))
    # The config's cpu.store does the same.
    via_config = tandem.load_model(path, cfg(fmt, store=str(tmp_path / "store")), progress=False)
    assert torch.equal(logits(packed, seed), logits(via_config, seed))


def test_a_fused_expert_checkpoint_converts_and_loads_from_its_store(checkpoint, tmp_path, seed):
    """Experts stored fused (transformers v5's save_original_format=False): the store holds
    the same packs as the per-expert checkpoint's (each expert's rows of the fused tensors
    hashed once, not the whole tensors per expert), so the same logits."""
    from transformers import AutoModelForCausalLM

    path = checkpoint("qwen3_moe", "bf16")
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(
        tmp_path / "fused", save_original_format=False)
    report = tandem.convert(tmp_path / "fused", cfg("int8"), out=tmp_path / "store", progress=False, verify=True)
    assert report["layers_written"] > 0
    # source bytes: each fused tensor counted once, as big as the per-expert ones together
    per_expert = tandem.convert(path, cfg("int8"), out=tmp_path / "store2", progress=False)
    assert report["source_bytes"] == per_expert["source_bytes"]
    packed = tandem.load_model(path, cfg("int8"), progress=False)
    stored = tandem.load_model(tmp_path / "fused", cfg("int8"), store=tmp_path / "store", progress=False)
    assert torch.equal(logits(packed, seed), logits(stored, seed))


def test_convert_and_run_from_the_command_line(tmp_path, capsys):
    from tandem import demo

    path = demo.ensure_demo_model(progress=False)  # a tokenizer too
    config = tmp_path / "int8.yaml"
    config.write_text("version: 1\ncpu: {format: int8, threads: 1}\ngpu: {device: none}\n")
    out = tmp_path / "s"
    assert cli.main(["convert", "--model", str(path), "--config", str(config), "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert f"store: {out}: 4 layers written" in text and f"--store {out}" in text, text
    assert cli.main(["convert", "--model", str(path), "--config", str(config), "--out", str(out), "--no-progress",
                     "--verify"]) == 0
    assert "already up to date; verified" in capsys.readouterr().out

    def run(*extra: str) -> str:
        assert cli.main(["run", "--model", str(path), "--config", str(config), "--no-progress",
                         "--max-new-tokens", "6", *extra]) == 0
        return capsys.readouterr().out

    plain, stored = run(), run("--store", str(out))
    assert f"experts: read from the store {out}" in stored
    output = [line for line in plain.splitlines() if line.startswith("output:")]
    assert output and output == [line for line in stored.splitlines() if line.startswith("output:")]
    # The format comes from the config: a store of another format is refused, naming the field.
    assert cli.main(["run", "--model", str(path), "--no-progress", "--store", str(out)]) == 2
    err = capsys.readouterr().err
    assert "does not hold these experts (format: the store has \"int8\", wanted \"bf16\")" in err, err
    # The default location: next to the checkpoint, named after the format.
    assert default_store(path, {"format": "int4", "group_size": 64, "zero_point": True}) == \
        Path(path) / "tandem-int4-g64-zp"


def test_store_arguments_are_checked_before_loading(cli_refuses, tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "layer-0001.tpk").write_bytes(b"x")
    cli_refuses("run", ["--store", "{tmp}/nowhere"], "--store {tmp}/nowhere: not a directory")
    cli_refuses("chat", ["--store", "{tmp}/half"], "--store {tmp}/half: no manifest.json there (an unfinished")
    (tmp_path / "half" / "manifest.json").write_text("{}")
    (tmp_path / "ad").mkdir()
    (tmp_path / "ad" / "adapter_config.json").write_text("{}")
    cli_refuses("run", ["--store", "{tmp}/half", "--adapter", "{tmp}/ad"], "--store and --adapter")
    cli_refuses("convert", ["--format", "int8", "--group-size", "64"], "--group-size / --zero-point apply to int4")


def test_training_and_adapters_refuse_a_store(checkpoint, tmp_path):
    path = checkpoint("mixtral", "bf16")
    tandem.convert(path, cfg(), out=tmp_path / "s", progress=False)
    with pytest.raises(ValueError, match="an expert store holds inference packs"):
        tandem.load_model(path, cfg(), store=tmp_path / "s", train=True, progress=False)
    with pytest.raises(ValueError, match="an expert store holds inference packs"):
        tandem.load_model(path, cfg(store=str(tmp_path / "s")), train=True, progress=False)
    with pytest.raises(ValueError, match="an adapter changes the experts"):
        tandem.load_model(path, cfg(), store=tmp_path / "s", adapter=tmp_path, progress=False)


def test_a_changed_checkpoint_is_refused(checkpoint, tmp_path, seed):
    import shutil

    from safetensors.torch import load_file, save_file

    src = checkpoint("qwen3_moe", "bf16")
    path = tmp_path / "model"
    shutil.copytree(src, path)
    tandem.convert(path, cfg("int8"), out=tmp_path / "s", progress=False)
    os.utime(path / "model.safetensors", ns=(1, 1))  # a copy's new time alone: the contents decide, and match
    tandem.load_model(path, cfg("int8"), store=tmp_path / "s", progress=False)
    # One expert weight edited in place (same names, shapes and size).
    tensors = load_file(path / "model.safetensors")
    key = next(k for k in sorted(tensors) if ".mlp.experts." in k and "layers.1." in k)
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] += 1
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model layer 1's expert tensors in .* differ from those"):
        tandem.load_model(path, cfg("int8"), store=tmp_path / "s", progress=False)


KILLED = textwrap.dedent("""
    import os, signal, sys
    from tandem import _C
    from tandem.loader import open_model_experts
    me = open_model_experts(sys.argv[1])
    E, H, I = me.shape
    def progress(done, total):
        if done == E + 1:  # the first layer file finished, the second begun: a kill
            os.kill(os.getpid(), signal.SIGKILL)
    _C.convert_experts(me.ckpt, me.naming, E, H, I, me.layers, "int4", 32, False, sys.argv[2], progress=progress)
""")


def test_a_conversion_killed_midway_never_loads_and_resumes(checkpoint, tmp_path, seed):
    path = checkpoint("deepseek_v3", "bf16")
    out = tmp_path / "s"
    r = subprocess.run([sys.executable, "-c", KILLED, str(path), str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr
    assert (out / "layer-0001.tpk").is_file() and not (out / "manifest.json").exists()
    assert any(".tmp." in p.name for p in out.iterdir())  # the second layer, half written
    with pytest.raises(OSError, match="its conversion did not finish"):
        tandem.load_model(path, cfg("int4"), store=out, progress=False)
    report = tandem.convert(path, cfg("int4"), out=out, progress=False, verify=True)
    assert (report["layers_kept"], report["layers_written"]) == (1, 1)
    assert not any(".tmp." in p.name for p in out.iterdir())
    packed = tandem.load_model(path, cfg("int4"), progress=False)
    stored = tandem.load_model(path, cfg("int4"), store=out, progress=False)
    assert torch.equal(logits(packed, seed), logits(stored, seed))


def test_a_disk_too_small_is_refused_before_writing(checkpoint, tmp_path, monkeypatch):
    import shutil

    path = checkpoint("qwen3_moe", "bf16")
    real = shutil.disk_usage

    def small(p):
        u = real(p)
        return type(u)(u.total, u.used, 1000)

    monkeypatch.setattr(shutil, "disk_usage", small)
    with pytest.raises(OSError, match=r"the store needs .* GB more, the disk holding .* has 0.00 GB free"):
        tandem.convert(path, cfg("int8"), out=tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()


def test_doctor_checks_the_configs_store(checkpoint, tmp_path, capsys):
    path = checkpoint("qwen3_moe", "bf16")
    tandem.convert(path, cfg("int8"), out=tmp_path / "s", progress=False)
    config = tmp_path / "c.yaml"
    for store, fmt, problem in (("s", "int8", None), ("s", "int4", "cpu.store: {s} holds int8 experts, the config asks "
                                                                    "for int4-g128"),
                                ("nowhere", "int8", "cpu.store: {nowhere} is not a directory")):
        config.write_text(f"version: 1\nmodel: {{path: {path}}}\ncpu: {{format: {fmt}, store: {store}}}\n"
                          "gpu: {device: none}\n")
        assert cli.main(["doctor", "--config", str(config)]) == (1 if problem else 0)
        out = capsys.readouterr().out
        if problem:
            assert problem.format(s=tmp_path / "s", nowhere=tmp_path / "nowhere") in out, out
        else:
            assert "fits this machine" in out, out


def test_store_spec_reports_what_it_holds(checkpoint, tmp_path):
    path = checkpoint("mixtral", "bf16")
    tandem.convert(path, cfg("int4"), out=tmp_path / "s", progress=False)
    s = _C.ExpertStore(str(tmp_path / "s"))
    spec = s.spec
    assert (spec["format"], spec["group_size"], spec["zero_point"]) == ("int4", 32, False)
    assert spec["layers"] == [0, 1, 2] and spec["experts"] == 8
    assert s.bytes > 0
