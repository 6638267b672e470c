"""One process of test_distributed.py's exchange tests (not a test module itself).

    MASTER_ADDR=... MASTER_PORT=... RANK=r WORLD_SIZE=w python exchange_worker.py OUT OWNERS METHOD [TOKENS...]

Runs ``tandem.distributed.ExpertExchange`` over gloo with reference experts in fp64
(f_e(x) = tanh(x (A_e + P_e)), P the "LoRA" every rank holds the same copy of), OWNERS a
comma-separated owner rank per expert, METHOD allgather / alltoall / auto. Each rank's batch
has TOKENS[r] tokens (some routed to no expert, some with an id of -1). Writes OUT.rank<r>:
this rank's inputs, outputs, the gradients of x, the routing weights and P, and the methods
the exchange ran.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

E, H, K = 6, 8, 3


def experts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(E, H, H, generator=g, dtype=torch.float64) / H ** 0.5, \
        torch.randn(E, H, H, generator=g, dtype=torch.float64) * 0.1


def batch(rank: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, H, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, K, dtype=torch.int64)
    if tokens > 1:
        ids[1, 2] = -1  # a slot routed nowhere
    w = torch.rand(tokens, K, generator=g, dtype=torch.float64)
    return x, ids, w


def local_experts(A: torch.Tensor, P: torch.Tensor, owned: set[int]):
    def run(x, ids, w):
        out = torch.zeros(x.shape, dtype=torch.float64)
        for e in sorted(owned):
            m = ids == e
            if not bool(m.any()):
                continue
            rows = m.any(1)
            we = (w * m).sum(1, keepdim=True)
            out = out + rows[:, None] * we * torch.tanh(x @ (A[e] + P[e]))
        return out
    return run


def main() -> None:
    from tandem.distributed import ExpertExchange, MachineGroup

    out, owners, method = sys.argv[1], [int(v) for v in sys.argv[2].split(",")], sys.argv[3]
    tokens = [int(v) for v in sys.argv[4:]]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mg = MachineGroup(dist.new_group(list(range(world))), list(range(world)), rank, 0, method, 4)
    A, P0 = experts()
    P = P0.clone().requires_grad_()
    ex = ExpertExchange(mg, E, owners)
    owned = {e for e in range(E) if owners[e] == rank}
    x, ids, w = batch(rank, tokens[rank])
    x.requires_grad_()
    w.requires_grad_()
    y = ex(x, ids, w, local_experts(A, P, owned) if owned else None, keep=[P])
    # a loss that weighs every output element differently
    wt = torch.linspace(0.5, 1.5, H, dtype=torch.float64)
    (y * wt).sum().backward()
    with torch.no_grad():
        y_inf = ex(x, ids, w, local_experts(A, P, owned) if owned else None, keep=[P])
    torch.save({"x": x.detach(), "ids": ids, "w": w.detach(), "y": y.detach(), "y_inf": y_inf,
                "gx": x.grad, "gw": w.grad, "gP": P.grad, "calls": ex.calls}, f"{out}.rank{rank}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
