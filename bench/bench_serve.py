"""Load on `tandem serve`: N concurrent streaming clients for a bounded time.

    .venv/bin/python bench/bench_serve.py [--clients 4] [--seconds 30] [--max-tokens 64]
                                          [--model DIR --config FILE]      # default: the demo model

Starts `python -m tandem serve --port 0` (queue long enough for every client), then each
client thread sends streaming chat requests back to back through the official `openai`
client until the time is up, each asking for exactly --max-tokens tokens (vLLM's
``min_tokens``, so lengths do not depend on the random model's end-of-text; with ``--batch``
above 1, which has no min_tokens, at most that many). For each request
it records the time to the first text, the whole latency and the usage the server reports;
at the end it prints the requests done, any error, latency percentiles, the aggregate
generation rate, and the same model's single-request rate (one client) for comparison. A
request counts as lost when its stream ends without a finish reason or its usage differs
from what it asked for.

``--continuous-batching`` also measures, in this process, what batched decoding would give:
the same model loaded through ``tandem.load_model``, --clients prompts of --max-tokens tokens
each by plain ``generate`` one after another, against transformers' continuous batching
(``generate_batch``, paged attention) with its default cache sizing and with a small one;
the time of each, and at which token each request's greedy output first differs from
``generate``'s (batch rounding in bf16 moves near-ties).
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import threading
import time


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "tandem", "serve", "--port", "0", "--no-progress",
           "--max-queue", str(max(args.clients, 1)), "--batch", str(args.batch)]
    if args.model:
        cmd += ["--model", args.model]
    if args.config:
        cmd += ["--config", args.config]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        m = re.search(r"on (http://\S+/v1) ", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, m.group(1)
    raise SystemExit(f"the server did not start (exit {proc.wait()})")


def run_clients(url: str, n: int, seconds: float, max_tokens: int, prompt: str, fixed: bool) -> dict:
    import openai

    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    mid = client.models.list().data[0].id
    done: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    stop_at = time.perf_counter() + seconds

    def one_client(i: int) -> None:
        k = 0
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            first = None
            finish, usage = None, None
            try:
                for c in client.chat.completions.create(
                        model=mid, messages=[{"role": "user", "content": f"{prompt} ({i}.{k})"}],
                        max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
                        extra_body={"min_tokens": max_tokens} if fixed else None):
                    if c.choices and c.choices[0].delta.content and first is None:
                        first = time.perf_counter()
                    if c.choices and c.choices[0].finish_reason:
                        finish = c.choices[0].finish_reason
                    if c.usage:
                        usage = c.usage
            except openai.APIError as e:
                with lock:
                    errors.append(f"client {i}: {e}")
                continue
            t1 = time.perf_counter()
            lost = finish is None or usage is None or (fixed and usage.completion_tokens != max_tokens)
            with lock:
                done.append({"ttft": (first or t1) - t0, "latency": t1 - t0, "end": t1,
                             "tokens": usage.completion_tokens if usage else 0, "lost": lost})
            k += 1

    t_start = time.perf_counter()
    threads = [threading.Thread(target=one_client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max([d["end"] for d in done], default=time.perf_counter()) - t_start
    return {"done": done, "errors": errors, "wall": wall}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def report(name: str, r: dict) -> None:
    d = r["done"]
    tokens = sum(x["tokens"] for x in d)
    lost = sum(x["lost"] for x in d)
    print(f"{name}: {len(d)} requests in {r['wall']:.1f} s, {len(r['errors'])} errors, {lost} lost; "
          f"{tokens / r['wall']:.1f} generated tokens/s in all")
    if d:
        ttft = [x["ttft"] * 1e3 for x in d]
        lat = [x["latency"] for x in d]
        print(f"  time to first text ms: p50 {pct(ttft, .5):.0f}  p95 {pct(ttft, .95):.0f}  max {max(ttft):.0f}"
              f"   latency s: p50 {pct(lat, .5):.2f}  p95 {pct(lat, .95):.2f}  mean {statistics.mean(lat):.2f}")
    for e in r["errors"][:5]:
        print("  error:", e)


def compare_continuous_batching(args) -> None:
    import torch
    from transformers import AutoTokenizer, ContinuousBatchingConfig, GenerationConfig

    import tandem
    from tandem import demo

    model_dir = args.model or str(demo.ensure_demo_model(progress=False))
    config = args.config or (None if args.model else str(demo.demo_config_path()))
    model = tandem.load_model(model_dir, config, progress=False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    n, m = args.clients, args.max_tokens
    prompts = [tok(f"{args.prompt} ({i})")["input_ids"] for i in range(n)]
    gc = GenerationConfig(max_new_tokens=m, do_sample=False, eos_token_id=-1)
    t0 = time.perf_counter()
    ref = [model.generate(torch.tensor([p]), max_new_tokens=m, min_new_tokens=m, do_sample=False)[0, len(p):].tolist()
           for p in prompts]
    seq = time.perf_counter() - t0
    print(f"generate, {n} requests one after another: {seq:.2f} s, {n * m / seq:.1f} tokens/s")
    for name, cb in [("default cache sizing", None),
                     ("64 pages of 32 tokens", ContinuousBatchingConfig(num_blocks=64, page_size=32,
                                                                       max_batch_tokens=256))]:
        for _ in range(2):  # the second call is the one reported
            t0 = time.perf_counter()
            out = model.generate_batch(inputs=prompts, generation_config=gc, progress_bar=False,
                                       continuous_batching_config=cb)
            dt = time.perf_counter() - t0
        first_diff = [next((j for j, (a, b) in enumerate(zip(out[f"req_{k}"].generated_tokens, ref[k])) if a != b),
                           None) for k in range(n)]
        print(f"generate_batch ({name}), {n} requests: {dt:.2f} s, {n * m / dt:.1f} tokens/s; first token "
              f"differing from generate's, per request: {first_diff}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt", default="write about mixtures of experts")
    ap.add_argument("--batch", type=int, default=1, help="the server's --batch (above 1: continuous batching; "
                    "then no min_tokens, so a request may end early at end-of-text)")
    ap.add_argument("--model")
    ap.add_argument("--config")
    ap.add_argument("--continuous-batching", action="store_true",
                    help="also compare generate with transformers' continuous batching (in this process)")
    args = ap.parse_args()
    import platform

    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
               platform.processor())
    proc, url = start_server(args)
    try:
        print(f"tandem serve at {url}; CPU {cpu}; {args.max_tokens} tokens a request, greedy")
        fixed = args.batch == 1
        run_clients(url, 1, 2.0, args.max_tokens, args.prompt, fixed)  # warm-up
        report("1 client ", run_clients(url, 1, args.seconds / 2, args.max_tokens, args.prompt, fixed))
        r = run_clients(url, args.clients, args.seconds, args.max_tokens, args.prompt, fixed)
        report(f"{args.clients} clients", r)
    finally:
        proc.send_signal(2)
        proc.wait(timeout=60)
    if args.continuous_batching:
        compare_continuous_batching(args)
    return 1 if r["errors"] or any(x["lost"] for x in r["done"]) else 0


if __name__ == "__main__":
    sys.exit(main())
