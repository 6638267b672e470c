"""Training data files read as a stream: memory bounded by the longest record allowed, not
by the file, and every problem reported as ``FILE:LINE: what is wrong``.

    for rec in iter_records("data.jsonl"):         # one record per line, checked as it is read
        ...
    texts = read_texts("notes.txt", max_record_bytes=64 * 2**20)

Formats (chosen by the file's suffix):

- ``.jsonl``: one JSON object per line, blank lines skipped, lines ending at ``\\n`` (``\\r\\n``
  too). A record is ``{"text": str}``, ``{"prompt": str, "completion": str}``,
  ``{"messages": [{"role": str, "content": str}, ...]}`` (a chat), or a conversational
  prompt / completion (``{"prompt": [messages], "completion": [messages]}``), the forms TRL's
  SFTTrainer takes; other keys are ignored. ``iter_records`` yields the record (a dict with
  exactly those keys); ``iter_texts`` the text of plain records (prompt + completion joined)
  and refuses chats, which need the model's chat template (``tandem.train``).
- ``.txt``, ``.text``, ``.md`` or no suffix: plain text, paragraphs separated by empty lines
  (``\\n``, ``\\r\\n`` or ``\\r`` line ends), each stripped of surrounding whitespace:
  ``{"text": paragraph}`` records.
- anything else is refused here, naming the file (``tandem train`` reads ``.json``,
  ``.csv``, ``.parquet`` files and ``datasets.save_to_disk`` directories through the
  ``datasets`` library).

The file is read in chunks of at most ``CHUNK_BYTES``; a record (a line of a .jsonl file, a
paragraph of a text file) longer than ``max_record_bytes`` is an error as soon as that many
of its bytes have been read, so a file that is one huge line costs ``max_record_bytes`` plus
a chunk of memory, never the whole line. The file must be UTF-8: other bytes are an error
naming the line and the byte offset in the file. Errors are ``DataError`` (a ValueError).

Only the standard library is used here (the tests run this module on its own to measure its
memory). Not named ``tandem.data``: that is the package's data folder (python/tandem/data/),
which an editable install maps as a namespace package that would shadow a data.py.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import BinaryIO, Iterator

DEFAULT_MAX_RECORD_BYTES = 16 * 2**20
CHUNK_BYTES = 2**20


class DataError(ValueError):
    """A training data file that cannot be used; the message starts with ``FILE:LINE:``
    (``FILE:`` for a problem of the whole file)."""


_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


def parse_size(text: str) -> int:
    """A byte count: ``1000``, or a number with K / M / G (1024-based; ``16M``, ``16MiB`` and
    ``16mb`` are all 16 * 2**20)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(?:i?[bB])?\s*", text)
    if not m:
        raise ValueError(f"not a byte count: {text!r} (expected e.g. 1048576, 512K, 16M or 1G)")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def format_size(n: int) -> str:
    """``16 MiB`` for a round number of KiB / MiB / GiB, else ``N bytes``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def _too_long(path: Path, line: int, what: str, limit: int, raise_with: str) -> DataError:
    return DataError(f"{path}:{line}: {what} longer than {format_size(limit)}, the limit on one record; "
                     f"raise it with {raise_with} if the data really has records this long")


def _lines(f: BinaryIO, path: Path, limit: int, raise_with: str) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, bytes without the ``\\n``) of each line of the binary file
    `f`, read in chunks; a line longer than `limit` bytes is an error as soon as the chunk
    that takes it past `limit` is read (memory: at most `limit` plus one chunk)."""
    line, start = 1, 0             # the current line's number and byte offset
    head = bytearray()             # its bytes read so far
    while True:
        chunk = f.read(CHUNK_BYTES)
        if not chunk:
            break
        parts = chunk.split(b"\n")
        # parts[0] continues the current line, parts[1:-1] are whole lines, parts[-1] begins one
        for k, part in enumerate(parts):
            last = k == len(parts) - 1
            if len(head) + len(part) > limit:
                raise _too_long(path, line, "line", limit, raise_with)
            if last:
                head += part
                break
            if head:
                head += part
                part = bytes(head)
                head.clear()
            yield line, start, part
            start += len(part) + 1
            line += 1
    if head:
        yield line, start, bytes(head)


def _decode(path: Path, line: int, offset: int, raw: bytes) -> str:
    # UTF-8 never uses the byte \n inside a character: each line decodes on its own.
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = " ".join(f"0x{b:02x}" for b in raw[e.start:e.end])
        raise DataError(f"{path}:{line}: not UTF-8 text at byte offset {offset + e.start} ({bad}: {e.reason}); "
                        "tandem reads training data as UTF-8") from None


def _messages(path: Path, line: int, key: str, value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{path}:{line}: \"{key}\" must be a non-empty list of messages "
                        f"({{\"role\": ..., \"content\": ...}}), got {type(value).__name__}")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{path}:{line}: \"{key}\"[{i}] is not a message with a string \"role\" and "
                            "\"content\"")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def record_of(path: Path, line: int, row) -> dict:
    """The training record a decoded row holds (see the module docstring), or DataError."""
    if isinstance(row, dict):
        if isinstance(row.get("text"), str):
            return {"text": row["text"]}
        if "messages" in row:
            return {"messages": _messages(path, line, "messages", row["messages"])}
        if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
            return {"prompt": row["prompt"], "completion": row["completion"]}
        if isinstance(row.get("prompt"), list) and isinstance(row.get("completion"), list):
            return {"prompt": _messages(path, line, "prompt", row["prompt"]),
                    "completion": _messages(path, line, "completion", row["completion"])}
        keys = sorted(row)
        shown = ", ".join(repr(k) if len(k) <= 40 else repr(k[:40]) + "..." for k in keys[:8])
        got = f"keys [{shown}]" + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
    else:
        got = type(row).__name__
    raise DataError(f"{path}:{line}: expected an object with a string \"text\", \"prompt\" and \"completion\", "
                    f"or \"messages\", got {got}")


def _json_record(path: Path, line: int, text: str) -> dict:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{line}: not JSON ({e.msg}, column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # e.g. an integer of 5000 digits, [[[[... nested too deep
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0]
        raise DataError(f"{path}:{line}: not usable JSON ({reason})") from None
    rec = record_of(path, line, row)
    if "\\u" in text:  # an escaped lone surrogate (\ud800) gives a str no tokenizer can encode
        for s in _strings(rec):
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:
                raise DataError(f"{path}:{line}: the text holds an unpaired surrogate escape "
                                f"(\\u{ord(s[e.start]):04x}), which is not a character") from None
    return rec


def _strings(rec: dict) -> Iterator[str]:
    for v in rec.values():
        if isinstance(v, str):
            yield v
        else:
            for m in v:
                yield m["role"]
                yield m["content"]


def _jsonl(f: BinaryIO, path: Path, limit: int, raise_with: str) -> Iterator[tuple[int, dict]]:
    for line, offset, raw in _lines(f, path, limit, raise_with):
        text = _decode(path, line, offset, raw)
        if text.strip():
            yield line, _json_record(path, line, text)


def _paragraphs(f: BinaryIO, path: Path, limit: int, raise_with: str) -> Iterator[tuple[int, dict]]:
    # What `path.read_text().split("\n\n")` with each piece stripped gave, without reading
    # the whole file: read_text turns \r\n and \r into \n, and a run of two or more \n ends a
    # paragraph (an odd one's last \n is whitespace the strip removes).
    para: list[str] = []
    first, size = 0, 0            # the paragraph's first line; its bytes up to the current line's end
    for line, offset, raw in _lines(f, path, limit, raise_with):
        text = _decode(path, line, offset, raw)
        if text.endswith("\r"):
            text = text[:-1]
        for piece in text.split("\r"):
            if piece:
                if not para:
                    first, size = line, -1
                para.append(piece)
            elif para:
                joined = "\n".join(para).strip()
                para = []
                if joined:
                    yield first, {"text": joined}
        if para:
            size += 1 + len(raw)
            if size > limit:
                raise _too_long(path, first, "paragraph", limit, raise_with)
    if para:
        joined = "\n".join(para).strip()
        if joined:
            yield first, {"text": joined}


TEXT_SUFFIXES = ("", ".txt", ".text", ".md")


def iter_records(path: str | os.PathLike, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                 raise_with: str = "max_record_bytes=N") -> Iterator[tuple[int, dict]]:
    """(line, record) of a training data file, read as a stream (see the module's docstring
    for the formats). Raises DataError naming FILE:LINE for a record that is too long, not
    UTF-8 or malformed, ``FILE: no texts`` for a file without any, and ``FILE: ...`` for a
    format this reader does not read; `raise_with` is how the error tells the user to raise
    the limit (`tandem train`: ``--max-record-bytes N``)."""
    path = Path(path)
    if max_record_bytes < 1:
        raise ValueError(f"max_record_bytes must be at least 1, got {max_record_bytes}")
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    if path.suffix.lower() == ".jsonl":
        records = _jsonl
    elif path.suffix.lower() in TEXT_SUFFIXES:
        records = _paragraphs
    else:
        raise DataError(f"{path}: not a format tandem reads as a stream (.jsonl, or plain text: "
                        f"{', '.join(s for s in TEXT_SUFFIXES if s)} or no suffix)")
    n = 0
    with open(path, "rb") as f:
        for line, rec in records(f, path, max_record_bytes, raise_with):
            n += 1
            yield line, rec
    if not n:
        raise DataError(f"{path}: no texts")


def iter_texts(path: str | os.PathLike, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
               raise_with: str = "max_record_bytes=N") -> Iterator[str]:
    """The texts of a training data file's plain records, one per record (prompt and
    completion joined); a chat record is a DataError (it needs a chat template)."""
    path = Path(path)
    for line, rec in iter_records(path, max_record_bytes, raise_with):
        if "text" in rec:
            yield rec["text"]
        elif isinstance(rec["prompt"] if "prompt" in rec else None, str):
            yield rec["prompt"] + rec["completion"]
        else:
            raise DataError(f"{path}:{line}: a chat record; its text needs the model's chat template")


def read_texts(path: str | os.PathLike, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
               raise_with: str = "max_record_bytes=N") -> list[str]:
    """All texts of a training data file (``iter_texts`` as a list)."""
    return list(iter_texts(path, max_record_bytes, raise_with))


def count_texts(path: str | os.PathLike, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                raise_with: str = "max_record_bytes=N") -> int:
    """Reads the whole file, checking every record, and keeps none of them: the number of
    records (at least 1), or the DataError the first bad record gives."""
    return sum(1 for _ in iter_records(path, max_record_bytes, raise_with))
