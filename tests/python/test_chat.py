"""`tandem chat`: turns rendered with the template, replies streamed, the conversation's KV
cache reused between turns (only what it does not hold is prefilled), and the replies what
generate gives on the whole conversation without any cache."""
from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tandem
from tandem import demo
from tandem.chat import Session

ROOT = Path(__file__).resolve().parents[2]


def test_cached_turns_give_the_replies_of_uncached_generation():
    from transformers import AutoTokenizer

    path = demo.ensure_demo_model(progress=False)
    model = tandem.load_model(path, ROOT / "configs" / "demo.yaml", progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    s = Session(model, tok, "Be brief.", dict(max_new_tokens=6, do_sample=False))
    first = s.reply("What is 2 plus 2?")
    assert first["reused"] == 0 and first["new_tokens"] == 6
    second = s.reply("And 3 plus 3?")
    # No re-prefill of the history: the first prompt and the reply (all but its last token,
    # which generate never feeds) come from the cache; what is prefilled is that token and
    # the template's text after the reply, up to the new generation prompt.
    assert second["reused"] == first["prefill_tokens"] + first["new_tokens"] - 1
    rendered = s.render(s.messages[:-1])
    tail = rendered[rendered.index(first["reply"], len(s.render(s.messages[:2]))) + len(first["reply"]):]
    assert second["prefill_tokens"] == 1 + s.encode(tail).shape[0]
    whole = second["prompt_ids"][None]
    history = torch.cat([first["prompt_ids"], first["reply_ids"]])  # as the model saw and generated it
    assert torch.equal(whole[0, :history.shape[0]], history)
    with torch.no_grad():  # the same conversation from scratch, no cache: the same greedy reply
        out = model.generate(whole, attention_mask=torch.ones_like(whole), max_new_tokens=6, do_sample=False,
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    assert tok.decode(out[0, whole.shape[1]:], skip_special_tokens=True) == second["reply"]
    s.reset()
    assert s.messages == [{"role": "system", "content": "Be brief."}] and s.cache.get_seq_length() == 0


def read_until(fd: int, pattern: str, timeout: float = 120) -> str:
    buf, end = b"", time.time() + timeout
    while time.time() < end:
        r, _, _ = select.select([fd], [], [], 0.5)
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            if re.search(pattern, buf.decode("utf-8", "replace")):
                return buf.decode("utf-8", "replace")
    raise AssertionError(f"no {pattern!r} in {buf.decode('utf-8', 'replace')!r}")


def test_tandem_chat_in_a_terminal():
    """Driven through a pseudo-terminal: two turns (the second prefills less than the whole
    conversation), /reset (the next turn prefills from nothing), /exit."""
    main, sub = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "tandem", "chat", "--max-new-tokens", "5", "--no-progress"],
                         stdin=sub, stdout=sub, stderr=sub, cwd=ROOT, close_fds=True)
    os.close(sub)
    try:
        read_until(main, r"/exit \(or end of input\) leaves")
        turns = []
        for text in ("hello there", "and again", "/reset", "third"):
            os.write(main, (text + "\n").encode())
            if text == "/reset":
                read_until(main, r"\(new conversation\)")
                continue
            out = read_until(main, r"\[prefill \d+ tokens \(\d+ from the cache\) at [\d.]+ tokens/s; 5 tokens at")
            turns.append(tuple(int(x) for x in re.findall(r"\[prefill (\d+) tokens \((\d+) from the cache\)", out)[-1]))
        os.write(main, b"/exit\n")
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
        os.close(main)
    (p1, r1), (p2, r2), (p3, r3) = turns
    assert r1 == 0 and r2 == p1 + 5 - 1 and r3 == 0, turns


@pytest.mark.parametrize("argv, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
    (["--sample", "--temperature", "0"], "--temperature must be a positive number, got 0.0"),
    (["--sample", "--temperature", "nan"], "--temperature must be a positive number, got nan"),
    (["--sample", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--adapter", "{tmp}/nowhere"], "--adapter {tmp}/nowhere: no adapter_config.json there"),
    (["--model", "{tmp}/nowhere"], "--model: {tmp}/nowhere: no such directory"),
])
def test_chat_checks_its_inputs_before_loading_a_model(argv, message, cli_refuses):
    cli_refuses("chat", argv, message)
