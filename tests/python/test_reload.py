"""Loading and freeing a model in a loop (notebooks, servers that reload, test suites) leaves
nothing behind (issue 25): after a warm-up, the process's open files, memory mappings,
threads and resident memory stay flat.

Bound on anonymous resident memory (RssAnon), per cycle after malloc_trim: stock from_pretrained of the same model
grows by about 10 KB a cycle (allocator and Python caches); a leak of anything tandem makes
per load (an engine's 160 KB trace chunk per pool thread was one, 385 KB a cycle; a packed
layer or a checkpoint mapping would be far more) is over 100 KB. 20 cycles may grow by 2 MiB
(100 KB a cycle) at most."""
from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import ctypes, gc, os, sys, torch, tandem
    from tandem import demo
    path = demo.ensure_demo_model(progress=False)
    trim = ctypes.CDLL("libc.so.6").malloc_trim
    def stats():
        maps = sum(1 for _ in open("/proc/self/maps"))
        # Anonymous resident memory: where a leak lives. VmRSS also counts file pages (the
        # libraries' code, the checkpoint's mapping), which come and go with the page cache
        # and once made this grow by 26 MB in a full CI run with nothing leaked.
        rss = int([l for l in open("/proc/self/status") if l.startswith("RssAnon")][0].split()[1])
        return len(os.listdir("/proc/self/fd")), maps, len(os.listdir("/proc/self/task")), rss
    def cycle():
        m = tandem.load_model(path, {"version": 1, "cpu": {"threads": 1}}, progress=False)
        with torch.no_grad():
            m(torch.zeros(1, 8, dtype=torch.long))
        del m
        gc.collect()
        trim(0)
    for _ in range(5):
        cycle()
    before = stats()
    for _ in range(20):
        cycle()
    print("STATS", *before, *stats())
""")


def test_load_and_free_the_demo_model_20_times():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=600)
    line = [l for l in out.stdout.splitlines() if l.startswith("STATS")]
    assert line, out.stdout + out.stderr
    fds0, maps0, tasks0, rss0, fds1, maps1, tasks1, rss1 = map(int, line[0].split()[1:])
    assert fds1 == fds0, f"open files {fds0} -> {fds1}"
    assert tasks1 == tasks0, f"threads {tasks0} -> {tasks1}"
    assert maps1 <= maps0 + 4, f"mappings {maps0} -> {maps1}"
    assert rss1 - rss0 <= 2048, f"anonymous resident memory grew by {rss1 - rss0} KB over 20 cycles"
