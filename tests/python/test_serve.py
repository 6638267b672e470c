"""`tandem serve` driven by the official `openai` client, against a live server on the demo model.

One server (a `python -m tandem serve` process, `--max-queue 1`, an API key) serves the whole
module; a reference copy of the same model, loaded in this process through `tandem.load_model`,
gives what greedy `generate` makes of the same prompt. Nothing here is timed: waits are
bounded polls of `/health`.
"""
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai")

KEY = "sk-tandem-test"


def _wait_for(cond, what: str, timeout: float = 60.0, every: float = 0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@contextlib.contextmanager
def live_server(*args: str):
    """(base url, the log lines so far) of a live `tandem serve --port 0 ARGS` on the demo
    model; at the end it gets Ctrl-C and must stop cleanly (exit 0, no traceback)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "tandem", "serve", "--port", "0", "--no-progress", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    url = []

    def read():
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"on (http://\S+/v1) ", line)
            if m:
                url.append(m.group(1))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        _wait_for(lambda: url or proc.poll() is not None, "the server to start", timeout=600, every=0.2)
        assert url, "".join(lines)
        yield url[0], lines
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        reader.join(timeout=10)
    log = "".join(lines)
    assert code == 0, log
    assert "Traceback" not in log and log.endswith("stopped\n"), log


@pytest.fixture(scope="module")
def server():
    """The module's server: --max-queue 1 and an API key."""
    with live_server("--max-queue", "1", "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def reference():
    """(model, tokenizer): the demo model loaded here, for generate's answer."""
    import tandem
    from tandem import demo
    from transformers import AutoTokenizer

    d = str(demo.ensure_demo_model(progress=False))
    model = tandem.load_model(d, str(demo.demo_config_path()), progress=False)
    return model, AutoTokenizer.from_pretrained(d)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0], api_key=KEY, max_retries=0, timeout=300)


def model_id(client) -> str:
    return client.models.list().data[0].id


def health(server) -> dict:
    with urllib.request.urlopen(server[0].removesuffix("/v1") + "/health", timeout=30) as r:
        return json.loads(r.read())


def greedy(reference, ids: torch.Tensor, n: int) -> tuple[list[int], str]:
    """generate's greedy tokens after `ids` and their text (end-of-text dropped)."""
    model, tok = reference
    with torch.no_grad():
        out = model.generate(ids[None], attention_mask=torch.ones(1, ids.shape[0], dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)[0, ids.shape[0]:]
    new = out.tolist()
    return new, tok.decode([t for t in new if t != tok.eos_token_id], skip_special_tokens=True)


def chat_ids(reference, messages) -> torch.Tensor:
    from tandem.chat import PLAIN_TEMPLATE

    _, tok = reference
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                   chat_template=None if tok.chat_template else PLAIN_TEMPLATE)
    return tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]


def completion_ids(reference, prompt: str) -> torch.Tensor:
    return reference[1](prompt, return_tensors="pt")["input_ids"][0]


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a mixture of experts?"}]


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["demo-qwen3-moe-v1"]


def test_chat_greedy_equals_generate_streamed_or_not(client, reference):
    ids = chat_ids(reference, MESSAGES)
    tokens, text = greedy(reference, ids, 24)
    r = client.chat.completions.create(model=model_id(client), messages=MESSAGES, max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == ("stop" if tokens[-1] == reference[1].eos_token_id else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ids.shape[0], len(tokens))
    assert r.usage.total_tokens == ids.shape[0] + len(tokens)

    chunks = list(client.chat.completions.create(model=model_id(client), messages=MESSAGES, max_tokens=24,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [r.choices[0].finish_reason]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == len(tokens)
    assert len({c.id for c in chunks}) == 1


def test_completion_greedy_equals_generate_streamed_or_not(client, reference):
    prompt = "the experts run on the cpu"
    ids = completion_ids(reference, prompt)
    tokens, text = greedy(reference, ids, 20)
    r = client.completions.create(model=model_id(client), prompt=prompt, max_tokens=20, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ids.shape[0], len(tokens))
    pieces = list(client.completions.create(model=model_id(client), prompt=prompt, max_tokens=20, temperature=0,
                                            stream=True))
    assert "".join(p.choices[0].text for p in pieces) == text
    assert pieces[-1].choices[0].finish_reason == r.choices[0].finish_reason
    # The same prompt as token ids.
    r2 = client.completions.create(model=model_id(client), prompt=ids.tolist(), max_tokens=20, temperature=0)
    assert r2.choices[0].text == text


def _stop_string(text: str, at_least: int = 3) -> tuple[str, int]:
    """A short piece of `text` whose first occurrence is at index >= at_least."""
    for k in range(at_least, len(text) - 1):
        for n in (2, 1):
            s = text[k:k + n]
            if "\ufffd" not in s and text.find(s) == k:
                return s, k
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_sequences_cut_the_reply(client, reference):
    prompt = "stop sequences"
    ids = completion_ids(reference, prompt)
    _, text = greedy(reference, ids, 40)
    stop, k = _stop_string(text)
    kw = dict(model=model_id(client), prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "\x00never"])
    r = client.completions.create(**kw)
    assert r.choices[0].text == text[:k] and r.choices[0].finish_reason == "stop", (text, stop)
    assert r.usage.completion_tokens < 40
    pieces = list(client.completions.create(**kw, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == text[:k]
    assert pieces[-1].choices[0].finish_reason == "stop"
    # Chat too, a single string.
    _, ctext = greedy(reference, chat_ids(reference, MESSAGES), 40)
    cstop, ck = _stop_string(ctext)
    c = client.chat.completions.create(model=model_id(client), messages=MESSAGES, max_tokens=40, temperature=0,
                                       stop=cstop)
    assert c.choices[0].message.content == ctext[:ck] and c.choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client):
    kw = dict(model=model_id(client), prompt="sampling", max_tokens=48, temperature=1.5, top_p=1.0)
    a = client.completions.create(**kw, seed=7).choices[0].text
    b = client.completions.create(**kw, seed=7).choices[0].text
    c = client.completions.create(**kw, seed=8).choices[0].text
    # 48 tokens at temperature 1.5 from a random model: two seeds agreeing on all is beyond chance.
    assert a == b and a != c


def test_min_tokens_holds_back_the_end_of_text(client):
    r = client.completions.create(model=model_id(client), prompt="x", max_tokens=64, temperature=0,
                                  extra_body={"min_tokens": 64})
    assert r.usage.completion_tokens == 64 and r.choices[0].finish_reason == "length"


BAD = [
    (dict(temperature=3), openai.BadRequestError, "temperature must be a number in [0.0, 2.0], got 3"),
    (dict(top_p=-0.5), openai.BadRequestError, "top_p must be a number in [0.0, 1.0]"),
    (dict(max_tokens=0), openai.BadRequestError, "max_tokens must be an integer at least 1, got 0"),
    (dict(max_tokens=5000), openai.BadRequestError, "together more than the model's context, 4096 tokens"),
    (dict(n=2), openai.BadRequestError, "n=2 is not supported"),
    (dict(logprobs=True), openai.BadRequestError, "logprobs=true is not supported"),
    (dict(frequency_penalty=0.5), openai.BadRequestError, "frequency_penalty=0.5 is not supported"),
    (dict(stop=["a", "b", "c", "d", "e"]), openai.BadRequestError, "stop must be"),
    (dict(stop=""), openai.BadRequestError, "stop must be"),
    (dict(extra_body={"repetition_penalty": 1.1}), openai.BadRequestError, "unsupported parameter 'repetition_penalty'"),
    (dict(extra_body={"min_tokens": 50}, max_tokens=10), openai.BadRequestError, "min_tokens (50) exceeds max_tokens (10)"),
    (dict(stream_options={"include_usage": True}), openai.BadRequestError, "stream_options takes only"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), openai.BadRequestError,
     "tools="),
    (dict(response_format={"type": "json_object"}), openai.BadRequestError, "response_format other than"),
    (dict(extra_body={"chat_template_kwargs": ["x"]}), openai.BadRequestError,
     "chat_template_kwargs must be an object"),
    (dict(extra_body={"chat_template_kwargs": {"add_generation_prompt": False}}), openai.BadRequestError,
     "chat_template_kwargs may not set 'add_generation_prompt'"),
    (dict(model="gpt-4o"), openai.NotFoundError, "the model 'gpt-4o' does not exist here"),
    (dict(messages=[]), openai.BadRequestError, "messages must be a non-empty list"),
    (dict(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]), openai.BadRequestError,
     "messages[0].role \"tool\" is not supported"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]),
     openai.BadRequestError, "messages[0].content[0] must be a text part"),
    (dict(messages=[{"role": "user", "content": 5}]), openai.BadRequestError,
     "messages[0].content must be a string"),
    (dict(messages=[{"role": "user", "content": "hi " * 5000}], max_tokens=None), openai.BadRequestError,
     "the model's context is 4096 tokens"),
]


@pytest.mark.parametrize("kw, error, message", BAD, ids=[b[2][:40] for b in BAD])
def test_bad_chat_requests_get_openai_errors(client, kw, error, message):
    args = dict(model=model_id(client), messages=MESSAGES, max_tokens=4)
    args.update(kw)
    args = {k: v for k, v in args.items() if v is not None}
    with pytest.raises(error) as e:
        client.chat.completions.create(**args)
    body = e.value.body
    assert message in body["message"], body
    assert body["type"] == "invalid_request_error"


def test_bad_completion_requests_and_keys(server, client):
    mid = model_id(client)
    for kw, message in [(dict(prompt=""), "the prompt is empty"),
                        (dict(prompt=[10 ** 9]), "prompt token 1000000000 is outside the vocabulary"),
                        (dict(prompt=["a", "b"]), "one prompt per request"),
                        (dict(prompt="x", echo=True), "echo=true is not supported"),
                        (dict(prompt="x", best_of=3), "best_of=3 is not supported")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=mid, max_tokens=4, **kw)
        assert message in e.value.body["message"], (kw, e.value.body)
    bad = openai.OpenAI(base_url=server[0], api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert "invalid or missing API key" in e.value.body["message"]
    with pytest.raises(urllib.error.HTTPError) as e:  # no key at all
        urllib.request.urlopen(server[0] + "/models", timeout=30)
    assert e.value.code == 401 and json.loads(e.value.read())["error"]["code"] == "invalid_api_key"
    # Not JSON, and not an object: 400 with an OpenAI error body.
    for raw in (b"{bad", b"[1, 2]"):
        req = urllib.request.Request(server[0] + "/chat/completions", data=raw,
                                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 400
        assert "request body" in json.loads(e.value.read())["error"]["message"]
    # After all of that the server is fine and no request failed inside it.
    assert health(server)["failed"] == 0
    assert client.completions.create(model=mid, prompt="still here", max_tokens=2, temperature=0).choices


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server[0] + path, data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_nulls_tiny_temperatures_names_and_model_routes(server, client, reference):
    """Fields sent as null are fields not set; a temperature below 1e-5 is greedy (not a
    500 from overflowing logits); a message's name is accepted; /v1/models/ID answers and
    unknown routes get OpenAI-style errors."""
    mid = model_id(client)
    prompt = "nulls and tiny temperatures"
    _, text = greedy(reference, completion_ids(reference, prompt), 12)
    code, body = _post(server, "/completions", {"model": mid, "prompt": prompt, "max_tokens": 12, "temperature": 1e-40,
                                                "n": None, "presence_penalty": None, "echo": None, "stop": None,
                                                "max_completion_tokens": None, "logprobs": None})
    assert code == 200 and body["choices"][0]["text"] == text, body
    code, body = _post(server, "/chat/completions", {"model": mid, "max_tokens": 4, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "hi", "name": "ann"}]})
    assert code == 200, body
    code, body = _post(server, "/completions", {"model": mid, "prompt": "x", "max_tokens": 4, "logprobs": 0})
    assert code == 400 and "logprobs=0 is not supported" in body["error"]["message"], body
    assert client.models.retrieve(mid).id == mid
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"
    code, body = _post(server, "/embeddings", {"model": mid, "input": "x"})
    assert code == 404 and "no route POST /v1/embeddings" in body["error"]["message"], body


def test_named_chat_templates_are_chosen_by_transformers(reference):
    """A tokenizer with several named templates (a dict) renders with its default one."""
    import copy

    from tandem.chat import PLAIN_TEMPLATE, Session

    model, tok = reference
    tok = copy.deepcopy(tok)
    tok.chat_template = {"default": PLAIN_TEMPLATE, "rag": "{{ 'rag' }}"}
    s = Session(model, tok, None, dict(max_new_tokens=2))
    assert s.render([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"


def test_two_concurrent_clients_each_get_their_own_answer(server, client, reference):
    prompts = ["first client says", "a second, longer prompt from another client"]
    want = [greedy(reference, completion_ids(reference, p), 32)[1] for p in prompts]
    # The server is shared with --max-queue 1: a request an earlier test's client gave up on
    # may still be finishing, and then one of these two would get a 503 (seen once in CI).
    def idle() -> bool:
        h = health(server)
        return h["running"] == 0 and h["waiting"] == 0

    _wait_for(idle, "the server to be idle")
    got: dict[int, str] = {}

    def ask(i):
        try:
            got[i] = "".join(c.choices[0].text for c in client.completions.create(
                model=model_id(client), prompt=prompts[i], max_tokens=32, temperature=0, stream=True))
        except Exception as e:  # noqa: BLE001 (reported by the assertion below)
            got[i] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert [got.get(0), got.get(1)] == want


def test_a_queued_job_not_yet_taken_counts_as_the_next_to_run(reference):
    """--max-queue 1 means one runs and one waits. Two requests that arrive before the
    generation thread has taken the first off the queue both get in; a third is refused.
    (The count once read the queue alone, and CI saw the second of two clients refused.)"""
    import asyncio

    from tandem.serve import APIError, Generator, Job, Params

    model, tok = reference
    release = threading.Event()

    class Held(Generator):  # its thread takes nothing off the queue until released
        def _loop(self):
            release.wait()
            super()._loop()

    gen = Held(model, tok, max_queue=1, log=lambda s: None)
    loop = asyncio.new_event_loop()
    params = Params(max_tokens=1, min_tokens=0, temperature=0.0, top_p=1.0, seed=None, stop=[], stream=False,
                    include_usage=False)

    def job(i):
        return Job(id=f"j{i}", prompt_ids=torch.tensor([1, 2, 3]), params=params, max_tokens=1, loop=loop,
                   out=asyncio.Queue())

    try:
        gen.submit(job(0))
        gen.submit(job(1))
        assert gen.state()["waiting"] == 2 and gen.state()["running"] == 0
        with pytest.raises(APIError) as e:
            gen.submit(job(2))
        assert e.value.status == 503 and "2 requests running or waiting" in str(e.value)
    finally:
        gen.shutdown()
        release.set()
        gen._thread.join(timeout=30)
        loop.close()


def test_full_queue_503_and_disconnects_free_their_slot(server, client, reference):
    """--max-queue 1: one runs, one waits, a third gets 503 at once. A client that gives up
    while waiting leaves the queue; one that disconnects mid-stream stops its generation."""
    mid = model_id(client)
    start = health(server)
    long = client.chat.completions.create(model=mid, messages=MESSAGES, max_tokens=4000, temperature=0, stream=True,
                                          extra_body={"min_tokens": 4000})
    it = iter(long)
    next(it), next(it)  # the role chunk, then generated text: it runs
    _wait_for(lambda: health(server)["running"] == 1, "the long request to run")
    # A client that waits at most 1 s: it times out in the queue, and the server drops it.
    impatient = openai.OpenAI(base_url=server[0], api_key=KEY, max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=mid, prompt="waiting", max_tokens=4)
    _wait_for(lambda: health(server)["waiting"] == 0, "the abandoned request to leave the queue", timeout=30)
    # One waits (its answer checked below), the next is refused at once.
    queued: dict[str, str] = {}
    prompt = "queued behind the long one"
    want = greedy(reference, completion_ids(reference, prompt), 8)[1]
    t = threading.Thread(target=lambda: queued.update(text=client.completions.create(
        model=mid, prompt=prompt, max_tokens=8, temperature=0).choices[0].text))
    t.start()
    _wait_for(lambda: health(server)["waiting"] == 1, "the second request to wait")
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=mid, prompt="one too many", max_tokens=4)
    assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
    assert "busy" in e.value.body["message"]
    # The long stream's client goes away: its generation stops, the waiting one runs.
    long.close()
    t.join(timeout=120)
    assert queued.get("text") == want
    h = health(server)
    assert h["cancelled"] - start["cancelled"] == 2, h   # the abandoned one and the long one
    assert h["rejected"] - start["rejected"] == 1 and h["running"] == 0 and h["waiting"] == 0, h
    log = "".join(server[1])
    cancelled = re.findall(r"cancelled: prompt \d+ tokens at \S+ tokens/s, (\d+) generated", log)
    assert cancelled and int(cancelled[-1]) < 4000, log


def test_serve_arguments_are_checked_before_loading(cli_refuses, tmp_path):
    cli_refuses("serve", ["--port", "70000"], "--port must be in [0, 65535], got 70000")
    cli_refuses("serve", ["--max-queue", "-1"], "--max-queue must be at least 0, got -1")
    cli_refuses("serve", ["--api-key", " "], "--api-key is empty")
    cli_refuses("serve", ["--adapter", "{tmp}"], "--adapter {tmp}: no adapter_config.json there")
    cli_refuses("serve", ["--chat-template", "{tmp}/none.jinja"], "--chat-template {tmp}/none.jinja: cannot read it")
    (tmp_path / "bad.jinja").write_text("line one\n{% for m in messages %}")
    cli_refuses("serve", ["--chat-template", "{tmp}/bad.jinja"], "--chat-template {tmp}/bad.jinja:2: not a Jinja")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cli_refuses("serve", ["--port", str(port)], f"--host 127.0.0.1 --port {port}: cannot listen there")


def test_batch_context_beyond_the_model_is_refused_before_loading(capsys):
    from tandem import cli

    assert cli.main(["serve", "--no-progress", "--batch", "2", "--batch-context", "100000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: --batch-context 100000: above the model's context of 4096 tokens"), err


def test_ctrl_c_ends_running_and_waiting_requests_with_an_error():
    """Ctrl-C while one request streams and one waits: both get "the server is shutting
    down" (a 503; an error event in the stream) and the server exits 0 (live_server checks)."""
    errors: dict[str, str] = {}
    with live_server() as (url, lines):
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        mid = model_id(c)
        stream = iter(c.completions.create(model=mid, prompt="long", max_tokens=4000, stream=True,
                                           extra_body={"min_tokens": 4000}))
        next(stream), next(stream)

        def drain():
            try:
                for _ in stream:
                    pass
            except openai.APIError as e:
                errors["stream"] = e.message

        def wait():
            try:
                c.completions.create(model=mid, prompt="waits", max_tokens=4)
            except openai.APIStatusError as e:
                errors["waiting"] = f"{e.status_code} {e.body['message']}"

        threads = [threading.Thread(target=drain), threading.Thread(target=wait)]
        for t in threads:
            t.start()
        _wait_for(lambda: health((url, lines))["waiting"] == 1, "the second request to wait")
    for t in threads:
        t.join(timeout=60)
    assert errors == {"stream": "the server is shutting down", "waiting": "503 the server is shutting down"}, errors


def test_chat_template_file_and_its_variables(tmp_path, reference):
    """--chat-template replaces the tokenizer's; chat_template_kwargs reach it (as Qwen3's
    enable_thinking would)."""
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% if think %}<think>{% endif %}{% endif %}")
    (tmp_path / "t.jinja").write_text(template)
    model, tok = reference
    msgs = [{"role": "user", "content": "hello"}]
    with live_server("--chat-template", str(tmp_path / "t.jinja")) as (url, lines):
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        for think in (False, True):
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, chat_template=template,
                                           think=think)
            assert text.endswith("<think>") == think
            ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
            r = c.chat.completions.create(model=model_id(c), messages=msgs, max_tokens=12, temperature=0,
                                          extra_body={"chat_template_kwargs": {"think": think}})
            assert r.usage.prompt_tokens == ids.shape[0]
            assert r.choices[0].message.content == greedy(reference, ids, 12)[1]
        assert "no chat template" not in "".join(lines)


# ---- --batch: transformers' continuous batching ---------------------------------------------

@pytest.fixture(scope="module")
def batched():
    """A server decoding up to 2 requests together, 1 more waiting."""
    with live_server("--batch", "2", "--max-queue", "1") as s:
        yield s


def test_batched_single_request_equals_generate_and_stops(batched, reference):
    url, lines = batched
    c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
    assert "continuous batching: up to 2 requests decoded together, 4096 tokens each" in "".join(lines)
    prompt = "one request alone"
    ids = completion_ids(reference, prompt)
    tokens, text = greedy(reference, ids, 24)
    r = c.completions.create(model=model_id(c), prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == text and r.usage.completion_tokens == len(tokens)
    _, text = greedy(reference, completion_ids(reference, "stop sequences"), 40)  # varied text
    stop, k = _stop_string(text)
    pieces = list(c.completions.create(model=model_id(c), prompt="stop sequences", max_tokens=40, temperature=0,
                                       stop=stop, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == text[:k] and pieces[-1].choices[0].finish_reason == "stop"
    m = c.chat.completions.create(model=model_id(c), messages=MESSAGES, max_tokens=16, temperature=0.8, top_p=0.9)
    assert m.usage.completion_tokens <= 16 and m.choices[0].finish_reason in ("stop", "length")
    for kw, message in [(dict(seed=1), "seed is not supported with --batch above 1"),
                        (dict(extra_body={"min_tokens": 4}), "min_tokens is not supported with --batch above 1"),
                        (dict(max_tokens=5000), "together more than the per-request context with --batch")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=model_id(c), prompt="x", **{"max_tokens": 4, **kw})
        assert message in e.value.body["message"], e.value.body


def test_batched_requests_run_together_queue_and_cancel(batched):
    """Two long streams both produce text before either ends (decoded together, not one
    after the other); a third waits, a fourth gets 503; closing a stream cancels it and lets
    the waiting one in."""
    url, lines = batched
    c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
    mid = model_id(c)
    start = health(batched)
    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    streams = [c.completions.create(model=mid, prompt=f"stream {i}", max_tokens=3000, temperature=0, stream=True)
               for i in range(2)]

    def read(i):
        seen = False
        try:
            for ch in streams[i]:
                if ch.choices and ch.choices[0].text and not seen:
                    seen = True
                    with lock:
                        events.append(("first", i))
                if ch.choices and ch.choices[0].finish_reason:
                    with lock:
                        events.append(("end", i))
        except Exception:  # noqa: BLE001 (closed by the test)
            pass

    readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in readers:
        t.start()
    _wait_for(lambda: len([e for e in events if e[0] == "first"]) == 2 or any(e[0] == "end" for e in events),
              "both streams to produce text", timeout=120)
    assert [e[0] for e in events[:2]] == ["first", "first"], events
    h = health(batched)
    assert h["running"] == 2 and h["waiting"] == 0, h
    queued: dict[str, object] = {}
    t3 = threading.Thread(target=lambda: queued.update(r=c.completions.create(model=mid, prompt="third",
                                                                                max_tokens=8, temperature=0)))
    t3.start()
    _wait_for(lambda: health(batched)["waiting"] == 1, "the third request to wait")
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model=mid, prompt="fourth", max_tokens=4)
    assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
    for s in streams:
        s.close()
    t3.join(timeout=120)
    assert queued["r"].usage.completion_tokens <= 8 and queued["r"].choices[0].finish_reason in ("stop", "length")
    for t in readers:
        t.join(timeout=60)
    _wait_for(lambda: health(batched)["running"] == 0, "every request to end", timeout=60)
    h = health(batched)
    assert h["cancelled"] - start["cancelled"] == 2 and h["rejected"] - start["rejected"] == 1, h
    assert h["failed"] == 0, h
