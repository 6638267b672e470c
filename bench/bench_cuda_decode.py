"""Where a decode step's time goes on a GPU: greedy decode tokens/s of one model in up to four
variants, run one after another in this process, plus the experts calls' share of the time.

    python bench/bench_cuda_decode.py                   # the demo model, 100 new tokens
    python bench/bench_cuda_decode.py --model DIR --config placement.yaml --new 200

Variants (the CUDA ones only where torch sees a GPU):
  hf-cuda      plain transformers on cuda:0, no tandem: the floor for this model on this GPU
  tandem-cuda  tandem.load_model on cuda:0, called on torch's default stream
  tandem-side  the same, loaded and called under a side stream (with torch.cuda.stream(s))
  tandem-cpu   tandem.load_model with the non-expert weights on the CPU

For the tandem variants, every experts call (each MoE layer's TandemExperts forward) is
timed twice: host ms (how long the Python call took to return, i.e. to enqueue) and, on
CUDA, stream ms (CUDA events recorded before and after it on the current stream: the time
the stream spent from the call's first operation to its last, the CPU experts included).
Per token, these against the token's wall time say whether the time is in tandem's
calls, in the enqueueing, or elsewhere (transformers, the GPU's own kernels).

2026-11-27 on an H200 machine, `tandem run` decoded the demo model at 18 tokens/s on
cuda:0 and 177 on the CPU alone: this script is the first thing to run there next time.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "python"))  # after PYTHONPATH: a tandem with its _C (gpu_check.sh's) wins

import torch  # noqa: E402

import tandem  # noqa: E402
from tandem import demo  # noqa: E402
from tandem.modules import TandemExperts  # noqa: E402
from tandem.run import timed_generate  # noqa: E402


class CallTimer:
    """Forward hooks on every TandemExperts module: host time of each call and, on CUDA,
    events around it on the current stream."""

    def __init__(self, model: torch.nn.Module, cuda: bool):
        self.cuda = cuda
        self.host_s = 0.0
        self.calls = 0
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._t0 = 0.0
        self._start = None
        self.handles = []
        for m in model.modules():
            if isinstance(m, TandemExperts):
                self.handles.append(m.register_forward_pre_hook(self._pre))
                self.handles.append(m.register_forward_hook(self._post))
        if not self.handles:
            raise SystemExit("bench_cuda_decode: the model has no TandemExperts modules")

    def _pre(self, module, args):
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        self._t0 = time.perf_counter()

    def _post(self, module, args, out):
        self.host_s += time.perf_counter() - self._t0
        self.calls += 1
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((self._start, end))

    def reset(self):
        self.host_s, self.calls, self.events = 0.0, 0, []

    def stream_s(self) -> float:
        if not self.cuda:
            return float("nan")
        torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b in self.events) / 1e3

    def remove(self):
        for h in self.handles:
            h.remove()


def run_variant(name: str, args, ids_cpu: torch.Tensor) -> dict:
    cuda = name != "tandem-cpu"
    device = "cuda:0" if cuda else "cpu"
    stream = torch.cuda.Stream() if name == "tandem-side" else None
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx:
        if name == "hf-cuda":
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(device)
        else:
            model = tandem.load_model(args.model, args.config, device=device, progress=False)
        model.eval()
        ids = ids_cpu.to(device)
        timer = CallTimer(model, cuda) if name != "hf-cuda" else None
        timed_generate(model, ids, max_new_tokens=8, do_sample=False)  # warm-up (CUDA's lazy kernel loading)
        if timer:
            timer.reset()
        _, t = timed_generate(model, ids, max_new_tokens=args.new, do_sample=False)
        if args.profile:
            profile(model, ids, args.profile, name)
        row = dict(variant=name, decode_tps=t.decode_tps, prefill_tps=t.prefill_tps,
                   ms_per_token=1e3 * (t.prefill_s + t.decode_s) / max(t.new_tokens, 1))
        if timer:
            per_tok = max(t.new_tokens, 1)
            row.update(calls_per_token=timer.calls / per_tok, host_ms=1e3 * timer.host_s / per_tok,
                       stream_ms=1e3 * timer.stream_s() / per_tok, stream=getattr(model.tandem_engine, "stream", "?"),
                       threads=model.tandem_engine.threads)
            timer.remove()
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def profile(model, ids: torch.Tensor, new: int, name: str) -> None:
    """torch.profiler over one generate of `new` tokens: the ops with the most CPU time (the
    Python thread's view: launches, syncs, CPU kernels) and, on CUDA, the most device time."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.is_cuda else [])
    with tprofile(activities=acts) as prof:
        timed_generate(model, ids, max_new_tokens=new, do_sample=False)
    ka = prof.key_averages()
    print(f"\n--- {name}: torch.profiler over {new} new tokens, by CPU total time ---")
    print(ka.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    if ids.is_cuda:
        print(f"--- {name}: by device time ---")
        print(ka.table(sort_by="device_time_total", row_limit=12, max_name_column_width=60))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the demo model)")
    p.add_argument("--config", help="placement YAML (default: configs/demo.yaml for the demo model, else defaults)")
    p.add_argument("--new", type=int, default=100, help="new tokens per timed generate (default 100)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt length in tokens (default 16)")
    p.add_argument("--variants", default="hf-cuda,tandem-cuda,tandem-side,tandem-cpu")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also run torch.profiler over a generate of N new tokens per variant and print its tables")
    args = p.parse_args()
    if args.model is None:
        args.model = str(demo.ensure_demo_model(progress=False))
        args.config = args.config or str(ROOT / "configs" / "demo.yaml")
    variants = [v for v in args.variants.split(",") if v]
    known = {"hf-cuda", "tandem-cuda", "tandem-side", "tandem-cpu"}
    for v in variants:
        if v not in known:
            p.error(f"--variants: unknown variant {v!r} (one of {', '.join(sorted(known))})")
    if not torch.cuda.is_available():
        skipped = [v for v in variants if v != "tandem-cpu"]
        if skipped:
            print(f"no CUDA device: skipping {', '.join(skipped)}")
        variants = [v for v in variants if v == "tandem-cpu"]
    else:
        print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    ids = torch.randint(0, vocab, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    print(f"model: {args.model}; {args.prompt_tokens}-token prompt, {args.new} new tokens (greedy), after an 8-token warm-up")
    rows = [run_variant(v, args, ids) for v in variants]
    print(f"\n{'variant':<12} {'decode tok/s':>12} {'ms/token':>9} {'calls/tok':>9} {'host ms/tok':>11} "
          f"{'stream ms/tok':>13}  engine")
    for r in rows:
        extra = (f"{r['calls_per_token']:>9.1f} {r['host_ms']:>11.3f} {r['stream_ms']:>13.3f}  "
                 f"{r['stream']}, {r['threads']} pool threads") if "host_ms" in r else f"{'-':>9} {'-':>11} {'-':>13}  -"
        print(f"{r['variant']:<12} {r['decode_tps']:>12.1f} {r['ms_per_token']:>9.2f} {extra}")
    print("\nhost ms: the experts calls' Python time per token (enqueueing on CUDA; the whole call on the CPU).\n"
          "stream ms: CUDA-event time around those calls on the stream (nan on the CPU).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
