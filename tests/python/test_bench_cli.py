"""`tandem bench` on the demo model: the tests it names, figures that are consistent with each
other (no speed is asserted: a benchmark, not a timed test), the JSON it writes, and its
input checks before any model loads."""
from __future__ import annotations

import json

import pytest


def test_bench_reports_pp_and_tg_with_the_decode_ceiling(tmp_path, capsys):
    from tandem import cli

    out = tmp_path / "bench.json"
    assert cli.main(["bench", "-p", "16,32", "-n", "4", "-r", "2", "--json", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    for want in ("read bandwidth", "pp16", "pp32", "tg4", "decode ceiling:", "MB read per token"):
        assert want in text, text
    data = json.loads(out.read_text())
    assert [r["test"] for r in data["results"]] == ["pp16", "pp32", "tg4"]
    assert data["read_bandwidth_bytes_per_s"] > 0 and data["decode_step_bytes"] > 0
    for r in data["results"]:
        assert len(r["runs_tokens_per_s"]) == 2 and all(x > 0 for x in r["runs_tokens_per_s"])
        assert r["tokens_per_s"] == pytest.approx(sum(r["runs_tokens_per_s"]) / 2)
        assert r["ms"] > 0 and 0 < r["moe_share"] <= 1, r
    tg = data["results"][-1]
    assert tg["ceiling_tokens_per_s"] == pytest.approx(data["read_bandwidth_bytes_per_s"] / data["decode_step_bytes"])
    assert tg["of_ceiling"] == pytest.approx(tg["tokens_per_s"] / tg["ceiling_tokens_per_s"])


@pytest.mark.parametrize("argv, message", [
    (["-p", "0", "-n", "0"], "nothing to measure: give -p and / or -n lengths above 0"),
    (["-p", "12x"], "-p '12x': expected comma-separated token counts, e.g. 128,512"),
    (["-n", "-3"], "-n '-3': each length must be in [0, 1048576]"),
    (["-r", "0"], "-r must be at least 1, got 0"),
    (["--json", "{tmp}/no-dir/b.json"], "--json {tmp}/no-dir/b.json: the directory {tmp}/no-dir does not exist"),
])
def test_bench_checks_its_inputs_before_loading_a_model(argv, message, cli_refuses):
    cli_refuses("bench", argv, message)
