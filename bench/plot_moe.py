"""Plot bench_moe output: layer time and effective bandwidth per token count, per format.

    .venv/bin/python bench/plot_moe.py bench/moe_bf16.txt bench/moe_int8.txt bench/moe_int4.txt bench/moe.png
"""
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def parse(path):
    fmt, rows = "?", {}
    for line in open(path):
        if line.startswith("machine:"):
            fmt = line.split("format: ")[1].split(";")[0]
        parts = [p.strip() for p in line.split("|")]
        head = parts[0].split()
        if len(parts) < 3 or len(head) != 3 or not head[1].isdigit():
            continue
        us, gbs, _ = map(float, parts[1].split())
        rows.setdefault(head[0], []).append((int(head[1]), us / 1e3, gbs))
    return fmt, rows


def main(srcs, dst):
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    styles = {"qwen3-235b": "o-", "deepseek-v3": "s--"}
    for src in srcs:
        fmt, rows = parse(src)
        for shape, pts in rows.items():
            t = [p[0] for p in pts]
            line, = ax1.plot(t, [p[1] for p in pts], styles.get(shape, "o-"), label=f"{shape} {fmt}")
            ax2.plot(t, [p[2] for p in pts], styles.get(shape, "o-"), color=line.get_color(), label=f"{shape} {fmt}")
    for ax, title, unit, log in ((ax1, "MoE layer time", "ms per layer", True),
                                 (ax2, "effective weight bandwidth", "GB/s", False)):
        ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("tandem CPU MoE layer (routed experts, top-8, cold weights)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:-1], sys.argv[-1])
