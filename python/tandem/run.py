"""`tandem run`: load a model through tandem, generate, report speed and where experts ran.

    tandem run                                   # the built-in demo model (built once, cached)
    tandem run --model DIR --config FILE         # a real checkpoint and its placement
    tandem run --trace out.json                  # also write the Chrome trace
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
    """model.generate, with the time to the first new token and to the last one."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

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
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                             stopping_criteria=StoppingCriteriaList([Stamp()]), **gen_kwargs)
    new = out.shape[1] - input_ids.shape[1]
    prefill = stamps[0] - t0 if stamps else float("nan")
    decode = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    return out, Timings(input_ids.shape[1] * input_ids.shape[0], new * input_ids.shape[0], prefill, decode)


def placement_report(engine) -> str:
    """Per MoE layer: routed (token, expert) pairs by where they ran."""
    lines = [f"experts: {engine.moe_layers} MoE layers x {engine.experts} experts, format {engine.format}; "
             f"CPU pool {engine.subpools} subpool(s), {engine.threads} threads ({engine.cpu_bytes / 2**20:.1f} MiB); "
             f"device stream {engine.stream} ({engine.device_bytes / 2**20:.1f} MiB of hot experts)",
             f"{'layer':>6} {'hot':>6} {'cpu':>8} {'deferred':>9}  hot experts"]
    for i in range(engine.moe_layers):
        c = engine.counts(i)
        hot = engine.hot(i)
        shown = ", ".join(map(str, hot[:8])) + (" ..." if len(hot) > 8 else "") if hot else "-"
        lines.append(f"{engine.layers[i]:>6} {sum(c['hot']):>6} {sum(c['cold']):>8} {sum(c['deferred']):>9}  {shown}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the built-in demo model)")
    p.add_argument("--config", help="placement YAML (default: configs/demo.yaml for the demo, else defaults)")
    p.add_argument("--prompt", default="The quick brown fox", help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--sample", action="store_true", help="sample (default: greedy)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--device", help="device of the non-expert weights (default: from the config)")
    p.add_argument("--trace", help="write a Chrome trace of the generation here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    import tandem
    from tandem import demo

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    model_dir = args.model or str(demo.ensure_demo_model(progress=not args.no_progress))
    config = args.config or (str(demo.demo_config_path()) if not args.model else None)
    t0 = time.perf_counter()
    model = tandem.load_model(model_dir, config, device=args.device, progress=not args.no_progress)
    load_s = time.perf_counter() - t0
    engine = model.tandem_engine
    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok(args.prompt, return_tensors="pt").to(model.device)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample)
    if args.sample:
        gen.update(temperature=args.temperature, top_p=args.top_p)
        torch.manual_seed(args.seed)
    if tok.pad_token_id is not None:
        gen["pad_token_id"] = tok.pad_token_id

    print(f"model: {model_dir} ({model.config.model_type}, {model.config.num_hidden_layers} layers, "
          f"dtype {model.dtype}, non-expert weights on {model.device}, torch threads {torch.get_num_threads()}); "
          f"loaded in {load_s:.1f} s")
    if args.trace:
        tandem.trace.enable(True)
    engine.reset_counts()
    out, t = timed_generate(model, enc["input_ids"], enc.get("attention_mask"), **gen)
    if args.trace:
        tandem.trace.write(args.trace)
        tandem.trace.enable(False)
    text = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"prompt: {args.prompt!r}")
    print(f"output: {text!r}")
    print(f"prefill: {t.prompt_tokens} tokens in {t.prefill_s * 1e3:.1f} ms = {t.prefill_tps:.1f} tokens/s")
    print(f"decode:  {t.new_tokens - 1} tokens in {t.decode_s * 1e3:.1f} ms = {t.decode_tps:.1f} tokens/s")
    print(placement_report(engine))
    if args.trace:
        print(f"trace: {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0
