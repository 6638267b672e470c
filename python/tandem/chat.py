"""`tandem chat`: talk to a model in the terminal.

    tandem chat                                   # the built-in demo model
    tandem chat --model /models/Qwen3-30B-A3B --config configs/qwen3-30b-a3b.yaml [--adapter DIR]

Each turn is rendered with the model's chat template (a tokenizer without one gets a plain
``role: content`` format, and the command says so), the reply is printed token by token as
it is generated, and the conversation's KV cache is kept between turns: the history is kept
as the tokens the model saw and generated (``Session.prompt_ids``), so a turn prefills only the
last reply's last token, the template's end of turn and the new user message (where the
template rewrites earlier turns, from the first token that differs).
After each reply one line reports the prefill and decode figures. ``/reset`` starts a new
conversation, ``/exit`` (or end of input) leaves.
"""
from __future__ import annotations

import argparse
import time

# For tokenizers without a chat template (the demo model's byte-level one).
PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


def end_ids(model, tok) -> set[int]:
    """The token ids generation stops at: the generation config's (it may list several, e.g.
    Qwen3's two) and the tokenizer's end-of-text."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = ids if isinstance(ids, (list, tuple)) else [ids]
    return {int(i) for i in [*ids, tok.eos_token_id] if i is not None}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .cli_checks import add_adapter_argument, add_generation_arguments, add_model_arguments

    add_model_arguments(p)
    add_adapter_argument(p)
    p.add_argument("--system", help="a system message to start every conversation with")
    add_generation_arguments(p, 256, "per reply")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def check_arguments(args: argparse.Namespace):
    from .cli_checks import check_adapter_argument, check_generation_arguments, select_model_and_config

    check_generation_arguments(args)
    check_adapter_argument(args)
    return select_model_and_config(args)


def common_prefix(a, b) -> int:
    """Length of the common prefix of two 1-d token tensors."""
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


class Session:
    """A conversation and the KV cache of what the model has already seen of it."""

    def __init__(self, model, tok, system: str | None, gen: dict):
        from .kv_cache import GrowingCache

        self.model, self.tok, self.system, self.gen = model, tok, system, gen
        # None: the tokenizer's own (a string, or a dict of named templates transformers picks from).
        self.template = None if tok.chat_template else PLAIN_TEMPLATE
        self.stop_ids = end_ids(model, tok)
        self._cache_type = GrowingCache  # appends in place (tandem.kv_cache)
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.drop_cache()

    def drop_cache(self) -> None:
        import torch

        self.cache = self._cache_type()
        self.seen = torch.zeros(0, dtype=torch.long)  # the tokens the cache holds
        self.last = None  # (the last turn's prompt text, its tokens, the reply's tokens as generated)

    def render(self, messages: list[dict], generation_prompt: bool = True) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                            chat_template=self.template)

    def encode(self, text: str):
        return self.tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]

    def prompt_ids(self):
        """The conversation's tokens, ending with the generation prompt. After a reply: the
        last prompt's tokens, the reply's tokens as the model generated them, and the
        template's text after the reply (end of turn, the new user turn) encoded; so the
        history is what the cache holds, whatever re-encoding the reply's text would give.
        Where the template renders the history otherwise (it rewrites earlier turns), the
        whole conversation encoded."""
        import torch

        text = self.render(self.messages)
        if self.last is not None:
            prev_text, prev_ids, gen = self.last
            reply = self.messages[-2]["content"]
            # The reply as the template wrote it: right after the prompt, or after whitespace
            # the template puts there (which the model did not see: it saw what it generated).
            at = text.find(reply, len(prev_text)) if reply else -1
            if text.startswith(prev_text) and at >= 0 and not text[len(prev_text):at].strip():
                tail = text[at + len(reply):]
                if gen.numel() and int(gen[-1]) in self.stop_ids:
                    eos_text = self.tok.decode([int(gen[-1])])
                    if tail.startswith(eos_text):
                        tail = tail[len(eos_text):]
                    else:
                        gen = gen[:-1]  # the template does not write the end token there
                if self.tok.decode(gen, skip_special_tokens=True) == reply:
                    return torch.cat([prev_ids, gen, self.encode(tail)])
        return self.encode(text)

    def reply(self, text: str, on_token=None) -> dict:
        """Adds the user's message, generates the reply (on_token(str) for each piece as it
        is decoded), adds it; returns the turn's figures."""
        import torch
        from transformers import TextStreamer

        self.messages.append({"role": "user", "content": text})
        ids = self.prompt_ids()
        prompt_text = self.render(self.messages)
        reuse = common_prefix(ids, self.seen)
        if reuse == ids.shape[0]:  # generate needs at least one new token to feed
            reuse -= 1
        held = self.cache.get_seq_length()
        if reuse == 0 and held:
            self.drop_cache()
        elif reuse < held:
            self.cache.crop(reuse - held)  # transformers 5: a negative count of tokens to drop
        stamps: dict[str, float] = {}

        class Stream(TextStreamer):
            def put(self, value):
                if "first" not in stamps and not self.next_tokens_are_prompt:
                    stamps["first"] = time.perf_counter()
                super().put(value)

            def on_finalized_text(self, piece: str, stream_end: bool = False):
                if on_token and piece:
                    on_token(piece)

        device = next(p.device for p in self.model.parameters())
        t0 = time.perf_counter()
        from .attention import generation_attention

        with torch.no_grad(), generation_attention(device):
            out = self.model.generate(ids[None].to(device), attention_mask=torch.ones(1, ids.shape[0], device=device,
                                                                                      dtype=torch.long),
                                      past_key_values=self.cache, streamer=Stream(self.tok, skip_prompt=True,
                                                                                  skip_special_tokens=True),
                                      pad_token_id=self.tok.pad_token_id if self.tok.pad_token_id is not None
                                      else self.tok.eos_token_id, **self.gen)[0].cpu()
        t1 = time.perf_counter()
        new = out[ids.shape[0]:]
        reply = self.tok.decode(new, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": reply})
        self.seen = out[: self.cache.get_seq_length()]
        self.last = (prompt_text, ids, new)
        first = stamps.get("first", t1)
        return {"prefill_tokens": int(ids.shape[0] - reuse), "reused": reuse, "new_tokens": int(new.shape[0]),
                "prompt_ids": ids, "reply_ids": new,
                "prefill_s": first - t0, "decode_s": t1 - first, "reply": reply}


def run(args: argparse.Namespace) -> int:
    import sys

    sel = check_arguments(args)
    from .cli_checks import check_device, describe

    import torch
    import tandem
    from tandem.gguf_checkpoint import load_tokenizer
    from tandem import demo

    check_device(args.device, sel, train=False)
    model_dir = sel.model or str(demo.ensure_demo_model(progress=not args.no_progress))
    print(describe(sel, model_dir), flush=True)
    tok = load_tokenizer(model_dir)  # first: a model without a usable tokenizer fails before the load
    model = tandem.load_model(model_dir, sel.config, device=args.device, store=args.store, progress=not args.no_progress,
                              adapter=args.adapter)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample)
    if args.sample:
        gen.update(temperature=args.temperature, top_p=args.top_p)
        torch.manual_seed(args.seed)
    session = Session(model, tok, args.system, gen)
    if not tok.chat_template:
        print("note: this tokenizer has no chat template; turns are rendered as 'role: content' lines")
    print("chat: type a message; /reset starts over, /exit (or end of input) leaves", flush=True)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            return 0
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit"):
            return 0
        if cmd == "/reset":
            session.reset()
            print("(new conversation)", flush=True)
            continue
        if cmd.startswith("/"):
            print(f"unknown command {cmd.split()[0]} (/reset, /exit)", flush=True)
            continue
        try:
            r = session.reply(line, on_token=lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        except (KeyboardInterrupt, Exception) as e:  # noqa: BLE001 (this reply fails; the conversation goes on)
            if session.messages and session.messages[-1]["role"] == "user":
                session.messages.pop()
            session.drop_cache()  # it may hold part of the reply
            if isinstance(e, KeyboardInterrupt):
                print("\n(interrupted)", flush=True)
            else:
                print(f"\nerror: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''} "
                      "(the message was not added; the conversation goes on)", flush=True)
            continue
        pf = r["prefill_tokens"] / r["prefill_s"] if r["prefill_s"] > 0 else float("inf")
        dec = (r["new_tokens"] - 1) / r["decode_s"] if r["decode_s"] > 0 and r["new_tokens"] > 1 else float("nan")
        print(f"\n[prefill {r['prefill_tokens']} tokens ({r['reused']} from the cache) at {pf:.1f} tokens/s; "
              f"{r['new_tokens']} tokens at {dec:.1f} tokens/s]", flush=True)
