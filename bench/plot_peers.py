"""Plot bench_peers.py output: tandem's speed over each peer's (median samples) per token
count, one panel per format, one line per peer and shape; the issue's goals as dotted lines
(decode >= 1.15x ggml at 8 / 4 bits and >= 1.0x in bf16; prefill >= 4x ggml and >= 2x kt-kernel
at 512 tokens).

    .venv/bin/python bench/plot_peers.py bench/peers_zen4_30b.txt bench/peers_zen4_235b.txt \\
        --out bench/peers_zen4.png
"""
from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROW = re.compile(r"\s*(\d+)\s+\d+ \|\s+[\d.]+\s+[\d.]+ \| (.{15})\s+[\d.]+\s+[\d.]+ \|\s+([\d.]+)x")


def parse(path: Path) -> tuple[str, dict]:
    """(shape, {format: {peer: [(tokens, tandem/peer)]}}) of one bench_peers.py output."""
    shape, fmt, out = "?", None, defaultdict(lambda: defaultdict(list))
    for line in path.read_text().splitlines():
        if m := re.match(r"== (\S+)", line):
            shape = m.group(1)
        elif m := re.match(r"-- (\w+):", line):
            fmt = m.group(1)
        elif fmt and (m := ROW.match(line)):
            out[fmt][m.group(2).strip()].append((int(m.group(1)), float(m.group(3))))
    return shape, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path("bench/peers.png"))
    args = ap.parse_args()
    runs = [parse(f) for f in args.files]
    formats = [f for f in ("bf16", "int8", "int4") if any(f in r for _, r in runs)]
    fig, axes = plt.subplots(1, len(formats), figsize=(5 * len(formats), 4.2), squeeze=False)
    styles = {"30b": "--", "235b": "-", "v3": ":"}
    for ax, fmt in zip(axes[0], formats):
        for shape, res in runs:
            for peer, pts in sorted(res.get(fmt, {}).items()):
                pts.sort()
                ax.plot([t for t, _ in pts], [r for _, r in pts], styles.get(shape, "-"), marker="o",
                        label=f"{peer} ({shape})")
        goal_dec = 1.0 if fmt == "bf16" else 1.15
        ax.axhline(goal_dec, color="grey", linestyle=":", linewidth=1)
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.plot([512], [4.0], "k*", markersize=9, label="goal at 512: 4x ggml")
        ax.plot([512], [2.0], "kx", markersize=9, label="goal at 512: 2x kt")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("tokens in the batch")
        ax.set_ylabel("tandem speed / peer speed")
        ax.set_title(f"{fmt}: one MoE layer's routed experts")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
