"""`tandem run`: load a model through tandem, generate, report speed and where experts ran.

    tandem run                                   # the built-in demo model (built once, cached)
    tandem run --model DIR --config FILE         # a real checkpoint and its placement
    tandem run --config FILE                     # the checkpoint named by FILE's model.path
    tandem run --trace out.json                  # also write the Chrome trace
    tandem run --record-routing stats.json       # routed counts per layer and expert, for
                                                 # gpu.hot_experts.statistics in a config

Every input that needs no model (config, model directory, device, output paths, prompt)
is checked before the model is loaded.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass


@dataclass
class Timings:
    prompt_tokens: int
    new_tokens: int
    prefill_s: float       # prompt in, first new token out
    decode_s: float        # the remaining new tokens

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tps(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.new_tokens > 1 and self.decode_s > 0 else float("nan")


def timed_generate(model, input_ids, attention_mask=None, **gen_kwargs):
    """model.generate, with the time to the first new token and to the last one (on CUDA with
    SDPA's cuDNN backend off: tandem.attention)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    from .attention import generation_attention

    stamps: list[float] = []

    class Stamp(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if input_ids.is_cuda:
                torch.cuda.synchronize(input_ids.device)
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    if input_ids.is_cuda:
        torch.cuda.synchronize(input_ids.device)
    t0 = time.perf_counter()
    with torch.inference_mode(), generation_attention(input_ids.device):
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                             stopping_criteria=StoppingCriteriaList([Stamp()]), **gen_kwargs)
    new = out.shape[1] - input_ids.shape[1]
    prefill = stamps[0] - t0 if stamps else float("nan")
    decode = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    return out, Timings(input_ids.shape[1] * input_ids.shape[0], new * input_ids.shape[0], prefill, decode)


def placement_report(engine) -> str:
    """Per MoE layer: routed (token, expert) pairs by where they ran."""
    moved = (f"; dynamic hot experts: {engine.rebalances} rebalance(s), {engine.hot_moves} promotion(s)"
             if getattr(engine, "dynamic_hot", False) else "")
    if getattr(engine, "hot_budget", 0):
        moved += f"; hot count auto: {len(engine.hot(0))} per layer in {engine.hot_budget / 2**30:.1f} GiB"
    lines = [f"experts: {engine.moe_layers} MoE layers x {engine.experts} experts, format {engine.format}; "
             f"CPU pool {engine.subpools} subpool(s), {engine.threads} threads ({engine.cpu_bytes / 2**20:.1f} MiB); "
             f"device stream {engine.stream} ({engine.device_bytes / 2**20:.1f} MiB of hot experts){moved}",
             f"{'layer':>6} {'hot':>6} {'cpu':>8} {'deferred':>9}  hot experts"]
    for i in range(engine.moe_layers):
        c = engine.counts(i)
        hot = engine.hot(i)
        shown = ", ".join(map(str, hot[:8])) + (" ..." if len(hot) > 8 else "") if hot else "-"
        lines.append(f"{engine.layers[i]:>6} {sum(c['hot']):>6} {sum(c['cold']):>8} {sum(c['deferred']):>9}  {shown}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .cli_checks import add_adapter_argument, add_generation_arguments, add_model_arguments

    add_model_arguments(p)
    p.add_argument("--prompt", default="The quick brown fox", help="prompt text")
    add_generation_arguments(p, 64)
    p.add_argument("--trace", help="write a Chrome trace of the generation here (default: the config's "
                                   "trace.path when its trace.enabled is true)")
    p.add_argument("--record-routing", metavar="FILE",
                   help="write the generation's routed counts per layer and expert here, for a config's "
                        "gpu.hot_experts.statistics")
    add_adapter_argument(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def check_arguments(args: argparse.Namespace):
    """Everything that can be checked without the model; returns the model / config selection."""
    from .cli_checks import (InputError, check_adapter_argument, check_generation_arguments, check_output_file,
                             select_model_and_config)

    check_generation_arguments(args)
    if not args.prompt:
        raise InputError("--prompt is empty")
    if args.trace:
        check_output_file(args.trace, "--trace")
    if args.record_routing:
        check_output_file(args.record_routing, "--record-routing")
    check_adapter_argument(args)
    return select_model_and_config(args)


def run(args: argparse.Namespace) -> int:
    sel = check_arguments(args)
    from . import tracing
    from .cli_checks import InputError, check_device, check_output_file, describe

    trace_path = args.trace or tracing.config_trace_path(sel.cfg)
    if trace_path and not args.trace:
        check_output_file(trace_path, f"{sel.config}: trace.path")

    import torch
    import tandem
    from tandem.gguf_checkpoint import load_tokenizer
    from tandem import demo
    from tandem.dense import describe_dense
    from tandem.loader import skipped_summary

    check_device(args.device, sel, train=False)
    model_dir = sel.model or str(demo.ensure_demo_model(progress=not args.no_progress))
    print(describe(sel, model_dir), flush=True)
    tok = load_tokenizer(model_dir)  # first: a model without a usable tokenizer fails before the load
    t0 = time.perf_counter()
    was_tracing = tandem.trace.enabled()  # TANDEM_TRACE=path records everything
    model = tandem.load_model(model_dir, sel.config, device=args.device, store=args.store, progress=not args.no_progress,
                              adapter=args.adapter)
    tracing.cancel_pending()  # this command writes its trace itself, at its end: see below
    tandem.trace.enable(was_tracing)
    load_s = time.perf_counter() - t0
    engine = model.tandem_engine
    enc = tok(args.prompt, return_tensors="pt").to(model.device)
    if enc["input_ids"].shape[1] == 0:
        raise InputError(f"--prompt {args.prompt!r} is no tokens for this tokenizer")
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample)
    if args.sample:
        gen.update(temperature=args.temperature, top_p=args.top_p)
        torch.manual_seed(args.seed)
    if tok.pad_token_id is not None:
        gen["pad_token_id"] = tok.pad_token_id

    if args.adapter:
        print(f"adapter: {args.adapter} (merged)")
    if model.tandem_store:
        print(f"experts: read from the store {model.tandem_store} (not packed from the checkpoint)")
    print(f"loaded: {model.config.model_type}, {model.config.num_hidden_layers} layers, "
          f"dtype {model.dtype}, non-expert weights on {model.device}, torch threads {torch.get_num_threads()}; "
          f"in {load_s:.1f} s")
    if skipped := skipped_summary(model):
        print(skipped)
    print(describe_dense(model))
    if trace_path:
        tandem.trace.enable(True)
    engine.reset_counts()
    out, t = timed_generate(model, enc["input_ids"], enc.get("attention_mask"), **gen)
    if trace_path:
        tandem.trace.write(str(trace_path))
        tandem.trace.enable(was_tracing)
    if args.record_routing:
        engine.write_statistics(args.record_routing)
    text = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"prompt: {args.prompt!r}")
    print(f"output: {text!r}")
    print(f"prefill: {t.prompt_tokens} tokens in {t.prefill_s * 1e3:.1f} ms = {t.prefill_tps:.1f} tokens/s")
    print(f"decode:  {t.new_tokens - 1} tokens in {t.decode_s * 1e3:.1f} ms = {t.decode_tps:.1f} tokens/s")
    print(placement_report(engine))
    if trace_path:
        print(f"trace: {trace_path} (open in https://ui.perfetto.dev or chrome://tracing)")
    if args.record_routing:
        print(f"routing statistics: {args.record_routing} (use as gpu.hot_experts.statistics, with a count)")
    return 0
