"""The repository's hostile inputs replayed through the command line (issue 25): every config
of the fuzzers' seed corpus (tests/fuzz/corpus_config/) through `tandem doctor --config` and
`tandem run --config`, every data file of tests/hostile/data/ through `tandem train --data`,
and a few broken checkpoints through `tandem run --model`. Each must end within seconds with
the expected one-line message naming the file (and line), exit code 2 for the commands (1 and
INVALID for the doctor), and nothing loaded: doctor and the loaders share one validation, so
the two commands give the same text for a config."""
from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "fuzz" / "corpus_config"
DATA = ROOT / "tests" / "hostile" / "data"
SECONDS = 20  # per input; the parsers bound their work, so this is generous even on a loaded CI machine

# config file -> what the error says after "FILE:LINE:COL: " (the doctor's INVALID line and
# `tandem run`'s one-line error alike)
CONFIG_ERRORS = {
    "alias_self": "cpu.numa_nodes: YAML anchors are not supported (&a)",
    "alias_undefined": "cpu: YAML aliases are not supported (*settings)",
    "big_numbers": "cpu.threads: 99999999999999999999 is outside the allowed range [1, 4096]",
    "bom_crlf": "YAML syntax error: did not find expected <document start>",
    "complex_key": ": unknown key; allowed here: version, model, cpu, gpu, buffers, trace, train, distributed",
    "control_chars": "YAML syntax error: control characters are not allowed",
    "deep_block": "nested more than 32 levels deep, over the limit (TANDEM_CONFIG_MAX_DEPTH raises it)",
    "deep_flow_map": "nested more than 32 levels deep",
    "deep_flow_seq": "nested more than 32 levels deep",
    "directives": "cpu: explicit YAML tags are not supported",
    "hang_comma": "YAML syntax error: did not find expected node content",
    "hang_comma_letter": "YAML syntax error: did not find expected node content",
    "hang_comma_space": "YAML syntax error: did not find expected node content",
    "hang_comma_then_config": "YAML syntax error: did not find expected node content",
    "hang_space_comma": "YAML syntax error: did not find expected node content",
    "hang_tag_comma": "YAML syntax error: did not find expected whitespace or line break",
    "laughs": "a0: YAML anchors are not supported (&a0)",
    "not_utf8": ": unknown key; allowed here:",
    "nulls": "cpu.format: has no value (remove the key to use the default)",
    "quoted_numbers": "cpu.threads: expected an integer, got '4'",
    "tags": "cpu.format: explicit YAML tags are not supported",
    "two_documents": "top level: a config is one YAML document; this holds 2",
    "unterminated_flow": "YAML syntax error: did not find expected ',' or ']'",
}
# Valid configs in the corpus (the fuzzers' good seeds): the doctor reads them without error.
VALID_CONFIGS = {"block_scalars", "hot_layers", "hot_stats", "int4_full"}

DATA_ERRORS = {
    "bad_json.jsonl": ":2: not JSON (Unterminated string starting at, column 10)",
    "empty.jsonl": ": no texts",
    "lone_surrogate.jsonl": ":1: the text holds an unpaired surrogate escape (\\ud83d), which is not a character",
    "message_without_content.jsonl": ':1: "messages"[0] is not a message with a string "role" and "content"',
    "missing_text.jsonl": ":1: expected an object with a string \"text\", \"prompt\" and \"completion\", or "
                          "\"messages\", got keys ['txt']",
    "mixed_prompt_completion.jsonl": ":1: expected an object with a string \"text\"",
    "not_utf8.jsonl": ":2: not UTF-8 text at byte offset 29 (0xff: invalid start byte)",
    "sheet.xlsx": ": not a training data format tandem reads",
    "truncated_nesting.jsonl": ":2: not JSON (Expecting value, column 11)",
    "wrong_columns.csv": ":row 1: expected an object with a string \"text\"",
    "wrong_keys.json": ":row 1: expected an object with a string \"text\"",
}


class TookTooLong(Exception):
    pass


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """tandem's command line in this process, stopped by SIGALRM after SECONDS."""
    from tandem import cli as tandem_cli

    def alarm(signum, frame):
        raise TookTooLong(f"tandem {' '.join(argv)} ran past {SECONDS} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(SECONDS)
    try:
        rc = tandem_cli.main(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    out = capsys.readouterr()
    return rc, out.out, out.err


def error_line(err: str) -> str:
    lines = [l for l in err.splitlines() if l.startswith("tandem: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_every_corpus_config_is_accounted_for():
    assert {p.name for p in CONFIGS.iterdir()} == set(CONFIG_ERRORS) | VALID_CONFIGS
    assert {p.name for p in DATA.iterdir()} == set(DATA_ERRORS)


@pytest.mark.parametrize("name", sorted(CONFIG_ERRORS))
def test_hostile_configs_through_doctor_and_run(name, capsys, tmp_path, monkeypatch):
    path = CONFIGS / name
    rc, out, _ = cli(["doctor", "--config", str(path), "--no-gpu-kernel"], capsys)
    assert rc == 1 and f"Config   {path}: INVALID" in out, out
    invalid = next(l.strip() for l in out.splitlines() if l.strip().startswith(f"{path}:"))
    assert CONFIG_ERRORS[name] in invalid, invalid
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))  # the demo model is never built for it
    rc, _, err = cli(["run", "--config", str(path), "--no-progress"], capsys)
    assert rc == 2
    assert error_line(err) == f"tandem: error: {invalid}", "doctor and the loaders say the same"
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("name", sorted(VALID_CONFIGS))
def test_valid_corpus_configs_are_read(name, capsys):
    rc, out, _ = cli(["doctor", "--config", str(CONFIGS / name), "--no-gpu-kernel"], capsys)
    assert rc in (0, 1) and f"Config   {CONFIGS / name}: valid" in out, out


@pytest.mark.parametrize("name", sorted(DATA_ERRORS))
def test_hostile_data_through_train(name, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    rc, _, err = cli(["train", "--data", str(DATA / name), "--steps", "1", "--out", str(tmp_path / "run"),
                      "--no-progress"], capsys)
    assert rc == 2
    assert error_line(err) == f"tandem: error: {DATA / name}{DATA_ERRORS[name]}" or \
        error_line(err).startswith(f"tandem: error: {DATA / name}{DATA_ERRORS[name]}"), err
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists(), "checked before any model"


def test_hostile_checkpoints_through_run(capsys, tmp_path):
    """Broken copies of the demo checkpoint: a NaN weight, a missing tensor, an absurd size."""
    from safetensors.torch import load_file, save_file

    from tandem import demo

    src = demo.ensure_demo_model(progress=False)
    sd = load_file(src / "model.safetensors")
    key = "model.layers.1.self_attn.q_proj.weight"

    def broken(name, edit_sd=None, edit_cfg=None):
        d = tmp_path / name
        shutil.copytree(src, d)
        if edit_sd:
            t = dict(sd)
            edit_sd(t)
            save_file(t, d / "model.safetensors", metadata={"format": "pt"})
        if edit_cfg:
            c = json.loads((d / "config.json").read_text())
            edit_cfg(c)
            (d / "config.json").write_text(json.dumps(c))
        return d

    def nan(t):
        t[key] = t[key].clone()
        t[key].view(-1)[3] = float("nan")
    cases = [
        (broken("nan", nan), f"tensor '{key}' element [0, 3] is nan; non-finite weights are refused"),
        (broken("missing", lambda t: t.pop(key)), f"checkpoint has no tensor '{key}'"),
        (broken("absurd", edit_cfg=lambda c: c.update(hidden_size=2**32 + 1)),
         "config.json: hidden_size = 4294967297 is not a valid size (expected an integer in [1, 262144])"),
    ]
    for d, message in cases:
        rc, _, err = cli(["run", "--model", str(d), "--config", str(ROOT / "configs" / "demo.yaml"),
                          "--max-new-tokens", "1", "--no-progress"], capsys)
        assert rc == 2 and message in error_line(err), err
    assert torch.isfinite(sd[key]).all()
