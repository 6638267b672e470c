"""Several ranks (torch.distributed) on one machine, one copy of the CPU experts.

Without this, every rank of a data-parallel job packs its own copy of the routed experts and
runs its own pool on the same cores (N copies of a 235B model's experts, N pools fighting
for the cores). With ``distributed.cpu_experts: shared`` (or ``auto`` when a machine runs
several ranks), the machine's first rank is the experts' **owner**: it alone packs them and
runs the pool; every rank of the machine sends the tokens its router sent to CPU experts
to the owner and gets their weighted sums back (KTransformers' pattern). The transport is
torch.distributed (gloo on CPU, NCCL on GPUs), in a process group of the machine's ranks of
its own, so that its collectives never interleave with DDP's or FSDP's.

The exchange (``ExpertExchange``) is written for any map from experts to owning ranks, so
that experts held on several GPUs (expert parallel) can use it; today's owner map puts
every expert on the machine's owner. Its steps are the MoE runners' of vLLM:

- prepare: which rank each (token, expert) pair goes to; one small all-gather of the
  per-rank token and row counts, so every rank knows every count (and picks the same method);
- dispatch: either **allgather** (every rank gets every token; cheap for a few tokens: two
  collectives) or **alltoall** (each token goes only to the ranks that own one of its
  experts, once per rank, with the routing weights of that rank's experts);
- run: the owner runs its experts on what it received (the weighted sum per row);
- combine: reduce-scatter (allgather) or the reverse all-to-all (alltoall);
- finalize: the rows summed into each token's output (the shared experts' sum stays in the
  model's code, outside the experts module, as for one process).

Training: every collective is torch's differentiable one
(``torch.distributed._functional_collectives``), so backward runs the reverse exchange; the
owner's LoRA tensors receive the gradient of every rank's tokens, the other ranks' LoRA
tensors a zero gradient (they stay in the graph, so DDP's reducer sees them used), and DDP's
average of the two is the gradient of one process on the combined batch. A rank with no work
in a call still takes part in every collective of it, forward and backward: the output is
made to depend on what it received (times zero), so its backward runs the same collectives
as the others'.
"""
from __future__ import annotations

import functools
import os
import socket
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

METHODS = ("allgather", "alltoall")

Local = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _machine_id() -> str:
    """Ranks with the same id share a machine (its memory and cores): the host name and the
    kernel's boot id (containers on one host may share a name; two boots never an id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass
class MachineGroup:
    """This machine's ranks: ``group`` (a process group of them alone), ``ranks`` (their
    global ranks, ascending), ``rank`` (this process's index in ``ranks``), ``owner`` (the
    index of the rank that holds the CPU experts), and the config's comm method."""
    group: Any
    ranks: list[int]
    rank: int
    owner: int = 0
    comm: str = "auto"
    alltoall_from_tokens: int | str = "auto"

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_owner(self) -> bool:
        return self.rank == self.owner

    def describe(self) -> str:
        return (f"rank {self.ranks[self.rank]} of {self.size} on this machine; CPU experts held by rank "
                f"{self.ranks[self.owner]}; comm {self.comm}")


def machine_group(cfg_json: dict) -> MachineGroup | None:
    """The machine's ranks when its CPU experts are shared (config ``distributed``), else None.

    ``cpu_experts: per_rank`` -> None. ``auto`` -> shared when torch.distributed is initialized
    and this machine runs more than one rank. ``shared`` -> the same, and an error when
    torch.distributed is not initialized (the config asks for something that cannot be).
    Every rank of the job must call this at the same point (it runs collectives)."""
    d = cfg_json.get("distributed", {})
    mode = d.get("cpu_experts", "auto")
    if mode == "per_rank":
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if mode == "shared":
            raise ValueError("distributed.cpu_experts is 'shared' but torch.distributed is not initialized: call "
                             "torch.distributed.init_process_group (or start under torchrun / accelerate launch) "
                             "before tandem.load_model, or set distributed.cpu_experts to per_rank")
        world = os.environ.get("WORLD_SIZE", "1")
        if world.isdigit() and int(world) > 1:  # a launcher started ranks, but no process group yet
            warnings.warn(f"WORLD_SIZE is {world} but torch.distributed is not initialized yet, so this rank packs a "
                          "copy of the experts of its own: initialize it before loading (torch.distributed."
                          "init_process_group, or touch TrainingArguments(...).device / Accelerator() first) to share "
                          "one copy per machine, or set distributed.cpu_experts: per_rank to keep a copy per rank",
                          stacklevel=3)
        return None
    world = dist.get_world_size()
    if world == 1:
        return None
    ids: list[str | None] = [None] * world
    dist.all_gather_object(ids, _machine_id())
    machines: dict[str, list[int]] = {}
    for r, m in enumerate(ids):
        machines.setdefault(m, []).append(r)
    me = dist.get_rank()
    mine = None
    # NCCL moves GPU tensors only: CPU tensors (a model on the CPU) take gloo in the same group.
    backend = "cpu:gloo,cuda:nccl" if "nccl" in str(dist.get_backend()) else None
    for ranks in machines.values():  # every rank creates every group, in the same order
        g = dist.new_group(ranks, backend=backend)
        if me in ranks:
            mine = MachineGroup(g, ranks, ranks.index(me), 0, d.get("comm", "auto"),
                                d.get("alltoall_from_tokens", "auto"))
    assert mine is not None
    return mine if mine.size > 1 else None


def warn_partial_pool(mg: MachineGroup | None, cfg_json: dict) -> None:
    """With shared experts the owner's pool serves the whole machine: a config that gives it a
    subset of the NUMA nodes (as a copy per rank needed: ``cpu.numa_nodes: [local rank]``)
    leaves the other nodes' cores idle. Said once, on the owner."""
    nodes = cfg_json.get("cpu", {}).get("numa_nodes", "auto")
    if mg is None or not mg.is_owner or nodes == "auto":
        return
    warnings.warn(f"distributed: this rank holds the CPU experts for all {mg.size} ranks of the machine, but "
                  f"cpu.numa_nodes limits its pool to nodes {nodes}; remove cpu.numa_nodes (all nodes) unless that is "
                  "intended, or set distributed.cpu_experts: per_rank for a copy per rank on its own node",
                  stacklevel=3)


def sync_generation(model) -> None:
    """Every rank of a machine must run each MoE layer the same number of times (each call is
    a collective): transformers' ``generate`` on a rank that finishes first would stop calling
    while the others wait for it. ``model.generate`` gets ``synced_gpus=True`` by default
    (transformers' own mechanism for ZeRO-3 / FSDP: a finished rank keeps running forward
    passes until every rank is done); passing ``synced_gpus=False`` is the caller's promise
    that all ranks generate in step."""
    gen = model.generate

    @functools.wraps(gen)
    def generate(*args, **kwargs):
        kwargs.setdefault("synced_gpus", True)
        return gen(*args, **kwargs)

    model.generate = generate


def _pad_rows(t: torch.Tensor, rows: int, value: float = 0) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = t.new_full((rows - t.shape[0],) + tuple(t.shape[1:]), value)
    return torch.cat([t, pad])


class ExpertExchange:
    """Runs one layer's routed experts across the machine's ranks (see the module docstring).

    ``owners``: [experts] -> index of the owning rank in ``mg.ranks`` (default: all on the
    owner). Call it as ``exchange(x [T, H], ids [T, K], weights [T, K], local, keep)``: ``local``
    runs this rank's experts (rows whose ids it does not own are -1) and returns the weighted
    sum per row in fp32 or wider, or is None on a rank that owns none; ``keep``: tensors (this rank's LoRA
    tensors) that must stay in the autograd graph with a zero gradient where ``local`` does not
    use them. Returns [T, H] in x's dtype."""

    def __init__(self, mg: MachineGroup, experts: int, owners: Sequence[int] | torch.Tensor | None = None):
        self.mg = mg
        if owners is None:
            owners = [mg.owner] * experts
        self.owners = torch.as_tensor(owners, dtype=torch.int64)
        if self.owners.shape != (experts,) or int(self.owners.min()) < 0 or int(self.owners.max()) >= mg.size:
            raise ValueError(f"expert owners {self.owners.tolist()}: need one rank in [0, {mg.size}) per expert "
                             f"({experts})")
        self.calls = {m: 0 for m in METHODS}  # how often each method ran (auto's choices)
        import torch.distributed as dist

        self._nccl = "nccl" in str(dist.get_backend(mg.group))  # fixed per group: read once

    def method_for(self, busiest: int) -> str:
        """The method for a call whose busiest rank has `busiest` tokens (the same on every rank)."""
        c = self.mg.comm
        if c != "auto":
            return c
        return "alltoall" if busiest >= self.alltoall_from() else "allgather"

    def alltoall_from(self) -> int:
        n = self.mg.alltoall_from_tokens
        if n != "auto":
            return int(n)
        # Measured over gloo (bench/RESULTS.md): all-to-all at every size (1..256 tokens, 1.0-2.8x
        # faster; gloo's reduce-scatter is slow). NCCL: vLLM's rule, all-gather for small batches
        # (not measured here).
        return 64 if self._nccl else 1

    def _comm_device(self, dev: torch.device) -> torch.device:
        return dev if self._nccl or dev.type == "cpu" else torch.device("cpu")

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, local: Local | None,
                 keep: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        import torch.distributed as dist

        mg, N, me = self.mg, self.mg.size, self.mg.rank
        T, H = x.shape
        K = ids.shape[1]
        out_dtype, home = x.dtype, x.device
        dev = self._comm_device(home)
        x, ids, w = x.to(dev), ids.to(dev, torch.int64), w.to(dev)
        grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or any(t.requires_grad for t in keep))
        owners = self.owners.to(dev)
        dest = torch.where(ids >= 0, owners[ids.clamp(min=0)], -1)                       # [T, K]
        goes = torch.stack([(dest == d).any(1) for d in range(N)])                         # [N, T]
        fan = goes.sum(0)                                                                  # ranks per token
        # prepare: every rank's token count, rows per destination and whether each of its
        # tokens goes to one rank at most, on every rank
        head = torch.cat([torch.tensor([T], device=dev), goes.sum(1), (fan <= 1).all().reshape(1)]).to(torch.int64)
        table = torch.empty(N * (N + 2), dtype=torch.int64, device=dev)
        dist.all_gather_into_tensor(table, head, group=mg.group)
        table = table.view(N, N + 2).cpu()
        method = self.method_for(int(table[:, 0].max()))
        self.calls[method] += 1
        # Weights and sums in fp32 at least (fp64 stays fp64). Results travel back in x's
        # dtype when no token anywhere has two ranks' partial sums to add (the owner's rounding
        # is then the only one, as in one process), else in that precision.
        acc = torch.promote_types(torch.promote_types(x.dtype, w.dtype), torch.float32)
        ret = x.dtype if not grad and bool(table[:, N + 1].all()) else acc
        if method == "allgather":
            Tm = int(table[:, 0].max())
            packed = self._pack(_pad_rows(x, Tm), _pad_rows(w, Tm), _pad_rows(ids, Tm, -1), grad, acc)
            xg, wg, ig = self._unpack(self._all_gather(packed, grad), H, K, x.dtype, grad, acc)
            mine = (ig >= 0) & (owners[ig.clamp(min=0)] == me)
            y = self._run(xg, torch.where(mine, ig, -1), torch.where(mine, wg, 0), local, keep, acc)
            out = self._reduce_scatter(y.to(ret), grad)[:T]
        else:
            send = [int(v) for v in table[me, 1:N + 1]]        # rows this rank sends to each rank
            recv = [int(v) for v in table[:, 1 + me]]        # rows each rank sends here
            # each token once per rank it goes to, with that rank's experts' ids and weights
            whole = sum(send) == T and bool((fan == 1).all())  # every token to one rank: no copies
            if whole:
                order = torch.argsort(dest.max(1).values, stable=True)
                rows = None if bool(torch.equal(order, torch.arange(T, device=dev))) else order
            else:
                rows = torch.cat([goes[d].nonzero().flatten() for d in range(N)])
            to = torch.repeat_interleave(torch.arange(N, device=dev), torch.tensor(send, device=dev))
            xs, ws, is_ = (x, w, ids) if rows is None else (x[rows], w[rows], ids[rows])
            mask = (is_ >= 0) & ((dest if rows is None else dest[rows]) == to[:, None])
            packed = self._pack(xs, torch.where(mask, ws, 0), torch.where(mask, is_, -1), grad, acc)
            xr, wr, ir = self._unpack(self._a2a(packed, recv, send, grad), H, K, x.dtype, grad, acc)
            y = self._run(xr, ir, wr, local, keep, acc)
            back = self._a2a(y.to(ret), send, recv, grad)
            if rows is None:
                out = back
            elif whole:
                out = torch.empty_like(back).index_copy(0, rows, back)
            else:
                out = torch.zeros((T, H), dtype=ret, device=dev).index_add(0, rows, back)
        return out.to(home, out_dtype)

    # ---- pieces ------------------------------------------------------------------------

    def _run(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, local: Local | None,
             keep: Sequence[torch.Tensor], acc: torch.dtype) -> torch.Tensor:
        """This rank's part: the weighted sum of its experts per row (fp32), or zeros that
        depend on what it received (and on `keep`), so its backward runs the same collectives."""
        if local is not None and bool((ids >= 0).any()):
            return local(x, ids, w)
        y = x.to(acc) * 0 + (w.sum(1, keepdim=True) * 0)
        for t in keep:
            if t.requires_grad:
                y = y + t.sum() * 0
        return y

    @staticmethod
    def _pack(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, grad: bool, acc: torch.dtype) -> torch.Tensor:
        """Rows of x, w and ids as one tensor, so that each step is one collective: in `acc`
        when gradients flow (ids < 2^24 are exact there), else their bytes side by side."""
        if grad:
            return torch.cat([x.to(acc), w.to(acc), ids.to(acc)], 1)
        parts = (x.contiguous(), w.to(acc).contiguous(), ids.to(torch.int32).contiguous())
        return torch.cat([p.view(torch.uint8) for p in parts], 1)

    @staticmethod
    def _unpack(t: torch.Tensor, H: int, K: int, x_dtype: torch.dtype, grad: bool,
                acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if grad:
            return t[:, :H].to(x_dtype), t[:, H:H + K], t[:, H + K:].round().to(torch.int64)
        if t.shape[0] == 0:
            return (t.new_empty((0, H), dtype=x_dtype), t.new_empty((0, K), dtype=acc),
                    t.new_empty((0, K), dtype=torch.int64))
        xb, wb = H * x_dtype.itemsize, K * acc.itemsize
        x = t[:, :xb].contiguous().view(x_dtype)
        w = t[:, xb:xb + wb].contiguous().view(acc)
        return x, w, t[:, xb + wb:].contiguous().view(torch.int32).to(torch.int64)

    def _all_gather(self, t: torch.Tensor, grad: bool) -> torch.Tensor:
        import torch.distributed as dist

        g, N = self.mg.group, self.mg.size
        if grad:
            import torch.distributed._functional_collectives as fc

            return fc.wait_tensor(fc.all_gather_tensor_autograd(t.contiguous(), 0, g))
        out = t.new_empty((N * t.shape[0],) + tuple(t.shape[1:]))
        dist.all_gather_into_tensor(out, t.contiguous(), group=g)
        return out

    def _reduce_scatter(self, y: torch.Tensor, grad: bool) -> torch.Tensor:
        import torch.distributed as dist

        g, N = self.mg.group, self.mg.size
        if grad:
            import torch.distributed._functional_collectives as fc

            return fc.wait_tensor(fc.reduce_scatter_tensor_autograd(y.contiguous(), "sum", 0, g))
        out = torch.empty((y.shape[0] // N, y.shape[1]), dtype=y.dtype, device=y.device)
        dist.reduce_scatter_tensor(out, y.contiguous(), group=g)
        return out

    def _a2a(self, t: torch.Tensor, out_rows: list[int], in_rows: list[int], grad: bool) -> torch.Tensor:
        """all_to_all_single of rows: sends in_rows[d] rows to rank d, receives out_rows[s] from s."""
        import torch.distributed as dist

        g = self.mg.group
        if grad:
            import torch.distributed._functional_collectives as fc

            return fc.wait_tensor(fc.all_to_all_single_autograd(t.contiguous(), out_rows, in_rows, g))
        out = t.new_empty((sum(out_rows),) + tuple(t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), out_rows, in_rows, group=g)
        return out
