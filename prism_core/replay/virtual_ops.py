"""What a virtual rank passes to gloo for one op of its graph: tensors of the right structure and size.

A virtual rank has no program, only its graph node: op, group, byte count, dtype. Where the
tensor cache of a context-switching collection holds the rank's inputs for the op (same key
as the collection wrote), they are sent as they were, so a sandbox rank receives the values the
real peer would have sent (and sizes that depend on values, such as MoE all-to-all splits,
agree). Otherwise zeros of the recorded size are sent. Output buffers are allocated to the
sizes the peers will deliver and dropped after completion.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from prism_core.backend.reduce_ops import BY_NAME
from prism_core.cache import TensorCacheReader


class ReplayError(RuntimeError):
    pass


@dataclass
class OpSpec:
    kind: str
    key: str                 # the op's key in the tensor cache
    group: tuple[int, ...]   # global ranks
    me: int                  # this rank's position in the group
    nbytes: int
    dtype: torch.dtype
    reduce: str              # "" for non-reductions
    root: int | None = None  # group position of the root (rooted ops)
    peer: int | None = None  # group position of the p2p peer
    tag: int = 0


class Inputs:
    """Cached inputs of every rank that has a cache group (None where the cache has no answer)."""

    def __init__(self, cache_root, ranks):
        self._readers: dict[int, TensorCacheReader] = {}
        if cache_root is not None:
            for r in ranks:
                if (cache_root / "ranks" / str(r)).is_dir():
                    self._readers[r] = TensorCacheReader(cache_root, r)

    def get(self, rank: int, key: str) -> list[torch.Tensor] | None:
        reader = self._readers.get(rank)
        if reader is None or f"{key}/0" not in reader:
            return None
        out, i = [], 0
        while f"{key}/{i}" in reader:
            out.append(reader.get(f"{key}/{i}").clone())
            i += 1
        return out

    def shape(self, rank: int, key: str) -> tuple[int, ...] | None:
        reader = self._readers.get(rank)
        if reader is None or key not in reader:
            return None
        return reader.shape(key)

    def splits(self, rank: int, key: str) -> list[int] | None:
        reader = self._readers.get(rank)
        if reader is None or f"{key}/splits" not in reader:
            return None
        return [int(s) for s in reader.get(f"{key}/splits").tolist()]

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()


def _zeros(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    size = torch.tensor([], dtype=dtype).element_size()
    if nbytes % size:
        raise ReplayError(f"{nbytes} B is not a whole number of {dtype} elements")
    return torch.zeros(nbytes // size, dtype=dtype)


def issue(pg: dist.ProcessGroup, op: OpSpec, rank: int, inputs: Inputs) -> tuple[list, list]:
    """Start `op` on this virtual member's gloo group; returns (works, tensors to keep alive)."""
    n = len(op.group)
    cached = inputs.get(rank, op.key) if op.kind not in ("recv", "barrier") else None
    flat = cached[0] if cached and len(cached) == 1 else None
    ins = cached if cached else [_zeros(op.nbytes, op.dtype)]
    k = op.kind
    if k in ("allreduce", "allreduce_coalesced", "reduce"):
        if k == "allreduce_coalesced":
            o = dist.AllreduceCoalescedOptions()
        else:
            o = dist.AllreduceOptions() if k == "allreduce" else dist.ReduceOptions()
        o.reduceOp = BY_NAME[op.reduce or "sum"]
        if k == "reduce":
            o.rootRank = op.root
            return [pg.reduce(ins, o)], ins
        return [pg.allreduce(ins, o) if k == "allreduce" else pg.allreduce_coalesced(ins, o)], ins
    if k == "broadcast":
        o = dist.BroadcastOptions()
        o.rootRank = op.root
        return [pg.broadcast(ins, o)], ins
    if k == "allgather":
        outs = [[torch.empty_like(t) for _ in range(n)] for t in ins]
        return [pg.allgather(outs, ins, dist.AllgatherOptions())], [ins, outs]
    if k == "all_gather_single":
        src = flat if flat is not None else torch.cat([t.reshape(-1) for t in ins])
        out = torch.empty(n * src.numel(), dtype=src.dtype)
        return [pg._allgather_base(out, src.reshape(-1), dist.AllgatherOptions())], [src, out]
    if k == "reduce_scatter":
        chunks = cached if cached and len(cached) == n else list(_zeros(op.nbytes, op.dtype).chunk(n))
        out = [torch.empty_like(chunks[op.me])]
        o = dist.ReduceScatterOptions()
        o.reduceOp = BY_NAME[op.reduce or "sum"]
        return [pg.reduce_scatter(out, [chunks], o)], [chunks, out]
    if k == "reduce_scatter_single":
        src = ins[0].reshape(-1)
        out = torch.empty(src.numel() // n, dtype=src.dtype)
        o = dist.ReduceScatterOptions()
        o.reduceOp = BY_NAME[op.reduce or "sum"]
        return [pg._reduce_scatter_base(out, src, o)], [src, out]
    if k == "all_to_all_single":
        src = ins[0]
        in_splits = inputs.splits(rank, op.key) or []
        out_splits = []
        if in_splits:
            for g, member in enumerate(op.group):
                theirs = member == rank and in_splits or inputs.splits(member, op.key)
                if theirs is None:
                    raise ReplayError(f"all_to_all_single {op.key}: rank {rank} splits unevenly but the cache has "
                                      f"no splits of rank {member}")
                out_splits.append(theirs[op.me])
        rows = sum(out_splits) if out_splits else (src.shape[0] if src.dim() else src.numel())
        out = torch.empty((rows, *src.shape[1:]), dtype=src.dtype)
        return [pg.alltoall_base(out, src, out_splits, in_splits, dist.AllToAllOptions())], [src, out]
    if k == "alltoall":
        chunks = cached if cached and len(cached) == n else list(_zeros(op.nbytes, op.dtype).chunk(n))
        outs = []
        for g, member in enumerate(op.group):
            shape = inputs.shape(member, f"{op.key}/{op.me}")
            outs.append(torch.empty(shape if shape is not None else chunks[g].shape, dtype=chunks[g].dtype))
        return [pg.alltoall(outs, chunks, dist.AllToAllOptions())], [chunks, outs]
    if k == "barrier":
        return [pg.barrier(dist.BarrierOptions())], []
    if k == "scatter":
        o = dist.ScatterOptions()
        o.rootRank = op.root
        out = [_zeros(op.nbytes, op.dtype)]
        if op.me == op.root:
            chunks = cached if cached and len(cached) == n else [torch.zeros_like(out[0]) for _ in range(n)]
            return [pg.scatter(out, [chunks], o)], [chunks, out]
        return [pg.scatter(out, [], o)], [out]
    if k == "gather":
        o = dist.GatherOptions()
        o.rootRank = op.root
        outs = [[torch.empty_like(ins[0]) for _ in range(n)]] if op.me == op.root else []
        return [pg.gather(outs, ins, o)], [ins, outs]
    if k == "send":
        return [pg.send(ins, op.peer, op.tag)], ins
    if k == "recv":
        shape = inputs.shape(op.group[op.peer], f"{op.key}/0")
        buf = torch.empty(shape, dtype=op.dtype) if shape is not None else _zeros(op.nbytes, op.dtype)
        return [pg.recv([buf], op.peer, op.tag)], [buf]
    raise ReplayError(f"the replayer cannot issue {k}")
