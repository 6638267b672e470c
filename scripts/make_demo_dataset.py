"""Writes python/tandem/data/demo_sft.jsonl: the small instruction dataset `tandem train`
fine-tunes the demo model on. Generated from templates (arithmetic, word facts, spelling),
so it is original, deterministic and learnable by a tiny byte-level model in a few hundred
steps. Re-run to regenerate: .venv/bin/python scripts/make_demo_dataset.py"""
import json
import random
from pathlib import Path

rng = random.Random(20261121)
WORDS = ["tandem", "expert", "router", "kernel", "thread", "memory", "tensor", "adapter", "layer", "token",
         "socket", "buffer", "vector", "matrix", "gradient", "weight", "engine", "stream", "cache", "batch"]
COLORS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "blood": "red", "sun": "yellow",
          "sea": "blue", "night": "dark", "milk": "white", "leaf": "green"}
rows = []
for _ in range(240):
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    rows.append(f"Question: What is {a} plus {b}?\nAnswer: {a + b}.")
for _ in range(120):
    w = rng.choice(WORDS)
    rows.append(f"Question: Spell the word {w}.\nAnswer: {'-'.join(w)}.")
for _ in range(80):
    w = rng.choice(WORDS)
    rows.append(f"Question: How many letters are in {w}?\nAnswer: {len(w)}.")
for _ in range(80):
    k = rng.choice(sorted(COLORS))
    rows.append(f"Question: What color is the {k}?\nAnswer: The {k} is {COLORS[k]}.")
rng.shuffle(rows)
out = Path(__file__).resolve().parents[1] / "python" / "tandem" / "data" / "demo_sft.jsonl"
out.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
print(f"wrote {len(rows)} examples to {out}")
