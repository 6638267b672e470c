"""tandem.data_reader, the streaming reader of `tandem train`'s data files: the formats read
as before it existed, and hostile files (a huge line, bytes that are not UTF-8, malformed
lines) refused with FILE:LINE, in memory bounded by the record limit, not by the file.

Fast (no model): the memory test writes a 64 MiB file and reads it in a subprocess that
loads only this module (no torch), so its peak RSS is the reader's.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tandem import data_reader
from tandem.data_reader import DataError, count_texts, format_size, iter_texts, parse_size, read_texts


def old_read_texts(path: Path) -> list[str]:
    """What train.read_texts did before the streaming reader (the whole file in memory): the
    reference the reader must match on well-formed files."""
    if path.suffix == ".jsonl":
        texts = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                texts.append(row["text"] if isinstance(row.get("text"), str) else row["prompt"] + row["completion"])
        return texts
    return [t.strip() for t in path.read_text(encoding="utf-8").split("\n\n") if t.strip()]


@pytest.mark.parametrize("chunk", [1, 5, 64, data_reader.CHUNK_BYTES])
def test_well_formed_files_read_as_before(chunk, tmp_path, monkeypatch, seed):
    # Random small files of both formats (line ends \n, \r\n and, in text files, \r; runs of
    # empty and whitespace-only lines; non-ASCII) read in chunks of every size from one byte:
    # the same texts as the old reader.
    monkeypatch.setattr(data_reader, "CHUNK_BYTES", chunk)
    rng = random.Random(seed)
    rows = ['{"text": "one two"}', '{"text": "caf\\u00e9\\nnext"}', '{"prompt": "Q: ", "completion": "A."}',
            '{"text": "é ü 😀", "other": 1}', "", "   ", '  {"text": " spaced "}  ']
    for i in range(300):
        p = tmp_path / "d.jsonl"
        lines = [rng.choice(rows) for _ in range(rng.randint(1, 8))] + ['{"text": "last"}']
        rng.shuffle(lines)
        p.write_bytes((rng.choice(["\n", "\r\n"]).join(lines) + rng.choice(["", "\n", "\r\n"])).encode())
        assert read_texts(p) == old_read_texts(p), p.read_bytes()
        t = tmp_path / "d.txt"
        t.write_bytes("".join(rng.choice(["a", "bé", " ", "\t", "\n", "\n\n", "\r", "\r\n", "x\n\n\ny"])
                              for _ in range(rng.randint(1, 40))).encode() + b"z")
        assert read_texts(t) == old_read_texts(t), t.read_bytes()
    demo = Path(data_reader.__file__).parent / "data" / "demo_sft.jsonl"
    assert read_texts(demo) == old_read_texts(demo) and count_texts(demo) == len(old_read_texts(demo)) > 100


# ---- a record longer than the limit ------------------------------------------------------

# Peak RSS in KiB: VmHWM, the peak of this process's own memory since exec. (getrusage's
# ru_maxrss would do, but Linux carries it over from the parent across fork + exec: here the
# test process, hundreds of MiB with torch loaded.)
MEMORY_PROBE = r"""
import importlib.util, sys
def peak_kib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
spec = importlib.util.spec_from_file_location("data_reader", sys.argv[1])
reader = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reader)
before = peak_kib()
try:
    print("texts", reader.count_texts(sys.argv[2], int(sys.argv[3]), "--max-record-bytes N"))
except reader.DataError as e:
    print("error", e)
print("grew_kib", peak_kib() - before)
print("peak_kib", peak_kib())
"""

FILE_MIB = 64


def write_big(path: Path, one_line: bool) -> None:
    """FILE_MIB MiB: one JSON line (a text of 64 MiB), or 1 KiB lines."""
    block = b"x" * 2**20
    line = b'{"text": "' + b"y" * 1000 + b'"}\n'
    with open(path, "wb") as f:
        if one_line:
            f.write(b'{"text": "short"}\n{"text": "')
            for _ in range(FILE_MIB):
                f.write(block)
            f.write(b'"}\n')
        else:
            f.write(line * (FILE_MIB * 2**20 // len(line)))


@pytest.mark.parametrize("one_line", [True, False], ids=["one-huge-line", "many-lines"])
def test_memory_is_bounded_by_the_record_limit_not_the_file(one_line, tmp_path):
    # A 64 MiB file read with a 1 MiB record limit in a process that has only the reader: its
    # peak RSS grows by a few MiB (a chunk, the line so far), not by the file. One huge line is
    # refused at line 2 after about a MiB; 64 MiB of short lines are read through (the check
    # `tandem train` runs before loading a model keeps no text). The old reader held the whole
    # file (and its decoded copy): growth >= 128 MiB, and no error.
    path = tmp_path / "big.jsonl"
    write_big(path, one_line)
    assert path.stat().st_size >= FILE_MIB * 2**20 * 0.99
    r = subprocess.run([sys.executable, "-c", MEMORY_PROBE, data_reader.__file__, str(path), str(2**20)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = dict(l.split(" ", 1) for l in r.stdout.splitlines())
    grew, peak = int(lines["grew_kib"]) * 1024, int(lines["peak_kib"]) * 1024
    print(f"[measure] {'one 64 MiB line' if one_line else '64 MiB of 1 KiB lines'}: peak RSS grew by "
          f"{grew / 2**20:.1f} MiB reading it, to {peak / 2**20:.1f} MiB; {r.stdout.splitlines()[0]}")
    if one_line:
        assert lines["error"] == (f"{path}:2: line longer than 1 MiB, the limit on one record; raise it with "
                                  "--max-record-bytes N if the data really has records this long")
    else:
        assert int(lines["texts"]) == FILE_MIB * 2**20 // 1013
    assert grew < 16 * 2**20 and peak < FILE_MIB * 2**20 / 2, (grew, peak)


def test_a_record_longer_than_the_limit_names_its_line_and_how_to_raise_it(tmp_path, monkeypatch):
    monkeypatch.setattr(data_reader, "CHUNK_BYTES", 16)
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "a"}\n\n{"text": "' + "b" * 100 + '"}\n')
    with pytest.raises(DataError) as e:
        read_texts(p, 100)
    assert str(e.value) == (f"{p}:3: line longer than 100 bytes, the limit on one record; raise it with "
                            "max_record_bytes=N if the data really has records this long")
    assert read_texts(p, 112) == ["a", "b" * 100]  # the line is 112 bytes without its \n
    # A text file's record is a paragraph: short lines, too many of them.
    t = tmp_path / "d.txt"
    t.write_text("first\n\n" + "line of a long paragraph\n" * 50 + "\nlast\n")
    with pytest.raises(DataError, match=rf"^{t}:3: paragraph longer than 1 KiB, the limit"):
        read_texts(t, 1024)
    assert len(read_texts(t, 2048)) == 3
    # The reader stops at the record: it does not read the rest of the file.
    it = iter_texts(p, 100)
    assert next(it) == "a"
    with pytest.raises(DataError, match=":3: line longer"):
        next(it)


# ---- bytes that are not UTF-8 ---------------------------------------------------------------

@pytest.mark.parametrize("chunk", [3, data_reader.CHUNK_BYTES])
@pytest.mark.parametrize("case", ["jsonl-invalid-start", "jsonl-truncated-at-eof", "txt-in-a-paragraph",
                                  "txt-overlong"])
def test_bytes_that_are_not_utf8_name_file_line_and_byte_offset(case, chunk, tmp_path, monkeypatch):
    # The old reader raised a bare UnicodeDecodeError ("'utf-8' codec can't decode byte 0xff in
    # position 31"): no file, no line, the position in the whole file's text.
    monkeypatch.setattr(data_reader, "CHUNK_BYTES", chunk)
    good = '{"text": "caf\u00e9"}\n'.encode()  # 2-byte é: offsets count bytes, not characters
    if case == "jsonl-invalid-start":
        data, line, bad, reason = good * 2 + b'{"text": "a\xffb"}\n' + good, 3, "0xff", "invalid start byte"
    elif case == "jsonl-truncated-at-eof":
        data, line, bad, reason = good + b'{"text": "\xe2\x82', 2, "0xe2 0x82", "unexpected end of data"
    elif case == "txt-in-a-paragraph":
        data, line, bad, reason = "one\n\ntwo é\nthree ".encode() + b"\x80 four\n", 4, "0x80", "invalid start byte"
    else:  # "/" encoded in two bytes, which UTF-8 forbids
        data, line, bad, reason = b"ok\r\nfine\r\n\xc0\xaf\r\n", 3, "0xc0", "invalid start byte"
    offset = data.index(bytes.fromhex(bad.replace("0x", "").replace(" ", "")))
    p = tmp_path / ("d.jsonl" if case.startswith("jsonl") else "d.txt")
    p.write_bytes(data)
    with pytest.raises(DataError) as e:
        read_texts(p)
    assert str(e.value) == (f"{p}:{line}: not UTF-8 text at byte offset {offset} ({bad}: {reason}); "
                            "tandem reads training data as UTF-8")
    assert isinstance(e.value, ValueError) and not isinstance(e.value, UnicodeError)


# ---- malformed lines ---------------------------------------------------------------------

@pytest.mark.parametrize("line, message", [
    ('{"text": "unterminated}', "not JSON (Unterminated string starting at, column 10)"),
    ('{"text": "a"} {"text": "b"}', "not JSON (Extra data, column 15)"),
    ('{"txt": "typo"}', 'expected an object with a string "text", "prompt" and "completion", or "messages", got '
                        'keys [\'txt\']'),
    ('{"prompt": "only the prompt"}', "got keys ['prompt']"),
    ('{"text": 5}', "got keys ['text']"),
    ('["text", "a list"]', "got list"),
    ('"a string"', "got str"),
    ("{" + ", ".join(f'"k{i}": 0' for i in range(20)) + "}", "got keys ['k0', 'k1', 'k10', 'k11', 'k12', 'k13', "
                                                             "'k14', 'k15'] and 12 more"),
    ("[" * 100000 + "]" * 100000, "not usable JSON (nested too deeply)"),
    ('{"text": ' + "9" * 5000 + "}", "not usable JSON (Exceeds the limit (4300 digits) for integer string"),
    ('{"text": "half a pair \\ud83d"}', "an unpaired surrogate escape (\\ud83d), which is not a character"),
    ("\ufeff" + '{"text": "after a BOM"}', "not JSON (Unexpected UTF-8 BOM (decode using utf-8-sig), column 1)"),
    ('{"messages": []}', '"messages" must be a non-empty list of messages'),
    ('{"messages": "hi"}', '"messages" must be a non-empty list of messages ({"role": ..., "content": ...}), got str'),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]}',
     '"messages"[1] is not a message with a string "role" and "content"'),
    ('{"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "assistant", "content": 5}]}',
     '"completion"[0] is not a message'),
    ('{"messages": [{"role": "user", "content": "half \\udc00"}]}', "an unpaired surrogate escape (\\udc00)"),
    ('{"' + "k" * 5000 + '": 1}', "got keys ['" + "k" * 40 + "'...]"),  # found by test_fuzz_data_reader
], ids=["json", "extra-data", "missing-text", "missing-completion", "text-not-string", "list", "string",
        "many-keys", "deep-nesting", "huge-integer", "lone-surrogate", "bom", "messages-empty", "messages-str",
        "message-no-content", "conversational-completion", "messages-surrogate", "huge-key"])
def test_a_malformed_line_is_an_error_naming_file_and_line(line, message, tmp_path):
    # Before: deep nesting was a RecursionError, a huge integer a ValueError without the file,
    # and a lone surrogate a TypeError from the tokenizer after the model had loaded.
    p = tmp_path / "d.jsonl"
    p.write_text(line + "\n" if "BOM" in message else '{"text": "fine"}\n\n' + line + "\n", encoding="utf-8")
    n = 1 if "BOM" in message else 3
    with pytest.raises(DataError) as e:
        count_texts(p)
    assert str(e.value).startswith(f"{p}:{n}: ") and message in str(e.value), str(e.value)
    assert len(str(e.value)) < 400


def test_files_without_texts(tmp_path):
    with pytest.raises(DataError, match=rf"^{tmp_path / 'none.jsonl'}: no such data file$"):
        read_texts(tmp_path / "none.jsonl")
    with pytest.raises(DataError, match=r": no such data file$"):
        read_texts(tmp_path)  # a directory
    for name, text in (("e.jsonl", "\n  \n\r\n"), ("e.txt", "\n\n \n"), ("empty.txt", "")):
        (tmp_path / name).write_text(text)
        with pytest.raises(DataError, match=rf"^{tmp_path / name}: no texts$"):
            read_texts(tmp_path / name)


def test_sizes():
    assert [parse_size(s) for s in ("1000", "512K", "16M", "16MiB", "16mb", " 1G ", "2GiB")] == \
        [1000, 512 * 2**10, 16 * 2**20, 16 * 2**20, 16 * 2**20, 2**30, 2 * 2**30]
    for bad in ("", "-1", "1.5M", "16T", "M", "16 MiBs"):
        with pytest.raises(ValueError, match="not a byte count"):
            parse_size(bad)
    assert [format_size(n) for n in (16 * 2**20, 2**30, 1536, 1000, 3 * 2**10)] == \
        ["16 MiB", "1 GiB", "1536 bytes", "1000 bytes", "3 KiB"]


def test_records_of_every_form_and_formats_refused(tmp_path):
    from tandem.data_reader import iter_records

    p = tmp_path / "d.jsonl"
    chat = [{"role": "user", "content": "hi", "name": "ignored"}, {"role": "assistant", "content": "hello"}]
    rows = [{"text": "t", "meta": 1}, {"prompt": "p", "completion": "c"}, {"messages": chat},
            {"prompt": chat[:1], "completion": chat[1:]}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert list(iter_records(p)) == [(1, {"text": "t"}), (2, {"prompt": "p", "completion": "c"}),
                                     (3, {"messages": plain}), (4, {"prompt": plain[:1], "completion": plain[1:]})]
    with pytest.raises(DataError, match=r"d.jsonl:3: a chat record; its text needs the model's chat template"):
        read_texts(p)
    for name in ("d.json", "d.csv", "d.parquet"):
        (tmp_path / name).write_text("[]")
        with pytest.raises(DataError, match=rf"{name}: not a format tandem reads as a stream \(.jsonl, or plain "
                                            r"text: .txt, .text, .md or no suffix\)"):
            count_texts(tmp_path / name)
    (tmp_path / "notes.md").write_text("one\n\ntwo\n")
    assert read_texts(tmp_path / "notes.md") == ["one", "two"]
