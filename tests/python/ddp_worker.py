"""One process of the data-parallel test in test_train_hf.py (not a test module itself).

    MASTER_ADDR=127.0.0.1 MASTER_PORT=... RANK=r WORLD_SIZE=w python ddp_worker.py CKPT OUT [--no-ddp]

Loads CKPT with ``tandem.load_model(..., train=True)`` (1 CPU thread), applies the same PEFT
LoRA with the same random adapters on every rank, wraps the model in
``DistributedDataParallel`` (gloo, CPU) and runs STEPS plain SGD steps (the update is linear in
the averaged gradient, so the parameters compare as the gradients do); each step's global
batch is BATCH fixed sequences, of which this rank takes its contiguous 1/w share. Each rank r writes
OUT.rank<r>: {"losses": per-step loss averaged over ranks, "initial": the trainable
parameters before training, "params": [the trainable parameters after each step],
"experts": class names of the modules holding a tandem LoRA layer, "sharded" / "trainable":
how many trainable parameters are FSDP2 shards / in all}.
--per-rank: every rank packs its own copy of the experts (distributed.cpu_experts: per_rank);
by default the machine's ranks share one copy, held by rank 0 (tandem.distributed).
--fsdp wraps the model in torch's FSDP2 (``fully_shard`` on each decoder layer and the root,
a CPU device mesh over gloo) instead of DDP: the trainable parameters are sharded over the
ranks and their gradients reduce-scattered (averaged), the same arithmetic as DDP's.
--no-ddp trains without the wrapper (no gradient averaging): a manual check that the test
can fail. --micro N (one process) takes each step's batch as N micro-batches of BATCH/N
sequences, sums their gradients and scales the sum by 1/N: with N = w, the exact
arithmetic of w DDP ranks (each rank's forward and backward see the same rows as a
micro-batch; DDP divides each gradient by w, exactly, and sums).
"""
from __future__ import annotations

import os
import sys

BATCH, SEQ, STEPS, VOCAB = 4, 16, 2, 200
LR = 0.5
CONFIG = {"version": 1, "cpu": {"threads": 1}, "gpu": {"device": "none"}}


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def random_lora(model, seed: int) -> None:
    """Every LoRA tensor N(0, 0.05^2) from a fixed generator (the same on every rank)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    sd = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in sorted(model.state_dict().items()) if "lora_" in k}
    assert sd
    model.load_state_dict(sd, strict=False)


def trainable(model) -> dict:
    """The trainable parameters, whole (an FSDP2 shard is gathered)."""
    out = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            t = p.detach()
            out[n] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def shard(model):
    """FSDP2 on CPU: each decoder layer, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    os.environ.setdefault("TANDEM_TORCH_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist
    from peft import get_peft_model
    from torch.nn.parallel import DistributedDataParallel

    import tandem

    ckpt, out = sys.argv[1], sys.argv[2]
    flags = sys.argv[3:]
    use_ddp = "--no-ddp" not in flags
    config = dict(CONFIG, distributed={"cpu_experts": "per_rank" if "--per-rank" in flags else "auto"})
    micro = int(flags[flags.index("--micro") + 1]) if "--micro" in flags else 1
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert BATCH % world == 0 and (micro == 1 or world == 1) and BATCH % micro == 0
    torch.manual_seed(0)
    model = tandem.load_model(ckpt, config, train=True, dtype=torch.float32, progress=False)
    model = get_peft_model(model, lora_config())
    random_lora(model, 11)
    model.train()
    initial = trainable(model)
    if "--fsdp" in flags:
        wrapped = model = shard(model)
    else:
        wrapped = DistributedDataParallel(model) if use_ddp else model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR)
    data = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    share = BATCH // world // micro
    losses, after = [], []
    for step in range(STEPS):
        total = torch.zeros(())
        for j in range(micro):
            ids = data[step, (rank * micro + j) * share:(rank * micro + j + 1) * share]
            loss = wrapped(input_ids=ids, labels=ids).loss
            loss.backward()
            total += loss.detach()
        if micro > 1:
            for p in params:
                p.grad.mul_(1.0 / micro)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append(total.item() / (world * micro))
        after.append(trainable(model))
    experts = [type(m).__name__ + ("" if m.lora_layer is not None else " (remote)")
               for m in model.modules() if hasattr(m, "lora_layer")]
    sharded = sum(1 for p in params if hasattr(p, "full_tensor"))  # FSDP2's DTensors
    torch.save({"losses": losses, "initial": initial, "params": after, "experts": experts, "sharded": sharded,
                "trainable": len(params)}, f"{out}.rank{rank}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
