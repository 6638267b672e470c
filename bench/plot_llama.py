"""Plot bench_llama.py --json output: decode tokens/s of tandem and llama.cpp per pairing,
labelled with the ratio and each one's % of the read bandwidth over the bytes a token reads;
prefill ratios in the second panel. Several JSON files (one per model or run) become one
figure, a row of pairings each.

    .venv/bin/python bench/plot_llama.py bench/llama_qwen3.json bench/llama_qwen3_k_quants.json \\
        bench/llama_deepseek_v2_lite.json --out bench/llama_cpu.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def pairs(path: Path) -> tuple[float, list[dict]]:
    """The run's read bandwidth (GB/s) and its (tandem, llama.cpp) rows."""
    d = json.loads(path.read_text())
    bw = d["ceilings"].get("read_gbs")
    out = []
    for t, l in d["rows"]:
        out.append(dict(label=f"{t['variant'].removeprefix('tandem ')}\nvs {l['variant'].removeprefix('llama.cpp/')}",
                        t_dec=t["decode_tps"], l_dec=l["decode_tps"], t_pre=t["prefill_tps"], l_pre=l["prefill_tps"],
                        t_bw=t["decode_tps"] * t["decode_bytes"] / 1e9 / bw if bw else None,
                        l_bw=l["decode_tps"] * l["decode_bytes"] / 1e9 / bw if bw else None))
    return bw, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", type=Path)
    p.add_argument("--names", help="comma-separated model name per JSON file (default: the file names)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    names = a.names.split(",") if a.names else [j.stem for j in a.json]
    rows = []
    for name, j in zip(names, a.json):
        bw, ps = pairs(j)
        rows += [dict(r, model=name, bw=bw) for r in ps]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(10, 1.6 * len(rows) + 3), 4.8),
                                   gridspec_kw=dict(width_ratios=[3, 1.4]))
    x = range(len(rows))
    w = 0.38
    tb = ax1.bar([i - w / 2 for i in x], [r["t_dec"] for r in rows], w, color="#2a7", label="tandem")
    lb = ax1.bar([i + w / 2 for i in x], [r["l_dec"] for r in rows], w, color="#888", label="llama.cpp")
    ax1.bar_label(tb, [f"{r['t_dec'] / r['l_dec']:.2f}x\n{100 * r['t_bw']:.0f}% bw" if r["t_bw"] else
                       f"{r['t_dec'] / r['l_dec']:.2f}x" for r in rows], fontsize=7)
    ax1.bar_label(lb, [f"{100 * r['l_bw']:.0f}%" if r["l_bw"] else "" for r in rows], fontsize=7)
    ax1.set_ylim(0, 1.15 * max(max(r["t_dec"], r["l_dec"]) for r in rows))
    ax1.set_xticks(list(x), [f"{r['model']}\n{r['label']}" for r in rows], fontsize=6.5)
    ax1.set_ylabel("decode tokens/s (CPU only)")
    ax1.legend(fontsize=8)
    ax1.set_title("decode: tandem / llama.cpp, and % of the read bandwidth over a token's bytes", fontsize=9)
    pre = [r["t_pre"] / r["l_pre"] for r in rows]
    bars = ax2.bar(list(x), pre, color="#27a")
    ax2.bar_label(bars, fmt="%.1fx", fontsize=7)
    ax2.axhline(3.0, color="#a33", lw=0.8, ls="--")
    ax2.set_xticks(list(x), [r["label"].split("\n")[0] for r in rows], fontsize=6, rotation=60)
    ax2.set_ylabel("prefill speed-up over llama.cpp")
    ax2.set_title("prefill (goal: 3x)", fontsize=9)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
