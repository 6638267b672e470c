"""The Python side uses the C++ parser: same values, same errors."""
from pathlib import Path

import pytest

import tandem

REPO = Path(__file__).resolve().parents[2]


def test_demo_config_values():
    cfg = tandem.load_config(REPO / "configs" / "demo.yaml")
    assert cfg["cpu"]["format"] == "bf16"
    assert cfg["cpu"]["virtual_subpools"] == 2
    assert cfg["gpu"]["hot_experts"]["policy"] == "none"
    assert cfg["source"].endswith("configs/demo.yaml")


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_config_parses(name):
    cfg = tandem.load_config(REPO / "configs" / name)
    assert cfg["version"] == 1


def test_relative_paths_resolve_against_the_file(tmp_path):
    (tmp_path / "p.yaml").write_text("model:\n  path: ckpt\ngpu:\n  hot_experts: {count: 2, statistics: s.json}\n")
    cfg = tandem.load_config(tmp_path / "p.yaml")
    assert cfg["model"]["path"] == str(tmp_path / "ckpt")
    assert cfg["gpu"]["hot_experts"]["statistics"] == str(tmp_path / "s.json")
    assert cfg["gpu"]["hot_experts"]["policy"] == "statistics"


def test_error_names_file_line_key_and_allowed(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("cpu:\n  format: int4\n  group_size: 100\n")
    with pytest.raises(ValueError) as info:
        tandem.load_config(p)
    assert str(info.value).startswith(f"{p}:3:15: cpu.group_size: '100' is not one of: 32, 64, 128  [")


def test_unknown_key_is_an_error():
    with pytest.raises(ValueError, match=r"^x.yaml:2:3: gpu.hot: unknown key; allowed here: device, hot_experts, deferred_experts"):
        tandem.parse_config("gpu:\n  hot: 3\n", "x.yaml")


def test_missing_file_is_oserror(tmp_path):
    with pytest.raises(OSError, match="cannot read config"):
        tandem.load_config(tmp_path / "absent.yaml")


def test_a_key_that_is_not_utf8_is_named_with_file_and_line(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes(b"cpu:\n  format: int8\n\xff: 1\n")
    with pytest.raises(ValueError) as info:
        tandem.load_config(p)
    assert str(info.value).startswith(f"{p}:3:1: ")
    assert "\\xff" in str(info.value)
