"""Start-up time of a model's routed experts: packing the checkpoint (what every start did
before `tandem convert`) against reading the packed store, from the page cache and from
disk, each next to the machine's file read speed measured on the same files in the same run.

    .venv/bin/python bench/bench_store.py                      # Qwen3-30B-A3B shapes, 4 layers
    .venv/bin/python bench/bench_store.py --formats int4 --reps 3

The checkpoint is bench_hf's random Qwen3-30B-A3B-shaped one (hidden 2048, 128 experts of
intermediate 768, bf16; built once into $TANDEM_CACHE). "From disk" drops the files' pages
from the page cache first (posix_fadvise DONTNEED, which needs no privileges; a page another
process holds stays). File read speed: the store's files read with 8 MiB preads into one
buffer, the same way (warm, then cold), one thread, into fresh memory as large as the data
(what a load must do: each page faulted in and zeroed as it is first written); for reference
also into memory touched beforehand, and into one reused 8 MiB buffer (what dd or fio report:
the destination stays in the CPU's cache). Resident memory: the process's RSS growth over the
load, against the packed bytes the engine holds.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))


def drop_cache(files: list[Path]) -> None:
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_speed(files: list[Path], cold: bool, into: str) -> float:
    """Seconds to read the files with 8 MiB preads into: "fresh" memory as large as the data
    (mapped, never touched: every page is faulted in and zeroed by the read, as it is for a
    load that allocates what it holds); "touched" memory of that size, faulted in before the
    clock starts; or "8mib", one reused 8 MiB buffer (what dd or fio report: the destination
    stays in the CPU's cache, so no memory is written)."""
    import mmap

    if cold:
        drop_cache(files)
    total = sum(p.stat().st_size for p in files)
    chunk = 8 << 20
    mm = mmap.mmap(-1, total if into != "8mib" else chunk)
    mm.madvise(mmap.MADV_HUGEPAGE)
    if into == "touched":
        for i in range(0, len(mm), 4096):
            mm[i] = 1
    view = memoryview(mm)
    at = 0
    t0 = time.perf_counter()
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view[at:at + chunk])
                if not n:
                    break
                if into != "8mib":
                    at += n
    dt = time.perf_counter() - t0
    view.release()
    mm.close()
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--formats", default="bf16,int8,int4")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of each load (the best is reported)")
    ap.add_argument("--store-root", type=Path, help="where the stores go (default: next to the checkpoint)")
    args = ap.parse_args()

    import torch

    from bench_hf import model_dir
    from tandem import _C
    from tandem.loader import open_model_experts

    path = model_dir("qwen3-30b-a3b", args.layers, 32768)
    me = open_model_experts(path)
    E, H, I = me.shape
    shards = sorted(Path(path).glob("*.safetensors"))
    print("machine: " + next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
          + f", {os.cpu_count()} CPUs")
    print(f"checkpoint: {path} ({len(me.layers)} MoE layers x {E} experts, hidden {H}, intermediate {I}; "
          f"torch threads {torch.get_num_threads()})")
    rows = []
    for fmt in args.formats.split(","):
        group = 128
        out = (args.store_root or Path(path)) / _C.store_dir_name(fmt, group, False)
        t0 = time.perf_counter()
        rep = _C.convert_experts(me.ckpt, me.naming, E, H, I, me.layers, fmt, group, False, str(out))
        convert_s = time.perf_counter() - t0
        files = sorted(out.glob("layer-*.tpk"))
        config = f"version: 1\ncpu: {{format: {fmt}}}\ngpu: {{device: none}}\n"
        store = _C.ExpertStore(str(out))

        def load(kind: str, cold: bool) -> tuple[float, int, int]:
            best, packed, grown = float("inf"), 0, 0
            for _ in range(args.reps):
                if cold:
                    drop_cache(files if kind == "store" else shards)
                gc.collect()
                before = rss()
                engine = _C.Engine(config_text=config, experts=E, hidden=H, inter=I, layers=me.layers)
                t = time.perf_counter()
                if kind == "store":
                    engine.load_store(store, me.ckpt, me.naming)
                else:
                    engine.load_checkpoint(me.ckpt, me.naming)
                best = min(best, time.perf_counter() - t)
                packed, grown = engine.cpu_bytes, rss() - before
                del engine
            return best, packed, grown

        pack_warm = load("pack", False)
        pack_cold = load("pack", True)
        store_warm = load("store", False)
        store_cold = load("store", True)
        read_warm = min(read_speed(files, False, "fresh") for _ in range(args.reps))
        read_cold = min(read_speed(files, True, "fresh") for _ in range(args.reps))
        read_touched = min(read_speed(files, False, "touched") for _ in range(args.reps))
        read_small = min(read_speed(files, False, "8mib") for _ in range(args.reps))
        nbytes = sum(f.stat().st_size for f in files)
        row = dict(format=fmt, store_gb=nbytes / 1e9, convert_s=convert_s, written=rep["layers_written"],
                   pack_warm=pack_warm[0], pack_cold=pack_cold[0], store_warm=store_warm[0], store_cold=store_cold[0],
                   read_warm=read_warm, read_cold=read_cold, read_small=read_small, read_touched=read_touched, packed_gb=store_warm[1] / 1e9,
                   rss_gb=store_warm[2] / 1e9)
        rows.append(row)
        g = nbytes / 1e9
        print(f"\n{fmt}: store {g:.2f} GB ({rep['layers_written']} layers written in {convert_s:.1f} s"
              f"{'; already there' if rep['up_to_date'] else ''}); engine holds {row['packed_gb']:.2f} GB, "
              f"RSS grew {row['rss_gb']:.2f} GB while loading from the store")
        print(f"  {'':28} {'seconds':>8} {'GB/s':>7} {'vs file read':>12}")
        for name, s, ref in (("pack the checkpoint (cached)", pack_warm[0], None),
                             ("pack the checkpoint (disk)", pack_cold[0], None),
                             ("store, page cache", store_warm[0], read_warm),
                             ("store, disk", store_cold[0], read_cold),
                             ("file read, page cache", read_warm, None),
                             ("file read, disk", read_cold, None),
                             ("(page cache, touched memory)", read_touched, None),
                             ("(page cache into 8 MiB)", read_small, None)):
            ratio = f"{ref / s:11.0%}" if ref else ""
            print(f"  {name:28} {s:8.2f} {g / s:7.2f} {ratio:>12}")
        print(f"  store start-up vs packing: {pack_warm[0] / store_warm[0]:.1f}x (cached), "
              f"{pack_cold[0] / store_cold[0]:.1f}x (disk)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
