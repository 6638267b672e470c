"""`tandem doctor` as a user runs it: exit codes, text and JSON."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tandem

REPO = Path(__file__).resolve().parents[2]


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "tandem", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def cpuinfo_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_doctor_json_matches_the_machine():
    r = run("doctor", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    flags = cpuinfo_flags()
    for feature, have in data["cpu"]["features"].items():
        assert have == (feature in flags), feature
    assert data["topology"]["cores"] >= 1
    assert data["cpu"]["hardware_isa"] == tandem.hardware_isa()
    gpu = data["gpu"]
    if not gpu["devices"]:
        assert gpu["status"] and gpu["status"] != "ok"


def test_doctor_text_and_demo_config():
    r = run("doctor", "--config", str(REPO / "configs" / "demo.yaml"), "--no-gpu-kernel")
    assert r.returncode == 0, r.stdout + r.stderr
    # demo.yaml names no model: its memory cannot be sized, so the doctor never says "fits".
    assert "valid; memory not checked" in r.stdout and "fits" not in r.stdout
    assert r.stdout.rstrip().endswith("OK")


def test_doctor_invalid_config_exit_code(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpu:\n  device: gpu0\n")
    r = run("doctor", "--config", str(bad), "--no-gpu-kernel")
    assert r.returncode == 1
    assert f"{bad}:2:11: gpu.device: 'gpu0' is not one of" in r.stdout


def test_isa_override_above_hardware_is_refused():
    if tandem.hardware_isa() == "amx":
        pytest.skip("this CPU has every level: nothing above the hardware to ask for")
    r = run("doctor", "--json", env={"TANDEM_ISA": "amx"})
    assert r.returncode == 1
    data = json.loads(r.stdout)
    assert data["cpu"]["effective_isa"] is None
    # The message lists exactly the features the amx level needs that this CPU lacks (Ice
    # Lake: avx512_bf16 first; Zen 4/5: the amx ones only), in the level order.
    have = tandem.cpu_features()
    needs = ["avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "amx_tile", "amx_bf16", "amx_int8"]
    missing = ", ".join(f for f in needs if not have[f])
    want = f"TANDEM_ISA=amx asks for more than this CPU provides: missing {missing}"
    assert data["cpu"]["isa_error"].startswith(want), data["cpu"]["isa_error"]


def test_isa_override_lowers_level():
    r = run("doctor", "--json", env={"TANDEM_ISA": "avx2"})
    assert json.loads(r.stdout)["cpu"]["effective_isa"] == ("avx2" if tandem.hardware_isa() != "scalar" else None)


def test_console_script_installed():
    exe = Path(sys.executable).with_name("tandem")
    r = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == tandem.__version__


def test_doctor_survives_non_utf8_config(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"\xff: 1\n")
    r = run("doctor", "--json", "--config", str(bad), "--no-gpu-kernel")
    assert r.returncode == 1, r.stderr
    err = json.loads(r.stdout)["config"]["error"]
    assert err.startswith(f"{bad}:1:1: ") and "unknown key; allowed here: version, model" in err


def test_doctor_reports_the_thread_count_the_pool_refuses(tmp_path):
    # What doctor accepts, the engine starts; what the engine refuses, doctor reports with
    # the same words (before: "valid, fits" and then an abort when the threads started).
    cfg = tmp_path / "threads.yaml"
    cfg.write_text("cpu:\n  threads: 4096\n  virtual_subpools: 64\ngpu:\n  device: none\n")
    with pytest.raises(ValueError) as info:
        tandem._C.Pool(config_text=cfg.read_text())
    refused = str(info.value).split("  [")[0]  # without the C++ location
    assert refused.startswith("cpu.threads = 4096 exceeds the "), refused
    r = run("doctor", "--json", "--config", str(cfg), "--no-gpu-kernel")
    assert r.returncode == 1, r.stdout
    assert refused in json.loads(r.stdout)["config"]["problems"]


def test_run_names_the_config_whose_bytes_are_not_utf8(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"\xff: 1\n")
    r = run("run", "--config", str(bad), "--prompt", "hi")
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"tandem: error: {bad}:1:1: "), r.stderr
    assert "codec" not in r.stderr


# ---- shipped configs ------------------------------------------------------------------

def test_every_shipped_config_parses_and_names_only_files_that_exist():
    # A shipped config runs as written: every path it names is shipped too. model.path is
    # the user's checkpoint, so shipped configs leave it unset (a commented-out placeholder
    # at most; --model or the user's own model.path gives it); gpu.hot_experts.statistics is
    # recorded by the user (tandem run --record-routing) and likewise commented out.
    files = sorted((REPO / "configs").glob("*.yaml"))
    assert len(files) >= 5
    for f in files:
        cfg = tandem.load_config(f)
        assert cfg["model"]["path"] == "", f"{f.name}: model.path is a user path; leave it commented out"
        stats = cfg["gpu"]["hot_experts"]["statistics"]
        assert not stats or Path(stats).is_file(), f"{f.name}: gpu.hot_experts.statistics {stats} is not shipped"
        # doctor finds no missing file either (other problems, e.g. no GPU here, are allowed)
        r = run("doctor", "--json", "--no-gpu-kernel", "--config", str(f))
        problems = json.loads(r.stdout)["config"].get("problems", [])
        assert not [p for p in problems if "does not exist" in p], (f.name, problems)


# ---- errors: one line, no internal locations, a traceback with --verbose ----------------

def test_errors_are_one_line_without_internal_locations(tmp_path, monkeypatch, capsys):
    from tandem import cli

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))  # the demo model is never built
    # A tandem::Error from C++ (a config path that is a directory) carries "[check ... at file:line]".
    assert cli.main(["run", "--config", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: cannot read config") and err.count("\n") == 1, err
    assert "[check" not in err and ".cpp:" not in err, err
    # --verbose, after the command or before it: the traceback and the location.
    for argv in (["run", "--verbose", "--config", str(tmp_path)], ["-v", "run", "--config", str(tmp_path)]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and "failed at runtime/config.cpp:" in err, err
        assert err.rstrip().splitlines()[-1].startswith("tandem: error: cannot read config")
    # A config error names file:line:col and the key, and nothing of the parser's source.
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpu:\n  device: gpu0\n")
    assert cli.main(["train", "--config", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tandem: error: {bad}:2:11: gpu.device: 'gpu0' is not one of") and err.count("\n") == 1
    assert "[at " not in err, err
    assert not (tmp_path / "cache").exists(), "an input error must come before the demo model is built"


def test_other_failures_are_one_line_with_exit_code_1(monkeypatch, capsys):
    import tandem.run
    from tandem import cli

    def internal(args):  # a tandem invariant breaking inside a command: RuntimeError with a location
        tandem._C._raise("internal", "an invariant broke")

    monkeypatch.setattr(tandem.run, "run", internal)
    assert cli.main(["run"]) == 1
    err = capsys.readouterr().err
    assert err == "tandem: error: RuntimeError: an invariant broke (--verbose shows the traceback)\n", err
    assert cli.main(["run", "--verbose"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "[at python/bindings.cpp:" in err, err


def test_a_missing_python_package_is_one_line(tmp_path, monkeypatch, capsys):
    from tandem import cli

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    real_torch = sys.modules["torch"]
    monkeypatch.setitem(sys.modules, "torch", None)  # "import torch" now fails as if not installed
    assert cli.main(["run", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: tandem run needs the Python module 'torch'") and err.count("\n") == 1, err
    assert "pip install" in err
    monkeypatch.setitem(sys.modules, "torch", real_torch)
    monkeypatch.setitem(sys.modules, "peft", None)
    assert cli.main(["train", "--no-progress", "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: tandem train needs the Python module 'peft'") and err.count("\n") == 1, err
