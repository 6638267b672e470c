"""`tandem serve`: an OpenAI-compatible HTTP server for a model loaded through tandem.

    tandem serve                                   # the built-in demo model on http://127.0.0.1:8000/v1
    tandem serve --model /models/Qwen3-235B-A22B --config configs/qwen3-235b-a22b.yaml \\
                 [--adapter DIR] [--host 0.0.0.0 --api-key KEY] [--port 8000] [--max-queue 8]

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (both
with ``stream: true`` as server-sent events, ``stream_options.include_usage``), ``GET /health``
(queue state, no key needed). Request fields: ``max_tokens`` / ``max_completion_tokens``,
``temperature`` (0: greedy), ``top_p``, ``seed``, ``stop`` (a string or up to 4), and vLLM's
``min_tokens`` (the end-of-text token is suppressed until that many tokens are out) and
``chat_template_kwargs`` (variables for the chat template, e.g. Qwen3's
``{"enable_thinking": false}``); a field sent as null is a field not set. The model's
``generation_config`` sampling defaults and penalties are not applied: a request gets what it
asks for, with OpenAI's defaults (temperature 1, top_p 1; below 1e-5 a temperature is greedy).
A field
this server does not implement (``n`` > 1, ``logprobs``, ``tools``, penalties, ...) is refused
with a 400 naming it, never ignored.

Built on FastAPI + uvicorn rather than ``transformers serve``: that server loads its models
itself through ``from_pretrained`` (which cannot hold a 235B checkpoint in RAM, and has no way
to take a model that ``tandem.load_model`` built).

By default requests run one at a time, in arrival order, on one generation thread that owns
the model; with ``--batch N`` up to N are decoded together through transformers' continuous
batching (``BatchedGenerator``; no per-request seed or min_tokens there). Up to
``--max-queue`` more wait, and one beyond that gets a 503 at once. A client that disconnects (streaming or not)
cancels its request: out of the queue if it waits, or at the next token if it runs. One
request's failure is that request's error (a 500 naming it); the server goes on.
"""
# No `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request,
# imported inside build_app) at definition time.
import argparse
import asyncio
import collections
import contextlib
import hmac
import json
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .chat import end_ids

DEFAULT_PORT = 8000


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .cli_checks import add_adapter_argument, add_model_arguments

    add_model_arguments(p)
    add_adapter_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                   "only; 0.0.0.0 for every interface, best with --api-key)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port (0: any free port, printed)")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $TANDEM_API_KEY; none: open)")
    p.add_argument("--max-queue", type=int, default=8, help="requests that may wait while one runs; "
                   "beyond that a request gets 503 at once (default 8)")
    p.add_argument("--batch", type=int, default=1, help="requests decoded together (default 1: one at a time, "
                   "in arrival order); above 1, through transformers' continuous batching (no per-request seed "
                   "or min_tokens then)")
    p.add_argument("--batch-context", type=int, metavar="TOKENS", help="with --batch: prompt + reply tokens a "
                   "request may hold, for sizing the paged KV cache (default: the model's context, at most 8192)")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template file to use instead of the "
                   "tokenizer's")
    p.add_argument("--served-model-name", help="the model id clients send and /v1/models lists "
                   "(default: the model directory's name)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars while loading")


def check_arguments(args: argparse.Namespace):
    from .cli_checks import InputError, check_adapter_argument, select_model_and_config

    check_adapter_argument(args)
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue < 0:
        raise InputError(f"--max-queue must be at least 0, got {args.max_queue}")
    if not 1 <= args.batch <= 256:
        raise InputError(f"--batch must be in [1, 256], got {args.batch}")
    if args.batch_context is not None:
        if args.batch == 1:
            raise InputError("--batch-context sizes the KV cache of --batch above 1; with --batch 1 requests may "
                             "use the model's whole context")
        if args.batch_context < 16:
            raise InputError(f"--batch-context must be at least 16 tokens, got {args.batch_context}")
    if args.api_key is not None and not args.api_key.strip():
        raise InputError("--api-key is empty (give a key, or leave it out for an open server)")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise InputError("--served-model-name is empty")
    if args.chat_template is not None:
        try:
            args.chat_template_text = open(args.chat_template, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"--chat-template {args.chat_template}: cannot read it "
                             f"({getattr(e, 'strerror', None) or e})") from None
        try:
            import jinja2

            jinja2.Environment().parse(args.chat_template_text)
        except jinja2.TemplateSyntaxError as e:
            raise InputError(f"--chat-template {args.chat_template}:{e.lineno}: not a Jinja template ({e.message})") \
                from None
    return select_model_and_config(args)


# ---- errors in OpenAI's shape -----------------------------------------------------------

class APIError(Exception):
    """A request the server answers with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---- request parsing ---------------------------------------------------------------------

# Fields a client may send that change nothing about the reply (metadata).
_IGNORED = {"user", "metadata", "store", "service_tier"}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
           "min_tokens", "n", "presence_penalty", "frequency_penalty", "logprobs", "logit_bias"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs", "top_logprobs", "tools", "tool_choice",
                   "parallel_tool_calls", "response_format", "functions", "function_call", "modalities",
                   "audio", "reasoning_effort", "prediction", "web_search_options"}
_COMPLETION = _COMMON | {"prompt", "echo", "suffix", "best_of"}
# Fields accepted only at the value meaning "off".
_OFF = {"n": (1,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logprobs": (False, None),
        "top_logprobs": (None, 0), "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
        "parallel_tool_calls": (None,), "functions": (None, []), "function_call": (None, "none"),
        "echo": (False,), "suffix": (None, ""), "best_of": (None, 1), "modalities": (None, ["text"]),
        "audio": (None,), "reasoning_effort": (None,), "prediction": (None,), "web_search_options": (None,)}


def _number(body: dict, key: str, lo: float, hi: float, default: float | None) -> float | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise APIError(400, f"{key} must be a number in [{lo}, {hi}], got {json.dumps(v)}", key)
    return float(v)


def _integer(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f"at least {lo}"
        raise APIError(400, f"{key} must be an integer {bound}, got {json.dumps(v)}", key)
    return v


@dataclass
class Params:
    """What one request asks of the generation (parsed and checked)."""
    max_tokens: int | None
    min_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def nucleus(self) -> float:
        """top_p as a sampler takes it: 0 (the most likely token only) as a tiny positive share."""
        return self.top_p if self.top_p > 0 else 1e-9


def _same(v: Any, o: Any) -> bool:
    """v is the JSON value o (false is not 0, 1 is not true)."""
    if isinstance(o, bool) or o is None or isinstance(v, bool):
        return v is o
    return v == o


def model_context(config) -> int | None:
    """The model's context length in tokens (None when its config gives none)."""
    return int(getattr(config, "max_position_embeddings", 0) or 0) or None


# Below this a temperature is greedy (as vLLM does): dividing logits by it overflows.
MIN_TEMPERATURE = 1e-5


def parse_params(body: dict, allowed: set[str]) -> Params:
    unknown = sorted(set(body) - allowed - _IGNORED)
    if unknown:
        raise APIError(400, f"unsupported parameter {unknown[0]!r} (tandem serve implements: "
                       f"{', '.join(sorted(allowed - set(_OFF)))})", unknown[0])
    for k, off in _OFF.items():
        if k in body and not any(_same(body[k], o) for o in off):
            raise APIError(400, f"{k}={json.dumps(body[k])} is not supported by tandem serve (only "
                           f"{' or '.join(json.dumps(o) for o in off)})", k)
    rf = body.get("response_format")
    if rf not in (None, {"type": "text"}):
        raise APIError(400, "response_format other than {\"type\": \"text\"} is not supported", "response_format")
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise APIError(400, "give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _integer(body, key, 1)
    min_tokens = _integer(body, "min_tokens", 0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({min_tokens}) exceeds {key} ({max_tokens})", "min_tokens")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "stop must be a non-empty string or a list of up to 4 non-empty strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"stream must be true or false, got {json.dumps(stream)}", "stream")
    so = body.get("stream_options")
    if so is not None and (not stream or not isinstance(so, dict) or set(so) - {"include_usage"}
                           or not isinstance(so.get("include_usage", False), bool)):
        raise APIError(400, "stream_options takes only {\"include_usage\": true|false}, and only with stream: true",
                       "stream_options")
    seed = _integer(body, "seed", -(1 << 63), (1 << 63) - 1)
    return Params(max_tokens=max_tokens, min_tokens=min_tokens,
                  temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
                  top_p=_number(body, "top_p", 0.0, 1.0, 1.0) or 0.0, seed=seed, stop=stop, stream=stream,
                  include_usage=bool(so and so.get("include_usage")))


def message_text(m: Any, i: int) -> dict:
    """One chat message as {"role", "content": str}; refuses what a text model cannot take."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise APIError(400, f"{where} must be an object with role and content", where)
    role = m.get("role")
    if role not in ("system", "developer", "user", "assistant"):
        raise APIError(400, f"{where}.role {json.dumps(role)} is not supported (system, developer, user, assistant)",
                       f"{where}.role")
    extra = sorted(set(m) - {"role", "content", "name"})
    if extra:
        raise APIError(400, f"{where}.{extra[0]} is not supported (text messages only)", f"{where}.{extra[0]}")
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise APIError(400, f"{where}.content[{j}] must be a text part ({{\"type\": \"text\", "
                               "\"text\": ...}}): this model takes text only", f"{where}.content[{j}]")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise APIError(400, f"{where}.content must be a string or a list of text parts", f"{where}.content")
    # The developer role (OpenAI's newer name for instructions) is what chat templates call system.
    out = {"role": "system" if role == "developer" else role, "content": content}
    if m.get("name") is not None:  # templates that know participants' names read it
        if not isinstance(m["name"], str):
            raise APIError(400, f"{where}.name must be a string", f"{where}.name")
        out["name"] = m["name"]
    return out


# ---- generation --------------------------------------------------------------------------

@dataclass
class Job:
    """One request: its prompt tokens and parameters, and the channel its pieces go out on."""
    id: str
    prompt_ids: Any          # 1-d LongTensor
    params: Params
    max_tokens: int
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""           # the whole reply, once done
    prefill_s: float = 0.0
    decode_s: float = 0.0

    def emit(self, kind: str, value: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: the server is stopping
            self.cancelled.set()


class TextTracker:
    """Turns the growing list of generated tokens into text pieces that are safe to send: held
    back while the text ends in an incomplete character or in what may become a stop string;
    cut before the first stop string (``stopped`` then holds)."""

    def __init__(self, tok, stop: list[str]):
        self.tok, self.stop = tok, stop
        self.sent = ""        # text already handed out
        self.text = ""        # the whole text so far (cut before a stop string)
        self.stopped = False

    def update(self, tokens: list[int], final: bool = False) -> str:
        text = self.tok.decode(tokens, skip_special_tokens=True)
        if self.stop:
            start = max(0, len(self.sent) - max(len(s) for s in self.stop))
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                self.text = text[:min(hits)]
                return self._take(self.text)
        self.text = text
        if not final:
            if text.endswith("\ufffd"):  # a character's bytes are not all out yet
                text = text.rstrip("\ufffd")
            hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[:len(text) - hold]
        return self._take(text)

    def _take(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece


_SHUTTING_DOWN = APIError(503, "the server is shutting down", code="shutting_down", kind="server_error")


def log_request(log, job: "Job", outcome: str) -> None:
    """One line per request; best effort (a closed stdout must not stop the server)."""
    pf = len(job.prompt_ids) / job.prefill_s if job.tokens and job.prefill_s > 0 else float("nan")
    dec = (len(job.tokens) - 1) / job.decode_s if job.decode_s > 0 and len(job.tokens) > 1 else float("nan")
    try:
        log(f"[{job.id}] {outcome}: prompt {len(job.prompt_ids)} tokens at {pf:.1f} tokens/s, "
            f"{len(job.tokens)} generated at {dec:.1f} tokens/s"
            + (f", finish {job.finish_reason}" if outcome == "completed" else ""))
    except Exception:  # noqa: BLE001 (stdout closed: the request's answer matters, not its log line)
        pass


class Generator:
    """Owns the model: one thread generates the queued jobs in order."""

    def __init__(self, model, tok, max_queue: int, log=print):
        self.model, self.tok, self.max_queue, self.log = model, tok, max_queue, log
        cfg = model.config
        self.context = model_context(cfg)
        self.context_what = "the model's context"
        self.eos_ids = end_ids(model, tok)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else next(iter(self.eos_ids), 0)
        self.device = next(p.device for p in model.parameters())
        self._waiting: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self.running: Job | None = None
        self.counts = collections.Counter()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="tandem-serve-generate", daemon=True)
        self._thread.start()

    def check(self, params: Params) -> None:
        """Refuses what this way of generating cannot do (nothing, one at a time)."""

    # -- queue ----------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stop:
                raise _SHUTTING_DOWN
            if not self._thread.is_alive():
                raise APIError(500, "the generation thread has stopped; restart the server", code="generator_stopped",
                               kind="server_error")
            # One runs and max_queue wait. A job the generation thread has not yet taken off the
            # queue is the one that runs next, so count jobs, not the running slot: with
            # --max-queue 1, two requests arriving together both get in.
            held = int(self.running is not None) + len(self._waiting)
            if held >= 1 + self.max_queue:
                self.counts["rejected"] += 1
                raise APIError(503, f"the server is busy: {held} requests running or waiting (1 runs at a time, "
                               f"--max-queue {self.max_queue}); retry later", code="queue_full", kind="server_error")
            self._waiting.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        with self._cv:
            job.cancelled.set()
            if job in self._waiting:
                self._waiting.remove(job)
                self.counts["cancelled"] += 1

    def state(self) -> dict:
        with self._cv:
            return {"status": "ok" if self._thread.is_alive() or self._stop else "generation thread stopped",
                    "running": int(self.running is not None), "waiting": len(self._waiting),
                    "max_queue": self.max_queue, **{k: self.counts[k] for k in
                                                   ("completed", "cancelled", "failed", "rejected")}}

    def shutdown(self) -> None:
        """Stops taking requests; each waiting or running one ends at once with a 503 (a
        stream: an error event), so the HTTP server's graceful shutdown finds them done."""
        with self._cv:
            self._stop = True
            for j in self._waiting:
                j.cancelled.set()
                j.emit("error", _SHUTTING_DOWN)
            self._waiting.clear()
            if self.running is not None:
                self.running.cancelled.set()  # _loop answers it when generate returns
            self._cv.notify()

    def close(self) -> None:
        self.shutdown()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                job = self.running = self._waiting.popleft()
            answer = None
            try:
                self._generate(job)
                outcome = "cancelled" if job.cancelled.is_set() else "completed"
                if outcome == "completed":
                    answer = ("done", (job.finish_reason, job.text))
                elif self._stop:
                    answer = ("error", _SHUTTING_DOWN)
            except BaseException as e:  # noqa: BLE001 (this request fails; the server goes on)
                outcome = "failed"
                from .cli_checks import user_message

                answer = ("error", APIError(500, f"generation failed: {type(e).__name__}: {user_message(e)}",
                                            kind="server_error"))
            # The slot is free before the answer goes out: a client sending its next request
            # the moment it has this one's must not find the server busy.
            with self._cv:
                self.running = None
                self.counts[outcome] += 1
            if answer is not None:
                job.emit(*answer)
            log_request(self.log, job, outcome)

    def _generate(self, job: Job) -> None:
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList
        from transformers.generation.streamers import BaseStreamer

        p = job.params
        tracker = TextTracker(self.tok, p.stop)
        stamps = {"start": time.perf_counter()}

        class Stream(BaseStreamer):
            prompt_seen = False

            def put(self, value):
                if not self.prompt_seen:  # generate hands the prompt over first
                    self.prompt_seen = True
                    return
                if "first" not in stamps:
                    stamps["first"] = time.perf_counter()
                for t in value.reshape(-1).tolist():
                    if not tracker.stopped:
                        job.tokens.append(int(t))
                piece = tracker.update([t for t in job.tokens if t not in self_eos])
                if piece:
                    job.emit("text", piece)

            def end(self):
                pass

        self_eos = self.eos_ids

        class Stop(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                done = job.cancelled.is_set() or tracker.stopped
                return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

        gen: dict[str, Any] = dict(max_new_tokens=job.max_tokens, do_sample=not p.greedy, pad_token_id=self.pad_id)
        if p.min_tokens:
            gen["min_new_tokens"] = p.min_tokens
        if not p.greedy:
            gen.update(temperature=p.temperature, top_p=p.nucleus, top_k=0)
            torch.manual_seed(p.seed if p.seed is not None else secrets.randbits(63))
        ids = job.prompt_ids[None].to(self.device)
        from .attention import generation_attention

        with torch.no_grad(), generation_attention(self.device):
            self.model.generate(ids, attention_mask=torch.ones_like(ids), streamer=Stream(),
                                stopping_criteria=StoppingCriteriaList([Stop()]), **gen)
        end = time.perf_counter()
        first = stamps.get("first", end)
        job.prefill_s, job.decode_s = first - stamps["start"], end - first
        if job.cancelled.is_set():
            return
        piece = tracker.update([t for t in job.tokens if t not in self.eos_ids], final=True)
        if piece:
            job.emit("text", piece)
        job.text = tracker.text
        if tracker.stopped or (job.tokens and job.tokens[-1] in self.eos_ids):
            job.finish_reason = "stop"
        else:
            job.finish_reason = "length"


class BatchedGenerator:
    """Up to `batch` requests decoded together through transformers' continuous batching (its
    ``ContinuousBatchingManager``: paged KV cache, requests joining and leaving the batch at any
    step, per-request temperature / top-p / top-k). Same interface as `Generator`; the
    manager's thread runs the model, and its results arrive on the event loop
    (``register_result_handler``), where they are turned into text. Greedy is top-k 1, since
    the manager samples or not for all. It has no per-request seed or minimum length: those
    are refused here."""

    def __init__(self, model, tok, batch: int, context: int | None, max_queue: int, log=print):
        import math

        from transformers import ContinuousBatchingConfig, GenerationConfig

        self.tok, self.batch, self.max_queue, self.log = tok, batch, max_queue, log
        cfg = model.config
        self.context = context or min(model_context(cfg) or 8192, 8192)
        self.context_what = f"the per-request context with --batch (--batch-context {self.context})"
        self.eos_ids = end_ids(model, tok)
        self.vocab = int(cfg.vocab_size)
        self.page = 32
        self.pages = math.ceil(batch * self.context / self.page)
        # Temperature, top-k and top-p other than their defaults, so that transformers builds
        # their per-request processors; every request sets all three.
        gc = GenerationConfig(do_sample=True, temperature=0.5, top_k=1, top_p=0.5, max_new_tokens=self.context,
                              eos_token_id=sorted(self.eos_ids) or -1)
        cb = ContinuousBatchingConfig(page_size=self.page, num_blocks=self.pages, max_requests_per_batch=batch,
                                      max_batch_tokens=max(256, batch * 64), per_request_processors=True,
                                      drop_unsupported_processors=False)
        # Continuous batching runs its own paged attention and takes only SDPA-family models:
        # the one-token pool attention (tandem.attention) gives the model back to SDPA here.
        from .attention import sdpa_attention

        sdpa_attention(model)
        self.manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cb)
        self.manager.start()
        self.active: dict[str, tuple[Job, TextTracker]] = {}
        self.counts = collections.Counter()
        self._stop = False
        self._lock = threading.Lock()
        layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
        heads = int(getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads", 0) or 0)
        head_dim = int(getattr(cfg, "head_dim", None) or (cfg.hidden_size // max(cfg.num_attention_heads, 1)))
        self.kv_bytes = self.pages * self.page * layers * 2 * heads * head_dim * model.dtype.itemsize

    def describe(self) -> str:
        return (f"continuous batching: up to {self.batch} requests decoded together, {self.context} tokens each "
                f"(KV cache about {self.kv_bytes / 2**30:.2f} GiB, {self.pages} pages of {self.page} tokens)")

    def check(self, params: Params) -> None:
        if params.seed is not None:
            raise APIError(400, "seed is not supported with --batch above 1 (transformers' continuous batching "
                           "samples every request from one generator); run the server with --batch 1", "seed")
        if params.min_tokens:
            raise APIError(400, "min_tokens is not supported with --batch above 1; run the server with --batch 1",
                           "min_tokens")

    def submit(self, job: Job) -> None:
        p = job.params
        kwargs = (dict(temperature=1.0, top_k=1, top_p=1.0) if p.greedy else
                  dict(temperature=p.temperature, top_k=self.vocab, top_p=p.nucleus))
        tracker = TextTracker(self.tok, p.stop)
        with self._lock:
            if self._stop:
                raise _SHUTTING_DOWN
            if len(self.active) >= self.batch + self.max_queue:
                self.counts["rejected"] += 1
                raise APIError(503, f"the server is busy: {len(self.active)} requests running or waiting (--batch "
                               f"{self.batch}, --max-queue {self.max_queue}); retry later", code="queue_full",
                               kind="server_error")
            self.active[job.id] = (job, tracker)
        job.prefill_s = time.perf_counter()  # the start, until the first token replaces it by the prefill time
        # The handler first: a result may come before add_request returns.
        self.manager.register_result_handler(job.id, lambda r: self._on_result(job, tracker, r))
        self.manager.add_request(job.prompt_ids.tolist(), request_id=job.id, max_new_tokens=job.max_tokens,
                                 streaming=True, **kwargs)

    def _on_result(self, job: Job, tracker: TextTracker, r) -> None:
        """On the event loop: one more token (or the end) of `job`."""
        if job.id not in self.active:
            return
        now = time.perf_counter()
        if r.error:
            self._finish(job, "failed", error=APIError(500, f"generation failed: {r.error}", kind="server_error"))
            return
        if not job.tokens and r.generated_tokens:
            job.prefill_s = now - job.prefill_s
            job.decode_s = now
        job.tokens = list(r.generated_tokens)
        text = [t for t in job.tokens if t not in self.eos_ids]
        finished = r.is_finished()
        piece = tracker.update(text, final=finished)
        if piece:
            job.out.put_nowait(("text", piece))
        if tracker.stopped:
            self.manager.cancel_request(job.id)
            job.finish_reason = "stop"
        elif finished:
            job.finish_reason = "stop" if job.tokens and job.tokens[-1] in self.eos_ids else "length"
        else:
            return
        if job.tokens:
            job.decode_s = now - job.decode_s
        job.text = tracker.text
        self._finish(job, "completed")

    def _finish(self, job: Job, outcome: str, error: APIError | None = None) -> None:
        with self._lock:
            if self.active.pop(job.id, None) is None:
                return
            self.counts[outcome] += 1
        # The manager drops a handler only when its request finishes, never for one cancelled
        # (a stop string, a disconnect): drop it here, or each would stay for good.
        router = getattr(self.manager, "output_router", None)
        if router is not None and hasattr(router, "result_handlers"):
            with router._lock:
                router.result_handlers.pop(job.id, None)
        if outcome == "completed":
            job.out.put_nowait(("done", (job.finish_reason, job.text)))
        elif error is not None:
            job.emit("error", error)
        log_request(self.log, job, outcome)

    def cancel(self, job: Job) -> None:
        job.cancelled.set()
        if job.id in self.active:
            self.manager.cancel_request(job.id)
            self._finish(job, "cancelled")

    def state(self) -> dict:
        with self._lock:
            n = len(self.active)
            return {"status": "ok" if self.manager.is_running() or self._stop else "batching thread stopped",
                    "running": min(n, self.batch), "waiting": max(0, n - self.batch), "batch": self.batch,
                    "max_queue": self.max_queue, **{k: self.counts[k] for k in
                                                   ("completed", "cancelled", "failed", "rejected")}}

    async def watch(self) -> None:
        """Fails every request if the manager's thread dies (else they would wait forever)."""
        while True:
            await asyncio.sleep(1.0)
            if not self.manager.is_running():
                why = getattr(self.manager.background_thread_status, "fatal_error", None)
                for job, _ in list(self.active.values()):
                    self._finish(job, "failed", APIError(500, f"the batching thread stopped ({why})",
                                                         kind="server_error"))
                with self._lock:
                    self._stop = True
                return

    def shutdown(self) -> None:
        with self._lock:
            self._stop = True
            jobs = [j for j, _ in self.active.values()]
        for job in jobs:
            job.cancelled.set()
            self.manager.cancel_request(job.id)
            self._finish(job, "cancelled", _SHUTTING_DOWN)

    def close(self) -> None:
        self.shutdown()
        self.manager.stop(block=True, timeout=30)


# ---- the app -----------------------------------------------------------------------------

def build_app(model, tok, model_id: str, max_queue: int = 8, api_key: str | None = None, log=print,
              chat_template: str | None = None, batch: int = 1, batch_context: int | None = None, on_ready=None):
    """The FastAPI application serving `model` (a tandem-loaded transformers model) as
    `model_id`. The generation thread starts with the app and stops at its shutdown."""
    from contextlib import asynccontextmanager

    from fastapi import Depends, FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from .chat import PLAIN_TEMPLATE

    # The model's generation_config may carry sampling defaults and penalties (temperature,
    # repetition_penalty, ...) that generate would apply to fields a request leaves unset: the
    # server keeps its token ids only, so a request gets what it asks for (OpenAI's defaults
    # otherwise), the same with --batch or without.
    from transformers import GenerationConfig

    old = getattr(model, "generation_config", None)
    model.generation_config = GenerationConfig(**{k: getattr(old, k, None) for k in
                                                  ("bos_token_id", "eos_token_id", "pad_token_id")})
    # None: the tokenizer's own (a string, or a dict of named templates transformers picks from).
    template = chat_template if chat_template is not None else (None if tok.chat_template else PLAIN_TEMPLATE)
    state: dict[str, Generator] = {}
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        if batch > 1:
            gen = state["gen"] = BatchedGenerator(model, tok, batch, batch_context, max_queue, log)
            log(gen.describe())
            watch = asyncio.create_task(gen.watch())
        else:
            state["gen"] = Generator(model, tok, max_queue, log)
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            if batch > 1:
                watch.cancel()
            state["gen"].close()

    async def check_key(request: Request):
        # A dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware hides the client's
        # disconnect from request.is_disconnected(), which cancels an abandoned request.
        if api_key is not None and request.url.path.startswith("/v1"):
            auth = request.headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                               code="invalid_api_key")

    app = FastAPI(title="tandem serve", lifespan=lifespan, dependencies=[Depends(check_key)])
    app.state.shutdown = lambda: state["gen"].shutdown() if "gen" in state else None

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):  # unknown routes, wrong methods
        what = {404: f"no route {request.method} {request.url.path} (this server has /v1/models, "
                     "/v1/chat/completions, /v1/completions, /health)",
                405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return JSONResponse(APIError(e.status_code, what).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    def unknown_model(name) -> APIError:
        return APIError(404, f"the model {name!r} does not exist here (this server serves {model_id!r})", "model",
                        code="model_not_found")

    async def read_body(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        # A field sent as null is a field not set (clients other than openai's send them).
        body = {k: v for k, v in body.items() if v is not None}
        if body.get("model") != model_id:
            if "model" not in body:
                raise APIError(400, f"model is required (this server serves {model_id!r})", "model")
            raise unknown_model(body["model"])
        return body

    def make_job(prompt_ids, params: Params, prefix: str) -> Job:
        n = int(prompt_ids.shape[0])
        if n == 0:
            raise APIError(400, "the prompt is empty", "prompt")
        gen = state["gen"]
        gen.check(params)
        ctx = gen.context
        if ctx is not None and n >= ctx:
            raise APIError(400, f"the prompt has {n} tokens; {gen.context_what} is {ctx} tokens",
                           code="context_length_exceeded")
        room = ctx - n if ctx is not None else None
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens is None:
            raise APIError(400, "max_tokens is required: the model's config gives no context length", "max_tokens")
        if room is not None and max_tokens > room:
            raise APIError(400, f"the prompt has {n} tokens and max_tokens is {max_tokens}: together more than "
                           f"{gen.context_what}, {ctx} tokens", "max_tokens", code="context_length_exceeded")
        loop = asyncio.get_running_loop()
        return Job(id=f"{prefix}-{secrets.token_hex(12)}", prompt_ids=prompt_ids, params=params,
                   max_tokens=max_tokens, loop=loop, out=asyncio.Queue())

    def usage(job: Job) -> dict:
        n, m = int(job.prompt_ids.shape[0]), len(job.tokens)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

    async def run(request: Request, job: Job, chunk, final):
        """Queues the job and answers: one JSON body, or server-sent events of chunk(text)
        and final(finish_reason); cancels the job when the client goes away."""
        gen = state["gen"]
        gen.submit(job)
        if not job.params.stream:
            try:
                while True:
                    try:
                        kind, value = await asyncio.wait_for(job.out.get(), timeout=0.5)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            return JSONResponse({}, status_code=499)  # the finally cancels it
                        continue
                    if kind == "error":
                        raise value
                    if kind == "done":  # (finish reason, the whole text)
                        return JSONResponse(final(value[1], value[0]))
            finally:
                gen.cancel(job)  # no-op once it finished

        async def events():
            try:
                yield f"data: {json.dumps(chunk(None))}\n\n"  # the role, at once (queued or not)
                while True:
                    kind, value = await job.out.get()
                    if kind == "text":
                        yield f"data: {json.dumps(chunk(value))}\n\n"
                    elif kind == "error":
                        yield f"data: {json.dumps(value.body())}\n\n"
                        break
                    else:
                        yield f"data: {json.dumps(final(None, value[0]))}\n\n"
                        if job.params.include_usage:
                            last = final(None, value[0])
                            last["choices"], last["usage"] = [], usage(job)
                            yield f"data: {json.dumps(last)}\n\n"
                        break
                yield "data: [DONE]\n\n"
            finally:
                gen.cancel(job)  # the client went away (or the stream ended: then a no-op)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def encode(text: str, special: bool):
        return tok(text, add_special_tokens=special, return_tensors="pt")["input_ids"][0]

    card = {"id": model_id, "object": "model", "created": created, "owned_by": "tandem"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")
    async def model_card(name: str):
        if name != model_id:
            raise unknown_model(name)
        return card

    @app.get("/health")
    async def health():
        return {"model": model_id, **state["gen"].state()}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request)
        params = parse_params(body, _CHAT)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise APIError(400, "messages must be a non-empty list", "messages")
        messages = [message_text(m, i) for i, m in enumerate(msgs)]
        extra = body.get("chat_template_kwargs") or {}
        if not isinstance(extra, dict):
            raise APIError(400, "chat_template_kwargs must be an object (e.g. {\"enable_thinking\": false})",
                           "chat_template_kwargs")
        taken = sorted(set(extra) & {"conversation", "messages", "tokenize", "add_generation_prompt",
                                     "chat_template", "continue_final_message", "return_dict", "tools"})
        if taken:
            raise APIError(400, f"chat_template_kwargs may not set {taken[0]!r} (the server sets it)",
                           "chat_template_kwargs")
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                           chat_template=template, **extra)
        except Exception as e:  # noqa: BLE001 (the template refuses these messages: e.g. roles out of order)
            raise APIError(400, f"the model's chat template refuses these messages: {e}", "messages") from None
        job = make_job(encode(text, False), params, "chatcmpl")
        head = {"id": job.id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_id}

        def chunk(piece):
            delta = {"role": "assistant", "content": ""} if piece is None else {"content": piece}
            return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}

        def final(text, reason):
            if text is None:
                return {**head, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}]}
            return {**head, "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                 "finish_reason": reason}], "usage": usage(job)}

        return await run(request, job, chunk, final)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        params = parse_params(body, _COMPLETION)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = encode(prompt, True)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            import torch

            vocab = len(tok)
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"prompt token {bad[0]} is outside the vocabulary [0, {vocab})", "prompt")
            ids = torch.tensor(prompt, dtype=torch.long)
        else:
            raise APIError(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt")
        job = make_job(ids, params, "cmpl")
        head = {"id": job.id, "object": "text_completion", "created": int(time.time()), "model": model_id}

        def chunk(piece):
            return {**head, "choices": [{"index": 0, "text": piece or "", "logprobs": None, "finish_reason": None}]}

        def final(text, reason):
            out = {**head, "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}]}
            if text is not None:
                out["usage"] = usage(job)
            return out

        return await run(request, job, chunk, final)

    return app


def run(args: argparse.Namespace) -> int:
    import socket

    sel = check_arguments(args)
    from .cli_checks import InputError, check_device, describe

    check_device(args.device, sel, train=False)
    # Bind first: a port in use fails in a second, before minutes of loading.
    try:
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        # Listening now: a second server on this port fails here, not after loading, and a
        # client that connects as soon as "serving ..." is printed waits in the backlog.
        sock.listen(2048)
    except OSError as e:
        raise InputError(f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror or e})") from None
    import uvicorn
    import tandem
    from tandem.gguf_checkpoint import load_tokenizer
    from tandem import demo

    model_dir = sel.model or str(demo.ensure_demo_model(progress=not args.no_progress))
    print(describe(sel, model_dir), flush=True)
    if args.batch_context is not None:  # before minutes of loading
        from tandem.gguf_checkpoint import load_config

        model_ctx = model_context(load_config(model_dir))
        if model_ctx and args.batch_context > model_ctx:
            raise InputError(f"--batch-context {args.batch_context}: above the model's context of {model_ctx} tokens")
    tok = load_tokenizer(model_dir)  # first: a model without a usable tokenizer fails before the load
    model = tandem.load_model(model_dir, sel.config, device=args.device, store=args.store, progress=not args.no_progress,
                              adapter=args.adapter)
    model_id = args.served_model_name or os.path.basename(os.path.normpath(model_dir))
    if args.chat_template is None and not tok.chat_template:
        print("note: this tokenizer has no chat template; chat turns are rendered as 'role: content' lines "
              "(--chat-template FILE gives one)")
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: listening on {args.host} without --api-key: anyone who reaches this port can use it")
    app = build_app(model, tok, model_id, args.max_queue, args.api_key, log=lambda s: print(s, flush=True),
                    chat_template=getattr(args, "chat_template_text", None), batch=args.batch,
                    batch_context=args.batch_context, on_ready=lambda: print(ready, flush=True))
    host, port = sock.getsockname()[:2]
    running = f"{args.batch} decoded together" if args.batch > 1 else "1 running"
    ready = (f"serving {model_id!r} on http://{host if ':' not in host else f'[{host}]'}:{port}/v1 "
             f"(OpenAI API; {running} + up to {args.max_queue} waiting; Ctrl-C stops)")

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # Ctrl-C / SIGTERM: end the requests first
            app.state.shutdown()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's own raises the signal again once the server has stopped, which
            # interrupts the app's shutdown with a KeyboardInterrupt traceback: this one
            # only stops the server (a second Ctrl-C forces it).
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    server = Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10))
    server.run(sockets=[sock])
    print("stopped", flush=True)
    return 0
