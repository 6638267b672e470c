"""One process of test_distributed.py's inference tests (not a test module itself).

    MASTER_ADDR=... MASTER_PORT=... RANK=r WORLD_SIZE=w python infer_worker.py OUT CKPT MODE COMM [offload] [bf16] [uneven]

Loads CKPT for inference with ``distributed: {cpu_experts: MODE, comm: COMM}`` (torch's
dense layers: ``cpu.dense_format: torch``, so that only the experts' placement differs
between modes; with `offload`, transformers loads CKPT and ``tandem.offload`` moves its
experts), runs one forward of this rank's prompt (its own length) and 4 greedy tokens
with ``generate`` (`uneven`: rank r generates 2 + 3 r tokens), and writes OUT.rank<r>: the prompt, its logits, the generated ids, the
logits of each generated step, which methods the exchanges ran, the engine's packed bytes
(0 without one) and the process's resident memory after loading.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

VOCAB = 200
LENGTHS = (9, 4, 6, 5)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    import tandem

    out, ckpt, mode, comm = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    cfg = {"version": 1, "cpu": {"threads": 1, "dense_format": "torch"}, "gpu": {"device": "none"},
           "distributed": {"cpu_experts": mode, "comm": comm, "alltoall_from_tokens": 6}}
    dtype = torch.bfloat16 if "bf16" in sys.argv[5:] else torch.float32
    if "offload" in sys.argv[5:]:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()
        engine = tandem.offload(model, cfg, progress=False)
    else:
        model = tandem.load_model(ckpt, cfg, dtype=dtype, progress=False)
        engine = model.tandem_engine
    rss = rss_bytes()
    ids = torch.randint(0, VOCAB, (1, LENGTHS[rank]), generator=torch.Generator().manual_seed(40 + rank))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        new = 2 + 3 * rank if "uneven" in sys.argv[5:] else 4
        gen = model.generate(ids, max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    calls = {}
    for m in model.modules():
        ex = getattr(m, "exchange", None)
        if ex is not None:
            for k, v in ex.calls.items():
                calls[k] = calls.get(k, 0) + v
    torch.save({"ids": ids, "logits": logits, "gen": gen.sequences, "step_logits": torch.stack(gen.logits),
                "calls": calls, "packed": engine.cpu_bytes if engine is not None else 0, "rss": rss,
                "remote": [m.engine is None for m in model.modules() if type(m).__name__ == "TandemExperts"]},
               f"{out}.rank{rank}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
