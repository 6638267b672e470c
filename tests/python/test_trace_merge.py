"""tandem trace-merge: tandem spans land on the torch.profiler timeline."""
import json

import pytest

from tandem.cli import main


def test_merge_shifts_tandem_events_onto_the_torch_timebase(tmp_path):
    ours = {"otherData": {"clock": "CLOCK_MONOTONIC", "wall_minus_monotonic_us": 1_000_000.0},
            "traceEvents": [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "w"}},
                            {"ph": "X", "name": "down", "pid": 1, "tid": 1, "ts": 500.0, "dur": 10.0}]}
    theirs = {"baseTimeNanoseconds": 400_000_000,  # 400_000 us
              "traceEvents": [{"ph": "X", "name": "aten::mm", "pid": 9, "tid": 9, "ts": 600_000.0, "dur": 5.0}]}
    (tmp_path / "t.json").write_text(json.dumps(ours))
    (tmp_path / "p.json").write_text(json.dumps(theirs))
    assert main(["trace-merge", str(tmp_path / "t.json"), str(tmp_path / "p.json"), "-o", str(tmp_path / "m.json")]) == 0
    merged = json.loads((tmp_path / "m.json").read_text())
    down = next(e for e in merged["traceEvents"] if e["name"] == "down")
    assert down["ts"] == pytest.approx(500.0 + 1_000_000.0 - 400_000.0)
    assert merged["baseTimeNanoseconds"] == 400_000_000
    assert any(e["name"] == "aten::mm" for e in merged["traceEvents"])


def test_merge_refuses_a_file_that_is_not_a_tandem_trace(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps({"traceEvents": []}))
    assert main(["trace-merge", str(tmp_path / "a.json"), str(tmp_path / "a.json"), "-o", str(tmp_path / "m.json")]) == 2
    assert "no otherData.wall_minus_monotonic_us" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()
