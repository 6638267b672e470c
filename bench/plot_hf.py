"""Plot bench_hf output: prefill and decode tokens/s per variant (transformers, tandem with
each cpu.dense_format), one panel each.

    .venv/bin/python bench/plot_hf.py bench/hf_dense.txt bench/hf_dense.png
"""
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def parse(path):
    """[(variant, torch threads, prefill tok/s, decode tok/s)] of the table bench_hf prints."""
    rows, title = [], ""
    for line in open(path):
        if line.startswith("machine:"):
            title = line.split("machine: ")[1].split(",")[0]
        parts = line.split()
        if len(parts) == 7 and (parts[0] == "transformers" or parts[0].startswith("tandem")):
            try:
                rows.append((parts[0], int(parts[1]), float(parts[2]), float(parts[3])))
            except ValueError:
                continue
    return title, rows


def main(src, dst):
    title, rows = parse(src)
    labels = [f"{v}\n({t} torch thr)" for v, t, _, _ in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, i, what in ((ax1, 2, "prefill"), (ax2, 3, "decode")):
        vals = [r[i] for r in rows]
        bars = ax.bar(range(len(rows)), vals, color=["#888"] + ["#2a7"] * (len(rows) - 1))
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=20)
        ax.set_ylabel(f"{what} tokens/s")
        ax.set_title(f"{what}")
    fig.suptitle(f"Qwen3-30B-A3B shapes, 4 layers, CPU only ({title}): tandem.dense formats vs transformers",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
