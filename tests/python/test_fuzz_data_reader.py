"""Mutation fuzzing of the training-data reader (tandem.data_reader, pure Python, so no
libFuzzer target): inputs made from the hostile data corpus and the demo dataset by byte
flips, insertions, deletions, splices and repeats, each read through iter_records with a
small record limit. Every input must end within a second with records of the documented
forms or a DataError naming the file; nothing else may escape (UnicodeDecodeError,
RecursionError, KeyError, TypeError, ...).

The run is replayable: TANDEM_FUZZ_SEED picks the seed (default 0), TANDEM_FUZZ_CASES the
number of inputs (default 1500, about 10 s here). Longer runs: docs/FUZZING.md."""
from __future__ import annotations

import os
import random
import time
from pathlib import Path

from tandem.data_reader import DataError, iter_records

ROOT = Path(__file__).resolve().parents[2]
SEEDS = sorted((ROOT / "tests" / "hostile" / "data").glob("*.jsonl")) + [ROOT / "python" / "tandem" / "data" /
                                                                           "demo_sft.jsonl"]
TOKENS = [b"{", b"}", b"[", b"]", b'"', b"\\", b"\\u", b"\\ud800", b"\n", b"\r\n", b"\r", b",", b":", b"\xff",
          b"\xc3", b"\xe2\x82", b"\x00", b'"text"', b'"messages"', b'"role"', b'"content"', b'"prompt"',
          b'"completion"', b"null", b"1e999", b"9" * 40, b"[" * 50, b"\xef\xbb\xbf"]


def mutate(rng: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        op = rng.randrange(6)
        pos = rng.randint(0, len(b))
        if op == 0 and b:  # flip a byte
            b[min(pos, len(b) - 1)] = rng.randrange(256)
        elif op == 1:  # insert a token
            b[pos:pos] = rng.choice(TOKENS)
        elif op == 2 and b:  # delete a run
            del b[pos:pos + rng.randint(1, 16)]
        elif op == 3:  # splice from another seed
            other = rng.choice(pool)
            s = rng.randint(0, len(other))
            b[pos:pos] = other[s:s + rng.randint(1, 200)]
        elif op == 4 and b:  # repeat a run
            run = bytes(b[pos:pos + rng.randint(1, 64)])
            b[pos:pos] = run * rng.randint(2, 40)
        else:  # truncate
            del b[pos:]
    return bytes(b)


def check_record(rec: dict) -> None:
    assert set(rec) in ({"text"}, {"prompt", "completion"}, {"messages"}), rec
    for v in rec.values():
        if isinstance(v, str):
            v.encode("utf-8")  # a str every tokenizer can take
        else:
            assert v and all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in v), v


def test_mutated_data_files_are_read_or_refused_cleanly(tmp_path):
    seed = int(os.environ.get("TANDEM_FUZZ_SEED", "0"))
    cases = int(os.environ.get("TANDEM_FUZZ_CASES", "20000"))
    rng = random.Random(seed)
    pool = [p.read_bytes()[:4000] for p in SEEDS]
    limit = 512  # small, so record-limit errors are exercised too
    outcomes = {"records": 0, "refused": 0}
    slowest = 0.0
    for i in range(cases):
        data = mutate(rng, rng.choice(pool), pool)
        suffix = rng.choice([".jsonl", ".jsonl", ".txt", ""])
        f = tmp_path / f"case{suffix}"
        f.write_bytes(data)
        t0 = time.perf_counter()
        try:
            for _, rec in iter_records(f, max_record_bytes=limit):
                check_record(rec)
            outcomes["records"] += 1
        except DataError as e:
            assert str(e).startswith(str(f)), (seed, i, str(e))
            assert len(str(e)) < 600, (seed, i, str(e))
            outcomes["refused"] += 1
        except Exception as e:  # noqa: BLE001 (the finding: report how to replay it)
            (tmp_path / "finding").write_bytes(data)
            raise AssertionError(f"case {i} of seed {seed} ({suffix or 'no suffix'}) raised {type(e).__name__}: {e}; "
                                 f"input kept in {tmp_path / 'finding'}") from e
        slowest = max(slowest, time.perf_counter() - t0)
        assert slowest < 1.0, (seed, i, slowest)
    print(f"seed {seed}: {cases} inputs, {outcomes}, slowest {slowest * 1e3:.1f} ms")
    assert outcomes["records"] > cases // 20 and outcomes["refused"] > cases // 20, outcomes
