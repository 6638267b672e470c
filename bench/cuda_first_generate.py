"""Why a first generation on CUDA is slow: sync latency, Python threads, decode tokens/s of
the first and later generations over the same key lengths (tandem and plain transformers,
with and without an attention mask), and where the syncing calls come from.

    python bench/cuda_first_generate.py        # the demo model on cuda:0 (needs a GPU)

2026-11-27 on an H200 it showed the first generate of a process at 17.7 tokens/s and the
later ones at 116-172: torch's cuDNN attention builds a plan per new key length
(bench/RESULTS.md). It sets TANDEM_SDPA_CUDNN=1, so tandem's timed_generate leaves torch's
SDPA backends as torch chooses them (cuDNN included): the behaviour this probe is about.
"""
import collections
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

os.environ["TANDEM_SDPA_CUDNN"] = "1"  # torch's own SDPA choice (see above)
sys.path.append(str(Path(__file__).resolve().parents[1] / "python"))
import tandem  # noqa: E402
from tandem import demo  # noqa: E402
from tandem.run import timed_generate  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

if not torch.cuda.is_available():
    sys.exit("cuda_first_generate: needs a CUDA device")


dev = "cuda:0"
x = torch.zeros(1, device=dev)
for name, fn in [("synchronize", lambda: (x.add_(1), torch.cuda.synchronize())),
                 ("item", lambda: x.add_(1).item()),
                 ("cpu()", lambda: x.add_(1).cpu())]:
    for _ in range(20): fn()
    t = time.perf_counter()
    for _ in range(200): fn()
    print(f"{name}: {(time.perf_counter() - t) / 200 * 1e6:.1f} us per call")
print("switch interval", sys.getswitchinterval())
path = str(demo.ensure_demo_model(progress=False))
tok = AutoTokenizer.from_pretrained(path)
enc = tok("The quick brown fox", return_tensors="pt").to(dev)
model = tandem.load_model(path, str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"), device=dev,
                          progress=False)
print("threads:", [(t.name, t.daemon) for t in threading.enumerate()])
hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(dev)

def run(m, mask, n=40):
    timed_generate(m, enc["input_ids"], enc["attention_mask"] if mask else None, max_new_tokens=4, do_sample=False)
    return timed_generate(m, enc["input_ids"], enc["attention_mask"] if mask else None, max_new_tokens=n,
                          do_sample=False)[1].decode_tps

for label, m in [("tandem", model), ("hf", hf)]:
    for mask in (False, True):
        print(f"{label} mask={mask}: {run(m, mask):.1f} tok/s")
sys.setswitchinterval(0.0002)
print(f"tandem mask=True switch 0.2 ms: {run(model, True):.1f} tok/s")
print(f"hf mask=False switch 0.2 ms: {run(hf, False):.1f} tok/s")
sys.setswitchinterval(0.005)
for label, m in [("tandem", model), ("hf", hf)]:
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        timed_generate(m, enc["input_ids"], enc["attention_mask"], max_new_tokens=5, do_sample=False)
    torch.cuda.set_sync_debug_mode(0)
    locs = collections.Counter()
    for r in w:
        if "synchroniz" in str(r.message):
            locs[f"{r.filename.split('site-packages/')[-1]}:{r.lineno}"] += 1
    print(f"{label}: {sum(locs.values())} syncing calls in a 5-token generate; top: {locs.most_common(8)}")
