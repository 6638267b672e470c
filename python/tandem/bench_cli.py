"""`tandem bench`: llama-bench-style figures on the user's own model.

    tandem bench --model /models/Qwen3-30B-A3B --config configs/qwen3-30b-a3b.yaml -p 512 -n 128 -r 3

For each prompt length P (``-p``, comma-separated) one forward of P random tokens (prompt
processing, "ppP"); for each generation length N (``-n``) N tokens generated greedily after a
one-token prompt ("tgN"); each ``-r`` times after one warm-up, reported as tokens/s, mean and
standard deviation. Beside them: the share of each test's wall time spent in tandem's MoE
layers (the trace's ``moe_layer`` spans: routed experts, hot and cold), and for generation the
machine's ceiling: the read bandwidth measured in the same run (torch summing 1 GiB with a
thread per logical CPU) over the bytes one decode step reads (the non-expert weights on the CPU, plus top_k
packed experts per MoE layer), as tokens/s and the ratio to it. ``--json FILE`` writes all of it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .cli_checks import add_model_arguments

    add_model_arguments(p)
    p.add_argument("-p", "--prompt-lengths", default="512", help="prompt lengths, comma-separated (0: none)")
    p.add_argument("-n", "--gen-lengths", default="128", help="generation lengths, comma-separated (0: none)")
    p.add_argument("-r", "--repetitions", type=int, default=3, help="timed runs of each test (after one warm-up)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _lengths(text: str, flag: str) -> list[int]:
    from .cli_checks import InputError

    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{flag} {text!r}: expected comma-separated token counts, e.g. 128,512") from None
    if any(n < 0 or n > 1 << 20 for n in out):
        raise InputError(f"{flag} {text!r}: each length must be in [0, 1048576]")
    return [n for n in out if n > 0]


def check_arguments(args: argparse.Namespace):
    from .cli_checks import InputError, check_output_file, select_model_and_config

    pp, tg = _lengths(args.prompt_lengths, "-p"), _lengths(args.gen_lengths, "-n")
    if not pp and not tg:
        raise InputError("nothing to measure: give -p and / or -n lengths above 0")
    if args.repetitions < 1:
        raise InputError(f"-r must be at least 1, got {args.repetitions}")
    if args.json:
        check_output_file(args.json, "--json")
    return select_model_and_config(args), pp, tg


def read_bandwidth(gib: float = 1.0, reps: int = 5) -> float:
    """Bytes/s torch reads summing a `gib` GiB fp32 tensor with a thread per logical CPU this
    process may use (best of reps); torch's own thread count is restored after."""
    import os

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    try:
        x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
        x.sum()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
        return x.numel() * 4 / best
    finally:
        torch.set_num_threads(before)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or platform.machine()


def _moe_share(trace_path, wall_s: float) -> float | None:
    """Fraction of wall_s inside tandem's moe_layer spans (the stream's per-layer spans)."""
    try:
        events = json.loads(open(trace_path).read())["traceEvents"]
    except (OSError, ValueError, KeyError):
        return None
    us = sum(e.get("dur", 0.0) for e in events if e.get("name") == "moe_layer" and e.get("ph") == "X")
    return min(1.0, us / 1e6 / wall_s) if wall_s > 0 else None


def run(args: argparse.Namespace) -> int:
    import os
    import tempfile

    sel, pp, tg = check_arguments(args)
    from .attention import generation_attention
    from .cli_checks import check_device, describe

    import torch

    import tandem
    from tandem import demo

    check_device(args.device, sel, train=False)
    model_dir = sel.model or str(demo.ensure_demo_model(progress=not args.no_progress))
    print(describe(sel, model_dir), flush=True)
    model = tandem.load_model(model_dir, sel.config, device=args.device, store=args.store, progress=not args.no_progress)
    engine = model.tandem_engine
    cfg = model.config
    dev = next(p.device for p in model.parameters())
    vocab = cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    pad = getattr(cfg, "pad_token_id", None)
    pad = pad if pad is not None else getattr(cfg, "eos_token_id", 0)
    if isinstance(pad, list):
        pad = pad[0]
    was_tracing = tandem.trace.enabled()

    def timed(fn) -> tuple[float, float | None]:
        with tempfile.TemporaryDirectory() as d:
            tandem.trace.enable(True)
            t0 = time.perf_counter()
            fn()
            wall = time.perf_counter() - t0
            path = os.path.join(d, "t.json")
            tandem.trace.write(path)
            tandem.trace.enable(was_tracing)
            return wall, _moe_share(path, wall)

    results = []
    with torch.no_grad():
        for p in pp:
            ids = torch.randint(0, vocab, (1, p), generator=g).to(dev)
            model(input_ids=ids, use_cache=False)  # warm-up: packs touched, scratch sized
            runs = [timed(lambda: model(input_ids=ids, use_cache=False)) for _ in range(args.repetitions)]
            results.append(("pp", p, runs))
        for n in tg:
            ids = torch.randint(0, vocab, (1, 1), generator=g).to(dev)
            gen = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad)

            def decode(ids=ids, gen=gen):
                with generation_attention(dev):
                    model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
            decode()
            runs = [timed(decode) for _ in range(args.repetitions)]
            results.append(("tg", n, runs))

    # The decode ceiling: bytes one step reads at the measured bandwidth.
    bw = read_bandwidth()
    cpu_non_expert = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cpu")
    layers = engine.moe_layers
    cold = sum(engine.experts - len(engine.hot(i)) for i in range(layers))
    per_expert = engine.cpu_bytes / cold if cold else 0.0
    top_k = next((getattr(cfg, a) for a in ("num_experts_per_tok", "moe_topk") if hasattr(cfg, a)), 1)
    step_bytes = cpu_non_expert + layers * min(top_k, engine.experts) * per_expert
    ceiling = bw / step_bytes if step_bytes else float("inf")

    rows = []
    print(f"machine: {cpu_name()}, torch threads {torch.get_num_threads()}, "
          f"kernels {engine.isa}, experts {engine.format}; read bandwidth {bw / 1e9:.1f} GB/s (torch sum of 1 GiB, "
          "this run)")
    print(f"{'test':>8} {'tokens/s':>10} {'± sd':>8} {'ms':>9} {'MoE layers':>11} {'ceiling t/s':>12} {'of ceiling':>11}")
    for kind, n, runs in results:
        tps = [n / w for w, _ in runs]
        mean = statistics.fmean(tps)
        sd = statistics.stdev(tps) if len(tps) > 1 else 0.0
        shares = [s for _, s in runs if s is not None]
        share = statistics.fmean(shares) if shares else None
        row = {"test": f"{kind}{n}", "tokens": n, "tokens_per_s": mean, "sd": sd,
               "ms": statistics.fmean(w for w, _ in runs) * 1e3, "runs_tokens_per_s": tps, "moe_share": share}
        if kind == "tg":
            row.update(ceiling_tokens_per_s=ceiling, of_ceiling=mean / ceiling)
        rows.append(row)
        ceil = f"{ceiling:12.1f} {mean / ceiling:10.0%}" if kind == "tg" else f"{'-':>12} {'-':>11}"
        print(f"{row['test']:>8} {mean:10.1f} {sd:8.1f} {row['ms']:9.1f} "
              f"{(f'{share:.0%}' if share is not None else '-'):>11} {ceil}")
    print(f"decode ceiling: {step_bytes / 1e6:.1f} MB read per token ({cpu_non_expert / 1e6:.1f} MB non-expert "
          f"weights on the CPU + {layers} MoE layers x {min(top_k, engine.experts)} experts x "
          f"{per_expert / 1e6:.2f} MB) at {bw / 1e9:.1f} GB/s")
    if args.json:
        out = {"model": model_dir, "config": sel.config if isinstance(sel.config, str) else None, "cpu": cpu_name(),
               "isa": engine.isa, "format": engine.format, "threads": torch.get_num_threads(),
               "read_bandwidth_bytes_per_s": bw, "decode_step_bytes": step_bytes, "results": rows}
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=2)
        os.replace(tmp, args.json)
        print(f"json: {args.json}")
    return 0
