"""`tandem train`: the demo job end to end (progress, decreasing loss, adapter, plot),
resume, and the adapter it writes in stock PEFT.

The demo model is built into a per-module cache (TANDEM_CACHE). Runs are short (tens of
steps, batch 4 x 32 tokens) so the module takes well under a minute on 2 cores.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tandem import cli, demo
from tandem.train import PackedDataset, read_texts
from test_lora_hf import record_choices, replay_choices

SHORT = ["--batch", "4", "--seq", "32", "--no-progress", "--warmup", "5"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("tandem-cache")
    old = os.environ.get("TANDEM_CACHE")
    os.environ["TANDEM_CACHE"] = str(d)
    demo.ensure_demo_model(progress=False)
    yield d
    if old is None:
        del os.environ["TANDEM_CACHE"]
    else:
        os.environ["TANDEM_CACHE"] = old


def losses(out) -> list[float]:
    rows = (out / "loss.csv").read_text().splitlines()
    assert rows[0] == "step,loss"
    return [float(r.split(",")[1]) for r in rows[1:]]


@pytest.fixture(scope="module")
def run60(cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("train60")
    assert cli.main(["train", "--steps", "60", "--save-every", "30", "--out", str(out), *SHORT]) == 0
    return out


def test_demo_job_learns_and_writes_adapter_checkpoint_and_plot(run60):
    ls = losses(run60)
    assert len(ls) == 60 and all(map(lambda v: v == v and v > 0, ls))
    first, last = sum(ls[:10]) / 10, sum(ls[-10:]) / 10
    # Random model on byte-level text: starts near ln(259) = 5.56; measured mean of the first 10
    # steps 5.16 -> last 10 steps 2.86
    # (60 steps). Require a clear drop (>= 1 nat), not a particular value.
    print(f"loss {first:.3f} -> {last:.3f}")
    assert ls[0] > 5.0 and last < first - 1.0, (first, last)
    png = (run60 / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    for f in ("adapter/adapter_model.safetensors", "adapter/adapter_config.json",
              "checkpoint/adapter_model.safetensors", "checkpoint/training_state.pt"):
        assert (run60 / f).is_file(), f
    cfg = json.loads((run60 / "adapter" / "adapter_config.json").read_text())
    assert sorted(cfg["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert not [p for p in run60.glob(".*tmp*")], "no temporary directories left behind"


def test_resume_continues_with_the_same_next_step_loss(run60, tmp_path):
    # 30 steps, then --resume to 60: every step after the resume equals the uninterrupted run
    # (same batches, adapter, Adam moments, scheduler and RNG).
    assert cli.main(["train", "--steps", "30", "--out", str(tmp_path), *SHORT]) == 0
    assert cli.main(["train", "--steps", "60", "--resume", "--out", str(tmp_path), *SHORT]) == 0
    a, b = losses(run60), losses(tmp_path)
    assert len(b) == 60
    assert b[:30] == pytest.approx(a[:30], rel=0, abs=0)
    # The pool's reductions run in a fixed order, so a resumed step is bitwise the same.
    assert b[30] == a[30], (b[30], a[30])
    assert b[30:] == pytest.approx(a[30:], rel=1e-5)


def test_adapter_loads_in_stock_peft_with_the_same_logits(run60, cache):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import tandem

    path = demo.ensure_demo_model(progress=False)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    stock = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                      run60 / "adapter").eval()
    base = tandem.load_model(path, demo.demo_config_path(), dtype=torch.float32, train=True, progress=False)
    ours = PeftModel.from_pretrained(base, run60 / "adapter").eval()
    # A token whose router scores two experts within rounding of each other picks either,
    # depending on how earlier layers rounded (tandem rounds the experts' inputs and h to
    # bf16), and one such flip moved one logit by 1.2e-2 to 5.5e-2 of max|logit| with the
    # adapters of 60-step runs (which adapter comes out depends on the CPU's kernels). So
    # tandem replays the stock run's expert choices (its routing weights stay its own).
    choices, hooks = record_choices(stock)
    with torch.no_grad():
        ref = stock(input_ids=ids).logits
    for h in hooks:
        h.remove()
    hooks = replay_choices(ours, choices)
    with torch.no_grad():
        got = ours(input_ids=ids).logits
    for h in hooks:
        h.remove()
    # The checkpoint's experts are bf16, so both sides have the same weights; tandem rounds
    # the experts' inputs and h to bf16 (u = 2^-9) over 4 layers: bound 1.5e-2 of max|logit|
    # (the inference tests' fp32 bound), measured 7e-4 to 1.1e-3 with expert choices replayed.
    err = (got - ref).abs().max() / ref.abs().max()
    print(f"logits error {float(err):.2e}")
    assert err < 1.5e-2, float(err)
    # and the adapter matters: without it the logits differ by far more than the bound
    with torch.no_grad(), stock.disable_adapter():
        base_logits = stock(input_ids=ids).logits
    assert (base_logits - ref).abs().max() / ref.abs().max() > 0.1


def test_bad_data_is_a_clear_error(cache, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "typo"}\n')
    assert cli.main(["train", "--steps", "1", "--data", str(bad), "--out", str(tmp_path / "o"), *SHORT]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err and '"text"' in err
    assert cli.main(["train", "--steps", "1", "--data", str(tmp_path / "none.jsonl"), *SHORT]) == 2
    assert "no such data file" in capsys.readouterr().err
    assert cli.main(["train", "--steps", "0", *SHORT]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err
    assert cli.main(["train", "--resume", "--steps", "2", "--out", str(tmp_path / "fresh"), *SHORT]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_packed_dataset_batches_are_a_function_of_the_step():
    tok = demo.build_tokenizer()
    ds = PackedDataset(read_texts(demo_data()), tok, 32, seed=7)
    again = PackedDataset(read_texts(demo_data()), tok, 32, seed=7)
    for step in (0, 5, 1000):
        assert torch.equal(ds.batch(step, 4), again.batch(step, 4))
    assert not torch.equal(ds.batch(0, 4), ds.batch(1, 4))
    # one epoch visits every block once
    seen = sorted(tuple(ds.batch(s, 1)[0].tolist()) for s in range(len(ds)))
    assert seen == sorted(tuple(r.tolist()) for r in ds.blocks)


def demo_data():
    from tandem.train import DEMO_DATA

    return DEMO_DATA


def test_a_checkpoint_missing_some_adapters_is_refused(cache, tmp_path):
    from peft import LoraConfig, get_peft_model

    import tandem
    from tandem.train import load_training_state, save_training_state

    path = demo.ensure_demo_model(progress=False)

    def model(targets):
        m = tandem.load_model(path, demo.demo_config_path(), dtype=torch.float32, train=True, progress=False)
        return get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))

    small = model(["q_proj"])
    save_training_state(tmp_path / "ck", small, torch.optim.AdamW([p for p in small.parameters() if p.requires_grad]), 1)
    with pytest.raises(ValueError, match=r"has no values for these adapter tensors.*v_proj"):
        load_training_state(tmp_path / "ck", model(["q_proj", "v_proj"]))
    assert load_training_state(tmp_path / "ck", model(["q_proj"]))[0] == 1


# ---- inputs checked before the model loads ---------------------------------------------

def _fake_checkpoint(d, rank: int, alpha: float):
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": alpha}))
    (d / "adapter_model.safetensors").write_bytes(b"")
    (d / "training_state.pt").write_bytes(b"")


@pytest.mark.parametrize("case", ["existing-run", "resume-and-overwrite", "resume-rank", "resume-incomplete",
                                  "trace-dir", "config-model-path", "device", "data", "data-not-utf8",
                                  "data-huge-line", "data-bad-json", "max-record-bytes"])
def test_train_checks_its_inputs_before_loading_a_model(case, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    argv = ["train", "--steps", "2", "--out", str(out), *SHORT]
    if case == "existing-run":
        out.mkdir()
        (out / "loss.csv").write_text("step,loss\n1,5.0\n")
        message = f"--out {out} already holds a run (loss.csv); pass --overwrite to replace it or --resume"
    elif case == "resume-and-overwrite":
        argv += ["--resume", "--overwrite"]
        message = "--resume and --overwrite exclude each other"
    elif case == "resume-rank":
        _fake_checkpoint(out / "checkpoint", 4, 8)
        argv += ["--resume"]  # the default --rank 8 --alpha 16
        message = f"--resume: {out / 'checkpoint'} was trained with --rank 4 --alpha 8; this run asks for --rank 8"
    elif case == "resume-incomplete":
        (out / "checkpoint").mkdir(parents=True)
        argv += ["--resume"]
        message = f"--resume: {out / 'checkpoint'} is not a tandem training checkpoint (missing adapter_config.json"
    elif case == "trace-dir":
        argv += ["--trace", str(tmp_path / "no-dir" / "t.json")]
        message = f"--trace {tmp_path / 'no-dir' / 't.json'}: the directory {tmp_path / 'no-dir'} does not exist"
    elif case == "config-model-path":
        cfg = tmp_path / "c.yaml"
        cfg.write_text("model:\n  path: /nonexistent/model\n")
        argv += ["--config", str(cfg)]
        message = f"model.path of {cfg}: /nonexistent/model: no such directory"
    elif case == "device":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        argv += ["--device", "cuda:0"]
        message = "--device cuda:0: torch sees no CUDA device"
    elif case == "data":
        (tmp_path / "d.txt").write_text("\n\n  \n")
        argv += ["--data", str(tmp_path / "d.txt")]
        message = f"{tmp_path / 'd.txt'}: no texts"
    elif case == "data-not-utf8":  # before: a bare UnicodeDecodeError, without the file
        (tmp_path / "d.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "latin-1: \xe9t\xe9"}\n')
        argv += ["--data", str(tmp_path / "d.jsonl")]
        message = f"{tmp_path / 'd.jsonl'}:2: not UTF-8 text at byte offset 34 (0xe9: invalid continuation byte)"
    elif case == "data-huge-line":  # before: read whole, however long
        with open(tmp_path / "d.jsonl", "wb") as f:
            f.write(b'{"text": "' + b"x" * 3 * 2**20 + b'"}\n')
        argv += ["--data", str(tmp_path / "d.jsonl"), "--max-record-bytes", "1M"]
        message = (f"{tmp_path / 'd.jsonl'}:1: line longer than 1 MiB, the limit on one record; raise it with "
                   "--max-record-bytes N if the data really has records this long")
    elif case == "data-bad-json":
        (tmp_path / "d.jsonl").write_text('{"text": "ok"}\n\n{"text": "no end}\n')
        argv += ["--data", str(tmp_path / "d.jsonl")]
        message = f"{tmp_path / 'd.jsonl'}:3: not JSON (Unterminated string starting at, column 10)"
    else:
        argv += ["--max-record-bytes", "0"]
        message = "--max-record-bytes must be at least 1, got 0"
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: " + message) and err.count("\n") == 1, err
    assert not (tmp_path / "cache").exists(), "checked only after the demo model was built"


# ---- model.path and trace.* from the config, --trace, --overwrite -----------------------

def test_train_uses_the_configs_model_path_and_trace_then_overwrite(cache, tmp_path, monkeypatch, capsys):
    import shutil

    copy = shutil.copytree(demo.ensure_demo_model(progress=False), tmp_path / "mymodel")
    cfg = tmp_path / "train.yaml"
    cfg.write_text(demo.DEMO_CONFIG_YAML.replace("enabled: false", "enabled: true")
                   .replace("path: tandem_trace.json", "path: train_trace.json") + "model:\n  path: mymodel\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    out = tmp_path / "out"
    assert cli.main(["train", "--config", str(cfg), "--steps", "2", "--out", str(out), *SHORT]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"model: {copy} (model.path of {cfg})", lines
    assert lines[1] == f"config: {cfg}", lines
    assert lines[2].startswith("loaded: qwen3_moe"), lines
    events = json.loads((work / "train_trace.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"sft_gate_up", "sft_down", "sft_bw_dh"} <= names, sorted(n for n in names if n)  # forward and backward
    assert len(losses(out)) == 2

    # Again into the same --out: refused without --overwrite (above); with it, the old run is
    # replaced, and --trace FILE (the flag wins over the config's trace.path) is written.
    trace = tmp_path / "flag_trace.json"
    assert cli.main(["train", "--config", str(cfg), "--steps", "1", "--out", str(out), "--overwrite",
                     "--trace", str(trace), *SHORT]) == 0
    assert len(losses(out)) == 1
    assert torch.load(out / "checkpoint" / "training_state.pt", weights_only=False)["step"] == 1
    assert json.loads(trace.read_text())["traceEvents"]


def test_max_record_bytes_raises_the_limit(tmp_path):
    from tandem.train import DEFAULT_MAX_RECORD_BYTES, check_arguments

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "' + "x" * 3000 + '"}\n')
    parser = cli.build_parser()

    def check(*flags):
        return check_arguments(parser.parse_args(["train", "--data", str(data), "--out", str(tmp_path / "o"), *flags]))

    assert parser.parse_args(["train"]).max_record_bytes == DEFAULT_MAX_RECORD_BYTES == 16 * 2**20
    assert check()[1] == data
    with pytest.raises(ValueError, match=r"d.jsonl:1: line longer than 2 KiB, .*raise it with --max-record-bytes N"):
        check("--max-record-bytes", "2K")
    assert check("--max-record-bytes", "4K")[1] == data
    assert check("--max-record-bytes", "3012")[1] == data  # the line's bytes, without its \n


# ---- atomic saves: temporary folders of killed saves ------------------------------------

def test_stale_temp_folders_and_nothing_else_are_removed(tmp_path):
    import subprocess
    import time

    from tandem.train import atomic_dir, remove_stale_temp_dirs

    def process_state(pid):
        return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]

    dead = subprocess.Popen(["true"])
    dead.wait()
    zombie = subprocess.Popen(["true"])  # exits and is not reaped until wait()
    for _ in range(500):
        if process_state(zombie.pid) == "Z":
            break
        time.sleep(0.01)
    live = subprocess.Popen(["sleep", "60"])  # a writer saving at this moment (started before its folder)
    try:
        final = tmp_path / "checkpoint"
        stale = [f".checkpoint.tmp-{dead.pid}", f".checkpoint.tmp-{zombie.pid}", f".checkpoint.tmp-{os.getpid()}"]
        kept = [f".checkpoint.tmp-{live.pid}",      # a live writer's
                f".adapter.tmp-{dead.pid}",         # another name's (removed by that name's next save)
                f"checkpoint.tmp-{dead.pid}", f".checkpoint.tmp-{dead.pid}x", ".checkpoint.tmp-", ".checkpoint.tmp-abc",
                f".checkpoint.old.tmp-{dead.pid}", "checkpoint.old", "notes"]
        for name in stale + kept:
            (tmp_path / name).mkdir()
            (tmp_path / name / "adapter_model.safetensors").write_bytes(b"partial")
        (tmp_path / "sub").mkdir()
        (tmp_path / "sub" / f".checkpoint.tmp-{dead.pid}").mkdir()      # not in the output directory
        (tmp_path / ".checkpoint.tmp-999999991").write_text("a file")  # tandem's temps are folders
        elsewhere = tmp_path / "sub" / "target"
        elsewhere.mkdir()
        (elsewhere / "keep").write_text("x")
        (tmp_path / ".checkpoint.tmp-999999992").symlink_to(elsewhere, target_is_directory=True)
        before = sorted(p.name for p in tmp_path.iterdir())

        assert sorted(p.name for p in remove_stale_temp_dirs(final)) == sorted(stale)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(before) - set(stale))
        assert (elsewhere / "keep").is_file() and (tmp_path / "sub" / f".checkpoint.tmp-{dead.pid}").is_dir()

        # The live process's folder, modified before that process started: not its folder but
        # one of an earlier process that had the same pid.
        old = time.time() - 3600
        os.utime(tmp_path / f".checkpoint.tmp-{live.pid}", (old, old))
        (tmp_path / f".checkpoint.tmp-{dead.pid}").mkdir()
        atomic_dir(final, lambda d: (d / "f").write_text("saved"))  # a save cleans up first
        assert (final / "f").read_text() == "saved"
        after = sorted(p.name for p in tmp_path.iterdir())
        # (checkpoint.old, the previous copy, goes once the new one is in place, as it always did)
        assert after == sorted(set(before) - set(stale) - {f".checkpoint.tmp-{live.pid}", "checkpoint.old"}
                               | {"checkpoint"})
    finally:
        live.kill()
        live.wait()
        zombie.wait()


def test_killed_training_resumes_and_no_temp_folder_survives(cache, tmp_path, seed):
    """`tandem train` killed (SIGKILL) three times at random moments (a fixed seed), two of them
    inside a save (the test hook TANDEM_TEST_SAVE_DELAY holds each save open after writing its
    temporary copy and again between its two renames), then run to the end: after every kill
    the checkpoint is complete (or there is none yet) and never older than before, the next
    run resumes from it, and no temporary folder survives the next successful saves."""
    import random
    import subprocess
    import sys
    import threading
    import time

    from tandem.train import SAVE_DELAY_ENV, resolve_dir

    rng = random.Random(seed)
    out, delay, steps = tmp_path / "out", 0.3, 12
    argv = [sys.executable, "-m", "tandem", "train", "--steps", str(steps), "--save-every", "3", "--out", str(out),
            "--batch", "2", "--seq", "16", "--warmup", "2", "--no-progress"]

    def checkpoint_step():
        ck = resolve_dir(out / "checkpoint")
        if not ck.exists():
            return None
        files = {f.name for f in ck.iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors", "training_state.pt"} <= files, files
        return torch.load(ck / "training_state.pt", weights_only=False)["step"]

    def temps():
        return sorted(p.name for p in out.glob(".*.tmp-*")) if out.exists() else []

    left, last_step, kills = set(), 0, []
    for kind in rng.sample(["save-writing", "save-renaming", "anytime"], 3):
        step = checkpoint_step()
        p = subprocess.Popen(argv + (["--resume"] if step is not None else []), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=dict(os.environ, **{SAVE_DELAY_ENV: str(delay)}))
        watchdog = threading.Timer(120, p.kill)  # a hung run fails the test instead of hanging it
        watchdog.start()
        try:
            lines = []
            for line in p.stdout:  # until training starts
                lines.append(line)
                if line.startswith("loaded:"):
                    break
            else:
                pytest.fail(f"tandem train ended before training: {''.join(lines)}")
            if kind == "anytime":
                wait = rng.uniform(0.0, 2.0)
            else:  # this process's own temporary folder appears: a save has begun
                mine = {f".checkpoint.tmp-{p.pid}", f".adapter.tmp-{p.pid}"}
                deadline = time.monotonic() + 60
                while not mine & set(temps()) and p.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.002)
                assert mine & set(temps()), "no save began"
                # writing the copy + the first delay, or the second delay (between the renames)
                wait = rng.uniform(0, 0.8 * delay) if kind == "save-writing" else rng.uniform(1.1 * delay, 1.9 * delay)
            time.sleep(wait)
        finally:
            watchdog.cancel()
            p.kill()
            p.wait()
            p.stdout.close()
        left |= set(temps())
        step = checkpoint_step()
        kills.append(f"{kind} +{wait:.2f}s: step {step}, {sorted(p.name for p in out.iterdir())}")
        assert (step or 0) >= last_step
        last_step = step or 0
    print("[measure] kills:\n  " + "\n  ".join(kills))
    assert left, "the killed saves left no temporary folder: the test proves nothing"

    resume = checkpoint_step() is not None
    r = subprocess.run(argv + (["--resume"] if resume else []), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("resuming at step" in r.stdout) == resume
    assert len(losses(out)) == steps and checkpoint_step() == steps
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "checkpoint", "loss.csv", "loss.png"], \
        f"left behind: {sorted(p.name for p in out.iterdir())} (temporary folders of the kills: {sorted(left)})"
