"""Several ranks on one machine (issue 28): tandem.distributed's expert exchange over gloo
(2 and 3 processes on this machine's CPU), against one process computing the same experts on
the same tokens, forward and backward; the config's comm methods; refusals.

The exchange tests run reference experts in fp64 (exchange_worker.py): the exchange moves
rows and sums each token's per-rank partial sums, so the only differences from one process
are the order of those sums (one owner: none at all). Bound: 1e-12 relative, a few ulps of
fp64 over sums of 3 terms.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import tandem  # noqa: F401
from tandem.config import config_json

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import exchange_worker as xw  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, world: int, out: Path, *args: str, timeout: int = 120) -> dict:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1", TANDEM_TORCH_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(HERE / script), str(out), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [f"rank {r}:\n{log[-4000:]}" for r, (p, log) in enumerate(zip(procs, logs)) if p.returncode != 0]
    assert not failed, "\n".join(failed)
    return {r: torch.load(f"{out}.rank{r}") for r in range(world)}


def reference(ranks: dict) -> tuple[list[dict], torch.Tensor]:
    """Each rank's output and gradients from one process holding every expert, and the
    gradient of P summed over the ranks' losses (what DDP's sum of the ranks' P gradients is)."""
    A, P0 = xw.experts()
    P = P0.clone().requires_grad_()
    run = xw.local_experts(A, P, set(range(xw.E)))
    wt = torch.linspace(0.5, 1.5, xw.H, dtype=torch.float64)
    res = []
    for r in sorted(ranks):
        x = ranks[r]["x"].clone().requires_grad_()
        w = ranks[r]["w"].clone().requires_grad_()
        y = run(x, ranks[r]["ids"], w)
        if y.requires_grad:
            (y * wt).sum().backward()
        res.append({"y": y.detach(), "gx": x.grad, "gw": w.grad})
    return res, P.grad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


CASES = [
    # (world, owners per expert, method, tokens per rank)
    (2, "0,0,0,0,0,0", "allgather", ["5", "3"]),      # one owner holds every expert (the shared CPU store)
    (2, "0,0,0,0,0,0", "alltoall", ["5", "3"]),
    (2, "0,1,0,1,1,0", "alltoall", ["7", "1"]),       # experts split over the ranks (expert parallel)
    (2, "0,1,0,1,1,0", "allgather", ["7", "1"]),
    (3, "2,0,1,1,2,0", "alltoall", ["4", "0", "6"]),  # a rank with no tokens still takes part
    (3, "2,0,1,1,2,0", "allgather", ["4", "0", "6"]),
    (2, "1,1,1,1,1,1", "auto", ["2", "9"]),           # auto: all-to-all from 4 tokens (the worker's threshold)
]


@pytest.mark.parametrize("world,owners,method,tokens", CASES, ids=[f"{c[0]}r-{c[2]}-{c[1]}-{'_'.join(c[3])}" for c in CASES])
def test_exchange_matches_one_process(world, owners, method, tokens, tmp_path):
    ranks = run_ranks("exchange_worker.py", world, tmp_path / "x.pt", owners, method, *tokens)
    ref, gP = reference(ranks)
    worst = 0.0
    for r in range(world):
        assert ranks[r]["y"].shape == (int(tokens[r]), xw.H)
        if not int(tokens[r]):
            continue
        for k in ("y", "gx", "gw"):
            worst = max(worst, rel(ranks[r][k], ref[r][k]))
        worst = max(worst, rel(ranks[r]["y_inf"], ref[r]["y"]))
    total = sum(ranks[r]["gP"] for r in range(world))
    worst = max(worst, rel(total, gP))
    print(f"[measure] exchange {world} ranks {method} owners {owners}: worst relative difference {worst:.1e}")
    assert worst < 1e-12
    # P's gradient lands where the experts run: a rank owning none gets exactly zero
    for r in range(world):
        if str(r) not in owners.split(","):
            assert torch.count_nonzero(ranks[r]["gP"]) == 0
    calls = ranks[0]["calls"]
    if method == "auto":  # 9 tokens on the busiest rank >= 4: all-to-all, for both calls
        assert calls == {"allgather": 0, "alltoall": 2}
    else:
        assert calls[method] == 2 and sum(calls.values()) == 2


def test_owner_told_when_its_pool_gets_part_of_the_machine():
    from tandem.distributed import MachineGroup, warn_partial_pool

    owner, other = MachineGroup(None, [0, 1], 0), MachineGroup(None, [0, 1], 1)
    with pytest.warns(UserWarning, match=r"limits its pool to nodes \[0\]"):
        warn_partial_pool(owner, {"cpu": {"numa_nodes": [0]}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_partial_pool(other, {"cpu": {"numa_nodes": [1]}})
        warn_partial_pool(owner, {"cpu": {"numa_nodes": "auto"}})
        warn_partial_pool(None, {"cpu": {"numa_nodes": [0]}})


def test_config_refuses_unknown_method_when_read():
    with pytest.raises(ValueError, match="distributed.comm: 'ring' is not one of: auto, allgather, alltoall"):
        config_json({"version": 1, "distributed": {"comm": "ring"}})
    cfg = config_json({"version": 1})
    assert cfg["distributed"] == {"cpu_experts": "auto", "comm": "auto", "alltoall_from_tokens": "auto"}


def test_shared_without_torch_distributed_is_refused(monkeypatch):
    from tandem.distributed import machine_group

    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        machine_group({"distributed": {"cpu_experts": "shared"}})
    assert machine_group({"distributed": {"cpu_experts": "auto"}}) is None
    # started by a launcher, loaded before the process group: one copy per rank, said aloud
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.warns(UserWarning, match="WORLD_SIZE is 4 but torch.distributed is not initialized"):
        assert machine_group({"distributed": {"cpu_experts": "auto"}}) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert machine_group({"distributed": {"cpu_experts": "per_rank"}}) is None


# ---- a whole model, for inference ----------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from hf_models import build

    out = tmp_path_factory.mktemp("qwen3_moe-fp32")
    build("qwen3_moe", 1, torch.float32, out)
    return out


@pytest.mark.parametrize("comm,how", [("auto", "load"), ("allgather", "load"), ("alltoall", "load"),
                                      ("auto", "offload"), ("allgather", "bf16"), ("alltoall", "bf16")])
def test_shared_experts_inference_matches_a_copy_per_rank(checkpoint, comm, how, tmp_path):
    """2 ranks, rank 0 holding the experts for both (its prompt 9 tokens, rank 1's 4), against
    2 ranks with a copy each: the same logits for the prompt and for every generated step.
    Each row's expert output is the same fp32 arithmetic in both; the owner's kernels see both
    ranks' rows at once, and may block them otherwise (another order of the same fp32 sums,
    ~1e-7 relative), which moves a logit by ~1e-6 relative at most through 3 layers (bound
    1e-4; a wrong expert or a dropped weight moves them by O(1)). `how`: tandem.load_model, or
    transformers' from_pretrained + tandem.offload, or load_model in bf16 (the owner's fp32
    sums come back rounded to bf16 once, as one process rounds them)."""
    extra = [how] if how != "load" else []
    shared = run_ranks("infer_worker.py", 2, tmp_path / "s.pt", str(checkpoint), "shared", comm, *extra)
    copies = run_ranks("infer_worker.py", 2, tmp_path / "c.pt", str(checkpoint), "per_rank", comm, *extra)
    assert shared[0]["remote"] == [False] * 3 and shared[1]["remote"] == [True] * 3
    assert shared[1]["packed"] == 0 and shared[0]["packed"] == copies[1]["packed"] > 0
    worst = 0.0
    for r in range(2):
        assert torch.equal(shared[r]["gen"], copies[r]["gen"]), r
        worst = max(worst, rel(shared[r]["logits"], copies[r]["logits"]),
                    rel(shared[r]["step_logits"], copies[r]["step_logits"]))
    calls = shared[0]["calls"]
    print(f"[measure] shared vs per-rank logits ({comm}): worst relative difference {worst:.1e}; exchanges {calls}")
    assert worst < 1e-4
    # 3 MoE layers x (the forward, generate's prompt (9 tokens on the busiest rank) and its
    # 3 one-token steps after the first token)
    if comm == "auto":  # all-to-all from 6 tokens: the prompts; all-gather: the steps
        assert calls == {"allgather": 9, "alltoall": 3 + 3}
    else:
        assert calls == {comm: 15, ("alltoall" if comm == "allgather" else "allgather"): 0}
    assert copies[0]["calls"] == {}


def test_ranks_generating_different_lengths_stay_in_step(checkpoint, tmp_path):
    """Rank 0 generates 2 tokens, rank 1 5: every MoE call is a collective, so rank 0 keeps
    running forward passes until rank 1 is done (generate's synced_gpus, which tandem turns on
    for shared experts); without it rank 1 would wait forever. Each rank's tokens and logits
    are those of a copy per rank."""
    shared = run_ranks("infer_worker.py", 2, tmp_path / "s.pt", str(checkpoint), "shared", "auto", "uneven")
    copies = run_ranks("infer_worker.py", 2, tmp_path / "c.pt", str(checkpoint), "per_rank", "auto", "uneven")
    for r in range(2):
        assert shared[r]["gen"].shape[1] == shared[r]["ids"].shape[1] + 2 + 3 * r
        assert torch.equal(shared[r]["gen"], copies[r]["gen"]), r
        assert rel(shared[r]["step_logits"], copies[r]["step_logits"]) < 1e-4
    # both ranks ran the same number of exchanges: the forward, the prompts and 4 steps (3 layers each)
    assert sum(shared[0]["calls"].values()) == sum(shared[1]["calls"].values()) == 3 * (1 + 1 + 4)
