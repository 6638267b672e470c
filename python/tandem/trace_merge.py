"""Merge a tandem Chrome trace into a torch.profiler (Kineto) Chrome trace.

tandem stamps spans with CLOCK_MONOTONIC microseconds and records, in
``otherData.wall_minus_monotonic_us``, the wall-clock offset at the time it wrote the
file. Kineto stamps events with wall-clock (Unix epoch) microseconds; newer versions
write them relative to a top-level ``baseTimeNanoseconds``. Merging shifts every tandem
event onto the torch timeline:

    ts_torch = ts_tandem + wall_minus_monotonic_us - baseTimeNanoseconds / 1000

    tandem trace-merge tandem_trace.json torch_trace.json -o merged.json

The offset is sampled once per tandem file, so the alignment is as good as the two
clocks' drift over the run (NTP slews the wall clock by at most 0.05%).
"""
import json
import os
import tempfile


def _load(path):
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, list):  # the JSON Array Format is also valid Chrome trace
        data = {"traceEvents": data}
    if "traceEvents" not in data:
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents)")
    return data


def merge(tandem_path, torch_path, out_path):
    ours = _load(tandem_path)
    theirs = _load(torch_path)
    try:
        offset_us = float(ours["otherData"]["wall_minus_monotonic_us"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{tandem_path}: no otherData.wall_minus_monotonic_us; is it a tandem trace?") from None
    base_us = float(theirs.get("baseTimeNanoseconds", 0)) / 1000.0
    shift = offset_us - base_us
    merged = dict(theirs)
    events = list(theirs["traceEvents"])
    for e in ours["traceEvents"]:
        e = dict(e)
        if "ts" in e:
            e["ts"] = float(e["ts"]) + shift
        events.append(e)
    merged["traceEvents"] = events
    # Atomic write: never leave a half-written file where the user's trace was.
    d = os.path.dirname(os.path.abspath(out_path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".trace_merge.", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(merged, f)
        os.replace(tmp, out_path)
    except BaseException:
        os.unlink(tmp)
        raise
    return shift
