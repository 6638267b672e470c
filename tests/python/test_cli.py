"""`tandem doctor` as a user runs it: exit codes, text and JSON."""
import json
import os
import subprocess
import sys
from pathlib import Path

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
    assert "valid, fits this machine" in r.stdout
    assert r.stdout.rstrip().endswith("OK")


def test_doctor_invalid_config_exit_code(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpu:\n  device: gpu0\n")
    r = run("doctor", "--config", str(bad), "--no-gpu-kernel")
    assert r.returncode == 1
    assert f"{bad}:2:11: gpu.device: 'gpu0' is not one of" in r.stdout


def test_isa_override_above_hardware_is_refused():
    if tandem.hardware_isa() == "amx":
        return  # nothing above the hardware to ask for
    r = run("doctor", "--json", env={"TANDEM_ISA": "amx"})
    assert r.returncode == 1
    data = json.loads(r.stdout)
    assert data["cpu"]["effective_isa"] is None
    assert data["cpu"]["isa_error"].startswith("TANDEM_ISA=amx asks for more than this CPU provides: missing amx_tile")


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
