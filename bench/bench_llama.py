"""Whole-model CPU prefill and decode: tandem next to llama.cpp (llama-cpp-python) on the same
random-weight checkpoint, same run, same machine, at comparable bytes per token.

    .venv/bin/python bench/bench_llama.py --llama DIR --llama-src SRC
    .venv/bin/python bench/bench_llama.py --llama DIR --llama-src SRC --layers 4 --vocab 32768 \\
        --pairs bf16/auto:bf16,int8/int8:q8_0,int4/int4:q4_0 --prompt 128 --new 32 --repeat 3

The peer is installed outside the project (it compiles llama.cpp for this CPU, ~10 minutes
on 2 cores):
    pip install --no-deps --target DIR llama-cpp-python diskcache
and its converter comes from the same release's source archive:
    pip download --no-deps --no-binary :all: llama-cpp-python   # then unpack it;
    SRC = llama_cpp_python-<version>/vendor/llama.cpp   (convert_hf_to_gguf.py, gguf-py)

Each pair is `tandem-format/dense-format:gguf-type`: tandem with cpu.format and
cpu.dense_format (through bench_hf.py's variant, i.e. `tandem.load_model` + transformers'
`generate`), and llama.cpp on the checkpoint converted by llama.cpp's own
convert_hf_to_gguf.py (bf16 / q8_0 directly; q4_0 etc. quantized from the bf16 GGUF with
llama.cpp's quantizer). Every variant runs in its own process. llama.cpp runs with one
thread per logical CPU (prompt and decode); tandem with its defaults (the pool on every
core, torch on what is left). Decode feeds the greedy token back, as generate does.

The checkpoint has no trained tokenizer: the GGUF gets the demo model's byte-level one
(token ids are what both tools read; the text is never used), registered under the "qwen2"
pre-tokenizer name, since llama.cpp's converter only knows the tokenizers of published models.

--rounds N runs each pair's two processes N times, alternating which starts, and prints the
ratio of every round next to the medians: on a machine whose read bandwidth moves by the
minute (a shared VM: 33-47 GB/s within an hour on the Zen 4 guest) one round compares two
different machines.

Bytes per decoded token: every weight except the embedding table (one row of it) plus top_k
of each MoE layer's experts, counted from the tensors each tool holds (the GGUF's tensor
sizes; tandem's packed bytes). Their rate over the read bandwidth measured by
build/bench/bench_ceilings in the same run is the "% of bw" column.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "python"))

GGUF_BASE = "bf16"  # the converter's output type that the quantizer starts from


def stage_checkpoint(ckpt: Path, work: Path) -> Path:
    """A directory the converter accepts: the checkpoint's files linked, plus the demo
    model's tokenizer."""
    from tandem import demo

    stage = work / "hf"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    for f in ckpt.iterdir():
        if f.is_file() and not f.name.startswith("tokenizer"):
            (stage / f.name).symlink_to(f.resolve())
    tok = demo.ensure_demo_model(progress=False)
    shutil.copy(tok / "tokenizer_config.json", stage / "tokenizer_config.json")
    # llama.cpp refuses a BPE vocabulary without merges, and the demo's byte-level one has
    # none: one merge ("a" + "b" -> "ab", a new id) satisfies it.
    t = json.loads((tok / "tokenizer.json").read_text())
    vocab = t["model"]["vocab"]
    vocab.setdefault("ab", max(max(vocab.values()), *(a["id"] for a in t.get("added_tokens", []))) + 1)
    t["model"]["merges"] = [["a", "b"]]
    (stage / "tokenizer.json").write_text(json.dumps(t))
    return stage


CONVERT = """
import runpy, sys
src = sys.argv[1]
sys.path.insert(0, src)
sys.path.insert(1, src + "/gguf-py")
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"   # see bench_llama.py's docstring
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def gguf_file(args, ckpt: Path, gtype: str) -> Path:
    """The checkpoint as a GGUF of type gtype, made once under the work directory."""
    work = Path(args.work) / ckpt.name
    out = work / f"model-{gtype}.gguf"
    if out.is_file():
        return out
    work.mkdir(parents=True, exist_ok=True)
    if gtype in ("bf16", "f16", "f32", "q8_0"):
        stage = stage_checkpoint(ckpt, work)
        tmp = out.with_suffix(".tmp")
        print(f"converting {ckpt.name} to {gtype} GGUF with llama.cpp's converter", flush=True)
        r = subprocess.run([sys.executable, "-c", CONVERT, args.llama_src, str(stage), "--outtype", gtype,
                            "--outfile", str(tmp)], capture_output=True, text=True)
        if r.returncode or not tmp.is_file():
            sys.exit(f"bench_llama: convert_hf_to_gguf.py failed:\n{r.stderr[-3000:]}")
        tmp.rename(out)
        return out
    base = gguf_file(args, ckpt, GGUF_BASE)
    print(f"quantizing {base.name} to {gtype} with llama.cpp's quantizer", flush=True)
    code = f"""
import sys, ctypes
sys.path.insert(0, {args.llama!r})
import llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + {gtype.upper()!r})
p.nthread = {os.cpu_count() or 1}
rc = llama_cpp.llama_model_quantize({str(base).encode()!r}, {str(out.with_suffix('.tmp')).encode()!r}, ctypes.byref(p))
sys.exit(rc)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"bench_llama: quantizing to {gtype} failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    out.with_suffix(".tmp").rename(out)
    return out


def gguf_decode_bytes(args, path: Path, top_k: int, experts: int) -> int:
    """Bytes a decoded token reads from this GGUF: all tensors but the embedding table (one
    row) and the expert tensors (top_k / experts of each)."""
    sys.path.insert(0, str(Path(args.llama_src) / "gguf-py"))
    import gguf

    total = 0
    for t in gguf.GGUFReader(str(path)).tensors:
        n = int(t.n_bytes)
        if t.name == "token_embd.weight":
            total += n // int(t.shape[-1])  # one row (shape is [n_embd, n_vocab] in GGUF order)
        elif "_exps." in t.name:
            total += n * top_k // experts
        else:
            total += n
    return total


def llama_variant(args) -> dict:
    """One llama.cpp run in this process: load, warm up, time prefill and greedy decode."""
    sys.path.insert(0, args.llama)
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    threads = os.cpu_count() or 1
    t0 = time.perf_counter()
    llm = Llama(model_path=args.gguf, n_ctx=args.prompt + args.new + 16, n_batch=max(args.prompt, 32),
                n_ubatch=max(args.prompt, 32), n_threads=threads, n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - t0
    vocab = llm.n_vocab()
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, min(vocab, 256), args.prompt).tolist()

    def once():
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        for _ in range(args.new - 1):
            # the last token's logits (llm.scores holds them only with logits_all)
            nxt = int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), shape=(vocab,))))
            llm.eval([nxt])
        t2 = time.perf_counter()
        return args.prompt / (t1 - t0), (args.new - 1) / (t2 - t1)

    llm.reset()
    llm.eval(prompt[:8])  # warm-up
    runs = [once() for _ in range(args.repeat)]
    return dict(variant=f"llama.cpp/{args.gtype}", load_s=load_s, prefill_tps=statistics.median(r[0] for r in runs),
                decode_tps=statistics.median(r[1] for r in runs), threads=threads)


def tandem_variant(args, ckpt: Path, fmt: str, dense: str) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "bench_hf.py"), "--variant", f"tandem/{dense}", "--dir", str(ckpt),
           "--prompt", str(args.prompt), "--new", str(args.new), "--repeat", str(args.repeat), "--format", fmt,
           "--group-size", str(args.group_size)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"bench_llama: tandem {fmt}/{dense} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama", default=os.environ.get("LLAMA_CPP_PATH"),
                   help="directory llama-cpp-python was installed into (pip install --target); or LLAMA_CPP_PATH")
    p.add_argument("--llama-src", default=os.environ.get("LLAMA_CPP_SRC"),
                   help="llama.cpp source directory with convert_hf_to_gguf.py and gguf-py; or LLAMA_CPP_SRC")
    p.add_argument("--model", default="qwen3-30b-a3b", choices=("qwen3-30b-a3b", "deepseek-v2-lite"),
                   help="whose shapes the random checkpoint has (default qwen3-30b-a3b)")
    p.add_argument("--layers", type=int, default=4, help="layers of the random checkpoint (default 4)")
    p.add_argument("--vocab", type=int, default=32768, help="its vocabulary (default 32768)")
    p.add_argument("--pairs", default="bf16/auto:bf16,int8/int8:q8_0,int4/int4:q4_0",
                   help="tandem-format/dense-format:gguf-type, comma-separated")
    p.add_argument("--group-size", type=int, default=128, help="tandem's int4 group (64 for deepseek-v2-lite: its "
                   "dense MLP's k = 10944)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="run each pair's two processes this many times, alternating which goes first; the "
                        "ratios are per round (a machine whose bandwidth moves by the minute needs several)")
    p.add_argument("--work", default=str(Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
                                         / "gguf"), help="where the GGUF files are kept")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--llama-variant", dest="gguf", help=argparse.SUPPRESS)
    p.add_argument("--gtype", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.llama or not (Path(args.llama) / "llama_cpp").is_dir():
        p.error("--llama DIR (or LLAMA_CPP_PATH): a directory holding llama_cpp (pip install --no-deps --target DIR "
                "llama-cpp-python diskcache)")
    if args.gguf:
        print(json.dumps(llama_variant(args)))
        return 0
    if not args.llama_src or not (Path(args.llama_src) / "convert_hf_to_gguf.py").is_file():
        p.error("--llama-src SRC (or LLAMA_CPP_SRC): llama.cpp's source directory with convert_hf_to_gguf.py "
                "(vendor/llama.cpp of the llama-cpp-python source archive)")
    pairs = []
    for item in args.pairs.split(","):
        try:
            left, gtype = item.split(":")
            fmt, dense = left.split("/")
        except ValueError:
            p.error(f"--pairs: {item!r} is not tandem-format/dense-format:gguf-type")
        pairs.append((fmt, dense, gtype))

    import bench_hf
    from transformers import AutoConfig

    ckpt = bench_hf.model_dir(args.model, args.layers, args.vocab)
    cfg = AutoConfig.from_pretrained(ckpt)
    ceil = bench_hf.ceilings()
    bw = ceil.get("read_gbs")
    print(ceil.get("machine", ""))
    print(f"checkpoint {ckpt.name}: {args.layers} layers, vocab {cfg.vocab_size}; prompt {args.prompt} tokens, "
          f"{args.new} new, median of {args.repeat}; read bandwidth (bench_ceilings) {bw} GB/s", flush=True)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    rows, rounds = [], {}

    def llama_run(gguf_path, gtype):
        r = subprocess.run([sys.executable, __file__, "--llama", args.llama, "--llama-variant", str(gguf_path),
                            "--gtype", gtype, "--prompt", str(args.prompt), "--new", str(args.new),
                            "--repeat", str(args.repeat)], capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"bench_llama: llama.cpp {gtype} failed:\n{r.stderr[-3000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def median_of(runs):
        out = dict(runs[0])
        for key in ("prefill_tps", "decode_tps", "load_s"):
            out[key] = statistics.median(x[key] for x in runs)
        return out

    for fmt, dense, gtype in pairs:
        gguf_path = gguf_file(args, ckpt, gtype)
        tds, lcs = [], []
        for i in range(args.rounds):  # odd rounds start with llama.cpp
            if i % 2:
                lcs.append(llama_run(gguf_path, gtype))
            tds.append(tandem_variant(args, ckpt, fmt, dense))
            if not i % 2:
                lcs.append(llama_run(gguf_path, gtype))
            if args.rounds > 1:
                print(f"  round {i + 1}: tandem {fmt}/{dense} decode {tds[-1]['decode_tps']:.2f} tok/s, "
                      f"llama.cpp/{gtype} {lcs[-1]['decode_tps']:.2f}: {tds[-1]['decode_tps'] / lcs[-1]['decode_tps']:.2f}x",
                      flush=True)
        td, lc = median_of(tds), median_of(lcs)
        experts = getattr(cfg, "num_experts", None) or cfg.n_routed_experts
        lc["decode_bytes"] = gguf_decode_bytes(args, gguf_path, cfg.num_experts_per_tok, experts)
        td["variant"] = f"tandem {fmt}, dense {dense}"
        rows.append((td, lc))
        rounds[td["variant"]] = [dict(decode=a["decode_tps"] / b["decode_tps"], prefill=a["prefill_tps"] / b["prefill_tps"])
                                 for a, b in zip(tds, lcs)]
        print(f"  {td['variant']}: decode {td['decode_tps']:.2f} tok/s; {lc['variant']}: {lc['decode_tps']:.2f}",
              flush=True)

    def gbs(x):
        return x["decode_bytes"] * x["decode_tps"] / 1e9

    print(f"\n{'variant':<26}{'threads':>8}{'prefill tok/s':>14}{'decode tok/s':>13}{'MiB/token':>10}"
          f"{'GB/s':>7}{'% of bw':>8}")
    for pair in rows:
        for x in pair:
            share = f"{gbs(x) / bw:>8.0%}" if bw else f"{'-':>8}"
            print(f"{x['variant']:<26}{x['threads']:>8}{x['prefill_tps']:>14.1f}{x['decode_tps']:>13.2f}"
                  f"{x['decode_bytes'] / 2**20:>10.1f}{gbs(x):>7.1f}{share}")
    print()
    for td, lc in rows:
        line = (f"{td['variant']} vs {lc['variant']}: prefill {td['prefill_tps'] / lc['prefill_tps']:.2f}x, "
                f"decode {td['decode_tps'] / lc['decode_tps']:.2f}x (bytes per token {td['decode_bytes'] / lc['decode_bytes']:.2f}x)")
        if args.rounds > 1:
            per = rounds[td["variant"]]
            line += ("; per round: decode " + " ".join(f"{r['decode']:.2f}" for r in per)
                     + f" (median {statistics.median(r['decode'] for r in per):.2f}x), prefill "
                     + " ".join(f"{r['prefill']:.2f}" for r in per)
                     + f" (median {statistics.median(r['prefill'] for r in per):.2f}x)")
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"ceilings": ceil, "rows": rows, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
