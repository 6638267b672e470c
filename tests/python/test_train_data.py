"""Training data in the forms the ecosystem uses (tandem.train.iter_data / tokenize_record):
text, prompt / completion, chats rendered with the model's chat template, conversational
prompt / completion; .jsonl, plain text, and .json / .csv / .parquet / save_to_disk through
datasets. The loss covers completions and assistant turns only unless --loss-on-all."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tandem import demo
from tandem.data_reader import DataError
from tandem.train import PackedDataset, count_data, iter_data, tokenize_record

# Every turn rendered as <|role|>content<|end|>; the generation prompt is <|assistant|>.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# Renders a closing marker only when no generation prompt is asked for: the text up to a turn
# is then not a prefix of the whole chat.
NOT_INCREMENTAL = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                   "{% if add_generation_prompt %}<|assistant|>{% else %}<|eot|>{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 plus 2?"},
        {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3 plus 3?"},
        {"role": "assistant", "content": "6."}]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(demo.ensure_demo_model(progress=False))
    t.chat_template = TEMPLATE
    return t


def learned_text(tok, ids, labels) -> str:
    return tok.decode([i for i, l in zip(ids, labels) if l != -100])


def test_the_loss_covers_assistant_turns_and_completions_only(tok):
    ids, labels = tokenize_record({"messages": CHAT}, tok)
    assert tok.decode(ids) == "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in CHAT)
    assert learned_text(tok, ids, labels) == "4.<|end|>6.<|end|>"  # the assistant turns and their end markers
    assert all(l in (-100, i) for i, l in zip(ids, labels))

    conv = {"prompt": CHAT[:2], "completion": CHAT[2:3]}
    ids, labels = tokenize_record(conv, tok)
    assert learned_text(tok, ids, labels) == "4.<|end|>"
    assert tok.decode(ids).startswith("<|system|>Be brief.<|end|><|user|>What is 2 plus 2?<|end|><|assistant|>")

    ids, labels = tokenize_record({"prompt": "Q: 2+2? A:", "completion": " 4"}, tok)
    assert learned_text(tok, ids, labels) == " 4" + tok.decode([tok.eos_token_id])
    assert ids[-1] == tok.eos_token_id
    ids, labels = tokenize_record({"text": "plain"}, tok)
    assert labels == ids
    for rec in ({"messages": CHAT}, {"prompt": "p", "completion": "c"}):
        ids, labels = tokenize_record(rec, tok, loss_on_all=True)
        assert labels == ids


def test_packed_labels_and_the_models_loss_follow_them(tok, tmp_path):
    """Blocks keep ids and labels aligned; a block without a learned token is dropped; the
    model's loss on a batch is the mean cross-entropy over exactly the learned positions."""
    import tandem

    recs = [{"messages": CHAT}] * 6 + [{"prompt": "x" * 80, "completion": "y"}]
    ds = PackedDataset(recs, tok, 16, seed=3)
    flat_ids = torch.cat([torch.tensor(tokenize_record(r, tok)[0]) for r in recs])
    assert ds.tokens == flat_ids.numel()
    assert ds.dropped >= 3, "blocks inside the 80-byte prompt have nothing to learn"
    assert bool(((ds.block_labels == -100) | (ds.block_labels == ds.blocks)).all())
    # Every block has a label the loss scores (position 0 is only ever an input: a block whose
    # one label sat there gave a NaN loss), and `learned` counts those scored labels.
    assert bool((ds.block_labels[:, 1:] != -100).any(1).all())
    assert ds.learned == int((ds.block_labels[:, 1:] != -100).sum())
    model = tandem.load_model(demo.ensure_demo_model(progress=False), "configs/demo.yaml", train=True,
                              dtype=torch.float32, progress=False)
    ids, labels = ds.batch(0, 4), ds.labels(0, 4)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
        loss = model(input_ids=ids, labels=labels).loss
    target = labels[:, 1:]
    mask = target != -100
    ce = torch.nn.functional.cross_entropy(logits[:, :-1][mask], target[mask])
    assert torch.allclose(loss, ce, rtol=1e-5), (loss, ce)


def test_chat_records_need_a_template_that_renders_turn_by_turn(tok):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(demo.ensure_demo_model(progress=False))
    with pytest.raises(DataError, match=r"f.jsonl:7: a chat record, but this model's tokenizer has no chat template"):
        tokenize_record({"messages": CHAT}, plain, "f.jsonl:7")
    bad = AutoTokenizer.from_pretrained(demo.ensure_demo_model(progress=False))
    bad.chat_template = NOT_INCREMENTAL
    with pytest.raises(DataError, match=r"f.jsonl:2: the model's chat template does not render this chat turn by "
                                        r"turn .* use --loss-on-all"):
        tokenize_record({"messages": CHAT}, bad, "f.jsonl:2")
    tokenize_record({"messages": CHAT}, bad, "f.jsonl:2", loss_on_all=True)  # the whole chat, no split needed


ROWS = [{"text": "one"}, {"prompt": "p", "completion": "c"}]


def test_datasets_formats_are_read_and_checked(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"messages": CHAT}] * 3)
    ds.to_parquet(str(tmp_path / "chat.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dict"))
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    (tmp_path / "rows.csv").write_text("prompt,completion\nhello,world\n")
    plain = [{"role": m["role"], "content": m["content"]} for m in CHAT]
    for name in ("chat.parquet", "saved", "dict"):
        got = list(iter_data(tmp_path / name))
        assert [r for _, r in got] == [{"messages": plain}] * 3, name
        assert got[1][0] == f"{tmp_path / name} row 2"
    assert [r for _, r in iter_data(tmp_path / "rows.json")] == ROWS
    assert [r for _, r in iter_data(tmp_path / "rows.csv")] == [{"prompt": "hello", "completion": "world"}]
    assert count_data(tmp_path / "chat.parquet") == {"chat": 3}

    datasets.Dataset.from_list([{"text": "fine"}, {"txt": "typo"}]).to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(DataError, match=r"bad.parquet:row 2: expected an object with a string \"text\""):
        count_data(tmp_path / "bad.parquet")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(DataError, match=r"broken.json: datasets cannot read it"):
        count_data(tmp_path / "broken.json")
    (tmp_path / "somedir").mkdir()
    with pytest.raises(DataError, match=r"somedir: a directory, but not one datasets.save_to_disk wrote"):
        count_data(tmp_path / "somedir")
    (tmp_path / "x.xlsx").write_text("")
    with pytest.raises(DataError, match=r"x.xlsx: not a training data format tandem reads"):
        count_data(tmp_path / "x.xlsx")


def test_tandem_train_on_a_chat_dataset(tmp_path):
    """The command on chat data: the banner counts the forms and the learned tokens, which
    are the assistant turns' (what PackedDataset over the same records learns)."""
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(demo.ensure_demo_model(progress=False), model)
    t = AutoTokenizer.from_pretrained(model)
    t.chat_template = TEMPLATE
    t.save_pretrained(model)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(40)))
    r = subprocess.run([sys.executable, "-m", "tandem", "train", "--model", str(model), "--config",
                        "configs/demo.yaml", "--data", str(data), "--steps", "2", "--batch", "2", "--seq", "32",
                        "--out", str(tmp_path / "run"), "--no-progress"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    ds = PackedDataset(iter_data(data), AutoTokenizer.from_pretrained(model), 32, 0)
    assert ds.dropped > 0  # blocks of system / user text only
    want = (f"data: {data} (chat 40): {len(ds)} sequences of 32 tokens ({ds.dropped} without a token to learn "
            f"dropped); loss on {ds.learned} of {len(ds) * 32} tokens (completions and assistant turns")
    assert want in r.stdout, r.stdout
    assert ds.learned < len(ds) * 32 / 2  # user and system turns are most of the text


@pytest.mark.parametrize("backward_format", ["bf16", "int8"])
def test_memory_estimates_match_what_training_allocates(backward_format, tmp_path):
    """The banner's backward-pack estimate is the pools' own pack size (moe_layer_cpu_bytes
    of the transposed shape), and its saved-state estimate per token is what a LoRA forward
    keeps (LoraContext.bytes): both against the real numbers after one step, within the
    token-group bookkeeping the estimate leaves out."""
    import argparse

    from peft import get_peft_model

    import tandem
    from tandem import lora
    from tandem.cli_checks import Selection
    from tandem.train import context_bytes_per_token, memory_report, peft_config

    path = demo.ensure_demo_model(progress=False)
    cfg = {"version": 1, "cpu": {"threads": 2}, "gpu": {"device": "none"}, "train": {"backward_format": backward_format}}
    model = tandem.load_model(path, cfg, train=True, dtype=torch.float32, progress=False)
    assert model.tandem_engine.backward_format == backward_format  # from the config's train section
    model = get_peft_model(model, peft_config(model, 8, 16.0))
    saved = []
    real_apply = lora.ExpertsFunction.apply

    def spy(*a):
        out = real_apply(*a)
        saved.append(out.grad_fn.saved_tensors[0].tandem_context.bytes if out.grad_fn is not None else 0)
        return out
    lora.ExpertsFunction.apply = spy
    try:
        ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        lora.ExpertsFunction.apply = real_apply
    e = model.tandem_engine
    args = argparse.Namespace(rank=8, batch=2, seq=32)
    text = memory_report(model, Selection(model=str(path), model_source="--model", config=cfg, cfg=cfg), args)
    assert f"({backward_format}, built at the first backward)" in text
    est = float(text.split("backward packs ~")[1].split(" GiB")[0]) * 2**30
    assert e.backward_bytes > 0 and abs(est - e.backward_bytes) <= 0.01 * 2**30 + 0.05 * e.backward_bytes
    hf = model.get_base_model().config
    per_token = context_bytes_per_token(e.hidden, e.inter, hf.num_experts_per_tok, 8)
    assert len(saved) == len(e.layers) and all(s > 0 for s in saved)
    for s in saved:  # per layer, 64 tokens: the rows' state plus the groups' index arrays
        assert per_token * 64 <= s <= per_token * 64 * 1.1, (s, per_token * 64)


def test_pieces_are_encoded_as_one_text(tok):
    """Prompt and completion (and chat turns) are encoded as one string, as inference sees
    them, with each token labelled by where its first character lies: encoding the pieces one
    by one would put a word-start marker at every boundary in SentencePiece-style tokenizers."""
    from tandem.train import _encode_pieces

    pieces = [("Question: what is two plus two", False), ("? It is four.", True), (" And more", False)]
    text = "".join(t for t, _ in pieces)
    ids, labels = _encode_pieces(tok, pieces, False)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    start, end = len(pieces[0][0]), len(pieces[0][0]) + len(pieces[1][0])
    want = [i if start <= s < end else -100 for i, (s, _) in zip(enc["input_ids"], enc["offset_mapping"])]
    assert labels == want and any(l != -100 for l in labels)


def test_a_jsonl_suffix_in_capitals_is_read(tmp_path):
    p = tmp_path / "data.JSONL"
    p.write_text('{"text": "one"}\n')
    assert [r for _, r in iter_data(p)] == [{"text": "one"}]
