"""Plot bench_kernels output: effective weight bandwidth and GFLOP/s per token count.

    build/bench/bench_kernels [--format int8] > bench/kernels_int8.txt
    .venv/bin/python bench/plot_kernels.py bench/kernels_int8.txt bench/kernels_int8.png
"""
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def parse(path):
    rows = {}
    fmt = "BF16"
    for line in open(path):
        if "format: " in line:
            fmt = line.split("format: ")[1].split(";")[0].upper()
        parts = [p.strip() for p in line.split("|")]
        if len(parts) < 3 or not parts[0].split()[-1].isdigit():
            continue
        name, m = parts[0].split()
        us, gbs, gflops = map(float, parts[1].split())
        dnnl = float(parts[3].split()[1]) if len(parts) > 4 else None
        rows.setdefault(name, []).append((int(m), gbs, gflops, dnnl))
    return rows, fmt


def main(src, dst):
    rows, fmt = parse(src)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, pts in rows.items():
        m = [p[0] for p in pts]
        line, = ax1.plot(m, [p[1] for p in pts], "o-", label=name)
        ax2.plot(m, [p[2] for p in pts], "o-", color=line.get_color(), label=f"{name} tandem")
        if pts[0][3] is not None:
            ax2.plot(m, [p[3] for p in pts], "x--", color=line.get_color(), label=f"{name} oneDNN")
    for ax, title, unit in ((ax1, "weight bandwidth (decode regime)", "GB/s"),
                            (ax2, "throughput (prefill regime)", "GFLOP/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per expert (m)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"tandem {fmt} expert kernels, cold weights, top-8 steps")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
